#!/usr/bin/env bash
# Which thread holds the interpreter lock while parked states load from disk: py-spy samples only the lock's
# holder (--gil), per thread, over one `bench.parking` run (N streams, default 64). Writes $OUT/gil_parkN.txt
# (collapsed stacks) and $OUT/parkN_spy.json (the run's own figures). Needs pyspy/py_spy-*.whl beside this file
# (ignored; `pip download py-spy --no-deps -d scripts/gpu/pyspy`). From the repository root on the device machine.
set -u
HERE=$(cd "$(dirname "$0")" && pwd)
OUT=${OUT:-/tmp/gpu-out}
N=${1:-64}
mkdir -p "$OUT" /tmp/pyspy
(cd /tmp/pyspy && python3 -m zipfile -e "$HERE"/pyspy/py_spy-*.whl . ) || exit 1
SPY=$(find /tmp/pyspy -name py-spy -type f | head -1); chmod +x "$SPY"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    "$HERE"/wheels/*.whl || { echo "gil_park.sh: the wheels did not install"; exit 1; }
export PYTHONPATH=$PWD:/tmp/site:$HERE/site PYTHONUNBUFFERED=1 TTS_HARVARD=$HERE/harvard.txt
"$SPY" record --gil --threads -r 100 --format raw -o "$OUT/gil_park$N.txt" -- \
    python3 -m bench.parking --device cuda --streams "$N" --moved-slots "$N" --warm-up --trace \
    > "$OUT/park${N}_spy.json" 2> "$OUT/spy.log"
echo "gil_park.sh: exit $?"; tail -n 3 "$OUT/spy.log"
python3 - "$OUT/gil_park$N.txt" "$OUT/park${N}_spy.json" <<'PY'
import collections, json, sys
threads, tops = collections.Counter(), collections.Counter()
for line in open(sys.argv[1]):
    stack, _, count = line.rstrip().rpartition(" ")
    frames = stack.split(";")
    threads[frames[0]] += int(count)
    tops[(frames[0][:40], frames[-1][:110])] += int(count)
total = sum(threads.values())
print("samples holding the lock", total)
for name, n in threads.most_common(8):
    print(f"  {n / total:6.1%}  {name}")
for (thread, top), n in tops.most_common(25):
    print(f"  {n / total:6.1%}  {thread} | {top}")
print("load", json.load(open(sys.argv[2]))["disk_tier_ms_per_stream"]["load"])
PY
