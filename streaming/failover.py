"""A killed replica's WebSocket sessions continue on another (Ray Serve scale-out; docs/scale-out.md, Failover).

A session's audio is a function of what its client sent: seeded sampling makes the same messages give the same
samples on any engine with the same weights. So every replica keeps, in a Ray actor that outlives it
(`Journals`), each session's **journal**: the client messages its server took, in order. When a replica dies, Ray's
proxy drops its sockets without a close frame; the client reconnects (through the proxy, to a live replica) and
sends `resume` with its token and what it holds. The live replica does not know the token, finds the journal, and
**replays** it into a new session of its own server: the messages go in again (but those of utterances the
client has whole: `compact`), the regenerated output the client already holds is dropped, the rest goes to the
client, and the client sends again the messages the journal lacks (`resumed.received` says how many it has).
From then on it is an ordinary session on this replica.

    client --resume(token, 96000 B, 1 event)--> replica B --claim(token)--> Journals: [start, text, text, end]
    replica B's server <-- start, text, text, end (the journal)
    replica B's server --> ready, audio 0..96000 B (dropped: the client has it), audio 96000.. B (sent)

`Failover` is ASGI middleware around the server's app (streaming/ray_serve.py puts it on every replica); it reads
and writes the WebSocket messages the app exchanges and touches nothing inside the server. It also gives every
`start` without a seed a random one, so that every utterance can be regenerated.

Limits (measured and stated in docs/scale-out.md): the gap is the time to regenerate the current utterance's
audio so far, which grows with its length; the journal of one session is bounded (MAX_JOURNAL_BYTES); a session is continued
sample-exactly when its audio depends only on its messages, which holds for every utterance without a `flush`
(a flush speaks what has come so far at once, so where it falls in the audio depends on timing; such an
utterance goes on with no byte lost or repeated, but its samples after the flush may differ).
"""
from __future__ import annotations

import asyncio
import base64
import json
import logging
import secrets
import time
from collections import deque
from dataclasses import dataclass, field

from streaming.protocol import UNCOUNTED

log = logging.getLogger("tts.failover")
FLUSH_S = 0.05  # how often a replica sends its sessions' new messages to the journals
TOUCH_S = 1.0  # how often a replica says that its sessions live on (the journals forget the others)
MAX_JOURNAL_BYTES = 4 << 20  # a session's journal past this is dropped: that session cannot fail over
JOURNALS_ACTOR = "tts-journals"
UNCOUNTED_EVENTS = ("queued", "audio", "resumed")  # events a client's position does not count


# A journal entry: a client message the server took (its text, or its binary data), or, where the server sent an
# utterance's `done`, {"done": context id, "at": [bytes, events]}: the context's count after it (`compact` uses it).
Entry = str | bytes | dict


class Journals:
    """Ray actor: every live session's journal, by journal id (the session's first resume token), and each token
    the session has had -> its journal id. A journal nobody touches for its time-to-live is forgotten (its
    replica is gone, and the window for a resume has passed). One actor: its methods run one at a time, so two
    replicas claiming one token cannot both win."""

    def __init__(self):
        self.entries: dict[str, list[Entry]] = {}
        self.sizes: dict[str, int] = {}
        self.expires: dict[str, float] = {}
        self.tokens: dict[str, str | None] = {}  # token -> journal id; None once claimed (spent)

    def append(self, batch: list[tuple[str, list[Entry], list[str], float]]) -> None:
        """(journal id, new entries, new tokens, time to live) for each session a replica has news of."""
        now = time.monotonic()
        for jid, entries, tokens, ttl_s in batch:
            if self.sizes.get(jid, 0) < 0:
                continue  # over the bound: it stays dropped
            self.entries.setdefault(jid, []).extend(entries)
            self.sizes[jid] = self.sizes.get(jid, 0) + sum(len(m) if not isinstance(m, dict) else 64 for m in entries)
            if self.sizes[jid] > MAX_JOURNAL_BYTES:
                self.entries[jid], self.sizes[jid] = [], -1
            self.tokens.update({token: jid for token in tokens})
            self.expires[jid] = now + ttl_s
        self._expire(now)

    def claim(self, token: str) -> tuple[str, list[Entry]] | None:
        """(journal id, its entries) for a resume with ``token``, which is then spent; None when no journal has it."""
        jid = self.tokens.get(token)
        if jid is None or self.sizes.get(jid, 0) < 0 or jid not in self.entries:
            return None
        self.tokens[token] = None
        return jid, list(self.entries[jid])

    def forget(self, ended: list[tuple[str, str]]) -> None:
        """(journal id, its session's last token) of sessions that ended; one that a resume took elsewhere since
        (its token claimed) lives on there."""
        for jid, token in ended:
            if self.tokens.get(token) == jid:
                self.expires[jid] = 0.0
        self._expire(time.monotonic())

    def claimed(self, tokens: list[str]) -> list[str]:
        """Those of ``tokens`` that a resume has claimed."""
        return [token for token in tokens if token in self.tokens and self.tokens[token] is None]

    def _expire(self, now: float) -> None:
        for jid in [jid for jid, at in self.expires.items() if at <= now]:
            del self.expires[jid]
            self.entries.pop(jid, None)
            self.sizes.pop(jid, None)
        self.tokens = {t: jid for t, jid in self.tokens.items() if jid is None or jid in self.entries}


