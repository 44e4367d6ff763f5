"""Voice agents on few slots: N WebSocket clients on a real server on loopback, each fed like an LLM and read
like a player. One JSON object.

    python -m bench.serve --agent                      # 64 clients, 8 slots, 2 minutes, shipped voices
    python -m bench.serve --agent --clients 16 --slots 4 --minutes 0.5 --tiny

Each client holds one connection for the whole run and speaks turns, one utterance each: 2-4 Harvard
sentences, each sent a word at a time at 10-30 tokens a second (1.3 tokens a word) and flushed, with pauses of
1-5 s between sentences (the LLM thinking), then `end`; between turns it listens for 2-6 s (the user speaks).
Its player plays the audio in real time and reads the socket only while less than ``--ahead-s`` is buffered, so
a reader that is behind holds up its stream (backpressure), as a real player does.

A **stall** is the player running dry inside a sentence: its audio has started (the first word's start, from
the `timing` events with word timings, is at or before the play position) and not ended (the last word's end
is unknown or later). Running dry between sentences is the LLM's pause, not a stall. After a stall the player
resumes at once; at the start of a sentence it first buffers ``JITTER_S``. **Real-time fraction**: the share of
clients that spoke and never stalled. **TTFA**: first text sent to first audio received, per turn.
The engine's parking figures (parks, restores, per tier park/restore/spill/load ms) come from its stats.

**Offered load** (`offered_streams`): the real-time streams of audio these clients ask for on average, from the
same timing draws with an engine that keeps up (each sentence spoken at the run's measured words per second of
audio as soon as its first word is in and the previous one has played). Compare it with what the slots deliver:
a load above it cannot be real-time, whatever the parking policy. `--offered-only` prints it without a server
(at `--words-per-s`, default the shipped model's 3.18).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import random
import re
import threading
import time

import numpy as np

from bench.common import harvard, percentiles

SAMPLE_RATE = 24_000
JITTER_S = 0.1  # what a player buffers before it starts a sentence
TOKENS_PER_WORD = 1.3


class Player:
    """Real-time playback of one turn's audio, from arrival times: counts stalls inside sentences."""

    def __init__(self, sentences: list[int]):
        self.words: list[tuple[float, float]] = []  # (start s, end s) of each word spoken, on the audio clock
        self.firsts = list(np.cumsum([0] + sentences[:-1]))  # index of each sentence's first word
        self.sizes = sentences
        self.received = 0.0  # seconds of audio received
        self.play_end = None  # wall time at which the audio received so far has played
        self.stalls, self.stall_s, self.first_audio = 0, 0.0, None

    def audio(self, now: float, seconds: float) -> None:
        if self.play_end is None or self.play_end < now:  # ran dry before this chunk
            inside = self.play_end is not None and self._inside_sentence(self.received)
            if inside:
                self.stalls += 1
                self.stall_s += now - self.play_end
            self.play_end = now + (0.0 if inside else JITTER_S)
            self.first_audio = self.first_audio or now
        self.play_end += seconds
        self.received += seconds

    def ahead(self, now: float) -> float:
        return 0.0 if self.play_end is None else self.play_end - now

    def _inside_sentence(self, position: float) -> bool:
        for first, size in zip(self.firsts, self.sizes):
            if first >= len(self.words):
                return False  # this sentence has no timed word yet: nothing of it was spoken
            start = self.words[first][0]
            end = self.words[first + size - 1][1] if first + size - 1 < len(self.words) else None
            if start <= position + 1e-6 and (end is None or position < end - 1e-6):
                return True
        return False


async def agent(url: str, index: int, deadline: float, sentences: list[str], ahead_s: float, results: list):
    import websockets
    rng = random.Random(index)
    await asyncio.sleep(rng.uniform(0, 5))  # clients arrive over the first seconds, not in one instant
    ws = None
    try:
        while time.perf_counter() < deadline:
            ws = ws or await websockets.connect(url, max_size=None)
            turn = rng.sample(sentences, rng.randint(2, 4))
            try:
                results.append(await speak_turn(ws, turn, rng, ahead_s))
            except Exception as err:  # refused or failed: reported; the client reconnects for a clean slate
                results.append({"error": f"{type(err).__name__}: {err}"[:120]})
                await ws.close()
                ws = None
            await asyncio.sleep(rng.uniform(2, 6))
    finally:
        if ws is not None:
            await ws.close()


