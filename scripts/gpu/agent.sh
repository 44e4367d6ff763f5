#!/usr/bin/env bash
# The agent bench on one H200 (issue 27: one H200, 1,024 slots, >= 8,192 connections): for each client count
# (default 8192 2048 4096: the target first, so that a slow call skips a smaller count, not it) one
# `python -m bench.agent --device cuda` run of MINUTES (default 1.5) on SLOTS (default 1024) slots, its clients
# in CLIENT_PROCESSES processes (default: cores - 4, at most 12), then its figures in two lines. Each run
# writes $OUT/agent_N.json (its stdout) and $OUT/agent_N.err as it finishes, so a later failure or the call's
# time limit loses nothing earlier; $OUT/offered.jsonl holds each count's offered
# load against the capacity first. A run takes ~2.5 min (start and graph capture ~15 s, warm-up with 1,024
# clients ~15 s, the run 90 s, grace <= 15 s); one that would not finish inside 570 s of the call is skipped.
#
# Needs, beside this file (this tree's scripts/gpu): wheels/ (the server's packages the device image lacks,
# for cp312), site/piper (piper's phonemizer), harvard.txt. The voices come from this tree's voices/ if it has
# them, else from ./voices (the root of the checkout the device machine received). Usage, there:
#     bash PATH/TO/THIS/TREE/scripts/gpu/agent.sh [CLIENTS ...]
# CPU rehearsal: DEVICE=cpu SLOTS=4 MINUTES=0.3 CLIENT_PROCESSES=2 WARM_UP_CLIENTS=4 NO_WHEELS=1 EXTRA=--tiny
# WORKERS=N (default 1): N server processes (`tts serve --workers N`, serving/workers.py), each with its own
# engine of SLOTS / N slots and CUDA context on the one GPU; files are then agent_N_wWORKERS.*, and
# gpu_apps_N_wWORKERS.csv samples each process's GPU memory every 15 s. E.g. WORKERS=4 bash agent.sh 512 1024
set -u
HERE=$(cd "$(dirname "$0")" && pwd)
TREE=$(cd "$HERE/../.." && pwd)
OUT=${OUT:-/tmp/agent-out}
MINUTES=${MINUTES:-1.5}
STARTED=$SECONDS
mkdir -p "$OUT"
COUNTS=("$@")
[ ${#COUNTS[@]} -gt 0 ] || COUNTS=(8192 2048 4096)
CORES=$(nproc)
PROCESSES=${CLIENT_PROCESSES:-$(( CORES - 4 < 12 ? (CORES - 4 > 1 ? CORES - 4 : 1) : 12 ))}

DEVICE=${DEVICE:-cuda}
SLOTS=${SLOTS:-1024}
WARM_UP_CLIENTS=${WARM_UP_CLIENTS:-1024}
EXTRA=${EXTRA:-}
WORKERS=${WORKERS:-1}
SUFFIX=$([ "$WORKERS" -gt 1 ] && echo "_w$WORKERS")
[ -n "${NO_WHEELS:-}" ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/agent-site "$HERE"/wheels/*.whl || { echo "agent.sh: the wheels did not install"; exit 1; }
VOICES=$TREE/voices
[ -f "$VOICES/voices.json" ] || VOICES=$PWD/voices
export PYTHONPATH=$TREE:/tmp/agent-site:$HERE/site PYTHONUNBUFFERED=1 TTS_HARVARD=$HERE/harvard.txt \
    TTS_VOICES_DIR=$VOICES
ulimit -n 1048576 2>/dev/null || ulimit -n "$(ulimit -Hn)"
cd "$TREE" || exit 1
echo "agent.sh: $(date -u +%T) tree $TREE, voices $VOICES, $CORES cores, $PROCESSES client processes," \
     "open files $(ulimit -n), counts ${COUNTS[*]}, $MINUTES min each, $WORKERS server process(es)"
nvidia-smi --query-gpu=name,memory.used,clocks.sm --format=csv,noheader 2>/dev/null
python3 -c "import torch, websockets, starlette, uvicorn, pydantic, soxr, rapidfuzz, piper; print('torch', torch.__version__,
torch.cuda.get_device_name() if '$DEVICE'.startswith('cuda') else 'cpu')" || { echo "agent.sh: imports failed"; exit 1; }

for n in "${COUNTS[@]}"; do
    python3 -m bench.agent --offered-only --device "${DEVICE%%:*}" --slots "$SLOTS" --clients "$n" --minutes "$MINUTES"
done | tee "$OUT/offered.jsonl"

NEED=$(awk "BEGIN { print int($MINUTES * 60 + 90) }")  # a run, its start, warm-up and grace included
CAP=$(awk "BEGIN { print int($MINUTES * 60 + 180) }")  # the most one run may take (a hang at exit: killed)
for n in "${COUNTS[@]}"; do
    left=$(( 570 - (SECONDS - STARTED) ))
    if [ "$left" -lt "$NEED" ]; then
        echo "agent.sh: $(date -u +%T) $left s left of the call: skipping $n clients"
        continue
    fi
    echo "agent.sh: $(date -u +%T) $n clients on $SLOTS slots, $WORKERS worker(s) ($left s left)"
    limit=$(( left - 10 < CAP ? left - 10 : CAP ))
    sampler=
    if [ "$WORKERS" -gt 1 ] && command -v nvidia-smi > /dev/null; then
        (while sleep 15; do date -u +%T; nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader
         done) > "$OUT/gpu_apps_$n$SUFFIX.csv" 2>&1 &
        sampler=$!
    fi
    # shellcheck disable=SC2086
    timeout -k 10 "$limit" python3 -m bench.agent --device "$DEVICE" --slots "$SLOTS" --clients "$n" \
        --client-processes "$PROCESSES" --minutes "$MINUTES" --grace-s 15 --warm-up-clients "$WARM_UP_CLIENTS" \
        --warm-up-s 5 --max-host-gb 16 --workers "$WORKERS" $EXTRA > "$OUT/agent_$n$SUFFIX.json" \
        2> "$OUT/agent_$n$SUFFIX.err"
    echo "agent.sh: exit $? after $(( SECONDS - STARTED )) s"
    [ -z "$sampler" ] || kill "$sampler"
    tail -n 4 "$OUT/agent_$n$SUFFIX.err"
    python3 - "$OUT/agent_$n$SUFFIX.json" <<'EOF' || true
import json, sys
d = json.load(open(sys.argv[1]))
keys = ("clients", "connections_held", "slots_used", "real_time_fraction", "clients_spoke", "stalls", "errors",
        "error_kinds", "turns", "turns_cut", "delivered_streams", "offered_streams", "capacity_streams",
        "tick_ms_full", "tick_ms", "step_ms", "ttfa_ms", "parks", "restores", "tiers_ms", "limited_by")
print(json.dumps({k: d.get(k) for k in keys}))
print(json.dumps(d.get("host")))
EOF
done
echo "agent.sh: $(date -u +%T) done in $(( SECONDS - STARTED )) s"
