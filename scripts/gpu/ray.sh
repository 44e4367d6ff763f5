#!/usr/bin/env bash
# Ray Serve on the H200 host's 16 CPU cores (issue 27: two replicas against one, failover on a quiet host).
# Ray is not on the device image and its wheel (79 MB) does not fit one call beside the tree, so a trimmed site
# (no jars, rllib, data, tune, train, llm, dashboard UI; binaries stripped: 25 MB as tar.xz) travels in parts
# over back-to-back calls to a warm machine, each stashed in /tmp/raykit, and the last call assembles it.
# Here (repository root):  see scripts/gpu/README ("Ray kit") for building scripts/gpu/ray/{part-*,deps/}.
# There:  bash scripts/gpu/ray.sh stash                 (a call carrying scripts/gpu/ray/part-aa, then one with -ab)
#         bash scripts/gpu/ray.sh scale [bench args]    (carrying the kit and scripts/gpu/ray/deps)
#         bash scripts/gpu/ray.sh kill [bench args]
set -u
HERE=$(cd "$(dirname "$0")" && pwd)
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT" /tmp/raykit
mode=$1; shift
if [ "$mode" = stash ]; then
    cp scripts/gpu/ray/part-* /tmp/raykit/ && ls -la /tmp/raykit
    exit
fi
if [ ! -d /tmp/raysite/ray ]; then
    ls -la /tmp/raykit
    mkdir -p /tmp/raysite && cat /tmp/raykit/part-* | xz -d | tar -x -C /tmp/raysite || { echo "ray.sh: no ray site"; exit 1; }
fi
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    "$HERE"/wheels/*.whl scripts/gpu/ray/deps/*.whl || { echo "ray.sh: the wheels did not install"; exit 1; }
export PYTHONPATH=$PWD:/tmp/site:$HERE/site:/tmp/raysite PYTHONUNBUFFERED=1 RAY_USAGE_STATS_ENABLED=0
lscpu | grep -E "Model name|^CPU\(s\)"
python3 - <<'PY'  # the int8 step and the codec's ONNX export built once, before any replica loads them
import time
from tts.api import get_engine
engine, started = get_engine(), time.monotonic()
while "int8" not in engine.step_kind and time.monotonic() - started < 240:
    time.sleep(1)
time.sleep(10)
print("ray.sh: step", engine.step_kind, "after", round(time.monotonic() - started), "s", flush=True)
PY
(while sleep 5; do  # where the replicas may run, and what they use (does the affinity hold?)
    for pid in $(pgrep -f "ServeReplica"); do echo "$(date +%T) $(taskset -pc "$pid") cpu% $(ps -o pcpu= -p "$pid")"; done
done) > "$OUT/replicas.log" 2>&1 &
sampler=$!
case $mode in
    scale) timeout -k 5 420 python3 -m bench.ray_serve --cores-per-replica 2 --no-direct --out "$OUT/ray_scale.json" "$@" \
               > "$OUT/ray_scale.log" 2>&1; echo "ray.sh: exit $?"; cat "$OUT/ray_scale.json" ;;
    kill) timeout -k 5 480 python3 -m bench.ray_serve --cores-per-replica 2 --kill --out "$OUT/ray_kill.json" "$@" \
              > "$OUT/ray_kill.log" 2>&1; echo "ray.sh: exit $?"; cat "$OUT/ray_kill.json" ;;
esac
kill "$sampler"
tail -n 20 "$OUT"/ray_*.log
