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
the two at the largest load one replica keeps real-time. `direct_no_ray` climbs the same loads on `tts serve`'s
server without Ray (what Ray's proxy and the replica processes cost).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
from pathlib import Path

from bench.common import ROOT
from bench.serve import load


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def engine_factory(tiny: bool):
    """(factory, kwargs) of the engine each replica (or the direct server) runs."""
    if tiny:
        from tests.helpers import tiny_random
        return tiny_random, {"max_streams": 8}
    from tts.api import get_engine
    return get_engine, {}


def climb(url: str, loads: list[int], rounds: int) -> dict:
    """The loads in turn until one is not real-time: the rows and the largest real-time load."""
    rows, capacity = {}, 0
    for clients in loads:
        row = asyncio.run(load(url, clients, rounds))
        row["realtime"] = row["rtf_p99"] < 1.0
        rows[str(clients)] = row
        if not row["realtime"]:
            break
        capacity = clients
    return {"loads": rows, "realtime_streams": capacity}


def on_ray(url: str, replicas: int, loads: list[int], rounds: int, tiny: bool) -> dict:
    """`climb` against ``replicas`` replicas on Ray Serve."""
    from ray import serve

    from server import create_app
    from streaming import ray_serve
    factory, kwargs = engine_factory(tiny)
    serve.run(ray_serve.application(factory, create_app, ray_serve.ScaleConfig(replicas=replicas), kwargs),
              name="tts", route_prefix="/")
    try:
        return climb(url, loads, rounds)
    finally:
        serve.delete("tts")


def direct(loads: list[int], rounds: int, tiny: bool) -> dict:
    """`climb` against `tts serve`'s server without Ray (in this process, as bench.serve runs it)."""
    from server import ServerThread
    factory, kwargs = engine_factory(tiny)
    engine = factory(**kwargs)
    with ServerThread(engine) as server:
        result = climb(server.ws_url, loads, rounds)
    engine.close()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="the tiny random-weight engine, not the shipped voices")
    parser.add_argument("--loads", type=int, nargs="+", default=[1, 2, 3, 4, 6, 8, 12, 16], help="concurrent clients")
    parser.add_argument("--rounds", type=int, default=3, help="utterances per client after its warm-up")
    parser.add_argument("--replicas", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--no-direct", action="store_true", help="skip the same loads on `tts serve` without Ray")
    parser.add_argument("--out", help="also write the JSON here (Ray may print a line of its own on stdout)")
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
            report["replicas"][str(replicas)] = on_ray(f"ws://127.0.0.1:{port}/v1/stream", replicas, args.loads,
                                                       args.rounds, args.tiny)
    finally:
        serve.shutdown()
        ray.shutdown()
    if not args.no_direct:
        report["direct_no_ray"] = direct(args.loads, args.rounds, args.tiny)
    report["loadavg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    one, two = report["replicas"].get("1"), report["replicas"].get("2")
    if one and two and one["realtime_streams"]:
        same = str(one["realtime_streams"])
        p50 = {n: r["loads"].get(same, {}).get("ttfa_ms_p50") for n, r in (("1", one), ("2", two))}
        report["ttfa_ms_p50_at_same_load"] = {"clients": int(same), **p50}
        report["streams_ratio_2_over_1"] = round(two["realtime_streams"] / one["realtime_streams"], 2)
        if p50["1"] and p50["2"]:
            report["ttfa_ratio_2_over_1"] = round(p50["2"] / p50["1"], 2)
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
