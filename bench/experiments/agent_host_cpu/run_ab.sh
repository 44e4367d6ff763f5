#!/usr/bin/env bash
# One A/B run of the agent bench: NAME and the bench arguments; writes NAME.json (stdout, with `uptime` before
# and after in NAME.load) in this folder. The "before" code is 29df7bd's streaming/ and tts/model.py checked out
# into the worktree for the run (run_ab.sh does not do that: see NOTES.md).
set -u
HERE=$(cd "$(dirname "$0")" && pwd)
NAME=$1; shift
cd "$HERE/../../.."
export TTS_HARVARD=${TTS_HARVARD:-/work/shared/eval/harvard-sentences.txt}
{ echo "before: $(uptime)"; echo "commit: $(git rev-parse --short HEAD) $(git status --short streaming tts | tr '\n' ' ')"; } > "$HERE/$NAME.load"
python -m bench.agent "$@" > "$HERE/$NAME.json" 2> "$HERE/$NAME.err"
echo "after: $(uptime)" >> "$HERE/$NAME.load"
python - "$HERE/$NAME.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
h = r["host"]
print(sys.argv[1].split("/")[-1], "tick", r["tick_ms"], "step", r["step_ms"], "delivered", r["delivered_streams"],
      "rt", r["real_time_fraction"], "stalls", r["stalls"], "ttfa", r["ttfa_ms"], "cores", h.get("server_thread_cores"),
      "cpu/audio_s", r["server_cpu_ms_per_audio_s"], "load", r["load_avg_1m_before"], r["load_avg_1m_after"])
PY
