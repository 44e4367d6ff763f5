"""Soak: the server at capacity for N minutes, mixed WebSocket and HTTP clients, some aborting and some reading
slowly. One JSON object, per minute and overall.

    python -m bench.soak --minutes 10          # the shipped voices, as `tts serve` runs them
    python -m bench.soak --minutes 2 --tiny    # the tiny random-weight engine (no shipped voices needed)

The server runs in a child process (`tts serve`'s own `serve()`, default limits), so its RSS is the server's
alone. Every slot is used twice at once before the clock starts (warm-up: steps built on first use). Then as
many clients as the engine has slots loop without pause; each utterance is, at random, a WebSocket utterance
or an OpenAI-style HTTP request (half each), and with 5 % chance aborted after its first audio, with 5 %
chance read slowly (half real time: the server must pause that stream and serve the rest as usual).
Per minute: utterances served, aborted and read slowly, errors by code (the server's typed errors, HTTP
statuses, dropped connections; aborts are not errors), first audio p50/p99 in ms (request sent to first audio
byte, utterances that were not aborted) and the server's RSS at the minute's end.
Targets (issue 25): no errors; RSS growth under 20 MB after the first minute; first-audio p99 within 2x p50
every minute. A refusal (`server_full`, `client_limit`) is listed with the server's message and what its /health
said just after (connections, sessions awaiting a resume), to tell which limit it met and why.
--abort sets the share aborted (a diagnosis: 0.5 fills the resume window with dropped sessions).

--timeline adds, per minute, where the server's first audios waited (`streaming.stream.TIMELINE`: request,
stream opened, text, units back from the text thread, slot, first prefill, first step, first chunk due, codec
job begun, delivered, read by the server, sent): the median of each stage's share over the minute's
utterances, and the breakdown of the slowest three.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter

import httpx2 as httpx
import numpy as np
import psutil
import websockets

from streaming.stream import TIMELINE

SENTENCES = [
    "The quick brown fox jumps over the lazy dog near the river.",
    "Please call me back when you have a moment this afternoon.",
    "Our train leaves the station at half past seven tomorrow morning.",
    "She found an old map hidden behind the kitchen cupboard door.",
    "It was 3:30 when the parcel, worth $12.50, finally arrived. Nobody had expected it so soon.",
    "Rain again.",
]
ABORT, SLOW = 0.05, 0.05
BYTES_PER_S = 2 * 24_000  # pcm_s16le at 24 kHz


class Tally:
    """What happened in one minute."""

    def __init__(self):
        self.served = self.aborted = self.slow = 0
        self.errors: Counter = Counter()
        self.refusals: list[dict] = []  # the first few refusals: code, message, the server's counts just after
        self.most_awaiting_resume = 0  # the most dropped sessions waiting for a resume at once (sampled each 1 s)
        self.first_audio_ms: list[float] = []
        self.utterances: list[dict] = []  # each served one: kind, sentence, first audio, when it was sent

    def add(self, kind: str, text: str, sent: float, first: float, done: dict | None = None) -> None:
        """``done``: a WebSocket utterance's done event, whose server-side first audio times (from its first
        text: to the first audio sent, and to the engine's first chunk) tell where a slow one waited."""
        self.served += 1
        self.first_audio_ms.append((first - sent) * 1000)
        server = (
            {}
            if done is None
            else {"server_ttfa_ms": done.get("ttfa_ms"), "engine_ttfa_ms": done.get("engine_ttfa_ms")}
        )
        self.utterances.append(
            {
                "kind": kind,
                "sentence": SENTENCES.index(text),
                "sent": sent,
                "first_audio_ms": round((first - sent) * 1000, 1),
                **server,
            }
        )

    def report(self, rss_mb: float, sends: list[float], engine: dict) -> dict:
        ttfa = np.asarray(self.first_audio_ms) if self.first_audio_ms else np.zeros(1)
        p50, p99 = float(np.percentile(ttfa, 50)), float(np.percentile(ttfa, 99))
        return {
            "served": self.served,
            "aborted": self.aborted,
            "slow_readers": self.slow,
            "errors": dict(self.errors),
            "refusals": self.refusals,
            "most_awaiting_resume": self.most_awaiting_resume,
            "first_audio_ms_p50": round(p50, 1),
            "first_audio_ms_p99": round(p99, 1),
            "p99_over_p50": round(p99 / p50, 2) if p50 else None,
            "rss_mb": round(rss_mb, 1),
            "p50_by_kind": {
                kind: round(float(np.median([u["first_audio_ms"] for u in self.utterances if u["kind"] == kind])), 1)
                for kind in sorted({u["kind"] for u in self.utterances})
            },
            "slowest": [_describe(u, sends) for u in sorted(self.utterances, key=lambda u: -u["first_audio_ms"])[:3]],
            "engine": engine,
        }