def journals():
    """The cluster's `Journals` actor, started on first use. Detached: it outlives the replica that started it."""
    import ray
    return ray.remote(Journals).options(name=JOURNALS_ACTOR, namespace="serve", lifetime="detached",
                                        get_if_exists=True, num_cpus=0, max_concurrency=1).remote()


def stop_journals() -> None:
    """End the journals actor, if there is one (it is detached: nothing else ends it but the cluster's end)."""
    import ray
    try:
        ray.kill(ray.get_actor(JOURNALS_ACTOR, namespace="serve"))
    except ValueError:
        pass


class Journaler:
    """A replica's side of the journals: new entries and tokens wait here and go in one call every FLUSH_S;
    every TOUCH_S the sessions still alive here (with a socket, or waiting for a resume) are touched. It also
    keeps what the replica knows of its sessions (tokens, shifts), until they end."""

    def __init__(self, actor, hub):
        self.actor, self.hub = actor, hub
        self.pending: dict[str, tuple[list[Entry], list[str]]] = {}
        self.live: dict[str, "Socket"] = {}  # journal id -> its socket here (the latest)
        self.resting: dict[str, str] = {}  # journal id -> its session's token, once its socket has gone
        self.local: dict[str, str] = {}  # token (the server's, or one a replay gave) -> journal id
        self.latest: dict[str, str] = {}  # journal id -> the server's latest token for the session
        self.shifts: dict[str, "Shift"] = {}  # journal id -> its shift, for sessions replayed here
        self._lock = asyncio.Lock()
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    def add(self, jid: str, entries: list[Entry] = (), tokens: list[str] = ()) -> None:
        queued = self.pending.setdefault(jid, ([], []))
        queued[0].extend(entries)
        queued[1].extend(tokens)

    async def flush(self) -> None:
        async with self._lock:
            ttl = self.hub.limits.resume_window_s + 2 * TOUCH_S
            batch, self.pending = [(jid, e, t, ttl) for jid, (e, t) in self.pending.items()], {}
            if batch:
                try:
                    await self.actor.append.remote(batch)
                except Exception:  # the journals are unreachable: serving goes on, without failover
                    log.exception("could not write the session journals")

    async def claim(self, token: str):
        try:
            return await self.actor.claim.remote(token)
        except Exception:
            log.exception("could not read the session journals")
            return None

    async def _run(self) -> None:
        touched = time.monotonic()
        while True:
            await asyncio.sleep(FLUSH_S)
            if time.monotonic() - touched >= TOUCH_S:
                touched = time.monotonic()
                await self._touch()
            await self.flush()

    async def _touch(self) -> None:
        """Touch the journals of live sessions; forget those whose session has ended here; end those waiting here
        for a resume that another replica has resumed (the client's resume went there)."""
        ended = []
        for jid, token in list(self.resting.items()):
            session = self.hub.resume_tokens.get(token)
            if session is None or session.closed:
                ended.append((jid, token))
                self._forget_here(jid)
        for jid in [*self.live, *self.resting]:
            self.add(jid)
        try:
            if ended:
                await self.actor.forget.remote(ended)
            if self.resting:
                for token in await self.actor.claimed.remote(list(self.resting.values())):
                    if (session := self.hub.resume_tokens.get(token)) is not None:
                        await session.close()
        except Exception:
            log.exception("could not update the session journals")

    def socket_started(self, socket: "Socket") -> None:
        self.live[socket.jid] = socket
        self.resting.pop(socket.jid, None)

    def socket_ended(self, socket: "Socket") -> None:
        if socket.jid is not None and self.live.get(socket.jid) is socket:
            del self.live[socket.jid]
            self.resting[socket.jid] = socket.token

    def _forget_here(self, jid: str) -> None:
        del self.resting[jid]
        self.latest.pop(jid, None)
        self.shifts.pop(jid, None)
        self.local = {token: j for token, j in self.local.items() if j != jid}


