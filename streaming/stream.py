"""One utterance being spoken: the thread-safe handle callers hold while the engine thread fills it.

Caller side: `push_text`, `flush`, `end`, `cancel`, `hold`, `release`, `read` (blocking) or `next_chunk` (awaited
on an event loop), `poll`, `take_timings`, `take_word_timings`, `stats`.
Engine side (the engine and its codec and text workers call these): `take_text`, `schedule`, `deliver`,
`finish`; and for moving a stream to another engine (`Engine.detach`/`attach`): `take_unread`,
`export_state`, `from_state`.
"""

from __future__ import annotations

import asyncio
import copy
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

from streaming.textstream import TextStream
from tts.lexicon import Lexicon
from tts.loudness import level
from tts.text import SYMBOLS, check_characters


class EngineInbox(Protocol):
    """What a `Stream` needs of its engine (`streaming.engine.Engine`): an inbox of four calls, each safe from any
    thread, and a few read-only facts."""

    model: Any  # its ``cfg`` sets the start hold (`TextStream`)
    codec: Any
    sample_rate: int
    frame_seconds: float
    max_queued: float
    start_latency: Any  # `StartLatency`

    def text_arrived(self, stream: Stream) -> None: ...  # new text, a flush or the end
    def cancelled(self, stream: Stream) -> None: ...
    def hold_changed(self, stream: Stream) -> None: ...  # `Stream.hold` / `release`
    def flow_changed(self, stream: Stream) -> None: ...  # the reader fell behind or caught up


# The way to a stream's first audio (`Stream.mark`): the server got the request; the engine opened the stream; it
# got a slot; its first text; the engine got its first units (text thread round trip; a slot may come later); its
# first units
# were encoded; the first tick that stepped it was launched; its first chunk was due (after the delay pattern);
# the codec thread began that chunk's job; the chunk was delivered; the server read it; and sent it.
TIMELINE = (
    "request",
    "opened",
    "slot",
    "text",
    "units",
    "prefill",
    "stepped",
    "due",
    "codec",
    "delivered",
    "read",
    "sent",
)


class _Moving(tuple):
    """The units a detaching stream's text thread hands on: none, and a mark (compared by identity)."""


MOVING = _Moving()
NOT_YET = object()  # `Stream.poll`: no audio yet, and more may come