def _describe(utterance: dict, sends: list[float]) -> dict:
    """A slow utterance: what it was, how many others were sent in the half second before it, and how many
    WebSocket utterances were aborted in the 4 s before it (a dropped session's stream speaks on for up to the
    engine's 4 s queue, waiting for a resume: one more stream than slots meanwhile)."""
    sent = utterance["sent"]
    return {
        **{k: v for k, v in utterance.items() if k != "sent"},
        "sent_in_prior_500ms": sum(sent - 0.5 <= t < sent for t in sends),
        "ws_aborts_in_prior_4s": sum(sent - 4 <= t < sent for t in WS_ABORTS),
    }


async def _refused(tally: Tally, code: str, message: str, base: str) -> None:
    """Count an error; a refusal (the first five a minute) is kept with the message and the server's counts."""
    tally.errors[code] += 1
    if ("server_full" in code or "client_limit" in code) and len(tally.refusals) < 5:
        async with httpx.AsyncClient(base_url=base, timeout=30) as http:
            health = (await http.get("/health")).json()
        tally.refusals.append(
            {
                "code": code,
                "message": message,
                "server_after": {
                    name: health.get(name)
                    for name in ("connections", "clients", "awaiting_resume", "streams", "queued")
                },
            }
        )


async def _read_slowly(chunk_bytes: int) -> None:
    await asyncio.sleep(2 * chunk_bytes / BYTES_PER_S)  # half real time


SENDS: list[float] = []  # when every utterance was sent
STARTED: list[float] = []  # when the clock started (perf_counter: the server's clock too, CLOCK_MONOTONIC)
WS_ABORTS: list[float] = []  # when each WebSocket abort happened
BASE: list[str] = []  # the server's URL


async def ws_utterance(url: str, text: str, abort: bool, slow: bool, tally: Tally) -> None:
    sent = time.perf_counter()
    SENDS.append(sent)
    ws = await websockets.connect(url, max_queue=4)
    try:
        await ws.send(json.dumps({"type": "start", "format": "pcm_s16le"}))
        await ws.send(json.dumps({"type": "text", "text": text}))
        await ws.send(json.dumps({"type": "end"}))
        first = None
        while True:
            message = await ws.recv()
            if isinstance(message, bytes):
                if first is None:
                    first = time.perf_counter()
                    if abort:
                        ws.transport.abort()
                        WS_ABORTS.append(time.perf_counter())
                        tally.aborted += 1
                        return
                if slow:
                    await _read_slowly(len(message))
                continue
            event = json.loads(message)
            if event["type"] == "error":
                await _refused(tally, event["code"], event["message"], BASE[0])
            elif event["type"] == "done":
                if first is not None and not event["cancelled"]:
                    tally.add("ws", text, sent, first, event)
                return
    finally:
        await ws.close()


async def http_utterance(http: httpx.AsyncClient, text: str, abort: bool, slow: bool, tally: Tally) -> None:
    sent = time.perf_counter()
    SENDS.append(sent)
    body = {"model": "tts-1", "input": text, "voice": "alloy", "response_format": "pcm"}
    async with http.stream("POST", "/v1/audio/speech", json=body) as response:
        if response.status_code != 200:
            error = json.loads(await response.aread())["error"]
            await _refused(tally, f"http_{response.status_code}_{error['code']}", error["message"], BASE[0])
            return
        first = None
        async for part in response.aiter_bytes():
            if first is None:
                first = time.perf_counter()
                if abort:
                    tally.aborted += 1
                    return  # leaving the block closes the connection mid-body
            if slow:
                await _read_slowly(len(part))
    tally.add("http", text, sent, first)


