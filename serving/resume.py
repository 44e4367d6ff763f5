"""Resuming a WebSocket session after a dropped connection (docs/protocol.md, Resume): what each context has sent
and the client has not acknowledged (`ReplayLog`), and one socket serving a session (`Link`).

A session outlives its socket. When the socket drops without a clean close, the session waits `resume_window_s`
for the client to come back with its resume token and say, per context, how much it has received; the server then
sends exactly the rest from the replay log, and the utterances go on. The log holds what was sent since the
client's last `ack`, bounded by `resume_buffer_bytes` per context: a resume from before what it still holds gets
`resume_offset`.
"""

from __future__ import annotations

import asyncio
import base64
import json
from collections import OrderedDict, deque
from dataclasses import dataclass

from starlette.websockets import WebSocket


class LinkBroken(ConnectionError):
    """The socket is gone (dropped, or replaced by a resume on another socket)."""


@dataclass
class LogEntry:
    """One thing sent on a context, at its position: audio bytes, or one JSON event."""

    seq: int  # order among everything the session has logged
    at_bytes: int  # audio bytes sent on the context before this entry
    at_events: int  # events sent on the context before this entry
    audio: bytes | None = None
    event: dict | None = None
    size: int = 0  # bytes it holds (an event: its JSON's length)


class ReplayLog:
    """What one context (a `context_id`, or the default one) of a session has sent since the client's last ack,
    in the order sent, so a client that reconnects gets exactly what it lacks.

    A position is (bytes, events), counted from the context's first use on the session: `bytes` of audio (the
    decoded bytes of base64 `audio` events too) and `events`, the JSON events but `queued`, `audio` and the answers
    to a resume. Example: ready, 3840 B of audio, a timing event, 7680 B of audio were sent: entries at (0, 0)
    ready, (0, 1) audio, (3840, 1) timing, (3840, 2) audio; the end is (11520, 2). A client holding (5000, 2)
    lacks the last 6520 B: `since(5000, 2)` -> [6520 B of audio]. `ack(3840, 1)` drops the first two entries;
    a resume from (0, 0) is then refused (`check`). Past `budget` bytes the oldest entries go as if acked."""

    def __init__(self, budget: int):
        self.budget = budget
        self.entries: deque[LogEntry] = deque()
        self.end_bytes = self.end_events = 0
        self.size = 0

    @property
    def start(self) -> tuple[int, int]:
        """The position of the oldest entry held (the end when none is)."""
        first = self.entries[0] if self.entries else None
        return (first.at_bytes, first.at_events) if first else (self.end_bytes, self.end_events)

    def add(self, seq: int, *, audio: bytes | None = None, event: dict | None = None) -> LogEntry:
        size = len(audio) if audio is not None else len(json.dumps(event))
        entry = LogEntry(seq, self.end_bytes, self.end_events, audio, event, size)
        self.entries.append(entry)
        self.size += entry.size
        if audio is not None:
            self.end_bytes += len(audio)
        else:
            self.end_events += 1
        while self.size > self.budget and len(self.entries) > 2:  # the newest (maybe not yet sent) stay
            self.size -= self.entries.popleft().size
        return entry

    def check(self, nbytes: int, events: int) -> None:
        """Raise ValueError unless (nbytes, events) lies within what is held, start .. end."""
        first_bytes, first_events = self.start
        if nbytes > self.end_bytes or events > self.end_events:
            raise ValueError(
                f"({nbytes} bytes, {events} events) is past what was sent ({self.end_bytes} bytes, "
                f"{self.end_events} events)"
            )
        if nbytes < first_bytes or events < first_events:
            raise ValueError(
                f"({nbytes} bytes, {events} events) is no longer held: the server holds from "
                f"({first_bytes} bytes, {first_events} events); acknowledge more often"
            )

    def ack(self, nbytes: int, events: int) -> None:
        """The client holds everything up to (nbytes, events): drop the entries wholly before it. Raises
        ValueError for a position past what was sent; an older ack than the last is harmless."""
        if nbytes > self.end_bytes or events > self.end_events:
            self.check(nbytes, events)
        while self.entries and _before(self.entries[0], nbytes, events):
            self.size -= self.entries.popleft().size

    def since(self, nbytes: int, events: int) -> list[LogEntry]:
        """The entries, or their tails, after (nbytes, events), in order (`check` it first)."""
        missing = []
        for entry in self.entries:
            if entry.audio is not None and entry.at_bytes + len(entry.audio) > nbytes:
                tail = entry.audio[max(0, nbytes - entry.at_bytes) :]
                missing.append(LogEntry(entry.seq, entry.at_bytes, entry.at_events, audio=tail, size=len(tail)))
            elif entry.event is not None and entry.at_events >= events:
                missing.append(entry)
        return missing


def _before(entry: LogEntry, nbytes: int, events: int) -> bool:
    if entry.audio is not None:
        return entry.at_bytes + len(entry.audio) <= nbytes
    return entry.at_events < events