class Stream:
    """One utterance being spoken. Audio chunks are float32 mono at the codec's sample rate."""

    def __init__(
        self,
        engine: EngineInbox,
        voice: str,
        speed: float,
        max_chars: int,
        seed: int,
        lookahead_words: int | None = None,
    ):
        self.engine, self.voice, self.speed, self.seed = engine, voice, speed, seed
        self.text = TextStream(max_chars, lookahead_words=lookahead_words, hold_start=engine.model.cfg)
        self._chunks: deque[np.ndarray] = deque()  # audio not yet read
        self._audio = threading.Condition()  # guards _chunks, queued_samples, _closed, moved and _waker
        self._waker: Callable[[], None] | None = None  # `poll`'s, called once when there may be more to read
        self._closed = False  # no audio comes after what is queued (finished or cancelled)
        self.queued_samples = 0
        self.gain_db = 0.0  # its voice's loudness gain (`tts.loudness.level`), applied to every chunk delivered
        self.max_queued_samples = int(engine.max_queued * engine.sample_rate)
        self.resume_samples = self.max_queued_samples  # a paused stream resumes once the reader is down to this
        self.cancelled = self.finished = False
        self.moved = False  # detached to another engine (`Engine.detach`): this reader gets no more audio
        self.detaching = False  # being detached: the text front end is no longer read here
        self.detach_request: Any = None  # `streaming.slot_mover.DetachRequest` while `Engine.detach` runs
        self.paused = False  # set by the engine while the reader is behind (backpressure)
        self.held = False  # `hold`: parked at once, no slot until `release`
        self.decode_alone = False  # the CPU codec decodes this stream's chunks in calls of their own
        self.opened_at = time.perf_counter()
        self.first_text_at: float | None = None
        self.first_audio_at: float | None = None
        self.last_audio_at: float | None = None
        self.samples = 0
        self.error: Exception | None = None
        self.marks: dict[str, float] = {"opened": self.opened_at}  # when it first reached each stage (`mark`)
        self.ticks: dict[str, int] = {}  # the engine's tick serial at "stepped" and at "due"
        self._unscheduled: list[int] = []  # unit ids taken from the text, not yet scheduled
        self._timings: list[tuple[str, float, float]] = []
        self._schedules: list[tuple[int, list[int], list[int]]] = []  # for word timings, computed when asked
        self._timings_lock = threading.Lock()

    # ---- caller side ----------------------------------------------------------------------------
    def push_text(self, text: str) -> None:
        """More text. A control character is refused (TextError, `tts.text.check_characters`), whoever calls."""
        check_characters(text)
        self.text.push(text)
        if self.first_text_at is None and text.strip():
            self.first_text_at = time.perf_counter()
            self.mark("text", self.first_text_at)
        self.engine.text_arrived(self)

    def flush(self) -> None:
        self.text.flush()
        self.engine.text_arrived(self)

    def end(self) -> None:
        self.text.end()
        self.engine.text_arrived(self)

    def cancel(self) -> None:
        self.cancelled = True
        with self._audio:
            self._chunks.clear()
            self.queued_samples = 0
            self._closed = True
            waker = self._news()
        if waker is not None:
            waker()
        self.engine.cancelled(self)

    def hold(self) -> None:
        """Stop generating now and give the slot back (parked without the grace: say, the reader's connection
        dropped and it may come back); text pushed meanwhile is kept. `release` lets it go on, sample-exactly
        where it stopped. Audio already decoded is still delivered."""
        if not self.held:
            self.held = True
            self.engine.hold_changed(self)

    def release(self) -> None:
        """End a `hold`: the stream waits for a slot and goes on."""
        if self.held:
            self.held = False
            self.engine.hold_changed(self)

    def read(self, timeout: float | None = None) -> np.ndarray | None:
        """Next audio chunk, or None once the utterance is finished (or moved to another engine). Raises
        TimeoutError, or the error the utterance failed with once its audio is read."""
        with self._audio:
            if not self._audio.wait_for(self._readable, timeout):
                raise TimeoutError("no audio yet")
            chunk, resume = self._pop()
        if resume:
            self.engine.flow_changed(self)
        return chunk

    def poll(self, waker: Callable[[], None] | None = None):
        """`read` without waiting: the next chunk, None, the error, or NOT_YET when there is nothing yet. With
        NOT_YET, ``waker`` (if given; it replaces an earlier one) is called once, from the thread that has news
        (a chunk, the end, a cancel, a move), with no lock held: then poll again."""
        with self._audio:
            if not self._readable():
                self._waker = waker
                return NOT_YET
            chunk, resume = self._pop()
        if resume:
            self.engine.flow_changed(self)
        return chunk

    async def next_chunk(self) -> np.ndarray | None:
        """`read` for a caller on an event loop: waits without a thread. The engine's threads wake the loop
        once per batch of news (`LoopWaker`), not once per chunk, and nothing polls meanwhile. Cancelling the
        caller leaves the stream as it was."""
        if (chunk := self.poll()) is not NOT_YET:
            return chunk
        loop = asyncio.get_running_loop()
        waker = LoopWaker.of(loop)
        while True:
            woken = loop.create_future()
            # late binding on purpose: a wake registered by an earlier poll wakes the future awaited now
            if (chunk := self.poll(lambda: waker.wake(woken))) is not NOT_YET:  # noqa: B023
                return chunk
            await woken

    def _readable(self) -> bool:
        return bool(self._chunks) or self._closed or self.moved

    def _pop(self) -> tuple[np.ndarray | None, bool]:
        """(the next chunk or None, whether the engine should resume this paused stream); holding _audio, with
        `_readable` true. Raises the utterance's error once its audio is read."""
        if self.moved:
            return None, False
        if not self._chunks:
            if self.error is not None:
                raise self.error
            return None, False
        chunk = self._chunks.popleft()
        self.queued_samples -= len(chunk)
        return chunk, self.paused and self.queued_samples <= self.resume_samples

    def _news(self):
        """Holding _audio, after a change a reader waits for: wake blocked readers; return `poll`'s waker (to
        be called once the lock is released) and forget it."""
        self._audio.notify_all()
        waker, self._waker = self._waker, None
        return waker

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
        return [
            word
            for first, starts, durations in schedules
            for word in self.text.word_timings(first, starts, durations, frame_s)
        ]

    def mark(self, stage: str, at: float | None = None) -> None:
        """Note when the stream first reached ``stage`` (perf_counter; later calls keep the first). The engine,
        its workers and the server mark the way to the first audio (`TIMELINE`), one dict write per stage."""
        if stage not in self.marks:
            self.marks[stage] = time.perf_counter() if at is None else at

    def timeline(self) -> dict[str, float]:
        """The marked stages in `TIMELINE` order, in ms since the first (the request, where the server marked it)."""
        marks = self.marks
        stages = [stage for stage in TIMELINE if stage in marks]
        origin = marks[stages[0]] if stages else 0.0
        return {stage: round((marks[stage] - origin) * 1000, 1) for stage in stages}

    # ---- engine side ----------------------------------------------------------------------------
    def take_text(self) -> tuple[list[int] | _Moving, bool, bool]:
        """Units ready to speak now, whether a flush or the end closed them (`TextStream.take`), and whether
        the text has ended. Raises what the text front end raises. While the stream is being detached: MOVING
        (no units; the engine then detaches it, after every take before)."""
        if self.detaching:
            return MOVING, False, False
        units, closed = self.text.take()
        with self._timings_lock:
            self._unscheduled += units
        return units, closed, self.text.ended

    def schedule(self, first_unit: int, start_frames: list[int], durations: list[int]) -> None:
        """Units ``first_unit``.. (absolute, in `take_text` order) will be spoken from these frames for these
        many frames each. Units come in order, each once."""
        frame_s = self.engine.frame_seconds
        with self._timings_lock:
            ids, self._unscheduled = self._unscheduled[: len(durations)], self._unscheduled[len(durations) :]
            self._timings += [
                (SYMBOLS[u], round(f * frame_s, 3), round((f + d) * frame_s, 3))
                for u, f, d in zip(ids, start_frames, durations)
                if d > 0
            ]
            self._schedules.append((first_unit, start_frames, durations))

    def deliver(self, chunk: np.ndarray) -> None:
        now = time.perf_counter()
        if self.first_audio_at is None:
            self.first_audio_at = now
            self.mark("delivered", now)
            if self.text.paced_release is not None:  # what the next streams' start holds plan with
                self.engine.start_latency.record(now - self.text.paced_release)
        self.last_audio_at = now
        self.samples += len(chunk)
        if self.gain_db:
            chunk = level(chunk, self.gain_db)
        with self._audio:
            if self.cancelled or self.moved:  # a chunk decoded as the reader left: it is not theirs any more
                return
            self.queued_samples += len(chunk)
            self._chunks.append(chunk)
            waker = self._news()
            behind = not self.paused and self.queued_samples > self.max_queued_samples
        if waker is not None:
            waker()
        if behind:
            self.engine.flow_changed(self)  # backpressure: the engine pauses this stream until the reader reads

    def finish(self, error: Exception | None = None) -> None:
        if self.finished:
            return
        self.error = error
        self.finished = True
        with self._audio:
            self._closed = True
            waker = self._news()
        if waker is not None:
            waker()

    # ---- moving to another engine -----------------------------------------------------------------
    def take_unread(self) -> list[np.ndarray]:
        """The audio not yet read; from now on `read` returns None (the stream continues elsewhere)."""
        with self._audio:
            self.moved = True
            chunks = list(self._chunks)
            self._chunks.clear()
            self.queued_samples = 0
            waker = self._news()
        if waker is not None:
            waker()
        return chunks

    def export_state(self) -> dict:
        """What a stream on another engine needs to continue this one (plain data; see `from_state`): voice,
        speed, seed, its text front end's state (pending text, lookahead, word-timing bookkeeping) and the
        timings not yet taken. Call on the engine thread while the stream is parked."""
        with self._timings_lock:
            timings = {
                "unscheduled": list(self._unscheduled),
                "timings": list(self._timings),
                "schedules": copy.deepcopy(self._schedules),
            }
        return {
            "voice": self.voice,
            "speed": self.speed,
            "seed": self.seed,
            "decode_alone": self.decode_alone,
            "max_chars": self.text.max_chars,
            "lookahead_words": self.text.lookahead_words,
            "text": object_state(self.text),
            "samples": self.samples,
            "gain_db": self.gain_db,
            "lexicon": None if self.text.lexicon is None else self.text.lexicon.state(),
            **timings,
        }

    @classmethod
    def from_state(cls, engine: EngineInbox, state: dict, unread: list[np.ndarray]) -> Stream:
        """A stream continuing an exported one (`export_state`) on ``engine``, its ``unread`` audio queued."""
        stream = cls(
            engine, state["voice"], state["speed"], state["max_chars"], state["seed"], state["lookahead_words"]
        )
        stream.decode_alone = state["decode_alone"]
        set_object_state(stream.text, state["text"])
        stream.text.lexicon = Lexicon(*state["lexicon"]) if state.get("lexicon") else None
        stream._unscheduled, stream._timings = list(state["unscheduled"]), list(state["timings"])
        stream._schedules = copy.deepcopy(state["schedules"])
        for chunk in unread:
            stream.deliver(chunk)  # already at its gain
        stream.gain_db = state.get("gain_db", 0.0)
        stream.samples = state["samples"]  # counts the unread audio too
        stream.first_audio_at = stream.first_audio_at or (time.perf_counter() if state["samples"] else None)
        return stream

    @property
    def stats(self) -> dict:
        sr = self.engine.sample_rate
        start = self.first_text_at or self.opened_at
        audio_s = self.samples / sr
        ttfa = None if self.first_audio_at is None else (self.first_audio_at - start) * 1000
        busy = None if self.last_audio_at is None else self.last_audio_at - start
        return {
            "audio_seconds": round(audio_s, 3),
            "ttfa_ms": None if ttfa is None else round(ttfa, 1),
            "rtf": None if not busy or not audio_s else round(busy / audio_s, 3),
            "frames": self.samples // self.engine.codec.cfg.hop,
        }


