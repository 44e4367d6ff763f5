"""Who may connect to the server, and who gets an engine slot next: its connection caps and its queue.

Connections and active streams are separate limits. A connection (an open WebSocket, or an HTTP speech request
in flight) is admitted or refused at once. A stream (one utterance, holding one engine slot) that finds every
slot busy waits in a bounded FIFO queue, up to a deadline, instead of failing. Each client (its remote address,
and its API key when keys are set) has its own caps on both, so one client cannot take everything.

A WebSocket session whose connection dropped and that waits for a resume is set aside from its client's caps
(`Place.set_aside`, `Ticket.set_aside`): it still counts against `max_connections` and holds its engine streams,
but not against `max_connections_per_client` / `max_streams_per_client`, so a client that aborts and comes straight
back is never refused because of its own dropped sessions. A client has at most `max_connections_per_client`
sessions set aside: one more and its oldest expires at once. A resume puts a session back (past the caps if need
be: it had its place). So one client holds at most `max_connections_per_client` connections it opened, as many
waiting sessions, and those it resumed (each no more than it had).
Example, caps 2: the client aborts sessions s1, s2, s3 in turn, reconnecting at once each time: each reconnection
is served (its live count is 1); s3 set aside makes three waiting, so s1 expires (its token: resume_expired). Two
live connections and a third: the third is refused (client_limit) as ever.

Pure asyncio and no engine: the server asks `Admission` first, then opens the engine stream (whose own
admission, streaming/reservations.py, also serves callers outside the server, in threads). Here the waiting costs
no thread, a WebSocket is told its place, a client that leaves leaves the queue, and caps count per client.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import Counter, deque

from serving.limits import Limits
from serving.protocol import ProtocolError


class Ticket:
    """An admitted stream's claim on one slot; `release()` (idempotent) hands it to the next in the queue.
    `set_aside()` / `put_back()` (idempotent): while its session waits for a resume it keeps the slot but counts
    against no client cap."""

    def __init__(self, admission: Admission, clients: tuple):
        self._admission, self._clients, self._held, self._aside = admission, clients, True, False

    def release(self) -> None:
        if self._held:
            self._held = False
            self._admission._release(self._clients, counted=not self._aside)

    def set_aside(self) -> None:
        if self._held and not self._aside:
            self._aside = True
            _uncount(self._admission._streams_of, self._clients)

    def put_back(self) -> None:
        if self._held and self._aside:
            self._aside = False
            self._admission._streams_of.update(self._clients)


class Place:
    """A connection's place in the connection caps, until `release()` (idempotent). `set_aside(expire)`: its
    session waits for a resume (its clients' caps no longer count it; ``expire()`` ends the session early should
    its client set aside too many); `put_back()`: resumed, it counts again."""

    def __init__(self, admission: Admission, clients: tuple):
        self._admission, self.clients = admission, clients
        self.held, self.aside = True, False
        self.expire = None

    def release(self) -> None:
        if self.held:
            self.held = False
            self._admission._disconnect(self)

    def set_aside(self, expire) -> None:
        if self.held and not self.aside:
            self.aside, self.expire = True, expire
            self._admission._set_aside(self)

    def put_back(self) -> None:
        if self.held and self.aside:
            self.aside = False
            self._admission._put_back(self)


class _Waiter:
    def __init__(self, clients: tuple):
        self.clients = clients
        self.granted = False
        self.moved = asyncio.Event()  # set when the queue ahead changes or the slot is granted


class Admission:
    """Connection counts and the FIFO stream queue, per server. Call only from the event loop's thread.

    Example, 2 slots, max_queue 2: streams a, b take the slots; c and d queue at positions 1 and 2; e is
    refused at once (server_full, the queue is full); a ends -> c takes its slot and d moves to position 1."""

    def __init__(self, limits: Limits, slots: int | None = None, retry_after_s: int = 2):
        self.limits, self.slots, self.retry_after_s = limits, slots, retry_after_s
        self.connections = 0
        self.active = 0  # streams holding a slot
        self._connections_of: Counter = Counter()
        self._streams_of: Counter = Counter()  # speaking or queued, per client
        self._aside_of: dict[tuple, deque[Place]] = {}  # per client, its places set aside, oldest first
        self._queue: deque[_Waiter] = deque()

    @property
    def queued(self) -> int:
        return len(self._queue)

    # ---- connections ---------------------------------------------------------------------------------
    def connect(self, clients: tuple) -> Place:
        """Count a connection against the server's and each client's cap, or raise server_full/client_limit."""
        if self.connections >= self.limits.max_connections:
            raise ProtocolError(
                "server_full",
                f"the server has {self.limits.max_connections} connections; try again shortly",
                retry_after=self.retry_after_s,
            )
        self._check(clients, self._connections_of, self.limits.max_connections_per_client, "connections")
        self.connections += 1
        self._connections_of.update(clients)
        return Place(self, clients)

    def disconnect(self, clients: tuple) -> None:
        """The connection `connect(clients)` counted has ended (or release the Place it returned)."""
        self.connections -= 1
        _uncount(self._connections_of, clients)

    def _disconnect(self, place: Place) -> None:
        if place.aside:
            self.connections -= 1
            self._forget_aside(place)
        else:
            self.disconnect(place.clients)

    def _set_aside(self, place: Place) -> None:
        """Out of its clients' caps, into their waiting sessions; past max_connections_per_client of those, the
        oldest expires (it stays set aside, so out of the caps, until its session has ended)."""
        _uncount(self._connections_of, place.clients)
        for client in place.clients:
            waiting = self._aside_of.setdefault(client, deque())
            waiting.append(place)
            while len(waiting) > self.limits.max_connections_per_client:
                oldest = waiting[0]
                self._forget_aside(oldest)
                oldest.expire()

    def _put_back(self, place: Place) -> None:
        self._forget_aside(place)
        self._connections_of.update(place.clients)

    def _forget_aside(self, place: Place) -> None:
        for client in place.clients:
            if place in (waiting := self._aside_of.get(client, ())):
                waiting.remove(place)
                if not waiting:
                    del self._aside_of[client]

    # ---- streams -------------------------------------------------------------------------------------
    async def stream(self, clients: tuple, on_queued=None) -> Ticket:
        """A slot for one utterance: at once if one is free and nobody waits, else after waiting in the FIFO
        queue (``await on_queued(position)`` whenever the position changes, 1 = next). Raises ProtocolError
        server_full when the queue is full or the deadline passes, client_limit past a per-client cap."""
        self._check(clients, self._streams_of, self.limits.max_streams_per_client, "utterances")
        if self.active < self._slots and not self._queue:
            self._take(clients)
            return Ticket(self, clients)
        if len(self._queue) >= self.limits.max_queue:
            raise ProtocolError(
                "server_full",
                f"all {self._slots} streams are busy and {len(self._queue)} utterances are queued; try again shortly",
                retry_after=self.retry_after_s,
            )
        waiter = _Waiter(clients)
        self._queue.append(waiter)
        self._streams_of.update(clients)  # a queued utterance counts against its client's cap
        try:
            await self._wait(waiter, on_queued)
        except BaseException:
            if waiter.granted:
                self._release(clients)
            else:
                self._leave_queue(waiter)
            raise
        return Ticket(self, clients)

    async def _wait(self, waiter: _Waiter, on_queued) -> None:
        deadline = time.monotonic() + self.limits.queue_timeout_s
        told = None
        while not waiter.granted:
            position = self._queue.index(waiter) + 1
            if on_queued is not None and position != told:
                told = position
                await on_queued(position)
                continue  # the queue may have moved while the client was told
            waiter.moved.clear()
            left = deadline - time.monotonic()
            if left <= 0:
                raise ProtocolError(
                    "server_full",
                    f"no stream slot came free within {self.limits.queue_timeout_s:g} s "
                    f"(position {position} of {len(self._queue)}); try again shortly",
                    retry_after=self.retry_after_s,
                )
            try:
                await asyncio.wait_for(waiter.moved.wait(), left)
            except TimeoutError:
                pass

    @property
    def _slots(self) -> int:
        if self.slots is None:
            raise RuntimeError("Admission.slots is set once the engine is loaded")
        return self.slots

    def _take(self, clients: tuple) -> None:
        self.active += 1
        self._streams_of.update(clients)

    def _release(self, clients: tuple, counted: bool = True) -> None:
        self.active -= 1
        if counted:
            _uncount(self._streams_of, clients)
        self._grant()

    def _leave_queue(self, waiter: _Waiter) -> None:
        self._queue.remove(waiter)
        _uncount(self._streams_of, waiter.clients)
        self._grant()

    def _grant(self) -> None:
        """Hand free slots to the head of the queue; tell everyone behind that they moved."""
        while self._queue and self.active < self._slots:
            waiter = self._queue.popleft()
            waiter.granted = True
            self.active += 1  # the waiter's client is already counted in _streams_of
            waiter.moved.set()
        for waiter in self._queue:
            waiter.moved.set()

    def _check(self, clients: tuple, counts: Counter, cap: int, what: str) -> None:
        for client in clients:
            if counts[client] >= cap:
                raise ProtocolError(
                    "client_limit",
                    f"{_describe(client)} already has {counts[client]} {what} "
                    f"open, the most one client may have; try again when one ends",
                    retry_after=self.retry_after_s,
                )

    def stats(self) -> dict:
        return {
            "connections": self.connections,
            "streams": self.active,
            "queued": len(self._queue),
            "clients": len(self._connections_of),
        }


def _uncount(counts: Counter, clients: tuple) -> None:
    """One less for each client; a client at zero is forgotten (memory stays flat however many come and go)."""
    counts.subtract(clients)
    for client in clients:
        if counts[client] <= 0:
            del counts[client]


def _describe(client: tuple) -> str:
    kind, value = client
    return f"address {value}" if kind == "addr" else "this API key"


def retry_after_header(err: ProtocolError) -> dict:
    return {"Retry-After": str(math.ceil(err.retry_after))} if err.retry_after else {}
