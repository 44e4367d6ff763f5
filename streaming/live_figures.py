"""Live figures (tick and step times, codec calls, slot waits) kept in fixed memory, so that a server's memory
does not grow while they fill; `Timer` takes a tick's (or a park's) times."""

from __future__ import annotations

import time

import numpy as np
import torch

# Ticks of live figures kept (13 min of one stream's 50 ticks a second; benches clear them per load)
FIGURES_KEPT = 40_000


class Recent:
    """The last ``capacity`` values of a live figure: a number, or a row of ``width`` numbers (a tick's parts).
    A ring of numpy memory, allocated and written once up front: appending never allocates, and the process's
    memory stays where it started (a deque of Python floats takes ~32 B a value and grows until full: the
    engine's figures grew a server by ~10 MB over its first 13 minutes). Read like the deque it replaces:
    ``len``, iteration oldest first (floats, or lists of ``width``), ``list(...)``, ``np.array(...)``, ``clear``.
    Reading from another thread while one appends is safe (a reader may miss the newest value, nothing more).

    Worked example, capacity 3: after appending 1, 2, 3, 4 the ring holds [4, 2, 3] and ``count`` is 4; the
    oldest value is at 4 % 3 = 1, so the values read 2, 3, 4. None is stored as NaN (a codec time not taken)."""

    def __init__(self, capacity: int, width: int = 1):
        self.capacity, self.width = capacity, width
        self._ring = np.full((capacity, width) if width > 1 else capacity, np.nan)
        self._count = 0  # appends since the last clear

    def append(self, value) -> None:
        self._ring[self._count % self.capacity] = value
        self._count += 1

    def clear(self) -> None:
        self._count = 0

    def __len__(self) -> int:
        return min(self._count, self.capacity)

    def values(self, last: int | None = None) -> np.ndarray:
        """The values oldest first, (n,) or (n, width), a copy; ``last``: only the newest that many."""
        count = self._count
        n = min(count, self.capacity, self.capacity if last is None else last)
        at = np.arange(count - n, count) % self.capacity
        return self._ring[at]

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        values = self.values()
        return values if dtype is None else values.astype(dtype)

    def __iter__(self):
        return iter(self.values().tolist())


class Timer:
    """Step and codec times of a tick (or a park's, a restore's): CUDA events on a GPU (read after the tick's
    sync), else the clock."""

    def __init__(self, cuda: bool):
        self.cuda = cuda
        self.marks = []
        self.mark()

    def mark(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def elapsed(self) -> tuple[float, float | None]:
        """(step ms, codec ms or None)."""

        def ms(a, b):
            return a.elapsed_time(b) if self.cuda else (b - a) * 1000

        codec = ms(self.marks[2], self.marks[3]) if len(self.marks) == 4 else None
        return ms(self.marks[0], self.marks[1]), codec