@dataclass
class Shift:
    """A session replayed here without its finished utterances (`compact`): per context, where the server's count
    of bytes and events starts in the session's; and how many client messages were left out. Acks, resumes and
    `resumed.received` are translated by it."""
    offsets: dict = field(default_factory=dict)  # context id -> [bytes, events]
    dropped: int = 0


@dataclass
class Socket:
    """One WebSocket's bookkeeping: its session's journal id, the session's current token, and per context the
    audio bytes and events sent (in the session's own count, which a resume continues)."""
    jid: str | None = None
    token: str | None = None
    sent: dict = field(default_factory=dict)  # context id -> [bytes, events]
    early: list = field(default_factory=list)  # journal entries from before the session's journal id was known
    replay: "Replay | None" = None
    shift: Shift = field(default_factory=Shift)
    untracked: bool = False  # a resumed session this replica has no journal of

    def position(self, context_id: str | None) -> list[int]:
        return self.sent.setdefault(context_id, [0, 0])


class Failover:
    """ASGI middleware: journal each WebSocket session's messages (`Journaler`); resume one whose token this
    replica does not know from its journal (`Replay`). HTTP passes through untouched."""

    def __init__(self, app, hub, actor):
        self.app, self.hub = app, hub
        self.journaler = Journaler(actor, hub)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "websocket":
            return await self.app(scope, receive, send)
        self.journaler.start()
        sock = Socket()
        try:
            await self.app(scope, self._receiver(sock, receive, send), self._sender(sock, send))
        finally:
            self.journaler.socket_ended(sock)

    # -- what the app receives --
    def _receiver(self, sock: Socket, receive, send):
        first = True

        async def wrapped():
            nonlocal first
            while True:
                if sock.replay is not None and (fed := sock.replay.next_message()) is not None:
                    return fed
                message = await receive()
                if message["type"] != "websocket.receive":
                    return message
                parsed = _parse(message)
                if not first or parsed.get("type") != "resume":
                    break
                first = False
                if (message := await self._on_resume(sock, message, parsed, send)) is not None:
                    return message  # else: replaying, from the top
            first = False
            if parsed.get("type") == "ack":
                return _shifted(message, parsed, sock.shift)
            if parsed.get("type") in UNCOUNTED:
                return message
            if parsed.get("type") == "start" and parsed.get("seed") is None:
                message = {**message, "text": json.dumps({**parsed, "seed": secrets.randbelow(2**62)})}
            self._journal(sock, message.get("text") or message.get("bytes") or b"")
            return message

        return wrapped

    async def _on_resume(self, sock: Socket, message: dict, parsed: dict, send) -> dict | None:
        """A resume: for the server here (the message, translated) if it knows the session or nobody does; else
        a replay of the session's journal is set up here (None)."""
        token = parsed.get("token")
        have = {p.get("context_id"): [p.get("bytes", 0), p.get("events", 0)]
                for p in parsed.get("contexts") or () if isinstance(p, dict)}
        known = self.journaler
        if isinstance(token, str) and token not in self.hub.resume_tokens and token in known.local:
            token = known.latest.get(known.local[token], token)  # a token a replay here gave: the server's own
            message = {**message, "text": json.dumps({**parsed, "token": token})}
        if not isinstance(token, str) or token in self.hub.resume_tokens:
            sock.jid = known.local.get(token)
            sock.untracked = sock.jid is None  # no journal of its past here: it gets none (a replay would miss it)
            sock.shift = known.shifts.get(sock.jid, sock.shift)
            sock.sent = have
            return _shifted(message, json.loads(message["text"]), sock.shift)
        claimed = await self.journaler.claim(token)
        if claimed is None:
            return message  # the server answers resume_expired
        sock.jid, entries = claimed
        sock.replay = Replay(entries, have)
        sock.shift = known.shifts[sock.jid] = sock.replay.shift
        sock.sent = {context_id: list(at) for context_id, at in sock.shift.offsets.items()}
        answer = secrets.token_urlsafe(16)  # the server's token comes with its first ready; until then, this one
        known.local[answer] = sock.jid
        known.socket_started(sock)
        known.add(sock.jid, tokens=[answer])
        await send({"type": "websocket.send", "text": json.dumps(
            {"type": "resumed", "resume_token": answer, "resume_window_s": self.hub.limits.resume_window_s,
             "received": sock.replay.received})})
        log.info("session %s… resumed from its journal: %d of its %d messages again", sock.jid[:6],
                 len(sock.replay.feed), sock.replay.received)
        return None

    def _journal(self, sock: Socket, entry) -> None:
        if sock.untracked or not self.hub.limits.resume_window_s:  # no resume, no failover
            return
        if sock.jid is None:
            sock.early.append(entry)
        else:
            self.journaler.add(sock.jid, [entry])

    # -- what the app sends --
    def _sender(self, sock: Socket, send):
        async def wrapped(message):
            if message["type"] != "websocket.send":
                return await send(message)
            context_id, nbytes, event = outgoing(message)
            kind = event.get("type") if event is not None else "audio"
            if (token := (event or {}).get("resume_token")) and kind in ("ready", "resumed"):
                self._token(sock, token)
            if kind == "resumed" and sock.shift.dropped:
                message = {**message, "text": json.dumps({**event, "received": event["received"] +
                                                          sock.shift.dropped})}
            position = sock.position(context_id)
            if sock.replay is not None:
                message = sock.replay.filter(message, event, position, nbytes, context_id)
            position[0] += nbytes
            position[1] += kind not in UNCOUNTED_EVENTS
            if kind == "done" and sock.jid is not None:
                self._journal(sock, {"done": context_id, "at": list(position)})
                await self.journaler.flush()  # the client forgets the utterance's messages once it has done
            if message is not None:
                await send(message)

        return wrapped

    def _token(self, sock: Socket, token: str) -> None:
        """The session's token (in ready or resumed): the first names its journal; each is an alias of it."""
        if token == sock.token or sock.untracked:
            return
        sock.token = token
        if sock.jid is None:
            sock.jid = token
        known = self.journaler
        known.local[token] = sock.jid
        known.latest[sock.jid] = token
        known.socket_started(sock)
        known.add(sock.jid, sock.early, [token])
        sock.early = []


