"""Voice agents on few slots: N WebSocket clients on a real server on loopback, each fed like an LLM and read
like a player. One JSON object.

    python -m bench.serve --agent                      # 64 clients, 8 slots, 2 minutes, shipped voices
    python -m bench.serve --agent --clients 16 --slots 4 --minutes 0.5 --tiny
    python -m bench.serve --agent --device cuda --slots 1024 --clients 8192 --client-processes 14 --grace-s 20
    python -m bench.serve --agent --offered-only --clients 8192 --slots 1024 --device cuda   # arithmetic only

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
The engine's parking figures (parks, restores, per tier park/restore/spill/load ms) come from its stats
(the tiers' times since the engine started, the warm-up's included).

**Offered load** (`offered_streams`): the real-time streams of audio these clients ask for on average, from the
same timing draws with an engine that keeps up (each sentence spoken at the run's measured words per second of
audio as soon as its first word is in and the previous one has played). Compare it with what the slots deliver:
a load above it cannot be real-time, whatever the parking policy. `--offered-only` prints it without a server
(at `--words-per-s`, default the shipped model's 3.18).

**Capacity** (`capacity_streams`): the real-time streams the slots can give, slots x frame time / whole-tick
time with the slots full (`tick_ms_full`: ticks sampled while at least 90 % of the slots were in use; with
`--offered-only`, `--tick-ms`, by default the last measured figure for the device). Offered load above it
cannot be real-time; `clients_at_capacity` is how many such clients the capacity could serve at most (the
offered load per client times that equals it); `limited_by` names what held a run back (rules in
`agent_load.limited_by`).

On a GPU (`--device cuda`) the engine is built as `bench.latency --device cuda` builds it (the CUDA-graph
tick, every slot bucket captured before the clock starts). The clients run in `--client-processes`
processes (default 1), client i in process i mod P, so the draws do not depend on P; each process reports
its CPU and its event loop's lag, the server process its threads' CPU by role and how long its event loop
takes to answer a trivial request (`host`): a run says whether the host side, not the device, limited it.
`--grace-s` ends turns still speaking that long after the run's end (counted as cut, their audio kept).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import multiprocessing
import os
import queue
import random
import re
import resource
import sys
import threading
import time

import numpy as np

from bench.agent_load import (
    FULL,
    MEASURED_TICK_MS,
    HostLoad,
    capacity_streams,
    client_load,
    cpu_per_audio_s,
    limited_by,
    loop_lag,
)
from bench.common import harvard, percentiles
from tts import SAMPLE_RATE

JITTER_S = 0.1  # what a player buffers before it starts a sentence
TOKENS_PER_WORD = 1.3
# The server's connection caps and the engine's open streams, per client: room for a session a client dropped
# (its close timed out), which the server holds for a resume while the client reconnects, so that the caps
# never bind before the slots do
HEADROOM = 2


class Player:
    """Real-time playback of one turn's audio, from arrival times: counts stalls inside sentences."""

    def __init__(self, sentences: list[int]):
        self.words: list[tuple[float, float]] = []  # (start s, end s) of each word spoken, on the audio clock
        self.firsts = list(np.cumsum([0] + sentences[:-1]))  # index of each sentence's first word
        self.sizes = sentences
        self.sent_at = time.perf_counter()  # the turn's first text goes out now
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

    def result(self) -> dict:
        return {
            "ttfa_ms": None if self.first_audio is None else (self.first_audio - self.sent_at) * 1000,
            "stalls": self.stalls,
            "stall_s": self.stall_s,
            "audio_s": self.received,
            "words": sum(self.sizes),
        }

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
    """One client's turns until ``deadline``. Cancelled (the run's grace is over), it records the turn it was
    speaking as cut, with what it received."""
    import websockets

    rng = random.Random(index)
    await asyncio.sleep(rng.uniform(0, 5))  # clients arrive over the first seconds, not in one instant
    ws = None
    try:
        while time.perf_counter() < deadline:
            player = None
            try:
                ws = ws or await websockets.connect(url, max_size=None, open_timeout=60)
                turn = rng.sample(sentences, rng.randint(2, 4))
                player = Player([len(s.split()) for s in turn])
                results.append(await speak_turn(ws, turn, rng, ahead_s, player))
            except asyncio.CancelledError:
                if player is not None:
                    results.append({**player.result(), "cut": True})
                raise
            except Exception as err:  # refused or failed: reported; the client reconnects for a clean slate
                results.append({"error": f"{type(err).__name__}: {err}"[:120]})
                await _close(ws)
                ws = None
            await asyncio.sleep(rng.uniform(2, 6))
    finally:
        await _close(ws)


