"""The Python API: ``synthesize_stream`` yields audio while it is being generated."""
from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator

import numpy as np
import torch

import kernels
from streaming.engine import Engine
from tts.text import TextError

from tts import SAMPLE_RATE  # noqa: F401  (re-exported: tts.api.SAMPLE_RATE)
_engine: Engine | None = None
_engine_lock = threading.Lock()


def get_engine(max_streams: int = 4, compile: bool = False) -> Engine:
    """The process-wide engine on the shipped voices, loaded on first use. Every step computes all
    ``max_streams`` slots, so on 2 CPU cores 4 slots is the measured sweet spot (bench/latency.py).
    ``compile`` compiles the decode step first (seconds; long-lived processes such as the server)."""
    global _engine
    with _engine_lock:
        if _engine is None:
            from tts.voices import load_shipped
            torch.set_flush_denormal(True)
            model, codec, presets = load_shipped()
            _engine = Engine(model, codec, presets, max_streams=max_streams,
                             step_factory=kernels.default_step_factory("cpu", compile))
        return _engine


def _feed(stream, pieces: Iterable[str]) -> None:
    try:
        for piece in pieces:
            if stream.cancelled:
                return
            stream.push_text(piece)
        stream.end()
    except Exception as err:  # a failing text source ends the utterance with its error
        stream.finish(err)
        stream.cancel()


def synthesize_stream(text: str | Iterable[str], voice: str | None = None, speed: float = 1.0,
                      engine: Engine | None = None) -> Iterator[np.ndarray]:
    """Yield float32 mono chunks at ``SAMPLE_RATE`` as they are decoded.

    ``text`` is a string, or an iterable of text pieces (an LLM's tokens): speaking starts once enough
    text has arrived, without waiting for the end. Raises ``TextError`` for empty, unspeakable or too
    long text, ``UnknownVoice`` for a voice that is not shipped, ``ValueError`` for a bad speed.
    """
    engine = engine or get_engine()
    if isinstance(text, str):
        if not text.strip():
            raise TextError("text is empty")
        if len(text) > engine.max_chars:
            raise TextError(f"text is {len(text)} characters; the limit is {engine.max_chars}")
        pieces: Iterable[str] = [text]
    else:
        pieces = text
    stream = engine.open(voice, speed)
    feeder = threading.Thread(target=_feed, args=(stream, pieces), daemon=True)
    feeder.start()
    try:
        while True:
            chunk = stream.read()
            if chunk is None:
                return
            yield chunk
    finally:
        if not stream.finished:
            stream.cancel()


def synthesize(text: str | Iterable[str], voice: str | None = None, speed: float = 1.0,
               engine: Engine | None = None) -> np.ndarray:
    """The whole utterance as one float32 array."""
    chunks = list(synthesize_stream(text, voice, speed, engine))
    return np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.float32)
