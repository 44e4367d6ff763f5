"""The NOTES.md table of the agent-bench runs in this folder (one row per JSON)."""
import glob
import json
import os

HERE = os.path.dirname(os.path.abspath(__file__))
print("| run | load 1m before-after | tick p50 / p99 ms | step p50 / p99 ms | events part p50 / p99 ms | delivered streams "
      "| stalls | engine / text / loop thread cores | server CPU ms per audio s |")
print("|---|---|---|---|---|---|---|---|---|")
for path in sorted(glob.glob(os.path.join(HERE, "*_[0-9].json"))):
    name = os.path.basename(path)[:-5]
    if name.startswith(("host_ops", "calls", "exact")):
        continue
    r = json.load(open(path))
    cores = r["host"].get("server_thread_cores") or {}
    parts = (r.get("tick_parts_ms") or {}).get("events")
    print(f"| {name} | {r['load_avg_1m_before']}-{r['load_avg_1m_after']} | {r['tick_ms']['p50']} / {r['tick_ms']['p99']} "
          f"| {r['step_ms']['p50']} / {r['step_ms']['p99']} | {parts and str(parts['p50']) + ' / ' + str(parts['p99']) or '-'} "
          f"| {r['delivered_streams']} | {r['stalls']} | {cores.get('tts-engine')} / {cores.get('tts-text')} / "
          f"{cores.get('tts-server')} | {r['server_cpu_ms_per_audio_s']['process']} |")
