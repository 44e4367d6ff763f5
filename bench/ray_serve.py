"""One Ray Serve replica against two on this machine: streams all real-time, and time to first audio at the same
load. One JSON object.

    python -m bench.ray_serve                  # shipped voices, loads 1 2 3 4 6 8 12 16, 3 utterances per client
    python -m bench.ray_serve --tiny           # the tiny random-weight engine
    python -m bench.ray_serve --loads 1 2 4 --rounds 2
    python -m bench.ray_serve --kill [--tiny] [--kill-after-s 1 4] [--trials 3] [--pace sentence]   # failover

For each replica count, Ray Serve runs `serving.ray_serve` (each replica: one engine, the server app, the
machine's cores shared evenly: `ScaleConfig.num_cpus` default) on a local Ray cluster, and `bench.serve.load` drives
N WebSocket clients through Ray's proxy, each speaking utterances one after another after one warm-up utterance.
A load is real-time when every utterance's rtf (text sent to `done`, over the audio's duration) is below 1 (its
p99 < 1); `realtime_streams` is the largest load that is, climbing the loads until one is not. Target (issue 27):
two replicas carry twice the streams of one at the same TTFA p50 (within 20 %); `ttfa_ms_p50_at_same_load` compares
the two at the largest load one replica keeps real-time. `direct_no_ray` climbs the same loads on `tts serve`'s
server without Ray (what Ray's proxy and the replica processes cost).

`--cores-per-replica N`: each replica count gets a Ray cluster of its own whose processes may run only on N cores
per replica (started under a CPU affinity, `cluster`: cores 0..R*N-1 for R replicas, which the replicas share,
as Ray pins nothing), each replica asking N CPUs, and this process (the clients) runs on the cores after them: on
a many-core host (the H200 machine's 16), R replicas get R*N cores, as scale-out gives them machines.
`ttfa_ms_p50_at_capacity` then compares one
replica at the largest load it keeps real-time with two at twice that load.

`--kill`: replica failover (serving/failover.py) on two replicas. Per trial: one seeded utterance, its text sent
a word every 50 ms by the Python client, spoken uninterrupted (the reference); then the same one again, and once
its client holds ``kill_after_s`` seconds of audio the replica serving it is killed (`ray.kill`). Reported per
kill point: `gap_ms` (the kill -> the first audio frame over the resumed connection, p50/p99), `resumed_ms_each`
(the kill -> the client's resume answered: the rest of the gap is the survivor regenerating audio the client
holds, from the latest checkpoint it holds), `from_checkpoints` (replays that attached a checkpoint rather than
regenerating the utterance from its start), `exact` (trials whose audio equals the reference: equal length, every
sample within 3 steps of 16 bits), `max_abs_diff` and `first_diff_s` (where the first sample more than 3 steps
apart lies, in seconds: before the kill point, the runs had parted before the kill). Ray starts a replacement replica
after each kill; the next
trial waits until the proxy routes to it. `snapshot` is what a checkpoint costs, measured afterwards in this
process on the same engine: `Engine.snapshot` of a speaking stream (ms, p50/p99) and its bytes.
`--checkpoint-audio-s S` checkpoints every S s of an utterance's audio (default 1; 0: none, every replay
regenerates the utterance from its start, as before checkpoints). `--pace sentence` sends the text a whole
sentence every 0.5 s instead of a word every 50 ms: the text front end's output depends on when words come, so
word-paced runs can differ from their reference without a kill; whole sentences test the replay's exactness.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import time
from pathlib import Path

from bench.common import ROOT, free_port, percentiles
from bench.serve import SAMPLE_RATE, SENTENCES, load

PACES = {"word": 0.05, "sentence": 0.5}  # --kill: seconds between the client's text messages (both ~20 words/s)


def engine_factory(tiny: bool):
    """(factory, kwargs) of the engine each replica (or the direct server) runs."""
    if tiny:
        from testkit import tiny_random

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


def load_limits(clients: int):
    """The server's limits with room for ``clients`` connections from this one address (the default caps one
    address at 16: a single load generator is not the many users it stands for)."""
    from serving.limits import Limits

    most = max(clients, Limits.max_connections_per_client)
    return Limits(
        max_connections=max(Limits.max_connections, 2 * most),
        max_connections_per_client=most,
        max_streams_per_client=most,
        max_queue=max(Limits.max_queue, most),
    )


def on_ray(url: str, replicas: int, loads: list[int], rounds: int, tiny: bool, cpus: float | None = None) -> dict:
    """`climb` against ``replicas`` replicas on Ray Serve, each asking ``cpus`` CPUs (None: `ScaleConfig`'s)."""
    from ray import serve

    from server import create_app
    from serving import ray_serve

    factory, kwargs = engine_factory(tiny)
    scale = ray_serve.ScaleConfig(replicas=replicas, num_cpus=cpus)
    app = ray_serve.application(factory, create_app, scale, kwargs, {"limits": load_limits(max(loads))})
    serve.run(app, name="tts", route_prefix="/")
    try:
        return climb(url, loads, rounds)
    finally:
        serve.delete("tts")


def direct(loads: list[int], rounds: int, tiny: bool) -> dict:
    """`climb` against `tts serve`'s server without Ray (in this process, as bench.serve runs it)."""
    from server import ServerThread

    factory, kwargs = engine_factory(tiny)
    engine = factory(**kwargs)
    with ServerThread(engine, **vars(load_limits(max(loads)))) as server:
        result = climb(server.ws_url, loads, rounds)
    engine.close()
    return result


async def utterance(
    url: str, seed: int, sentences: list[str], pace: str = "word", kill_at_bytes: int | None = None
) -> dict:
    """One seeded utterance through the Python client, its text a word every 50 ms (``pace`` "word") or a whole
    sentence every PACES["sentence"] s; with ``kill_at_bytes``, the replica serving it is killed once the client
    holds that much audio. {audio, gap_ms, resumed_ms}."""
    from tts.client import connect

    pieces = [word + " " for word in " ".join(sentences).split()] if pace == "word" else [s + " " for s in sentences]

    async def llm():
        for piece in pieces:
            yield piece
            await asyncio.sleep(PACES[pace])

    async def watch(client, killed_at: float) -> float:
        while not client.reconnects:
            await asyncio.sleep(0.002)
        return (time.perf_counter() - killed_at) * 1000

    audio, killed_at, gap_ms, resumed = b"", None, None, None
    async with connect(url, backoff_s=0.05) as client:
        async for frame in client.stream(llm(), seed=seed):
            if killed_at is not None and gap_ms is None and client.reconnects:
                gap_ms = (time.perf_counter() - killed_at) * 1000
            audio += frame
            if kill_at_bytes is not None and killed_at is None and len(audio) >= kill_at_bytes:
                await asyncio.to_thread(kill_replica, client.ws.response.headers["x-tts-replica"])
                killed_at = time.perf_counter()
                resumed = asyncio.create_task(watch(client, killed_at))
    return {"audio": audio, "gap_ms": gap_ms, "resumed_ms": resumed and await resumed}


def kill_replica(replica: str) -> None:
    import ray

    ray.kill(ray.get_actor(f"SERVE_REPLICA::tts#tts#{replica}", namespace="serve"), no_restart=True)


async def both_serve(url: str, seconds: float = 300) -> None:
    """Wait until the proxy places two connections held at once on two replicas (after a kill, Ray's replacement
    is running some time before the proxy routes to it: a kill before then finds no other replica to go to);
    then warm both up with a paced utterance each. A fresh engine's first utterance of paced text can differ from
    its later ones with the same seed (measured: from the first sample, on the shipped voices), so the reference
    and the killed run must not be a replica's first."""
    import websockets

    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        async with websockets.connect(url) as a, websockets.connect(url) as b:
            if a.response.headers["x-tts-replica"] != b.response.headers["x-tts-replica"]:
                await asyncio.gather(warm_up(a), warm_up(b))
                return
        await asyncio.sleep(0.5)
    raise TimeoutError("the proxy did not route to two replicas")


async def warm_up(ws) -> None:
    """One seeded utterance of one sentence on ``ws``, a word every 50 ms, read to its `done`."""
    await ws.send(json.dumps({"type": "start", "format": "pcm_s16le", "seed": 0}))
    for word in SENTENCES[0].split():
        await ws.send(json.dumps({"type": "text", "text": word + " "}))
        await asyncio.sleep(0.05)
    await ws.send(json.dumps({"type": "end"}))
    while isinstance(message := await asyncio.wait_for(ws.recv(), 120), bytes) or json.loads(message)["type"] != "done":
        pass


def failover(
    url: str,
    kill_after_s: list[float],
    trials: int,
    tiny: bool,
    checkpoint_audio_s: float,
    pace: str = "word",
    cpus: float | None = None,
) -> dict:
    """The kill trials (module docstring) on two replicas, each asking ``cpus`` CPUs (None: `ScaleConfig`'s)."""
    import numpy as np
    import ray
    from ray import serve

    from server import create_app
    from serving import ray_serve
    from serving.failover import journals

    factory, kwargs = engine_factory(tiny)
    scale = ray_serve.ScaleConfig(replicas=2, checkpoint_audio_s=checkpoint_audio_s, num_cpus=cpus)
    serve.run(ray_serve.application(factory, create_app, scale, kwargs), name="tts", route_prefix="/")
    actor = journals()
    rows = {}
    try:
        asyncio.run(both_serve(url))
        for after_s in kill_after_s:
            gaps, resumed, diffs, first_diffs, exact = [], [], [], [], 0
            replays = ray.get(actor.stats.remote())["from_checkpoints"]
            for trial in range(trials):
                reference = asyncio.run(utterance(url, 100 + trial, SENTENCES, pace))["audio"]
                cut = asyncio.run(utterance(url, 100 + trial, SENTENCES, pace, int(after_s * SAMPLE_RATE) * 2))
                a, b = (np.frombuffer(x, np.int16).astype(int) for x in (reference, cut["audio"]))
                same_length = len(a) == len(b)
                diff = int(np.abs(a - b).max()) if same_length and len(a) else None
                exact += same_length and diff is not None and diff <= 3
                diffs.append(diff)
                apart = np.flatnonzero(np.abs(a[: len(b)] - b[: len(a)]) > 3)
                first_diffs.append(round(int(apart[0]) / SAMPLE_RATE, 2) if len(apart) else None)
                gaps.append(cut["gap_ms"])
                resumed.append(cut["resumed_ms"])
                asyncio.run(both_serve(url))
            done = [g for g in gaps if g is not None]
            rows[str(after_s)] = {
                "trials": trials,
                "resumed": len(done),
                "from_checkpoints": ray.get(actor.stats.remote())["from_checkpoints"] - replays,
                "exact": exact,
                "max_abs_diff": diffs,
                "first_diff_s": first_diffs,
                "audio_s": round(len(a) / SAMPLE_RATE, 2),
                "gap_ms": percentiles(done) if done else None,
                "gap_ms_each": [round(g, 1) for g in done],
                "resumed_ms_each": [r and round(r, 1) for r in resumed],
            }
            print(json.dumps({after_s: rows[str(after_s)]}), file=sys.stderr, flush=True)  # as they come
    finally:
        serve.delete("tts")
    return {
        "checkpoint_audio_s": checkpoint_audio_s,
        "pace": pace,
        "kills": rows,
        "snapshot": snapshot_cost(tiny) if checkpoint_audio_s else None,
    }


def snapshot_cost(tiny: bool, count: int = 20) -> dict:
    """`Engine.snapshot` of a speaking stream (read as it comes), ``count`` times 0.1 s apart: ms (p50/p99) and
    bytes."""
    import threading

    factory, kwargs = engine_factory(tiny)
    engine = factory(**kwargs)
    stream = engine.open(seed=1)
    stream.push_text(" ".join(SENTENCES * 3))
    stream.end()
    assert stream.read(timeout=60) is not None
    reader = threading.Thread(target=lambda: list(iter(lambda: stream.read(timeout=60) is not None, False)))
    reader.start()
    times, size = [], 0
    for _ in range(count):
        started = time.perf_counter()
        state, _ = engine.snapshot(stream)
        times.append((time.perf_counter() - started) * 1000)
        size = len(state)
        time.sleep(0.1)
    stream.cancel()
    reader.join()
    return {"ms": percentiles(times), "bytes": size}


@contextlib.contextmanager
def cluster(port: int, cores: int = 0):
    """A local Ray cluster started in this process, with Serve's proxy on ``port``, for a ``with`` block.
    ``cores`` > 0: Ray's processes (and the replicas they spawn, which inherit the affinity) may run only on
    this process's first ``cores`` cores, and this process (the clients) moves to the cores after them; 0: all
    the machine's cores, shared. Example: 16 cores and cores=4: Ray on 0-3 (2 replicas of 2 cores), the clients
    on 4-15."""
    import ray
    from ray import serve

    mine = os.sched_getaffinity(0)
    if cores and cores >= len(mine):
        raise SystemExit(f"--cores-per-replica: {cores} cores for Ray leave none of {len(mine)} for the clients")
    ray_cores = set(sorted(mine)[:cores]) if cores else mine
    os.sched_setaffinity(0, ray_cores)  # what Ray spawns from here on inherits it
    ray.init(
        num_cpus=len(ray_cores),
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={
            "env_vars": {"PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        },
    )
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    os.sched_setaffinity(0, mine - ray_cores or mine)
    try:
        yield
    finally:
        serve.shutdown()
        ray.shutdown()
        os.sched_setaffinity(0, mine)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="the tiny random-weight engine, not the shipped voices")
    parser.add_argument("--loads", type=int, nargs="+", default=[1, 2, 3, 4, 6, 8, 12, 16], help="concurrent clients")
    parser.add_argument("--rounds", type=int, default=3, help="utterances per client after its warm-up")
    parser.add_argument("--replicas", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--no-direct", action="store_true", help="skip the same loads on `tts serve` without Ray")
    parser.add_argument("--kill", action="store_true", help="replica failover: kill a replica mid-stream")
    parser.add_argument(
        "--kill-after-s",
        type=float,
        nargs="+",
        default=[1.0, 4.0],
        help="audio the client holds when its replica is killed (seconds)",
    )
    parser.add_argument("--trials", type=int, default=3, help="kills per kill point")
    parser.add_argument(
        "--checkpoint-audio-s",
        type=float,
        default=1.0,
        help="checkpoint live utterances every this much audio (0: never)",
    )
    parser.add_argument(
        "--pace",
        choices=sorted(PACES),
        default="word",
        help="--kill: the client sends its text a word every 50 ms, or a sentence every 0.5 s",
    )
    parser.add_argument(
        "--cores-per-replica",
        type=int,
        default=0,
        help="a Ray cluster per replica count pinned to this many cores per replica (0: the machine's cores shared)",
    )
    parser.add_argument("--out", help="also write the JSON here (Ray may print a line of its own on stdout)")
    args = parser.parse_args()
    from serving.ray_serve import STATS_PERIOD_S

    port = free_port()
    url = f"ws://127.0.0.1:{port}/v1/stream"
    report = {
        "engine": "tiny_random" if args.tiny else "shipped",
        "cpu_cores": os.cpu_count(),
        "cores_per_replica": args.cores_per_replica,
        "loadavg_at_start": [round(x, 2) for x in os.getloadavg()],
        "utterances_per_client": args.rounds,
        "stats_period_s": STATS_PERIOD_S,
        "replicas": {},
    }
    if args.kill:
        report = {k: report[k] for k in ("engine", "cpu_cores", "cores_per_replica", "loadavg_at_start")}
        with cluster(port, args.cores_per_replica and 2 * args.cores_per_replica):
            report["failover"] = failover(
                url,
                args.kill_after_s,
                args.trials,
                args.tiny,
                args.checkpoint_audio_s,
                args.pace,
                args.cores_per_replica or None,
            )
    for replicas in [] if args.kill else args.replicas:
        with cluster(port, args.cores_per_replica and replicas * args.cores_per_replica):
            report["replicas"][str(replicas)] = on_ray(
                url, replicas, args.loads, args.rounds, args.tiny, args.cores_per_replica or None
            )
    if not args.no_direct and not args.kill:
        report["direct_no_ray"] = direct(args.loads, args.rounds, args.tiny)
    report["loadavg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    one, two = report.get("replicas", {}).get("1"), report.get("replicas", {}).get("2")
    if one and two and one["realtime_streams"]:
        same = str(one["realtime_streams"])
        p50 = {n: r["loads"].get(same, {}).get("ttfa_ms_p50") for n, r in (("1", one), ("2", two))}
        report["ttfa_ms_p50_at_same_load"] = {"clients": int(same), **p50}
        report["streams_ratio_2_over_1"] = round(two["realtime_streams"] / one["realtime_streams"], 2)
        if p50["1"] and p50["2"]:
            report["ttfa_ratio_2_over_1"] = round(p50["2"] / p50["1"], 2)
        at_twice = two["loads"].get(str(2 * one["realtime_streams"]), {}).get("ttfa_ms_p50")
        report["ttfa_ms_p50_at_capacity"] = {
            "one_at": int(same),
            "one": p50["1"],
            "two_at": 2 * int(same),
            "two": at_twice,
            "ratio": at_twice and p50["1"] and round(at_twice / p50["1"], 2),
        }
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
