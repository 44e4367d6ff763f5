"""Resume after a dropped connection, measured on the real server (docs/protocol.md, Resume).

    python -m bench.resume            # the shipped voices, as `tts serve` runs them
    python -m bench.resume --tiny     # the tiny random-weight engine (no shipped voices needed)

One seeded f32le utterance is spoken once uninterrupted (the reference), then `--drops` times with its connection
cut mid-utterance (the client's transport aborted after 1..6 chunks: no closing handshake, as a lost network) and
resumed on a new connection by the bundled client's protocol (resume with the bytes and events received).
Reports, as JSON: `resume_ms` p50/p99 (the abort to the first byte of the rest on the new connection: reconnect,
resume handshake, replay), `handshake_ms` p50/p99 (resume sent to `resumed`), and `exact`: how many resumed
utterances equal the reference bit for bit (the target: all of them). Warm-up: the reference is spoken twice.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time

import websockets

from bench.common import percentiles
from server import ServerThread

TEXT = "The quick brown fox jumps over the lazy dog near the river. " * 4
SEED = 7


async def speak(url: str, drop_after: int | None = None) -> dict:
    """The utterance's audio (and, when dropped, the resume's figures)."""
    audio, events, figures = bytearray(), 0, {}
    ws = await websockets.connect(url)
    for message in (
        {"type": "start", "format": "f32le", "seed": SEED},
        {"type": "text", "text": TEXT},
        {"type": "end"},
    ):
        await ws.send(json.dumps(message))
    chunks = 0
    while True:
        message = await ws.recv()
        if isinstance(message, bytes):
            audio += message
            chunks += 1
        else:
            event = json.loads(message)
            events += 1
            if event["type"] == "ready":
                token = event["resume_token"]
            if event["type"] == "done":
                break
        if chunks == drop_after:
            drop_after, cut = None, time.perf_counter()
            ws.transport.abort()
            ws = await websockets.connect(url)
            sent = time.perf_counter()
            await ws.send(
                json.dumps({"type": "resume", "token": token, "contexts": [{"bytes": len(audio), "events": events}]})
            )
            assert json.loads(await ws.recv())["type"] == "resumed"
            figures["handshake_ms"] = (time.perf_counter() - sent) * 1000
            first = await ws.recv()
            figures["resume_ms"] = (time.perf_counter() - cut) * 1000
            assert isinstance(first, bytes), first
            audio += first
    await ws.close()
    return {"audio": bytes(audio), **figures}


async def measure(url: str, drops: int) -> dict:
    for _ in range(2):
        reference = (await speak(url))["audio"]
    runs = [await speak(url, drop_after=1 + i % 6) for i in range(drops)]
    return {
        "drops": drops,
        "exact": sum(run["audio"] == reference for run in runs),
        "resume_ms": percentiles([run["resume_ms"] for run in runs]),
        "handshake_ms": percentiles([run["handshake_ms"] for run in runs]),
        "reference_bytes": len(reference),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--drops", type=int, default=20, help="dropped and resumed utterances (default 20)")
    parser.add_argument("--tiny", action="store_true", help="the tiny random-weight engine, not the shipped voices")
    args = parser.parse_args()
    if args.tiny:
        from testkit import tiny_random

        engine = tiny_random(max_streams=4)
    else:
        from tts.api import get_engine

        engine = get_engine(compile=True)  # as `tts serve` runs it (TTS_NO_COMPILE=1: the eager step)
    with ServerThread(engine) as server:
        report = {
            "engine": "tiny_random" if args.tiny else "shipped",
            "cpu_cores": os.cpu_count(),
            **asyncio.run(measure(server.ws_url, args.drops)),
        }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