async def _close(ws) -> None:
    if ws is not None:
        with contextlib.suppress(Exception):
            await ws.close()


async def speak_turn(ws, turn: list[str], rng: random.Random, ahead_s: float, player: Player) -> dict:
    """One utterance. Text goes out from the start, as an LLM's would (the server keeps it while the utterance
    waits for its stream)."""
    await ws.send(json.dumps({"type": "start", "format": "pcm_s16le", "word_timings": True}))
    player.sent_at = time.perf_counter()
    writer = asyncio.create_task(write_turn(ws, turn, rng))
    ready, error = False, None
    try:
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
    except BaseException:  # failed or cut: the writer goes too
        writer.cancel()
        raise
    if error is not None:
        raise RuntimeError(error)
    await writer
    return player.result()


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


def sample_server(
    server, engine, stop: threading.Event, used: list[int], held: list[int], full_ticks: list[float]
) -> None:
    """Every 0.1 s: the engine's slots in use and the server's open connections; while the slots are full
    (`agent_load.FULL`), the newest ticks' times. Every 30 s a progress line on stderr."""
    last_line = time.perf_counter()
    while not stop.wait(0.1):
        stats = engine.stats()
        used.append(stats["slots_used"])
        held.append(server.hub.admission.stats()["connections"])
        if stats["slots_used"] >= FULL * engine.max_streams:
            full_ticks.extend(engine.tick_ms.values(last=2).tolist())
        if time.perf_counter() - last_line >= 30:
            last_line = time.perf_counter()
            print(
                f"agent: {held[-1]} connections, {used[-1]} slots used, parks {stats['parks']}, "
                f"tick {stats['tick_ms']}",
                file=sys.stderr,
                flush=True,
            )


def clients(
    url: str, indices: list[int], seconds: float, ahead_s: float, grace_s: float | None = None, ready=None, go=None
) -> tuple[dict[int, list], dict]:
    """The clients ``indices`` in this process for ``seconds`` (turns still speaking ``grace_s`` later are
    cut); with ``ready`` (a queue) and ``go`` (an event), it says it is ready and starts on ``go``, so that
    every process starts together. Returns each client's turns and this process's load: CPU, wall time and
    its event loop's lag (`agent_load.loop_lag`)."""
    sentences = _sentences()
    results: dict[int, list] = {i: [] for i in indices}
    lag: list[float] = []
    if ready is not None:
        ready.put(None)
        go.wait()

    async def everyone():
        watch = asyncio.create_task(loop_lag(lag))
        deadline = time.perf_counter() + seconds
        tasks = [asyncio.create_task(agent(url, i, deadline, sentences, ahead_s, results[i])) for i in indices]
        late = ()
        if tasks:
            _, late = await asyncio.wait(tasks, timeout=None if grace_s is None else seconds + grace_s)
        for task in late:
            task.cancel()
        await asyncio.gather(*late, return_exceptions=True)
        watch.cancel()

    cpu, wall = time.process_time(), time.perf_counter()
    asyncio.run(everyone())
    return results, {"cpu_s": time.process_time() - cpu, "wall_s": time.perf_counter() - wall, "lag_ms": lag}


def _client_process(out, *args) -> None:
    out.put(clients(*args))


def run_elsewhere(
    url: str, count: int, seconds: float, ahead_s: float, processes: int = 1, grace_s: float | None = None
) -> tuple[list[list], list[dict]]:
    """``count`` clients in ``processes`` processes of their own (client i in process i mod P, so that they
    do not share the server's interpreter lock, nor one another's), started together. Returns each client's
    turns, in client order, and each process's load."""
    processes = max(1, min(processes, count))
    context = multiprocessing.get_context("spawn")
    out, ready, go = context.Queue(), context.Queue(), context.Event()
    workers = [
        context.Process(
            target=_client_process,
            daemon=True,
            args=(out, url, list(range(p, count, processes)), seconds, ahead_s, grace_s, ready, go),
        )
        for p in range(processes)
    ]
    for worker in workers:
        worker.start()
    for _ in workers:
        ready.get(timeout=300)
    go.set()
    results: dict[int, list] = {}
    loads = []
    while len(loads) < len(workers):
        try:
            turns, load = out.get(timeout=5)
        except queue.Empty:
            if any(worker.exitcode not in (None, 0) for worker in workers):
                raise RuntimeError("a client process failed (its traceback is above)") from None
            continue
        results.update(turns)
        loads.append(load)
    for worker in workers:
        worker.join()
    return [results[i] for i in range(count)], loads