async def client(
    base: str,
    http: httpx.AsyncClient,
    index: int,
    until: float,
    minutes: list[Tally],
    started: float,
    abort_share: float,
) -> None:
    rng = random.Random(index)
    async with http:
        while time.monotonic() < until:
            tally = minutes[min(int((time.monotonic() - started) // 60), len(minutes) - 1)]
            text, abort, slow = rng.choice(SENTENCES), rng.random() < abort_share, rng.random() < SLOW
            tally.slow += slow
            try:
                if rng.random() < 0.5:
                    await ws_utterance(base.replace("http", "ws", 1) + "/v1/stream", text, abort, slow, tally)
                else:
                    await http_utterance(http, text, abort, slow, tally)
            except (OSError, websockets.ConnectionClosed, httpx.HTTPError) as err:
                tally.errors[type(err).__name__] += 1


async def warm_up(base: str, clients: int) -> float:
    """Every slot busy at once, twice, before the clock starts: a step built on first use (a compiled step, a
    batch size met for the first time) is start-up, not the steady state the soak measures. Seconds taken."""
    started = time.monotonic()
    async with httpx.AsyncClient(base_url=base, timeout=600) as http:
        for _ in range(2):
            await asyncio.gather(*(http_utterance(http, SENTENCES[0], False, False, Tally()) for _ in range(clients)))
    return time.monotonic() - started


async def soak(base: str, minutes: int, clients: int, server: psutil.Process, abort_share: float = ABORT) -> dict:
    BASE.append(base)
    warm_up_s = await warm_up(base, clients)
    # Each client's HTTP client is made before the clock starts: making one blocks this process's event loop
    # ~25 ms (its TLS context), and 8 made at once held minute 1's first audios back 200-300 ms at the client
    # after the server had sent them (`--timeline`: the server's own p99 that minute was 1.5x its p50).
    https = [httpx.AsyncClient(base_url=base, timeout=120) for _ in range(clients)]
    started = time.monotonic()
    STARTED.append(time.perf_counter())
    tallies = [Tally() for _ in range(minutes)]
    rss_start, fds_start = server.memory_info().rss / 2**20, server.num_fds()
    tasks = [
        asyncio.create_task(client(base, https[i], i, started + 60 * minutes, tallies, started, abort_share))
        for i in range(clients)
    ]
    sampler = asyncio.create_task(_sample_awaiting_resume(base, tallies, started))
    reports = []
    for minute in range(minutes):
        await asyncio.sleep(max(0.0, started + 60 * (minute + 1) - time.monotonic()))
        reports.append(tallies[minute].report(server.memory_info().rss / 2**20, SENDS, await _engine_figures(base)))
        print(json.dumps({"minute": minute + 1, **reports[-1]}), file=sys.stderr, flush=True)
    await asyncio.gather(*tasks)
    sampler.cancel()
    fds_end = await _fds_when_drained(base, server)
    errors = sum((Counter(r["errors"]) for r in reports), Counter())
    rss = [r["rss_mb"] for r in reports]
    return {
        "minutes": reports,
        "clients": clients,
        "warm_up_s": round(warm_up_s, 1),
        "served": sum(r["served"] for r in reports),
        "aborted": sum(r["aborted"] for r in reports),
        "slow_readers": sum(r["slow_readers"] for r in reports),
        "errors": dict(errors),
        "rss_mb_start": round(rss_start, 1),
        "rss_mb_end": rss[-1],
        "rss_growth_after_minute_1_mb": round(rss[-1] - rss[0], 1),
        "worst_p99_over_p50": max((r["p99_over_p50"] or 0) for r in reports),
        "open_fds_start": fds_start,
        "open_fds_after_drain": fds_end,
    }


async def _fds_when_drained(base: str, server: psutil.Process, seconds: float = 60.0) -> int:
    """The server's open file descriptors once its connections are gone (dropped sessions expire after the resume
    window, 30 s by default): they should be back to what they were before the clock started (issue 48)."""
    deadline = time.monotonic() + seconds
    async with httpx.AsyncClient(base_url=base, timeout=10) as http:
        while time.monotonic() < deadline and (await http.get("/health")).json().get("connections"):
            await asyncio.sleep(1.0)
    await asyncio.sleep(1.0)
    return server.num_fds()


async def _sample_awaiting_resume(base: str, minutes: list[Tally], started: float) -> None:
    """Each second, the server's dropped sessions waiting for a resume (/health): the most, per minute. Each counts
    as a connection until it expires (resume_window_s), against max_connections (and, before the fix of 2026-12-02,
    against its client's caps too: the soak's rare 429 client_limit, 8 clients on one address with a cap of 16)."""
    async with httpx.AsyncClient(base_url=base, timeout=30) as http:
        while True:
            tally = minutes[min(int((time.monotonic() - started) // 60), len(minutes) - 1)]
            waiting = (await http.get("/health")).json().get("awaiting_resume", 0)
            tally.most_awaiting_resume = max(tally.most_awaiting_resume, waiting)
            await asyncio.sleep(1.0)


async def _engine_figures(base: str) -> dict:
    """The server's engine at the minute's end: recent tick p99, slot waits and parking (from /health)."""
    async with httpx.AsyncClient(base_url=base, timeout=30) as http:
        engine = (await http.get("/health")).json().get("engine", {})
    parking = engine.get("parking", {})
    return {
        "tick_ms_p99": engine.get("tick_ms", {}).get("p99"),
        "step_kind": engine.get("step_kind"),
        "slot_waits": engine.get("slot_waits"),
        "parks": engine.get("parks"),
        "parked_disk": parking.get("parked", {}).get("disk"),
        "spills": parking.get("spill_ms", {}).get("count"),
        "slowest_ticks_ms": engine.get("slowest_ticks_ms"),
        "codec_queued": engine.get("codec_queued"),
    }


def timeline_by_minute(lines: list[dict], started: float, minutes: int) -> list[dict]:
    """The server's timelines (one per stream, TTS_TIMELINE_LOG) of served utterances, by the minute
    their request came in: the server's first audio (request to sent) p50/p99, each stage's median (ms since the
    stage before it), and the slowest three stage by stage with the engine ticks from first step to first chunk.
    Stages as `_stages` counts them."""
    served = [line for line in lines if line["finished"] and "sent" in line["timeline_ms"] and line["at"]]
    report = []
    for minute in range(minutes):
        those = [line for line in served if int((line["at"] - started) // 60) == minute]
        if not those:
            report.append({})
            continue
        stages = [_stages(line["timeline_ms"]) for line in those]
        total = np.asarray([line["timeline_ms"]["sent"] for line in those])
        names = [name for name in TIMELINE[1:] if any(name in s for s in stages)]
        slowest = np.argsort(-total)[:3]
        report.append(
            {
                "server_first_audio_ms_p50": round(float(np.percentile(total, 50)), 1),
                "server_first_audio_ms_p99": round(float(np.percentile(total, 99)), 1),
                "stage_ms_p50": {
                    name: round(float(np.median([s.get(name, 0.0) for s in stages])), 1) for name in names
                },
                "slowest": [
                    {
                        "first_audio_ms": float(total[i]),
                        "ticks_to_due": those[i]["ticks_to_due"],
                        "stages_ms": stages[i],
                    }
                    for i in slowest
                ],
            }
        )
    return report


def _stages(timeline: dict) -> dict:
    """What each stage added: ms from the latest stage before it (0 if it was reached before them: a slot
    granted before the text came back, say). Example: {"request": 0, "opened": 1.2, "slot": 9.0, "text": 1.5,
    "units": 6.0} -> {"opened": 1.2, "slot": 7.8, "text": 0.0, "units": 0.0}."""
    names, stages, latest = list(timeline), {}, 0.0
    for name in names[1:]:
        stages[name] = round(max(0.0, timeline[name] - latest), 1)
        latest = max(latest, timeline[name])
    return stages


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _trace_memory(every_s: float = 60.0, top: int = 12) -> None:
    """Diagnosis of memory growth (--trace-memory): Python's allocations traced from now on; every ``every_s``
    the RSS, the traced total and the source lines whose allocations grew most since the first report, as
    JSON lines on stderr. Memory outside Python's allocator (torch tensors, ONNX Runtime) is RSS but untraced."""
    import threading
    import tracemalloc

    tracemalloc.start(4)
    me = psutil.Process()

    def report() -> None:
        first = None
        while True:
            time.sleep(every_s)
            snapshot = tracemalloc.take_snapshot().filter_traces([tracemalloc.Filter(False, tracemalloc.__file__)])
            first = first or snapshot
            grown = snapshot.compare_to(first, "traceback")[:top]
            print(
                json.dumps(
                    {
                        "rss_mb": round(me.memory_info().rss / 2**20, 1),
                        "traced_mb": round(tracemalloc.get_traced_memory()[0] / 2**20, 1),
                        "grown_since_first": [
                            {
                                "kb": round(s.size_diff / 1024, 1),
                                "count": s.count_diff,
                                "where": [f"{f.filename.rsplit('/', 2)[-1]}:{f.lineno}" for f in s.traceback],
                            }
                            for s in grown
                        ],
                    }
                ),
                file=sys.stderr,
                flush=True,
            )

    threading.Thread(target=report, daemon=True, name="trace-memory").start()


def _serve(port: int, tiny: bool, trace_memory: bool = False) -> None:
    """The child process: the server, as `tts serve` runs it (or on the tiny engine). Each full (generation 2)
    garbage collection is logged to stderr with its pause: one walks the whole heap with the GIL held."""
    import gc

    from server import serve

    if trace_memory:
        _trace_memory()
    started = {}

    def note(phase: str, info: dict) -> None:
        if info["generation"] == 2:
            if phase == "start":
                started["at"] = time.perf_counter()
            else:
                print(
                    json.dumps(
                        {
                            "gc_generation_2_ms": round((time.perf_counter() - started["at"]) * 1000, 1),
                            "objects_tracked": len(gc.get_objects()),
                        }
                    ),
                    file=sys.stderr,
                    flush=True,
                )

    gc.callbacks.append(note)
    engine = None
    if tiny:  # as `tts serve` builds its engine: as many open streams as connections, those waiting parked
        from serving.limits import Limits
        from testkit import tiny_random

        engine = tiny_random(max_streams=4, max_open=Limits().max_connections)
    serve(port=port, engine=engine, log_level="warning")


def _wait_healthy(base: str, child: subprocess.Popen, seconds: float = 600) -> dict:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and child.poll() is None:
        try:
            return httpx.get(base + "/health", timeout=2).json()
        except httpx.HTTPError:
            time.sleep(0.5)
    raise SystemExit(f"the server did not come up (exit code {child.poll()})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=int, default=10)
    parser.add_argument(
        "--abort",
        type=float,
        default=ABORT,
        help=f"share of utterances aborted after their first audio (default {ABORT})",
    )
    parser.add_argument("--tiny", action="store_true", help="the tiny random-weight engine, not the shipped voices")
    parser.add_argument(
        "--trace-memory",
        action="store_true",
        help="diagnosis: the server's Python allocations that grew, every minute on stderr (slower)",
    )
    parser.add_argument(
        "--timeline",
        action="store_true",
        help="diagnosis: per minute, where the server's first audios waited (stage by stage)",
    )
    parser.add_argument("--serve", type=int, help=argparse.SUPPRESS)  # the child process: serve on this port
    args = parser.parse_args()
    if args.serve:
        return _serve(args.serve, args.tiny, args.trace_memory)
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    timeline = None
    env = dict(os.environ)
    if args.timeline:
        handle, timeline = tempfile.mkstemp(prefix="soak-timeline-", suffix=".jsonl")
        os.close(handle)
        env["TTS_TIMELINE_LOG"] = timeline
    child = subprocess.Popen(
        [sys.executable, "-m", "bench.soak", "--serve", str(port)]
        + ["--tiny"] * args.tiny
        + ["--trace-memory"] * args.trace_memory,
        env=env,
    )
    try:
        slots = _wait_healthy(base, child)["slots"]
        report = asyncio.run(soak(base, args.minutes, slots, psutil.Process(child.pid), args.abort))
    finally:
        child.terminate()
        child.wait(timeout=30)
    if timeline is not None:
        with open(timeline) as lines:
            breakdown = timeline_by_minute([json.loads(line) for line in lines], STARTED[0], args.minutes)
        os.unlink(timeline)
        for minute, figures in zip(report["minutes"], breakdown):
            minute["timeline"] = figures
    report = {
        "engine": "tiny_random" if args.tiny else "shipped",
        "cpu_cores": os.cpu_count(),
        "abort": args.abort,
        **report,
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
