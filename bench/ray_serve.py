"""One Ray Serve replica against two on this machine: streams all real-time, and time to first audio at the same
load. One JSON object.

    python -m bench.ray_serve                  # shipped voices, loads 1 2 3 4 6 8 12 16, 3 utterances per client
    python -m bench.ray_serve --tiny           # the tiny random-weight engine
    python -m bench.ray_serve --loads 1 2 4 --rounds 2

For each replica count, Ray Serve runs `streaming.ray_serve` (each replica: one engine, the server app, the
machine's cores shared evenly: `ScaleConfig.num_cpus` default) on a local Ray cluster, and `bench.serve.load` drives
N WebSocket clients through Ray's proxy, each speaking utterances one after another after one warm-up utterance.
A load is real-time when every utterance's rtf (text sent to `done`, over the audio's duration) is below 1 (its
p99 < 1); `realtime_streams` is the largest load that is, climbing the loads until one is not. Target (issue 27):
two replicas carry twice the streams of one at the same TTFA p50 (within 20 %); `ttfa_ms_p50_at_same_load` compares
the two at the largest load one replica keeps real-time.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket

from bench.common import ROOT
from bench.serve import load


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def measure(url: str, replicas: int, loads: list[int], rounds: int, tiny: bool) -> dict:
    """Deploy ``replicas`` replicas, climb the loads until one is not real-time; the rows and the capacity."""
    from ray import serve

    from server import create_app
    from streaming import ray_serve
    if tiny:
        from tests.helpers import tiny_random as factory
        kwargs = {"max_streams": 8}
    else:
        from tts.api import get_engine as factory
        kwargs = {}
    app = ray_serve.application(factory, create_app, ray_serve.ScaleConfig(replicas=replicas), kwargs)
    serve.run(app, name="tts", route_prefix="/")
    rows, capacity = {}, 0
    try:
        for clients in loads:
            row = asyncio.run(load(url, clients, rounds))
            row["realtime"] = row["rtf_p99"] < 1.0
            rows[str(clients)] = row
            if not row["realtime"]:
                break
            capacity = clients
    finally:
        serve.delete("tts")
    return {"loads": rows, "realtime_streams": capacity}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="the tiny random-weight engine, not the shipped voices")
    parser.add_argument("--loads", type=int, nargs="+", default=[1, 2, 3, 4, 6, 8, 12, 16], help="concurrent clients")
    parser.add_argument("--rounds", type=int, default=3, help="utterances per client after its warm-up")
    parser.add_argument("--replicas", type=int, nargs="+", default=[1, 2])
    args = parser.parse_args()
    import ray
    from ray import serve

    from streaming import ray_serve
    port = free_port()
    ray.init(num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}})
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    report = {"engine": "tiny_random" if args.tiny else "shipped", "cpu_cores": os.cpu_count(),
              "loadavg_at_start": [round(x, 2) for x in os.getloadavg()], "utterances_per_client": args.rounds,
              "stats_period_s": ray_serve.STATS_PERIOD_S, "replicas": {}}
    try:
        for replicas in args.replicas:
            report["replicas"][str(replicas)] = measure(f"ws://127.0.0.1:{port}/v1/stream", replicas, args.loads,
                                                        args.rounds, args.tiny)
    finally:
        serve.shutdown()
        ray.shutdown()
    report["loadavg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    one, two = report["replicas"].get("1"), report["replicas"].get("2")
    if one and two and one["realtime_streams"]:
        same = str(one["realtime_streams"])
        p50 = {n: r["loads"].get(same, {}).get("ttfa_ms_p50") for n, r in (("1", one), ("2", two))}
        report["ttfa_ms_p50_at_same_load"] = {"clients": int(same), **p50}
        report["streams_ratio_2_over_1"] = round(two["realtime_streams"] / one["realtime_streams"], 2)
        if p50["1"] and p50["2"]:
            report["ttfa_ratio_2_over_1"] = round(p50["2"] / p50["1"], 2)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