async def speak_turn(ws, turn: list[str], rng: random.Random, ahead_s: float) -> dict:
    """One utterance. Text goes out from the start, as an LLM's would (the server keeps it while the utterance
    waits for its stream)."""
    await ws.send(json.dumps({"type": "start", "format": "pcm_s16le", "word_timings": True}))
    player = Player([len(s.split()) for s in turn])
    sent_at = time.perf_counter()
    writer = asyncio.create_task(write_turn(ws, turn, rng))
    ready, error = False, None
    while True:
        message = await ws.recv()
        now = time.perf_counter()
        if isinstance(message, bytes):
            player.audio(now, len(message) / 2 / SAMPLE_RATE)
            if (wait := player.ahead(now) - ahead_s) > 0:
                await asyncio.sleep(wait)  # a player reads no further ahead than it must
            continue
        event = json.loads(message)
        kind = event.get("type")
        if kind == "ready":
            ready = True
        elif kind == "timing":
            player.words += [(w["start"], w["end"]) for w in event.get("words", [])]
        elif kind == "done":
            break
        elif kind == "error":
            writer.cancel()
            if not ready:  # refused: no `done` follows
                raise RuntimeError(f"refused: {event.get('code')}")
            error = event.get("code")  # its `done` follows
    if error is not None:
        raise RuntimeError(error)
    await writer
    return {"ttfa_ms": None if player.first_audio is None else (player.first_audio - sent_at) * 1000,
            "stalls": player.stalls, "stall_s": player.stall_s, "audio_s": player.received, "words": sum(player.sizes)}


async def write_turn(ws, turn: list[str], rng: random.Random) -> None:
    for k, sentence in enumerate(turn):
        if k:
            await asyncio.sleep(rng.uniform(1, 5))
        delay = TOKENS_PER_WORD / rng.uniform(10, 30)
        for word in sentence.split():
            await ws.send(json.dumps({"type": "text", "text": word + " "}))
            await asyncio.sleep(delay)
        await ws.send(json.dumps({"type": "flush"}))
    await ws.send(json.dumps({"type": "end"}))


def offered_streams(clients: int, seconds: float, ahead_s: float, words_per_s: float) -> float:
    """Audio seconds the clients ask for per wall second (module docstring): each client's turns drawn as
    `agent` and `write_turn` draw them. Example: a client whose 10 s turn holds 6 s of speech, then listens
    4 s, asks for 0.6 of a stream; 64 such clients, 38 streams."""
    sentences, audio = _sentences(), 0.0
    for index in range(clients):
        rng = random.Random(index)
        now = rng.uniform(0, 5)
        while now < seconds:
            sent = played = now
            for k, sentence in enumerate(rng.sample(sentences, rng.randint(2, 4))):
                sent += rng.uniform(1, 5) if k else 0.0
                words, delay = len(sentence.split()), TOKENS_PER_WORD / rng.uniform(10, 30)
                played = max(sent + delay, played) + words / words_per_s
                audio += words / words_per_s
                sent += words * delay
            now = max(played - ahead_s, sent) + rng.uniform(2, 6)  # `done` comes ahead_s before the end plays
    return audio / seconds


def _sentences() -> list[str]:
    return [s for s in harvard(720) if re.fullmatch(r"[A-Za-z' ]+\.", s)]


def sample_server(server, engine, stop: threading.Event, used: list[int], held: list[int]) -> None:
    """Every 0.1 s: the engine's slots in use and the server's open connections."""
    while not stop.wait(0.1):
        used.append(engine.stats()["slots_used"])
        held.append(server.hub.admission.stats()["connections"])


def run(url: str, clients: int, seconds: float, ahead_s: float, out=None) -> list[list]:
    """The clients, in this process (put their results in ``out``, a queue, when given)."""
    sentences = _sentences()
    deadline = time.perf_counter() + seconds
    results: list[list] = [[] for _ in range(clients)]

    async def everyone():
        await asyncio.gather(*(agent(url, i, deadline, sentences, ahead_s, results[i]) for i in range(clients)))
    asyncio.run(everyone())
    if out is not None:
        out.put(results)
    return results


def run_elsewhere(url: str, clients: int, seconds: float, ahead_s: float) -> list[list]:
    """The clients in a process of their own, so that they do not share the server's interpreter lock."""
    context = multiprocessing.get_context("spawn")
    out = context.Queue()
    process = context.Process(target=run, args=(url, clients, seconds, ahead_s, out))
    process.start()
    results = out.get()
    process.join()
    return results