class Replay:
    """A session coming back from its journal on this replica: the journal's messages go to the server first
    (those of utterances the client has whole left out: `compact`), and of the server's output only what the
    client lacks goes out.

    Example: the client holds 9600 audio bytes and 1 event (ready) of the default context; the replay's output
    is ready, 4800 B, timing, 9600 B, ...: ready is dropped (event 0 < 1), the 4800 B too (bytes 0..4800 < 9600),
    the timing event goes (event 1 >= 1), of the 9600 B chunk (bytes 4800..14400) the last 4800 B go."""

    def __init__(self, entries: list, have: dict):
        self.received = sum(not isinstance(entry, dict) for entry in entries)
        feed, self.shift = compact(entries, have)
        self.feed, self.have = deque(feed), have

    def next_message(self) -> dict | None:
        """The next journal message for the server; None when the journal is all in."""
        if not self.feed:
            return None
        message = self.feed.popleft()
        if isinstance(message, bytes):
            return {"type": "websocket.receive", "bytes": message}
        return {"type": "websocket.receive", "text": message}

    def filter(self, message: dict, event: dict | None, position: list[int], nbytes: int, context_id) -> dict | None:
        """The part of an output message the client lacks (None: it has it all). ``position``: the context's
        (bytes, events) before it, in the session's count."""
        have_bytes, have_events = self.have.get(context_id, (0, 0))
        if event is None or event.get("type") == "audio":
            return _tail(message, event, max(0, have_bytes - position[0])) if nbytes else message
        if event.get("type") == "queued":
            return message if position[0] >= have_bytes and position[1] >= have_events else None
        return message if position[1] >= have_events else None


