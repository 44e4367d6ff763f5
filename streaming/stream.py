"""One utterance being spoken: the thread-safe handle callers hold while the engine thread fills it."""
from __future__ import annotations

import queue
import threading
import time
from typing import TYPE_CHECKING

import numpy as np

from streaming.textstream import TextStream

if TYPE_CHECKING:
    from streaming.engine import Engine


class Stream:
    """One utterance being spoken. Audio chunks are float32 mono at the codec's sample rate."""

    def __init__(self, engine: "Engine", voice: str, speed: float, max_chars: int):
        self.engine, self.voice, self.speed = engine, voice, speed
        self.text = TextStream(max_chars)
        self._audio: queue.Queue = queue.Queue()
        self.queued_samples = 0
        self.cancelled = self.finished = False
        self.opened_at = time.perf_counter()
        self.first_text_at: float | None = None
        self.first_audio_at: float | None = None
        self.last_audio_at: float | None = None
        self.samples = 0
        self.error: Exception | None = None
        self._timings: list[tuple[str, float, float]] = []
        self._word_timings: list[dict] = []  # filled where units are scheduled: TextStream.word_timings(...)
        self._timings_lock = threading.Lock()

    def push_text(self, text: str) -> None:
        self.text.push(text)
        if self.first_text_at is None and text.strip():
            self.first_text_at = time.perf_counter()
        self.engine.wake()

    def flush(self) -> None:
        self.text.flush()
        self.engine.wake()

    def end(self) -> None:
        self.text.end()
        self.engine.wake()

    def cancel(self) -> None:
        self.cancelled = True
        while not self._audio.empty():
            try:
                self._audio.get_nowait()
            except queue.Empty:
                break
        self._audio.put(None)
        self.engine.wake()

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
        self.engine.wake()
        return chunk

    def take_timings(self) -> list[tuple[str, float, float]]:
        """Phoneme units scheduled since the last call: (unit, start s, end s) on the stream's audio clock.
        Units are scheduled a little ahead of the audio that speaks them."""
        with self._timings_lock:
            timings, self._timings = self._timings, []
        return timings

    def take_word_timings(self) -> list[dict]:
        """Words whose units were all scheduled since the last call, as the user wrote them:
        ``{"word": "$3.50", "start": s, "end": s}`` on the stream's audio clock (`TextStream.word_timings`)."""
        with self._timings_lock:
            timings, self._word_timings = self._word_timings, []
        return timings

    def _schedule(self, timings: list[tuple[str, float, float]]) -> None:
        with self._timings_lock:
            self._timings += timings

    def _deliver(self, chunk: np.ndarray) -> None:
        now = time.perf_counter()
        self.first_audio_at = self.first_audio_at or now
        self.last_audio_at = now
        self.samples += len(chunk)
        self.queued_samples += len(chunk)
        self._audio.put(chunk)

    def _finish(self, error: Exception | None = None) -> None:
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
