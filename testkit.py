"""Test helpers: a tiny random-weight engine for fast tests of everything around the model, and a WebSocket
client's side of a resumed session (tests/test_resume.py, tests/test_workers.py)."""

from __future__ import annotations

import asyncio
import base64
import json
import threading
import time
from collections import defaultdict
from dataclasses import dataclass

import torch
import websockets

from streaming.engine import Engine
from tts.codec import CODEC_PRESETS, Codec
from tts.model import MODEL_PRESETS, TTSModel

VOICE_NAMES = ["joe", "slt", "rms", "kal", "awb"]
SENTENCE = "The quick brown fox jumps over the lazy dog. "


def tiny_model_and_codec() -> tuple[TTSModel, Codec, dict[str, dict]]:
    """A tiny random model and codec (the same weights on every call) and five voices for them."""
    torch.manual_seed(0)
    codec = Codec(CODEC_PRESETS["tiny"])
    codec.quantizer.codebooks.normal_()
    model = TTSModel(MODEL_PRESETS["tiny"])
    torch.nn.init.constant_(model.text.duration[-1].bias, 1.4)  # about 3 frames a unit, like speech
    voices = {
        n: {
            "name": n,
            "index": i,
            "description": "tiny random test voice",
            "teacher": "none",
            "sample_rate": codec.cfg.sample_rate,
            "default": i == 0,
        }
        for i, n in enumerate(VOICE_NAMES)
    }
    return model, codec, voices


def tiny_random(max_streams: int = 4, **kwargs) -> Engine:
    """An engine on the tiny random model and codec: real scheduling, streaming and audio shapes, noise for
    sound."""
    model, codec, voices = tiny_model_and_codec()
    return Engine(model, codec, voices, max_streams=max_streams, **kwargs)


def wait_until(condition, seconds: float = 10.0) -> bool:
    """Poll ``condition`` until it holds (True) or ``seconds`` pass (False)."""
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


def held_codec_worker(codec: Codec, slots: int):
    """A CPU `CodecWorker` whose first decode waits until the test sets the returned gate (so the test can queue
    jobs behind it): (worker, gate, lengths of the decodes run so far)."""
    from streaming.codec_worker import CodecWorker

    gate, lengths = threading.Event(), []

    def held(codes, state):
        lengths.append(codes.shape[-1])
        if len(lengths) == 1:
            gate.wait(30)
        return codec.decode_step(codes, state)

    worker = CodecWorker(codec, slots, "cpu")
    worker.set_decode_step(held)
    return worker, gate, lengths


# ---- a client's side of a resumed WebSocket session --------------------------------------------------
async def send(ws, **message) -> None:
    await ws.send(json.dumps(message))


class Received:
    """What a client holds of one session, per context: audio bytes, and events (not queued or resumed)."""

    def __init__(self):
        self.audio: dict = defaultdict(bytearray)
        self.events: dict = defaultdict(list)

    def take(self, message) -> dict | None:
        if isinstance(message, bytes):
            self.audio[None] += message
            return None
        event = json.loads(message)
        context = event.get("context_id")
        if event["type"] == "audio":
            self.audio[context] += base64.b64decode(event["audio"])
        elif event["type"] not in ("queued", "resumed"):
            self.events[context].append(event)
        return event

    def done(self, context=None) -> bool:
        return any(e["type"] == "done" for e in self.events[context])

    def position(self, context=None) -> dict:
        where = {"bytes": len(self.audio[context]), "events": len(self.events[context])}
        return where if context is None else {"context_id": context, **where}

    def words(self, context=None) -> list:
        return [w for e in self.events[context] if e["type"] == "timing" for w in e["words"]]

    async def read(self, ws, until, timeout: float = 60) -> None:
        async with asyncio.timeout(timeout):
            while not until():
                self.take(await ws.recv())


STARTS = {
    None: {"format": "f32le", "seed": 11, "word_timings": True},
    "b": {"format": "pcm_s16le", "seed": 22, "word_timings": True, "voice": "slt"},
}


async def open_contexts(ws, got: Received, sentences: int = 3) -> str:
    """Start both contexts of STARTS with their text ended; returns the resume token of their ready."""
    for context, start in STARTS.items():
        await send(ws, type="start", **start, **({"context_id": context} if context else {}))
    await got.read(ws, lambda: all(any(e["type"] == "ready" for e in got.events[c]) for c in STARTS))
    for context in STARTS:
        named = {"context_id": context} if context else {}
        await send(ws, type="text", text=SENTENCE * sentences, **named)
        await send(ws, type="end", **named)
    return got.events[None][0]["resume_token"]


async def uninterrupted(url: str, sentences: int = 3) -> Received:
    got = Received()
    async with websockets.connect(url) as ws:
        await open_contexts(ws, got, sentences)
        await got.read(ws, lambda: all(got.done(c) for c in STARTS))
    return got


def assert_same_output(resumed: Received, reference: Received) -> None:
    for context in STARTS:
        assert len(resumed.audio[context]) == len(reference.audio[context]) > 0, context
        assert bytes(resumed.audio[context]) == bytes(reference.audio[context]), context
        assert resumed.words(context) == reference.words(context) != [], context
        kinds = [e["type"] for e in resumed.events[context]]
        assert kinds.count("ready") == 1 and kinds.count("done") == 1 and kinds[-1] == "done", kinds
        assert not resumed.events[context][-1]["cancelled"]


@dataclass
class CutAndResumed:
    reference: Received  # the same request, never interrupted
    got: Received  # what the client holds after the resume
    token: str  # the resume token of the first ready
    resumed: dict  # the server's answer to the resume
    held: bool  # whether `held()` came true before the resume
    watched: object  # what `watch()` returned just after that answer


async def cut_and_resume(url: str, held, resume_url: str | None = None, watch=lambda: None) -> CutAndResumed:
    """Both contexts of STARTS on `url`, acknowledged up to ~20 KB and ~5 KB, then read on unacknowledged to ~40 KB
    (the server must replay that part), cut by a transport abort (no close frame, as a lost network); once
    ``held()`` (polled in a thread), resumed on `resume_url` (default `url`) and read to both contexts' done."""
    reference = await uninterrupted(url)
    got = Received()
    ws = await websockets.connect(url)
    token = await open_contexts(ws, got)
    await got.read(ws, lambda: len(got.audio[None]) > 20_000 and len(got.audio["b"]) > 5_000)
    await send(ws, type="ack", **got.position(None))
    await send(ws, type="ack", **got.position("b"))
    await got.read(ws, lambda: len(got.audio[None]) > 40_000)
    ws.transport.abort()
    kept = await asyncio.to_thread(wait_until, held)
    async with websockets.connect(resume_url or url) as again:
        await send(again, type="resume", token=token, contexts=[got.position(c) for c in STARTS])
        resumed = json.loads(await again.recv())
        watched = watch()
        await got.read(again, lambda: all(got.done(c) for c in STARTS))
    return CutAndResumed(reference, got, token, resumed, kept, watched)
