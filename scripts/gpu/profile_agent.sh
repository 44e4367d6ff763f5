#!/usr/bin/env bash
# Where a busy server worker's tick goes (issue 27, 1,024 agents): the agent bench (agent.sh, WORKERS, MINUTES)
# for CLIENTS, and once it is in its measured phase, py-spy samples the busiest server process(es) for SECONDS.
# Writes $OUT/pyspy_<pid>.txt (collapsed stacks, --threads) and $OUT/ps.txt beside agent.sh's files.
# Needs pyspy/py_spy-*.whl beside this file (ignored; `pip download py-spy --no-deps -d scripts/gpu/pyspy`).
# Usage there: CLIENTS=1024 WORKERS=4 MINUTES=0.75 DELAY=75 SECONDS_=20 bash scripts/gpu/profile_agent.sh
set -u
HERE=$(cd "$(dirname "$0")" && pwd)
OUT=${OUT:-/tmp/agent-out}
mkdir -p "$OUT" /tmp/pyspy
(cd /tmp/pyspy && python3 -m zipfile -e "$HERE"/pyspy/py_spy-*.whl . ) || exit 1
SPY=$(find /tmp/pyspy -name py-spy -type f | head -1); chmod +x "$SPY"
bash "$HERE/agent.sh" "${CLIENTS:-1024}" &
bench=$!
sleep "${DELAY:-75}"
ps -eo pid,pcpu,args --sort=-pcpu | head -30 > "$OUT/ps.txt"
for pid in $(ps -eo pid,pcpu,args --sort=-pcpu | grep -E "tts|streaming|multiprocessing|spawn" | grep -v grep \
             | grep -v "bench.agent" | head -"${PROCS:-2}" | awk '{print $1}'); do
    "$SPY" record --pid "$pid" --duration "${SECONDS_:-20}" --rate 250 --threads --nonblocking --format raw \
        -o "$OUT/pyspy_$pid.txt" > "$OUT/pyspy_$pid.log" 2>&1 &
done
wait
