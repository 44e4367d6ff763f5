"""The text thread: phonemises what streams receive (`Stream.take_text`) off the engine thread, so that a
burst of new text never stalls a tick, and passes each result (or the error it raised) on.

A take that returned units goes to the back of the queue to take again: a front end that hands out a long
text a piece at a time is read to the end, and many streams arriving at once each get their first piece
before any gets its second."""
from __future__ import annotations

import threading
from collections import deque
from typing import Callable

from streaming.stream import Stream
from tts.text import TextError


class TextWorker:
    def __init__(self, deliver: Callable[[Stream, object], None]):
        """``deliver(stream, news)``: news is (units, closed, ended, spoken_any) or the TextError to fail with."""
        self.deliver = deliver
        self._jobs: deque[Stream] = deque()
        self._queued: set[Stream] = set()  # a stream is queued once, however many pieces arrive meanwhile
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

    def close(self) -> None:
        self._closing = True
        self._wake.set()
        self._thread.join(timeout=2)

    def _run(self) -> None:
        while not self._closing:
            self._wake.wait()
            while (stream := self._next()) is not None:
                if stream.cancelled or stream.finished:
                    continue
                try:
                    news = stream.take_text() + (stream.text.spoken_any,)
                except TextError as err:
                    news = err
                except Exception as err:  # the front end choked on this stream's text: it alone fails
                    news = TextError(f"this text could not be read: {type(err).__name__}: {err}")
                self.deliver(stream, news)
                if isinstance(news, tuple) and news[0]:
                    self.arrived(stream)  # there may be more: take again after the others

    def _next(self) -> Stream | None:
        with self._lock:
            if not self._jobs:
                self._wake.clear()
                return None
            stream = self._jobs.popleft()
            self._queued.discard(stream)
            return stream