def report(results: list[list], held: list[int], used: list[int], engine, args, load_before, before) -> dict:
    turns = [t for per in results for t in per if "error" not in t]
    errors = [t["error"] for per in results for t in per if "error" in t]
    spoke = [per for per in results if any("error" not in t and t["audio_s"] > 0 for t in per)]
    steady = [per for per in spoke if all(t.get("stalls", 0) == 0 for t in per)]
    ttfa = [t["ttfa_ms"] for t in turns if t["ttfa_ms"] is not None]
    audio_s = sum(t["audio_s"] for t in turns)
    words_per_s = sum(t["words"] for t in turns if t["audio_s"] > 0) / audio_s if audio_s else None
    stats = engine.stats()
    parking = stats["parking"]
    return {
        "engine": "tiny_random" if args.tiny else "shipped", "step_kind": stats["step_kind"],
        "cpu_cores": os.cpu_count(), "load_avg_1m_before": round(load_before, 2),
        "load_avg_1m_after": round(os.getloadavg()[0], 2), "clients": args.clients, "slots": args.slots,
        "minutes": args.minutes, "park_after_s": engine.parking.park_after_s,
        "disk_after_s": engine.parking.disk_after_s,
        "connections_held": {"p50": int(np.median(held)) if held else 0, "max": max(held, default=0)},
        "slots_used": {"p50": float(np.median(used)) if used else 0, "max": max(used, default=0)},
        "turns": len(turns), "errors": len(errors), "error_kinds": sorted(set(errors))[:5],
        "audio_s": round(audio_s, 1), "delivered_streams": round(audio_s / (args.minutes * 60), 2),
        "offered_streams": words_per_s and round(offered_streams(args.clients, args.minutes * 60, args.ahead_s,
                                                                 words_per_s), 2),
        "words_per_audio_s": words_per_s and round(words_per_s, 2),
        "real_time_fraction": round(len(steady) / len(spoke), 3) if spoke else None,
        "clients_spoke": len(spoke), "stalls": sum(t["stalls"] for t in turns),
        "stall_s": round(sum(t["stall_s"] for t in turns), 2),
        "ttfa_ms": percentiles(ttfa) if ttfa else None,
        **{name: stats[name] - before[name] for name in ("parks", "restores", "slot_waits")},
        "slot_wait_ms": stats["slot_wait_ms"],
        "tiers_ms": {kind: parking[f"{kind}_ms"] for kind in ("park", "restore", "spill", "load")},
        "tick_ms": stats["tick_ms"], "step_ms": stats["step_ms"],
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.serve --agent", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--minutes", type=float, default=2.0)
    parser.add_argument("--ahead-s", type=float, default=2.0, help="how far ahead a player reads (default 2 s)")
    parser.add_argument("--park-after-s", type=float, default=None, help="the engine's grace (default its own)")
    parser.add_argument("--disk-after-s", type=float, default=None, help="the engine's disk tier idle time")
    parser.add_argument("--tiny", action="store_true", help="the tiny random-weight engine")
    parser.add_argument("--offered-only", action="store_true", help="print the offered load alone (no server)")
    parser.add_argument("--words-per-s", type=float, default=3.18, help="speaking rate for --offered-only")
    args = parser.parse_args(argv)
    if args.offered_only:
        streams = offered_streams(args.clients, args.minutes * 60, args.ahead_s, args.words_per_s)
        print(json.dumps({"clients": args.clients, "minutes": args.minutes, "ahead_s": args.ahead_s,
                          "words_per_s": args.words_per_s, "offered_streams": round(streams, 2)}))
        return
    from streaming.parking import ParkingConfig
    parking = ParkingConfig()
    if args.park_after_s is not None:
        parking.park_after_s = args.park_after_s
    if args.disk_after_s is not None:
        parking.disk_after_s = args.disk_after_s
    if args.tiny:
        from tests.helpers import tiny_random
        engine = tiny_random(max_streams=args.slots, max_open=args.clients, parking=parking)
    else:
        from tts.api import get_engine
        engine = get_engine(max_streams=args.slots, compile=True, max_open=args.clients)
        engine.parking = parking  # before any stream: the store reads it when it first spills
        engine.store.config = parking
    from server import ServerThread
    limits = dict(max_connections=args.clients, max_connections_per_client=args.clients,
                  max_streams_per_client=args.clients, max_queue=args.clients)
    load_before = os.getloadavg()[0]
    with ServerThread(engine, **limits) as server:
        run(server.ws_url, 1, 5, args.ahead_s)  # warm-up: one client, 5 s
        used, held, stop, before = [], [], threading.Event(), engine.stats()
        sampler = threading.Thread(target=sample_server, args=(server, engine, stop, used, held), daemon=True)
        sampler.start()
        results = run_elsewhere(server.ws_url, args.clients, args.minutes * 60, args.ahead_s)
        stop.set()
        sampler.join()
        print(json.dumps(report(results, held, used, engine, args, load_before, before), indent=2))
    engine.close()


if __name__ == "__main__":
    main()