class LoopWaker:
    """Wakes futures of one event loop from any thread, in batches: the first wake of a batch schedules one
    call on the loop (`call_soon_threadsafe`), and the wakes that come before that call runs join it. So the
    codec thread delivering a tick's chunks to a hundred streams costs the loop one wake-up, not a hundred.
    One per loop (`of`), gone with its loop (it holds the loop weakly)."""

    _loops: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, LoopWaker] = weakref.WeakKeyDictionary()
    _made = threading.Lock()

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = weakref.ref(loop)
        self._due: list[asyncio.Future] = []
        self._lock = threading.Lock()

    @classmethod
    def of(cls, loop: asyncio.AbstractEventLoop) -> LoopWaker:
        if (waker := cls._loops.get(loop)) is None:
            with cls._made:
                waker = cls._loops.setdefault(loop, cls(loop))
        return waker

    def wake(self, future: asyncio.Future) -> None:
        """Resolve ``future`` (with None) on the loop soon; a no-op if it is done by then (say, cancelled)."""
        with self._lock:
            self._due.append(future)
            if len(self._due) > 1:
                return  # the call that wakes the batch is scheduled already
        loop = self._loop()
        try:
            if loop is None:
                raise RuntimeError("the loop is gone")
            loop.call_soon_threadsafe(self._run)
        except RuntimeError:  # the loop is closed or gone: nobody waits any more
            with self._lock:
                self._due.clear()

    def _run(self) -> None:
        with self._lock:
            due, self._due = self._due, []
        for future in due:
            if not future.done():
                future.set_result(None)


_LOCKS = (type(threading.Lock()), type(threading.RLock()))


def object_state(obj) -> dict:
    """An object's attributes as plain data: nested objects (not plain values) by their own attributes,
    locks left out. Example: a TextStream -> {"_text": "How are", "_done": 2, ..., "_timings": {"__object__":
    {"unit_word": [...], ...}}}. Attributes named in the class's TRANSIENT are left out (a TextStream's ``reader``).
    Restored into a fresh object of the same class by `set_object_state`."""
    state = {}
    transient = getattr(obj, "TRANSIENT", ())  # what the engine that holds the object sets (not its state)
    for name, value in vars(obj).items():
        if isinstance(value, _LOCKS) or name in transient:
            continue
        if hasattr(value, "__dict__") and not isinstance(value, type):
            value = {"__object__": object_state(value)}
        state[name] = copy.deepcopy(value)
    return state


def set_object_state(obj, state: dict) -> None:
    for name, value in state.items():
        if isinstance(value, dict) and set(value) == {"__object__"}:
            set_object_state(getattr(obj, name), value["__object__"])
        else:
            setattr(obj, name, copy.deepcopy(value))
