"""The text threads: phonemise what streams receive (`Stream.take_text`) off the engine thread, so that a
burst of new text never stalls a tick, and pass each result (or the error it raised) on.

A stream whose text has more to read after a take (`TextStream.pending`) goes to the back of the queue to
take again: a front end that hands out a long text a piece at a time is read to the end, and many streams
arriving at once each get their first piece (a first take reads one sentence) before any gets its second.

Optionally (``TTS_TEXT_PROCESSES=N``, or ``processes``) the sentences are read (`read_sentence`: normalising,
espeak, aligning) in N processes of their own, one text thread each: that reading then neither holds the
engine thread's interpreter lock nor waits for it, and streams starting together are read in parallel. One
stream is taken by one thread at a time, so its units keep their order. Off by default: on 2 cores it does
not pay (128 streams at once: the text thread's CPU per stream 1.1 -> 0.86 ms, but first units later, the
processes taking cores from the engine), and it is not yet measured on a host of many cores.
"""
from __future__ import annotations

import multiprocessing
import os
import threading
from collections import deque
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Callable

from streaming.stream import Stream
from streaming.textstream import read_sentence
from tts.normalize import tokenize
from tts.text import TextError

MAX_PROCESSES = 16


def default_processes() -> int:
    """Text processes: TTS_TEXT_PROCESSES (0 to MAX_PROCESSES; unset or unreadable: 0, read in this process)."""
    try:
        return min(max(0, int(os.environ.get("TTS_TEXT_PROCESSES", "0"))), MAX_PROCESSES)
    except ValueError:
        return 0


class TextWorker:
    def __init__(self, deliver: Callable[[Stream, object], None], processes: int | None = None):
        """``deliver(stream, news)``: news is (units, closed, ended, spoken_any) or the TextError to fail with.
        ``processes``: text processes (None: `default_processes`; 0: read in this process, one thread)."""
        self.deliver = deliver
        self.processes = default_processes() if processes is None else processes
        self._pool = _SentencePool(self.processes) if self.processes else None
        self._jobs: deque[Stream] = deque()
        self._queued: set[Stream] = set()  # a stream is queued once, however many pieces arrive meanwhile
        self._busy: set[Stream] = set()  # being taken now: text arriving meanwhile queues it after the take
        self._again: set[Stream] = set()
        self._ready = threading.Condition()
        self._closing = False
        self._threads = [threading.Thread(target=self._run, name=f"tts-text-{k}", daemon=True)
                         for k in range(max(1, self.processes))]
        for thread in self._threads:
            thread.start()

    def arrived(self, stream: Stream) -> None:
        with self._ready:
            if stream in self._busy:
                self._again.add(stream)
            elif stream not in self._queued:
                self._queued.add(stream)
                self._jobs.append(stream)
                self._ready.notify()

    def wait_for_processes(self, timeout: float | None = None) -> bool:
        """Block until the text processes read sentences (they start in the background); False if there are
        none, they could not start here, or the timeout passed."""
        return self._pool is not None and self._pool.up(timeout)

    def close(self) -> None:
        with self._ready:
            self._closing = True
            self._ready.notify_all()
        for thread in self._threads:
            thread.join(timeout=2)
        if self._pool:
            self._pool.close()

    def _run(self) -> None:
        while (stream := self._next()) is not None:
            more = False
            if not (stream.cancelled or stream.finished):
                if self._pool:
                    stream.text.reader = self._pool.read
                try:
                    news = stream.take_text() + (stream.text.spoken_any,)
                except TextError as err:
                    news = err
                except Exception as err:  # the front end choked on this stream's text: it alone fails
                    news = TextError(f"this text could not be read: {type(err).__name__}: {err}")
                self.deliver(stream, news)
                more = isinstance(news, tuple) and stream.text.pending
            with self._ready:
                self._busy.discard(stream)
                if stream in self._again or (more and not (stream.cancelled or stream.finished)):
                    self._again.discard(stream)
                    self._queued.add(stream)
                    self._jobs.append(stream)  # more to read: take again after the others
                    self._ready.notify()

    def _next(self) -> Stream | None:
        with self._ready:
            while not self._jobs and not self._closing:
                self._ready.wait()
            if self._closing:
                return None
            stream = self._jobs.popleft()
            self._queued.discard(stream)
            self._busy.add(stream)
            return stream


class _SentencePool:
    """Processes running `read_sentence`. Until they are up (a second or so after the engine starts) and after
    a crash of one (it is restarted), sentences are read in this process."""

    def __init__(self, processes: int):
        self.processes = processes
        self._lock = threading.Lock()
        self._start()

    def _start(self) -> None:
        context = multiprocessing.get_context("forkserver")  # not fork: the engine's threads and CUDA
        self._executor = ProcessPoolExecutor(self.processes, mp_context=context)
        tokens = tokenize("The 3 birch canoes slid on the smooth planks, on March 4.")  # every rule's imports
        self._up = [self._executor.submit(read_sentence, tokens, 0, True) for _ in range(self.processes)][-1]

    def up(self, timeout: float | None = None) -> bool:
        try:
            self._up.result(timeout)
            return True
        except Exception:
            return False

    def read(self, tokens, first: int, closed: bool) -> tuple[list[str], list[int]]:
        if not self._up.done() or self._up.exception() is not None:  # not up yet, or cannot start here
            return read_sentence(tokens, first, closed)
        executor = self._executor
        try:
            return executor.submit(read_sentence, tokens, first, closed).result()
        except BrokenProcessPool:
            with self._lock:
                if self._executor is executor:
                    self._start()
            return read_sentence(tokens, first, closed)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