def report(
    results: list[list],
    held: list[int],
    used: list[int],
    engine,
    args,
    load_before,
    before,
    full_ticks: list[float],
    host: dict,
    run_s: float,
) -> dict:
    turns = [t for per in results for t in per if "error" not in t]
    errors = [t["error"] for per in results for t in per if "error" in t]
    spoke = [per for per in results if any("error" not in t and t["audio_s"] > 0 for t in per)]
    steady = [per for per in spoke if all(t.get("stalls", 0) == 0 for t in per)]
    ttfa = [t["ttfa_ms"] for t in turns if t["ttfa_ms"] is not None]
    audio_s = sum(t["audio_s"] for t in turns)
    whole = [t for t in turns if t["audio_s"] > 0 and not t.get("cut")]  # a cut turn's words outran its audio
    whole_s = sum(t["audio_s"] for t in whole)
    words_per_s = sum(t["words"] for t in whole) / whole_s if whole_s else None
    offered = words_per_s and offered_streams(args.clients, args.minutes * 60, args.ahead_s, words_per_s)
    frame_ms = engine.frame_seconds * 1000
    tick_full = percentiles(full_ticks) if full_ticks else None
    capacity = tick_full and capacity_streams(engine.max_streams, tick_full["p50"], frame_ms)
    stats = engine.stats()
    parking = stats["parking"]
    return {
        "engine": "tiny_random" if args.tiny else "shipped",
        "step_kind": stats["step_kind"],
        "frame_codec": bool(getattr(args, "frame_codec", False)),
        "text_process": os.environ.get("TTS_TEXT_PROCESS", "") not in ("", "0"),
        "device": args.device,
        "cpu_cores": os.cpu_count(),
        "load_avg_1m_before": load_before,
        "load_avg_1m_after": load_average(),
        "clients": args.clients,
        "slots": args.slots,
        "minutes": args.minutes,
        "park_after_s": engine.parking.park_after_s,
        "disk_after_s": engine.parking.disk_after_s,
        "max_host_bytes": engine.parking.max_host_bytes,
        "connections_held": {"p50": int(np.median(held)) if held else 0, "max": max(held, default=0)},
        "slots_used": {"p50": float(np.median(used)) if used else 0, "max": max(used, default=0)},
        "turns": len(turns),
        "turns_cut": sum(1 for t in turns if t.get("cut")),
        "errors": len(errors),
        "error_kinds": sorted(set(errors))[:5],
        "run_s": round(run_s, 1),
        "audio_s": round(audio_s, 1),
        "delivered_streams": round(audio_s / (args.minutes * 60), 2),
        "offered_streams": offered and round(offered, 2),
        "capacity_streams": capacity and round(capacity, 1),
        "tick_ms_full": tick_full,
        "clients_at_capacity": offered and capacity and round(capacity * args.clients / offered),
        "words_per_audio_s": words_per_s and round(words_per_s, 2),
        "real_time_fraction": round(len(steady) / len(spoke), 3) if spoke else None,
        "clients_spoke": len(spoke),
        "stalls": sum(t["stalls"] for t in turns),
        "stall_s": round(sum(t["stall_s"] for t in turns), 2),
        "ttfa_ms": percentiles(ttfa) if ttfa else None,
        **{name: stats[name] - before[name] for name in ("parks", "restores", "slot_waits")},
        "slot_wait_ms": stats["slot_wait_ms"],
        "tiers_ms": {kind: parking[f"{kind}_ms"] for kind in ("park", "restore", "spill", "load")},
        "tick_ms": stats["tick_ms"],
        "step_ms": stats["step_ms"],
        "tick_parts_ms": tick_parts(engine),
        "server_cpu_ms_per_audio_s": cpu_per_audio_s(host, audio_s),
        "host": host,
        "limited_by": limited_by(offered, capacity, tick_full and tick_full["p50"], frame_ms, host),
    }


def tick_parts(engine) -> dict | None:
    """The engine's last 2,000 ticks by part (`Engine.tick_phases`), p50/p99 ms: ``events`` (events, slot grants,
    parking and the batched device updates with the text encoder: the host work per event), ``launch``,
    ``wait`` (for the device) and ``hand_out``. None for a run of several workers."""
    phases = getattr(engine, "tick_phases", None)
    if phases is None or not len(phases):
        return None
    from streaming.engine import TICK_PHASES

    values = phases.values(last=2000) * 1000
    return {name: percentiles(values[:, i]) for i, name in enumerate(TICK_PHASES)}


