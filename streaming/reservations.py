"""Who may hold a slot: at most ``slots`` streams at once; callers beyond wait in a bounded first-come,
first-served queue up to their deadline. The engine thread alone assigns actual slots; this only counts
reservations, so `Engine.open` never touches the slot table (no race between a start and a cancel)."""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable


class Full(Exception):
    """No reservation: every slot is held and the caller would not (or could not) wait."""


class Reservations:
    def __init__(self, slots: int, max_waiting: int):
        self.slots, self.max_waiting = slots, max_waiting
        self.held = 0  # reservations: streams holding a slot or about to
        self._waiting: deque = deque()  # (item, granted event), first come first served
        self._lock = threading.Lock()

    @property
    def queued(self) -> int:
        return len(self._waiting)

    def admit(self, item, wait_s: float, start: Callable) -> None:
        """Reserve a slot for ``item`` and call ``start(item)`` (under the lock, so starts keep the order of
        reservations), waiting up to ``wait_s`` seconds in the queue. Raises Full.
        Example, 2 slots both held, max_waiting 1: a caller with wait_s=5 queues; the next with any wait_s gets
        Full at once; when a slot is released within 5 s, the queued caller's item is started."""
        with self._lock:
            if self.held < self.slots and not self._waiting:
                self.held += 1
                start(item)
                return
            if wait_s <= 0 or len(self._waiting) >= self.max_waiting:
                raise Full(f"all {self.slots} streams are busy; try again shortly")
            granted = threading.Event()
            self._waiting.append((item, granted, start))
        if granted.wait(wait_s):
            return
        with self._lock:
            if not granted.is_set():  # not handed a slot at the last moment
                self._waiting.remove((item, granted, start))
                raise Full(f"all {self.slots} streams stayed busy for {wait_s:g} s; try again shortly")

    def release(self) -> None:
        """A reservation ends: the first waiting caller gets it (its item is started), else it is free."""
        with self._lock:
            if self._waiting:
                item, granted, start = self._waiting.popleft()
                start(item)
                granted.set()
            else:
                self.held -= 1