def compact(entries: list, have: dict) -> tuple[list, Shift]:
    """The journal's messages to replay for a client holding ``have`` (context id -> (bytes, events)), and the
    shift: per context, the messages before the last `done` the client holds are left out, and the server's
    count for it starts where that done left the session's.

    Example: journal [start, text, end, done-mark(None at 96000 B, 3 events), start, text] and a client holding
    (120000 B, 4 events) of the default context: it has the first utterance's done, so the replay is [start,
    text]; the shift is offsets {None: [96000, 3]}, 3 messages dropped; the server's 0 B is the session's 96000 B."""
    cuts = {}
    for i, entry in enumerate(entries):
        if isinstance(entry, dict):
            held_bytes, held_events = have.get(entry["done"], (0, 0))
            if entry["at"][0] <= held_bytes and entry["at"][1] <= held_events:
                cuts[entry["done"]] = (i, entry["at"])
    feed, shift = [], Shift({context_id: list(at) for context_id, (_, at) in cuts.items()})
    for i, entry in enumerate(entries):
        if isinstance(entry, dict):
            continue
        cut = cuts.get(_context(entry))
        if cut is not None and i < cut[0]:
            shift.dropped += 1
        else:
            feed.append(entry)
    return feed, shift


def _context(message) -> str | None:
    """The context a client message belongs to (the default one, None, for binary data and unreadable text)."""
    return _parse({"text": message}).get("context_id") if isinstance(message, str) else None


def _shifted(message: dict, parsed: dict, shift: Shift) -> dict:
    """An ack or resume with its positions in the server's count (`Shift`)."""
    if not shift.offsets:
        return message
    def moved(position: dict) -> dict:
        bytes_at, events_at = shift.offsets.get(position.get("context_id"), (0, 0))
        return {**position, "bytes": max(0, position.get("bytes", 0) - bytes_at),
                "events": max(0, position.get("events", 0) - events_at)}
    if parsed.get("type") == "ack":
        parsed = moved(parsed)
    else:
        parsed = {**parsed, "contexts": [moved(p) for p in parsed.get("contexts") or () if isinstance(p, dict)]}
    return {**message, "text": json.dumps(parsed)}


def _parse(message: dict) -> dict:
    """A client message's JSON object ({} for binary data or anything else)."""
    try:
        parsed = json.loads(message.get("text") or "null")
    except ValueError:
        return {}
    return parsed if isinstance(parsed, dict) else {}


def outgoing(message: dict) -> tuple[str | None, int, dict | None]:
    """(context id, audio bytes, the event or None) of a message the server sends: binary audio is the default
    context's; a named context's audio is an `audio` event with base64 data."""
    if message.get("bytes") is not None:
        return None, len(message["bytes"]), None
    event = json.loads(message["text"])
    nbytes = 0
    if event.get("type") == "audio":  # base64: 4 characters per 3 bytes, "=" padding the last group
        data = event["audio"]
        nbytes = len(data) * 3 // 4 - data[-2:].count("=")
    return event.get("context_id"), nbytes, event


def _tail(message: dict, event: dict | None, skip: int) -> dict | None:
    """An audio message without its first ``skip`` bytes (None when nothing is left)."""
    if skip == 0:
        return message
    if event is None:
        rest = message["bytes"][skip:]
        return {**message, "bytes": rest} if rest else None
    rest = base64.b64decode(event["audio"])[skip:]
    return {**message, "text": json.dumps({**event, "audio": base64.b64encode(rest).decode("ascii")})} if rest else None
