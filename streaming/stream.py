"""One utterance being spoken: the thread-safe handle callers hold while the engine thread fills it.

Caller side: `push_text`, `flush`, `end`, `cancel`, `read`, `take_timings`, `take_word_timings`, `stats`.
Engine side (the engine and its codec and text workers call these): `take_text`, `schedule`, `deliver`,
`finish`.
"""
from __future__ import annotations

import queue
import threading
import time
from typing import TYPE_CHECKING

import numpy as np

from streaming.textstream import TextStream
from tts.text import SYMBOLS

if TYPE_CHECKING:
    from streaming.engine import Engine


class Stream:
    """One utterance being spoken. Audio chunks are float32 mono at the codec's sample rate."""

    def __init__(self, engine: "Engine", voice: str, speed: float, max_chars: int, seed: int,
                 lookahead_words: int | None = None):
        self.engine, self.voice, self.speed, self.seed = engine, voice, speed, seed
        self.text = TextStream(max_chars) if lookahead_words is None else \
            TextStream(max_chars, lookahead_words=lookahead_words)
        self._audio: queue.Queue = queue.Queue()
        self.queued_samples = 0
        self.max_queued_samples = int(engine.max_queued * engine.sample_rate)
        self.cancelled = self.finished = False
        self.paused = False  # set by the engine while the reader is behind (backpressure)
        self.decode_alone = False  # the CPU codec decodes this stream's chunks in calls of their own
        self.opened_at = time.perf_counter()
        self.first_text_at: float | None = None
        self.first_audio_at: float | None = None
        self.last_audio_at: float | None = None
        self.samples = 0
        self.error: Exception | None = None
        self._unscheduled: list[int] = []  # unit ids taken from the text, not yet scheduled
        self._timings: list[tuple[str, float, float]] = []
        self._schedules: list[tuple[int, list[int], list[int]]] = []  # for word timings, computed when asked
        self._timings_lock = threading.Lock()

    # ---- caller side ----------------------------------------------------------------------------
    def push_text(self, text: str) -> None:
        self.text.push(text)
        if self.first_text_at is None and text.strip():
            self.first_text_at = time.perf_counter()
        self.engine.text_arrived(self)

    def flush(self) -> None:
        self.text.flush()
        self.engine.text_arrived(self)

    def end(self) -> None:
        self.text.end()
        self.engine.text_arrived(self)

    def cancel(self) -> None:
        self.cancelled = True
        while not self._audio.empty():
            try:
                self._audio.get_nowait()
            except queue.Empty:
                break
        self._audio.put(None)
        self.engine.cancelled(self)

    def read(self, timeout: float | None = None) -> np.ndarray | None:
        """Next audio chunk, or None once the utterance is finished. Raises TimeoutError."""
        try:
            chunk = self._audio.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError("no audio yet") from None
        if chunk is None:
            self._audio.put(None)  # stay finished for later reads
            if self.error is not None:
                raise self.error
            return None
        self.queued_samples -= len(chunk)
        if self.paused and self.queued_samples <= self.max_queued_samples:
            self.engine.flow_changed(self)
        return chunk

    def take_timings(self) -> list[tuple[str, float, float]]:
        """Phoneme units scheduled since the last call: (unit, start s, end s) on the stream's audio clock.
        Units are scheduled a little ahead of the audio that speaks them."""
        with self._timings_lock:
            timings, self._timings = self._timings, []
        return timings

    def take_word_timings(self) -> list[dict]:
        """Input words whose units have all been scheduled since the last call: {"word", "start", "end"}
        (seconds on the stream's audio clock), from `TextStream.word_timings`. Computed here, when asked for,
        so streams whose callers never ask pay nothing."""
        with self._timings_lock:
            schedules, self._schedules = self._schedules, []
        frame_s = self.engine.frame_seconds
        return [word for first, starts, durations in schedules
                for word in self.text.word_timings(first, starts, durations, frame_s)]

    # ---- engine side ----------------------------------------------------------------------------
    def take_text(self) -> tuple[list[int], bool, bool]:
        """Units ready to speak now, whether a flush or the end closed them (`TextStream.take`), and whether
        the text has ended. Raises what the text front end raises."""
        units, closed = self.text.take()
        with self._timings_lock:
            self._unscheduled += units
        return units, closed, self.text.ended

    def schedule(self, first_unit: int, start_frames: list[int], durations: list[int]) -> None:
        """Units ``first_unit``.. (absolute, in `take_text` order) will be spoken from these frames for these
        many frames each. Units come in order, each once."""
        frame_s = self.engine.frame_seconds
        with self._timings_lock:
            ids, self._unscheduled = self._unscheduled[:len(durations)], self._unscheduled[len(durations):]
            self._timings += [(SYMBOLS[u], round(f * frame_s, 3), round((f + d) * frame_s, 3))
                              for u, f, d in zip(ids, start_frames, durations) if d > 0]
            self._schedules.append((first_unit, start_frames, durations))

    def deliver(self, chunk: np.ndarray) -> None:
        now = time.perf_counter()
        self.first_audio_at = self.first_audio_at or now
        self.last_audio_at = now
        self.samples += len(chunk)
        self.queued_samples += len(chunk)
        self._audio.put(chunk)
        if not self.paused and self.queued_samples > self.max_queued_samples:
            self.engine.flow_changed(self)  # backpressure: the engine pauses this stream until the reader reads

    def finish(self, error: Exception | None = None) -> None:
        if self.finished:
            return
        self.error = error
        self.finished = True
        self._audio.put(None)

    @property
    def stats(self) -> dict:
        sr = self.engine.sample_rate
        start = self.first_text_at or self.opened_at
        audio_s = self.samples / sr
        ttfa = None if self.first_audio_at is None else (self.first_audio_at - start) * 1000
        busy = None if self.last_audio_at is None else self.last_audio_at - start
        return {"audio_seconds": round(audio_s, 3), "ttfa_ms": None if ttfa is None else round(ttfa, 1),
                "rtf": None if not busy or not audio_s else round(busy / audio_s, 3),
                "frames": self.samples // self.engine.codec.cfg.hop}