class SpentTokens:
    """Resume tokens spent by a resume whose session has since ended, so that one more resume with one is
    still `resume_used` (not `resume_expired`), as long as the server remembers it: the last `keep` of them
    (16 bytes each: memory stays bounded however many sessions come and go)."""

    def __init__(self, keep: int = 10_000):
        self.keep = keep
        self._tokens: OrderedDict[str, None] = OrderedDict()

    def add(self, token: str) -> None:
        self._tokens[token] = None
        while len(self._tokens) > self.keep:
            self._tokens.popitem(last=False)

    def spent(self, token: str) -> bool:
        return token in self._tokens

    def __len__(self) -> int:
        return len(self._tokens)


class Link:
    """One socket serving a session. `first_seq`: log entries before it were sent on an earlier socket (or are
    replayed by the resume), so a sender that waited through the drop must not send them again. Every send and
    receive gives up at once when the link breaks (`cut`): a socket that a resume replaced may be half-open, and
    nothing may wait on it."""

    def __init__(self, ws: WebSocket, first_seq: int, timeout_s: float):
        self.ws, self.first_seq, self.timeout_s = ws, first_seq, timeout_s
        self.broken = False
        self.dropped = False  # ended without a clean close: the session waits for a resume
        self.replaced = False  # a resume took the session to another socket
        self.heard = False  # a message has come from the client on it
        self._racing: dict[asyncio.Task, float] = {}  # the tasks awaiting a send or receive in `race`: deadline
        self._stopped: dict[asyncio.Task, str] = {}  # those of them this link cancelled: "cut" or "timeout"
        self._timer: asyncio.TimerHandle | None = None  # at the earliest deadline, or later (`_expire`)

    def cut(self, *, dropped: bool = False, replaced: bool = False) -> None:
        if not self.broken:
            self.dropped, self.replaced, self.broken = dropped, replaced, True
            for task in self._racing:
                self._stop(task, "cut")

    def close(self) -> None:
        """The socket no longer serves the session: whatever still races on it gives up (LinkBroken), and its
        timer goes, which would otherwise keep the link, its socket and their buffers alive up to a timeout
        more (30 s by default) for every connection that has ended."""
        if not self.broken:
            self.broken = True
            for task in self._racing:
                self._stop(task, "cut")
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    async def send_text(self, text: str) -> None:
        await self.race(self.ws.send_text(text), self.timeout_s)

    async def send_audio(self, data: bytes, context_id: str | None) -> None:
        """The default context's audio as a binary frame; a named context's as JSON with base64 (a binary frame
        cannot say which utterance it belongs to)."""
        if context_id is None:
            await self.race(self.ws.send_bytes(data), self.timeout_s)
        else:
            await self.send_text(
                json.dumps({"type": "audio", "context_id": context_id, "audio": base64.b64encode(data).decode("ascii")})
            )

    async def race(self, work, timeout_s: float):
        """Await `work` for at most `timeout_s` (TimeoutError), or until the link breaks (LinkBroken). In the
        awaiting task itself, which `cut` or the link's one timer cancels: a task, a future and a timer per
        message sent or received cost the event loop more than the send (50-65 us a message against 1.4-2.1 us,
        measured)."""
        if self.broken:
            work.close()
            raise LinkBroken("the connection is gone")
        task, loop = asyncio.current_task(), asyncio.get_running_loop()
        self._racing[task] = deadline = loop.time() + timeout_s
        if self._timer is None or self._timer.when() > deadline:
            self._arm(loop, deadline)
        try:
            return await work
        except asyncio.CancelledError:
            why = self._stopped.pop(task, None)
            if why is not None and task.uncancel() == 0:  # cancelled by this link alone
                if why == "cut":
                    raise LinkBroken("the connection is gone") from None
                raise TimeoutError(f"no progress for {timeout_s:g} s") from None
            raise
        finally:
            del self._racing[task]

    def _arm(self, loop: asyncio.AbstractEventLoop, when: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = loop.call_at(when, self._expire, loop)

    def _expire(self, loop: asyncio.AbstractEventLoop) -> None:
        """The timer: stop the races past their deadline; wait for the earliest of the others. A race that
        ended early leaves the timer where it was, so an active link's timer goes off about once per timeout,
        not once per message. Example: timeout 30 s, a send each 0.3 s: the timer set by the first send goes
        off at 30 s, finds the send then in flight due at 59.9 s, and is set for then."""
        self._timer, now = None, loop.time()
        for task, deadline in self._racing.items():
            if deadline <= now:
                self._stop(task, "timeout")
        if pending := [deadline for task, deadline in self._racing.items() if task not in self._stopped]:
            self._arm(loop, min(pending))

    def _stop(self, task: asyncio.Task, why: str) -> None:
        if task not in self._stopped:
            self._stopped[task] = why
            task.cancel()


def dropped(message: dict) -> bool:
    """Whether a websocket.disconnect means the connection was lost rather than closed. uvicorn reports a lost
    transport as 1006, or, once the handshake is done, as 1005 without the `reason` a received close frame has."""
    return message.get("code") == 1006 or (message.get("code") == 1005 and "reason" not in message)
