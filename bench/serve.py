"""Serving latency over the WebSocket protocol, with 1, 2 and 4 concurrent clients. One JSON object.

    python -m bench.serve            # shipped voices, 12 utterances per client
    python -m bench.serve --quick    # 4 utterances per client
    python -m bench.serve --tiny     # the tiny random-weight engine (no shipped voices needed)
    python -m bench.serve --agent [--clients 64] [--slots 8] [--minutes 2] [--device cuda] [--client-processes P]
                                 # voice agents: `bench.agent`

The real server runs in this process on a free loopback port; each client is a `websockets` connection that
speaks utterances one after another. Per utterance: `ttfa_ms` is the time from sending the text to receiving the
first binary frame, on the client; `rtf` is the time from sending the text to receiving `done`, divided by the
audio's duration. Both reported as p50 and p99 over every utterance of every client, after one warm-up
utterance per client. `server_overhead_ms_p50` is the client's TTFA minus the engine's own (text pushed to
chunk decoded): what the socket, the audio pump and the client add.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time

from bench.common import percentiles
from server import ServerThread
from tts import SAMPLE_RATE

SENTENCES = [
    "The quick brown fox jumps over the lazy dog near the river.",
    "Please call me back when you have a moment this afternoon.",
    "Our train leaves the station at half past seven tomorrow morning.",
    "She found an old map hidden behind the kitchen cupboard door.",
]


async def speak(ws, text: str) -> tuple[float, float, float]:
    """One utterance: (ms from text sent to first audio frame, wall time / audio time, the engine's own
    time to first audio in ms)."""
    await ws.send(json.dumps({"type": "start", "format": "pcm_s16le"}))
    while (ready := json.loads(await ws.recv())).get("type") == "queued":
        pass  # every slot busy: wait for one
    if ready.get("type") != "ready":
        raise RuntimeError(f"start refused: {ready}")
    sent = time.perf_counter()
    await ws.send(json.dumps({"type": "text", "text": text}))
    await ws.send(json.dumps({"type": "end"}))
    first, samples = None, 0
    while isinstance(message := await ws.recv(), bytes):
        first = first or time.perf_counter()
        samples += len(message) // 2
    done = json.loads(message)
    if done.get("type") != "done" or first is None:
        raise RuntimeError(f"utterance failed: {done}")
    return (first - sent) * 1000, (time.perf_counter() - sent) / (samples / SAMPLE_RATE), done["engine_ttfa_ms"]


async def client(url: str, index: int, rounds: int) -> list[tuple[float, float, float]]:
    import websockets

    async with websockets.connect(url) as ws:
        await speak(ws, SENTENCES[index % len(SENTENCES)])  # warm-up
        return [await speak(ws, SENTENCES[(index + r) % len(SENTENCES)]) for r in range(rounds)]


async def load(url: str, clients: int, rounds: int) -> dict:
    results = await asyncio.gather(*(client(url, i, rounds) for i in range(clients)))
    runs = [run for per_client in results for run in per_client]
    ttfa, rtf = percentiles([t for t, _, _ in runs]), percentiles([r for _, r, _ in runs])
    overhead = percentiles([t - engine for t, _, engine in runs])  # socket, pump and client, beyond the engine
    return {
        "utterances": len(runs),
        "ttfa_ms_p50": ttfa["p50"],
        "ttfa_ms_p99": ttfa["p99"],
        "rtf_p50": rtf["p50"],
        "rtf_p99": rtf["p99"],
        "server_overhead_ms_p50": overhead["p50"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="4 utterances per client instead of 12")
    parser.add_argument("--tiny", action="store_true", help="the tiny random-weight engine, not the shipped voices")
    parser.add_argument("--agent", action="store_true", help="many agent-like clients on few slots (bench.agent)")
    args, rest = parser.parse_known_args()
    if args.agent:
        from bench.agent import main as agent

        return agent(rest + (["--tiny"] if args.tiny else []))
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.tiny:
        from testkit import tiny_random

        engine = tiny_random(max_streams=4)
    else:
        from tts.api import get_engine

        engine = get_engine(compile=True)  # as `tts serve` runs it (TTS_NO_COMPILE=1: the eager step)
    rounds = 4 if args.quick else 12
    report = {
        "engine": "tiny_random" if args.tiny else "shipped",
        "cpu_cores": os.cpu_count(),
        "utterances_per_client": rounds,
        "concurrency": {},
    }
    with ServerThread(engine) as server:
        for clients in (1, 2, 4):
            report["concurrency"][str(clients)] = asyncio.run(load(server.ws_url, clients, rounds))
    report["ttfa_ms_p50_1_client"] = report["concurrency"]["1"]["ttfa_ms_p50"]
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