def offered_only(args) -> dict:
    """`--offered-only`: the offered load against the capacity of ``--slots`` at ``--tick-ms``."""
    from tts.codec import CodecConfig

    frame_ms = 1000 / CodecConfig().frame_rate
    tick_ms = args.tick_ms or MEASURED_TICK_MS[args.device.split(":")[0]]
    streams = offered_streams(args.clients, args.minutes * 60, args.ahead_s, args.words_per_s)
    capacity = capacity_streams(args.slots, tick_ms, frame_ms)
    return {
        "clients": args.clients,
        "minutes": args.minutes,
        "ahead_s": args.ahead_s,
        "words_per_s": args.words_per_s,
        "offered_streams": round(streams, 2),
        "slots": args.slots,
        "device": args.device,
        "tick_ms": tick_ms,
        "capacity_streams": round(capacity, 1),
        "clients_at_capacity": round(capacity * args.clients / streams) if streams else None,
        "real_time_possible": streams <= capacity,
    }


def worker_engine(args, parking, max_streams: int, max_open: int):
    """(procs) One worker's engine under --workers: build_engine's, on the worker's share of the slots."""
    return build_engine(argparse.Namespace(**{**vars(args), "slots": max_streams}), parking)


def build_engine(args, parking):
    """The engine of the run: on the CPU, the shipped model as every user path gets it (`get_engine`); on a
    GPU, as `bench.latency --device cuda` builds it, every slot bucket's graphs captured now; ``--tiny``: the
    tiny random-weight model, on either."""
    if args.device == "cpu" and not args.tiny:
        from tts.api import get_engine

        engine = get_engine(max_streams=args.slots, compile=True, max_open=HEADROOM * args.clients)
        engine.parking = parking  # before any stream: the store reads it when it first spills
        engine.store.config = parking
        return engine
    import kernels
    from streaming.engine import Engine

    if args.tiny:
        from testkit import tiny_model_and_codec

        model, codec, voices = tiny_model_and_codec()
    else:
        from tts.voices import load_shipped

        model, codec, voices = load_shipped(device=args.device)
    cuda = args.device.startswith("cuda")
    engine = Engine(
        model.to(args.device),
        codec.to(args.device),
        voices,
        max_streams=args.slots,
        device=args.device,
        step_factory=kernels.default_step_factory(args.device) if cuda else None,
        max_open=HEADROOM * args.clients,
        parking=parking,
        frame_codec=True if getattr(args, "frame_codec", False) else None,
    )
    if cuda:
        engine.warm_up()
    return engine


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.serve --agent", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--minutes", type=float, default=2.0)
    parser.add_argument("--ahead-s", type=float, default=2.0, help="how far ahead a player reads (default 2 s)")
    parser.add_argument("--park-after-s", type=float, default=None, help="the engine's grace (default its own)")
    parser.add_argument("--disk-after-s", type=float, default=None, help="the engine's disk tier idle time")
    parser.add_argument(
        "--max-host-gb",
        type=float,
        default=None,
        help="parked states kept in host memory before the oldest spill to disk (default its own)",
    )
    parser.add_argument("--tiny", action="store_true", help="the tiny random-weight engine")
    parser.add_argument(
        "--frame-codec",
        action="store_true",
        help="--tiny on the CPU: decode every frame in the tick and hand chunks out as a GPU does "
        "(`FrameCodec`, `AudioOutbox`), so that the host side a GPU server runs shows",
    )
    parser.add_argument(
        "--text-process",
        action="store_true",
        help="read sentences in a process of their own per engine (TTS_TEXT_PROCESS=1, "
        "`streaming.sentence_reader.ProcessReader`)",
    )
    parser.add_argument("--device", default="cpu", help="where the engine runs: cpu (default) or cuda")
    parser.add_argument("--client-processes", type=int, default=1, help="processes the clients run in")
    parser.add_argument(
        "--grace-s",
        type=float,
        default=None,
        help="cut turns still speaking this long after the run's end (default: wait for them)",
    )
    parser.add_argument("--warm-up-clients", type=int, default=1, help="clients of the warm-up (default 1)")
    parser.add_argument("--warm-up-s", type=float, default=5.0, help="length of the warm-up (default 5 s)")
    parser.add_argument("--offered-only", action="store_true", help="print the offered load alone (no server)")
    parser.add_argument("--workers", type=int, default=1, help="server processes (`tts serve --workers`)")
    parser.add_argument("--words-per-s", type=float, default=3.18, help="speaking rate for --offered-only")
    parser.add_argument(
        "--tick-ms",
        type=float,
        default=None,
        help="--offered-only: whole-tick ms with the slots full (default: the last measured, "
        + ", ".join(f"{d} {ms}" for d, ms in MEASURED_TICK_MS.items())
        + ")",
    )
    args = parser.parse_args(argv)
    if args.offered_only:
        print(json.dumps(offered_only(args)))
        return
    raise_open_files_limit()
    if args.text_process:  # every engine of the run, in this process and in the workers (they inherit it)
        os.environ["TTS_TEXT_PROCESS"] = "1"
    from streaming.parking import ParkingConfig

    parking = ParkingConfig()
    if args.park_after_s is not None:
        parking.park_after_s = args.park_after_s
    if args.disk_after_s is not None:
        parking.disk_after_s = args.disk_after_s
    if args.max_host_gb is not None:
        parking.max_host_bytes = int(args.max_host_gb * 2**30)
    building = time.perf_counter()
    from server import ServerProcesses, ServerThread

    room = HEADROOM * args.clients
    limits = dict(max_connections=room, max_connections_per_client=room, max_streams_per_client=room, max_queue=room)
    if args.workers > 1:  # (procs) N server processes, each its own engine of slots / N (serving/workers.py)
        serving = ServerProcesses(
            functools.partial(worker_engine, args, parking), args.workers, args.slots, parking, **limits
        ).start()
        engine = serving.hub  # the workers' /health, summed
    else:
        engine = build_engine(args, parking)
        serving = ServerThread(engine, **limits)
    engine_start_s = round(time.perf_counter() - building, 1)
    load_before = load_average()
    with serving as server:
        warm_up(server, engine, args)
        used, held, full_ticks, stop, before = [], [], [], threading.Event(), engine.stats()
        sampler = threading.Thread(
            target=sample_server, args=(server, engine, stop, used, held, full_ticks), daemon=True
        )
        host, started = HostLoad(server.url).start(), time.perf_counter()
        workers_cpu = args.workers > 1 and server.cpu_seconds()
        sampler.start()
        results, loads = run_elsewhere(
            server.ws_url, args.clients, args.minutes * 60, args.ahead_s, args.client_processes, args.grace_s
        )
        run_s = time.perf_counter() - started
        stop.set()
        sampler.join()
        host = {**host.stop(), **client_load(loads)}
        if args.workers > 1:  # (procs) server_process_cores is this parent's alone; the workers' own:
            host["worker_process_cores"] = round((server.cpu_seconds() - workers_cpu) / run_s, 3)
        result = report(results, held, used, engine, args, load_before, before, full_ticks, host, run_s)
        print(
            json.dumps(
                {
                    **result,
                    "engine_start_s": engine_start_s,
                    "workers": args.workers,
                    **(gpu_figures(args.device) if args.workers == 1 else {}),
                },
                indent=2,
            ),
            flush=True,
        )
    engine.close()


