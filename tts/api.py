"""The Python API: ``synthesize_stream`` yields audio while it is being generated.

for chunk in synthesize_stream("Hello there. How are you?"):
    play(chunk)                      # a float32 numpy array at chunk.sample_rate
    chunk.words                      # [{"word": "Hello", "start": 0.02, "end": 0.31}, ...] starting in it
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Iterator

import numpy as np
import torch

from streaming.engine import Engine
from tts.lexicon import Lexicon
from tts.rates import SAMPLE_RATE  # noqa: F401  (re-exported: tts.api.SAMPLE_RATE)
from tts.text import validate_text

WAIT_S = 30.0  # how long a call waits for a free engine slot while other threads speak
log = logging.getLogger("tts")
_engine: Engine | None = None
_engine_lock = threading.Lock()


class Chunk(np.ndarray):
    """One chunk of speech: a float32 mono numpy array (use it as one), plus

    * ``sample_rate``: samples per second;
    * ``start``: where it starts in the utterance, in seconds;
    * ``words``: the words that start in it, ``{"word", "start", "end"}`` in seconds on the same clock,
      as the user wrote them (``"$5"``, not "five dollars").

    Views (slices) keep these attributes; arithmetic and reductions give plain arrays and scalars."""

    sample_rate: int
    start: float
    words: list

    def __new__(cls, audio: np.ndarray, sample_rate: int, start: float = 0.0, words: list | None = None) -> Chunk:
        chunk = np.asarray(audio, dtype=np.float32).view(cls)
        chunk.sample_rate, chunk.start, chunk.words = sample_rate, start, list(words or [])
        return chunk

    def __array_finalize__(self, source) -> None:
        self.sample_rate = getattr(source, "sample_rate", SAMPLE_RATE)
        self.start = getattr(source, "start", 0.0)
        self.words = getattr(source, "words", [])

    def __array_wrap__(self, array, context=None, return_scalar=False):
        array = array.view(np.ndarray)
        return array[()] if return_scalar else array

    @property
    def end(self) -> float:
        return self.start + len(self) / self.sample_rate


def get_engine(max_streams: int | None = None, compile: bool = True, max_open: int | None = None) -> Engine:
    """The process-wide engine on the shipped voices, loaded on first use (about a second).

    Its decode step is the fastest one ready now (`kernels.auto`: ONNX Runtime with int8 weights when that
    export is cached, else the fp32 export or the lean eager step while it is built in a background
    process, swapped in when ready, without dropping a stream); the codec decoder likewise runs in ONNX Runtime once
    its export is ready
    (`kernels.auto.faster_codec_step`). A step costs what its active slots cost, so ``max_streams`` (default:
    the engine's, 8 on a CPU) only bounds how many callers can speak at once; ``max_open`` (default: as many)
    how many streams may be open, those waiting for text or for their reader parked without a slot.
    ``compile=False`` (or TTS_NO_COMPILE=1) keeps the plain eager step and the torch decoder; TTS_NO_ORT=1 the
    lean step and the torch decoder; TTS_NO_QUANT=1 the fp32 ONNX Runtime step."""
    global _engine
    with _engine_lock:
        if _engine is None:
            from kernels import enabled
            from kernels.auto import auto_step_factory, faster_codec_step
            from tts.text import phonemize
            from tts.voices import load_shipped

            started = time.perf_counter()
            torch.set_flush_denormal(True)
            front_end = threading.Thread(target=phonemize, args=("Hello.",))  # espeak's start-up (0.2-0.5 s),
            front_end.start()  # on the other core while the weights load
            model, codec, presets = load_shipped()
            front_end.join()  # before the engine's text thread can use espeak, which is not thread-safe
            factory = auto_step_factory() if compile and enabled("compile") else None
            if factory is not None:
                factory.prepare(model)  # the shipped graph's step, opened now rather than on the first tick
            _engine = Engine(model, codec, presets, max_streams=max_streams, step_factory=factory, max_open=max_open)
            log.info(
                "engine ready in %.2f s: %d slots, step %s",
                time.perf_counter() - started,
                _engine.max_streams,
                _engine.step_kind,
            )
            faster = getattr(factory, "faster", None)  # a Future: the faster factory, or None if none will come
            if faster is None:
                log.info("step in use: %s", _engine.step_kind)
            else:
                faster.add_done_callback(_swap_in(_engine, factory, started))
                faster_codec_step(codec).add_done_callback(_swap_in_codec(_engine, started))
        return _engine


def _swap_in(engine: Engine, factory, started: float):
    """A callback for the future of a faster step factory: hand it to the engine, which switches at a tick
    boundary without dropping a stream. Logs the step that is then final, for the start-up timeline."""

    def swap(faster) -> None:
        if faster.result() is None:  # resolved when the engine's first tick built its step
            log.info(
                "step in use: %s, the fastest there is (%.2f s after loading began)",
                factory.kind,
                time.perf_counter() - started,
            )
            return
        engine.set_step_factory(faster.result())
        log.info(
            "step in use: %s (built in the background, swapped in %.2f s after loading began)",
            getattr(faster.result(), "kind", "?"),
            time.perf_counter() - started,
        )

    return swap


def _swap_in_codec(engine: Engine, started: float):
    """As `_swap_in`, for the future of a faster codec decode step (`Engine.set_codec_step`)."""

    def swap(faster) -> None:
        if faster.result() is not None:
            engine.set_codec_step(faster.result())
            log.info(
                "codec decoder in use: %s (%.2f s after loading began)",
                faster.result().kind,
                time.perf_counter() - started,
            )

    return swap


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


def _chunks(stream) -> Iterator[Chunk]:
    """The stream's audio as Chunks, each with the words whose start falls in it. Words are scheduled a
    little ahead of their audio; one that comes later than its chunk goes with the next chunk."""
    rate, position, pending = stream.engine.sample_rate, 0, []
    while (audio := stream.read()) is not None:
        pending += stream.take_word_timings()
        end = (position + len(audio)) / rate
        due = next((i for i, w in enumerate(pending) if w["start"] >= end), len(pending))  # in start order
        yield Chunk(audio, rate, position / rate, pending[:due])
        pending = pending[due:]
        position += len(audio)
    pending += stream.take_word_timings()
    if pending:  # words scheduled past the last audio (nothing left to voice them): an empty last chunk
        yield Chunk(np.zeros(0, np.float32), rate, position / rate, pending)


def synthesize_stream(
    text: str | Iterable[str],
    voice: str | None = None,
    speed: float = 1.0,
    engine: Engine | None = None,
    *,
    seed: int | None = None,
    wait_s: float = WAIT_S,
    hold: bool = True,
    lexicon=None,
) -> Iterator[Chunk]:
    """Yield `Chunk`s (float32 mono numpy arrays with ``sample_rate``, ``start`` and ``words``) as they are
    decoded.

    ``text`` is a string, or an iterable of text pieces (an LLM's tokens): speaking starts once enough
    text has arrived, without waiting for the end. ``seed`` makes the speech repeatable (the same seed and
    text give the same audio). When every engine slot is busy (other threads speaking), the call waits up to
    ``wait_s`` seconds for one, first come first served. ``hold=False`` starts speaking as soon as the engine can,
    without waiting until the text's pace so far would keep the audio from running dry (earlier first audio, more
    stalls when text comes slower than speech). ``lexicon``: how words are said, ``{"word": "/IPA/" or
    "respelling"}`` or a `tts.lexicon.Lexicon` (its case rules there). Raises ``TextError`` for empty, unspeakable
    or too long text or a bad lexicon entry (`LexiconError`, naming it), ``UnknownVoice`` for a voice that is not
    shipped, ``ValueError`` for a bad speed or seed, ``ServerFull`` when no slot freed in time.
    """
    engine = engine or get_engine()
    if isinstance(text, str):
        validate_text(text, engine.max_chars)  # the one check every front end makes, before any audio
        pieces: Iterable[str] = [text]
    else:
        pieces = text
    lexicon = Lexicon.of(lexicon)
    stream = engine.open(voice, speed, seed=seed, wait_s=wait_s)
    stream.text.lexicon = lexicon
    if not hold:
        stream.text.hold_off()
    feeder = threading.Thread(target=_feed, args=(stream, pieces), daemon=True)
    feeder.start()
    try:
        yield from _chunks(stream)
    finally:
        if not stream.finished:
            stream.cancel()


def synthesize(
    text: str | Iterable[str],
    voice: str | None = None,
    speed: float = 1.0,
    engine: Engine | None = None,
    *,
    seed: int | None = None,
    wait_s: float = WAIT_S,
    lexicon=None,
) -> np.ndarray:
    """The whole utterance as one float32 array (the arguments as for `synthesize_stream`)."""
    chunks = list(synthesize_stream(text, voice, speed, engine, seed=seed, wait_s=wait_s, lexicon=lexicon))
    return np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.float32)
