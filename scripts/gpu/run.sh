#!/usr/bin/env bash
# One device call: install the kit, then run the named steps in order, each with its own time limit, each's
# output to $OUT/<step>.txt (so a later failure or the call's limit loses nothing earlier). From the
# repository root on the device machine:   bash scripts/gpu/run.sh STEP [STEP ...]
# Steps: smoke | parkN[_label] (bench.parking N streams, traced) | diag* | race | pytest | latency; a step name
# containing one_bucket, shared or switch adds that experiment's flag (--one-bucket; diag.py --shared-capture;
# bench.parking --switch-interval 0.001); a step name containing shm spills the disk tier to /dev/shm (tmpfs), omp1
# runs it with one OpenMP/BLAS thread, ioK with K parking I/O threads
set -u
HERE=$(cd "$(dirname "$0")" && pwd)
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
STARTED=$SECONDS
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    "$HERE"/wheels/*.whl || { echo "run.sh: the wheels did not install"; exit 1; }
export PYTHONPATH=$PWD:/tmp/site:$HERE/site PYTHONUNBUFFERED=1 TTS_HARVARD=$HERE/harvard.txt
nvidia-smi --query-gpu=name,memory.used,clocks.sm,driver_version --format=csv,noheader
echo "run.sh: $(date -u +%T) $(git log -1 --format='%h %s' 2>/dev/null | cut -c1-80)"
echo "run.sh: file systems: $(df -T "${TMPDIR:-/tmp}" /dev/shm "$PWD" 2>/dev/null | awk 'NR > 1 {print $7 "=" $2}' | tr '\n' ' ')"
step() {  # name, limit in seconds, command...
    local name=$1 limit=$2; shift 2
    local left=$(( 575 - (SECONDS - STARTED) ))
    [ "$left" -gt 30 ] || { echo "run.sh: no time left for $name"; return; }
    [ "$limit" -lt "$left" ] || limit=$left
    echo "run.sh: $(date -u +%T) $name (limit $limit s): $*"
    local t0=$SECONDS
    echo "== $name: $*" >> "$OUT/errors.log"
    timeout -k 5 "$limit" "$@" > "$OUT/$name.txt" 2>> "$OUT/errors.log"
    echo "run.sh: $name exit $? after $(( SECONDS - t0 )) s"
}
summary() {  # a parking JSON's key figures
    python3 - "$1" <<'EOF' 2>/dev/null || tail -n 5 "$1"
import json, sys
d = json.load(open(sys.argv[1]))
t = d.get("tiers_ms_per_stream", {})
print(" ", d["within_1e-4_by_round"], "max", d["max_abs_diff"], "park", t.get("park"), "restore", t.get("restore"),
      "parks", d["parks"], "parted", d["parted"][:4])
print("  disk", d.get("disk_tier_ms_per_stream"))
print("  park_wait", t.get("park_wait"), "park_host", t.get("park_host"), "row_pool", d.get("row_pool"))
parks = [b for b in d.get("batches", []) if b["kind"] == "park" and b["ms"] is not None]
for b in sorted(parks, key=lambda b: -b["ms"] / b["streams"])[:5]:
    print("   slowest park calls (ms per stream first)", round(b["ms"] / b["streams"], 3), b)
for row in d.get("trace", []):
    if row["first_bad"] is not None:
        print("  ", row)
        break
EOF
}
dsummary() {  # a diag JSON's key figures
    python3 - "$1" <<'EOF' 2>/dev/null || tail -n 5 "$1"
import json, sys
d = json.load(open(sys.argv[1]))
print(" ", "one_bucket", d["one_bucket"], "shared_capture", d.get("shared_capture"), "parted per round", [r["parted"] for r in d["rounds"]])
for r in d["rounds"]:
    for p in r["detail"][:2]:
        print("   round", r["round"], {k: v for k, v in p.items() if k != "schedules"})
EOF
}
variant() {  # experiment flags named in a step's name
    local flags=()
    [[ $1 == *one_bucket* ]] && flags+=(--one-bucket)
    [[ $1 == *shared* ]] && flags+=(--shared-capture)
    [[ $1 == *switch* ]] && flags+=(--switch-interval 0.001)  # parkN_switch: the interpreter's switch interval 1 ms
    [[ $1 =~ io([0-9]+) ]] && flags+=(--io-threads "${BASH_REMATCH[1]}")  # parkN_ioK: the store's K I/O threads
    echo "${flags[@]}"
}
for s in "$@"; do
    case $s in
        diag*) # shellcheck disable=SC2046
               step "$s" 150 python3 "$HERE/diag.py" --device cuda --streams 64 --rounds 5 $(variant "$s")
               dsummary "$OUT/$s.txt" ;;
        smoke) step smoke 150 python3 "$HERE/smoke.py"; cat "$OUT/smoke.txt" ;;
        park[0-9]*) n=${s#park}; n=${n%%_*}  # parkN[_label]: N streams, the detached one into N slots
                 spill=${TMPDIR:-/tmp}; [[ $s == *shm* ]] && spill=/dev/shm
                 one=; [[ $s == *omp1* ]] && one=1
                 # shellcheck disable=SC2046
                 TMPDIR=$spill step "$s" 240 env ${one:+OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1} \
                     python3 -m bench.parking --device cuda --streams "$n" --moved-slots "$n" --warm-up \
                     --trace $(variant "$s")
                 summary "$OUT/$s.txt" ;;
        store[0-9]*) n=${s#store}; n=${n%%_*}  # storeN[_shm]: the disk tier alone, N states, 5 rounds
                 spill=${TMPDIR:-/tmp}; [[ $s == *shm* ]] && spill=/dev/shm
                 TMPDIR=$spill step "$s" 120 python3 -m bench.parking --device cuda --store-only --streams "$n"
                 python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(' ', d.get('disk_tier_ms_per_stream'))" \
                     "$OUT/$s.txt" 2>/dev/null || tail -n 5 "$OUT/$s.txt" ;;
        race) step race 60 python3 "$HERE/workspace_race.py"; cat "$OUT/race.txt" ;;
        pytest) step pytest 90 python3 -m pytest -q -x -p no:cacheprovider tests/test_gpu_graphs.py
                tail -n 4 "$OUT/pytest.txt" ;;
        latency) step latency 150 python3 -m bench.latency --device cuda --streams 64 256 --poisson-max 64 \
                     --sentences 2
                 tail -n 3 "$OUT/latency.txt" ;;
        *) echo "run.sh: unknown step $s" ;;
    esac
done
echo "run.sh: done after $(( SECONDS - STARTED )) s"
