"""The text thread: phonemises what streams receive (`Stream.take_text`) off the engine thread, so that a
burst of new text never stalls a tick, and passes each result (or the error it raised) on.

A take that returned units goes to the back of the queue to take again: a front end that hands out a long
text a piece at a time is read to the end, and many streams arriving at once each get their first piece
before any gets its second. A stream whose start is held takes again when its hold would end without more text
(`TextStream.release_at`), not only when the next piece comes."""

from __future__ import annotations

import contextlib
import heapq
import itertools
import threading
import time
from collections import deque
from collections.abc import Callable

from streaming.stream import Stream
from tts.text import TextError


class TextWorker:
    def __init__(self, deliver: Callable[[Stream, object], None]):
        """``deliver(stream, news)``: news is (units, closed, ended, spoken_any) or the TextError to fail with."""
        self.deliver = deliver
        self._jobs: deque[Stream] = deque()
        self._queued: set[Stream] = set()  # a stream is queued once, however many pieces arrive meanwhile
        self._timers: list[tuple[float, int, Stream]] = []  # (perf_counter, tie-break, stream): take again then
        self._ties = itertools.count()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="tts-text", daemon=True)
        self._thread.start()

    def arrived(self, stream: Stream) -> None:
        with self._lock:
            if stream in self._queued:
                return
            self._queued.add(stream)
            self._jobs.append(stream)
        self._wake.set()

    def run_in_turn(self, call: Callable[[], None]) -> None:
        """Run ``call`` on the text thread at its place in the queue: every stream queued before it has been
        taken, and no take runs while it does (`Engine.snapshot` stops the text thread at a stream's place)."""
        self.arrived(_InTurn(call))

    def close(self) -> None:
        self._closing = True
        self._wake.set()
        self._thread.join(timeout=2)

    def _run(self) -> None:
        while not self._closing:
            self._wake.wait(self._due_in())
            while (stream := self._next()) is not None:
                if isinstance(stream, _InTurn):
                    with contextlib.suppress(Exception):  # its caller waits on the call's own result
                        stream.call()
                    continue
                if stream.cancelled or stream.finished:
                    continue
                try:
                    self._take(stream)
                except Exception as err:  # a fault past the front end (a bug): this stream fails, not the thread
                    with contextlib.suppress(Exception):  # that every other stream's text needs
                        self.deliver(stream, TextError(f"this text could not be read: {type(err).__name__}: {err}"))

    def _take(self, stream: Stream) -> None:
        """One take of a stream's text, handed on; then queued to take again, or a timer set for its hold."""
        try:
            news = stream.take_text() + (stream.text.spoken_any,)
        except TextError as err:
            news = err
        except Exception as err:  # the front end choked on this stream's text: it alone fails
            news = TextError(f"this text could not be read: {type(err).__name__}: {err}")
        self.deliver(stream, news)
        if isinstance(news, tuple) and news[0]:
            self.arrived(stream)  # there may be more: take again after the others
        elif isinstance(news, tuple) and not stream.detaching and (at := stream.text.release_at()) is not None:
            with self._lock:
                heapq.heappush(self._timers, (at, next(self._ties), stream))

    def _due_in(self) -> float | None:
        """Seconds to the next timer (None: none), once those due are queued."""
        now = time.perf_counter()
        while True:
            with self._lock:
                if not self._timers:
                    return None
                if self._timers[0][0] > now:
                    return self._timers[0][0] - now
                stream = heapq.heappop(self._timers)[2]
            if not stream.detaching:  # a detaching stream's text thread hands on one mark, on detach's call
                self.arrived(stream)

    def _next(self) -> Stream | None:
        with self._lock:
            if not self._jobs:
                self._wake.clear()
                return None
            stream = self._jobs.popleft()
            self._queued.discard(stream)
            return stream


class _InTurn:
    """A call queued among the streams (`TextWorker.run_in_turn`)."""

    def __init__(self, call: Callable[[], None]):
        self.call = call