def warm_up(server, engine, args) -> None:
    """One client for 5 s unless asked otherwise (several: cut at the end when the run has a grace), then
    until the server holds no connection and no slot (at most 30 s)."""
    warm = min(args.warm_up_clients, args.clients)
    if warm > 1:
        run_elsewhere(
            server.ws_url,
            warm,
            args.warm_up_s,
            args.ahead_s,
            min(args.client_processes, warm),
            None if args.grace_s is None else 0.0,
        )
    else:
        clients(server.ws_url, [0], args.warm_up_s, args.ahead_s)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and (server.hub.admission.stats()["connections"] or engine.stats()["slots_used"]):
        time.sleep(0.1)


def gpu_figures(device: str) -> dict:
    """The GPU's name and the engine's peak memory on it (nothing on the CPU)."""
    if not device.startswith("cuda"):
        return {}
    import torch

    return {"gpu": torch.cuda.get_device_name(device), "gpu_peak_bytes": torch.cuda.max_memory_allocated(device)}


def load_average() -> float | None:
    """The 1-minute load average (None where the system has none)."""
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


def raise_open_files_limit() -> None:
    """Thousands of connections need as many descriptors: the soft limit up to the hard one (inherited by the
    client processes)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = 1 << 20 if hard == resource.RLIM_INFINITY else hard
    if soft != resource.RLIM_INFINITY and soft < wanted:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))


if __name__ == "__main__":
    main()
