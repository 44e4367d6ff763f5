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

`Failover` is ASGI middleware around the server's app (serving/ray_serve.py puts it on every replica); it reads
and writes the WebSocket messages the app exchanges and touches nothing inside the server. It also gives every
`start` without a seed a random one, so that every utterance can be regenerated.

**Checkpoints** bound what the replay regenerates. Every CHECKPOINT_AUDIO_S of new audio, a replica copies each
live utterance's engine state (`Engine.snapshot`: the slot's caches and counters, the text front end, the codec
decoder; ~2.2 MB for the shipped model) while the utterance goes on, and stores it with the journal (`Checkpoint`:
the place in the journal whose messages it has taken in, and the audio bytes before it). The survivor then
`attach`es the latest checkpoint whose audio the client holds instead of starting the utterance anew: it feeds
the server the utterance's `start` (whose seed stands in for the checkpoint: `Checkpointing.open` attaches it)
and only the messages after the checkpoint, and regenerates at most about one checkpoint interval of audio before
the bytes the client lacks. A checkpoint is taken while the session's server waits for its next message (no
message is handed to it until the copy is done), so the state and the journal position agree.

    journal [start, text, text, text, end], checkpoint after 3 entries at 48000 B; the client holds 60000 B
    replica B's server <-- start (seed: a stand-in for the checkpoint), text, end
    replica B's server --> ready (dropped), audio 48000.. B: 48000..60000 dropped, 60000.. sent

Limits (measured and stated in docs/scale-out.md): without a usable checkpoint (a compressed or resampled format,
timings asked for, a flush or an error in the utterance, an engine on the GPU's frame codec, or a kill before the
first checkpoint) the gap is the time to regenerate the current utterance's audio so far, which grows with its
length; the journal of one session is bounded (MAX_JOURNAL_BYTES); a session is continued sample-exactly when its
audio depends only on its messages. A `flush` breaks that (it speaks what has come so far at once, so where it
falls in the audio depends on timing), and so, measured on the shipped voices, does text arriving word by word
(the text front end's output depends on when words come; a replay feeds them all at once): such an utterance goes
on with no byte lost or repeated, but its samples after the checkpoint (or the flush) may differ.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from dataclasses import dataclass, field

from serving.journals import (  # noqa: F401
    CHECKPOINTS_KEPT,
    JOURNALS_ACTOR,
    MAX_JOURNAL_BYTES,
    Checkpoint,
    JournalEntry,
    Journals,
    journals,
    stop_journals,
)
from serving.protocol import UNCOUNTED
from serving.replay import Replay, Shift, compact, outgoing, parsed_message, shifted_message  # noqa: F401

log = logging.getLogger("tts.failover")
FLUSH_S = 0.05  # how often a replica sends its sessions' new messages to the journals
TOUCH_S = 1.0  # how often a replica says that its sessions live on (the journals forget the others)
# A live utterance is checkpointed each time it has this much more audio: a failover regenerates at most about
# this much (at the engine's speed: 0.25 s of work at RTF 0.25) before the client's next byte. Each costs a
# snapshot (~2.2 MB for the shipped model) sent to the journals actor.
CHECKPOINT_AUDIO_S = 1.0
CHECKPOINT_POLL_S = 0.1  # how often a replica looks for utterances due a checkpoint
RAW_WIDTHS = {"pcm_s16le": 2, "pcm": 2, "f32le": 4}  # formats whose bytes are samples x width: a byte -> a sample
UNCOUNTED_EVENTS = ("queued", "audio", "resumed")  # events a client's position does not count


class Journaler:
    """A replica's side of the journals: new entries and tokens wait here and go in one call every FLUSH_S;
    every TOUCH_S the sessions still alive here (with a socket, or waiting for a resume) are touched. It also
    keeps what the replica knows of its sessions (tokens, shifts), until they end."""

    def __init__(self, actor, hub):
        self.actor, self.hub = actor, hub
        self.pending: dict[str, tuple[list[JournalEntry], list[str]]] = {}
        self.tracks: dict[str, Track] = {}  # journal id -> its journal's length and utterances (for checkpoints)
        self.standins: dict[str, list[int]] = {}  # journal id -> seeds its replay here stood in for checkpoints
        self.engine: Checkpointing | None = None
        self.live: dict[str, Socket] = {}  # journal id -> its socket here (the latest)
        self.resting: dict[str, str] = {}  # journal id -> its session's token, once its socket has gone
        self.local: dict[str, str] = {}  # token (the server's, or one a replay gave) -> journal id
        self.latest: dict[str, str] = {}  # journal id -> the server's latest token for the session
        self.shifts: dict[str, Shift] = {}  # journal id -> its shift, for sessions replayed here
        self._lock = asyncio.Lock()
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    def add(self, jid: str, entries: list[JournalEntry] = (), tokens: list[str] = ()) -> None:
        self.tracks.setdefault(jid, Track()).note(entries)
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

    def follow(self, jid: str, entries: list[JournalEntry], replay: Replay) -> None:
        """A session replayed here: follow its journal from ``entries`` on; an utterance continued from a
        checkpoint has the stand-in seed its server got, and its audio starts at the checkpoint's sample."""
        track = self.tracks[jid] = Track()
        track.note(entries)
        for context_id, (seed, samples) in replay.standins.items():
            track.contexts[context_id].seed, track.contexts[context_id].samples = seed, samples
        self.standins[jid] = [seed for seed, _ in replay.standins.values()]

    def replayed(self, replay: Replay) -> None:
        """Count a replay in the journals' figures (`Journals.stats`), without waiting for it."""
        try:
            self.actor.replayed.remote(replay.starts, len(replay.standins))
        except Exception:
            log.exception("could not count a replay")

    def spoil(self, jid: str, context_id: str | None) -> None:
        """An error went out on the context: its utterance gets no more checkpoints (its events no longer
        follow from the messages a checkpoint leaves out)."""
        if (current := self.tracks.get(jid, Track()).contexts.get(context_id)) is not None:
            current.exact = False

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

    def socket_started(self, socket: Socket) -> None:
        self.live[socket.jid] = socket
        self.resting.pop(socket.jid, None)

    def socket_ended(self, socket: Socket) -> None:
        if socket.jid is not None and self.live.get(socket.jid) is socket:
            del self.live[socket.jid]
            self.resting[socket.jid] = socket.token

    def _forget_here(self, jid: str) -> None:
        del self.resting[jid]
        self.latest.pop(jid, None)
        self.shifts.pop(jid, None)
        self.tracks.pop(jid, None)
        if self.engine is not None:  # a checkpoint its server never opened (it ended first)
            self.engine.discard(self.standins.pop(jid, ()))
        self.local = {token: j for token, j in self.local.items() if j != jid}


@dataclass
class Current:
    """A context's latest utterance in a session's journal: where its start is, its seed (as its server has it),
    whether a checkpoint continues it exactly (no flush, no error so far), and its latest checkpoint's sample."""

    start: int
    seed: int | None
    exact: bool = True
    samples: int = 0


@dataclass
class Track:
    """What a replica follows of a session's journal: its length, and each context's latest utterance."""

    length: int = 0
    contexts: dict = field(default_factory=dict)  # context id -> Current

    def note(self, entries) -> None:
        for entry in entries:
            message = parsed_message({"text": entry}) if isinstance(entry, str) else {}
            context_id = message.get("context_id")
            if message.get("type") == "start":
                self.contexts[context_id] = Current(self.length, message.get("seed"))
            elif message.get("type") == "flush" and context_id in self.contexts:
                self.contexts[context_id].exact = False
            self.length += 1


class Checkpointing:
    """The engine as a replica's server sees it: `open` with a seed that a replay registered (`expect`) attaches
    that checkpoint's state instead of starting afresh; everything else is the engine's own."""

    def __init__(self, engine):
        self.engine = engine
        self._expected: dict[int, bytes] = {}  # stand-in seed -> state

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def expect(self, state: bytes) -> int:
        """A seed that stands in for ``state`` in the `start` a replay feeds the server."""
        seed = secrets.randbelow(2**62)
        self._expected[seed] = state
        return seed

    def discard(self, seeds) -> None:
        for seed in seeds:
            self._expected.pop(seed, None)

    def open(self, voice=None, speed=1.0, *, seed=None, wait_s=0.0, **options):
        state = self._expected.pop(seed, None) if seed is not None else None
        if state is None:
            return self.engine.open(voice, speed, seed=seed, wait_s=wait_s, **options)
        return self.engine.attach(state, wait_s=wait_s)


class Checkpointer:
    """Every CHECKPOINT_POLL_S: a checkpoint of each utterance live here that has ``every_s`` more audio
    than at its last and that a checkpoint continues exactly (raw PCM at the engine's rate, no timings asked
    for, no flush or error: `Current.exact`), sent to the journals after its session's pending entries."""

    def __init__(self, journaler: Journaler, engine: Checkpointing, every_s: float = CHECKPOINT_AUDIO_S):
        self.journaler, self.engine, self.every_s = journaler, engine, every_s
        self.taken = 0

    async def run(self) -> None:
        while True:
            await asyncio.sleep(CHECKPOINT_POLL_S)
            for jid, sock in list(self.journaler.live.items()):
                try:
                    await self._checkpoint(jid, sock)
                except Exception:  # serving goes on; this session's failover regenerates more
                    log.exception("could not checkpoint a session")

    def _due(self, jid: str) -> list[tuple[str | None, Current, object, int]]:
        """(context id, its utterance in the journal, its engine stream, bytes a sample) of the session's
        utterances due a checkpoint."""
        known, rate = self.journaler, self.engine.sample_rate
        session, track = known.hub.resume_tokens.get(known.latest.get(jid)), known.tracks.get(jid)
        if session is None or track is None:
            return []
        due = []
        for context_id, utterance in list(session.utterances.items()):
            current, stream, start = track.contexts.get(context_id), utterance.stream, utterance.start
            width = RAW_WIDTHS.get(start.format)
            if (
                current is None
                or stream is None
                or not current.exact
                or start.seed != current.seed
                or width is None
                or start.sample_rate != rate
                or start.timings
                or start.word_timings
            ):
                continue
            if stream.samples - current.samples >= self.every_s * rate:
                due.append((context_id, current, stream, width))
        return due

    async def _checkpoint(self, jid: str, sock: Socket) -> None:
        """Snapshot the session's due utterances while its server waits for the next message (none is handed
        to it until they are done: every message journaled has been taken in, and nothing after)."""
        from streaming.errors import EngineError  # here: the journals actor imports this module without torch

        due = self._due(jid)
        if not due or not sock.receiving:
            return
        known, taken = self.journaler, []
        after = known.tracks[jid].length
        sock.free.clear()
        try:
            for context_id, current, stream, width in due:
                try:
                    state, samples = await known.hub.call(self.engine.snapshot, stream)
                except EngineError:  # parked, ending or moving just now: the next poll tries again
                    continue
                taken.append(
                    Checkpoint(
                        context_id, current.start, after, samples, samples * width, self.engine.fingerprint, state
                    )
                )
                current.samples = samples
        finally:
            sock.free.set()
        if taken:
            await known.flush()  # the entries it has taken in reach the journal first
            await known.actor.checkpoint.remote(jid, taken)
            self.taken += len(taken)


@dataclass
class Socket:
    """One WebSocket's bookkeeping: its session's journal id, the session's current token, and per context the
    audio bytes and events sent (in the session's own count, which a resume continues)."""

    jid: str | None = None
    token: str | None = None
    sent: dict = field(default_factory=dict)  # context id -> [bytes, events]
    early: list = field(default_factory=list)  # journal entries from before the session's journal id was known
    replay: Replay | None = None
    shift: Shift = field(default_factory=Shift)
    untracked: bool = False  # a resumed session this replica has no journal of
    receiving: bool = False  # its server waits for the next message (it has taken in every one before)
    free: asyncio.Event = field(default_factory=asyncio.Event)  # clear: a checkpoint holds the next message back

    def position(self, context_id: str | None) -> list[int]:
        return self.sent.setdefault(context_id, [0, 0])


class Failover:
    """ASGI middleware: journal each WebSocket session's messages (`Journaler`); resume one whose token this
    replica does not know from its journal (`Replay`). HTTP passes through untouched."""

    def __init__(
        self, app, hub, actor, engine: Checkpointing | None = None, checkpoint_audio_s: float = CHECKPOINT_AUDIO_S
    ):
        """``engine``: the server's engine, wrapped (`Checkpointing`), checkpointed every ``checkpoint_audio_s``
        of an utterance's audio; None (or 0 s): replays regenerate each current utterance from its start. An
        engine on a frame codec (a GPU) takes no snapshots."""
        self.app, self.hub = app, hub
        self.journaler = Journaler(actor, hub)
        checkpoints = engine is not None and checkpoint_audio_s > 0 and not getattr(engine, "frame_codec", False)
        self.engine = engine if checkpoints else None
        self.checkpointer = Checkpointer(self.journaler, engine, checkpoint_audio_s) if checkpoints else None
        self.journaler.engine = self.engine
        self._task: asyncio.Task | None = None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "websocket":
            return await self.app(scope, receive, send)
        self.journaler.start()
        if self.checkpointer is not None and self._task is None:
            self._task = asyncio.get_running_loop().create_task(self.checkpointer.run())
        sock = Socket()
        sock.free.set()
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
                sock.receiving = True
                try:
                    message = await receive()
                finally:
                    sock.receiving = False
                await sock.free.wait()  # a checkpoint in progress: the server takes nothing in meanwhile
                if message["type"] != "websocket.receive":
                    return message
                parsed = parsed_message(message)
                if not first or parsed.get("type") != "resume":
                    break
                first = False
                if (message := await self._on_resume(sock, message, parsed, send)) is not None:
                    return message  # else: replaying, from the top
            first = False
            if parsed.get("type") == "ack":
                return shifted_message(message, parsed, sock.shift)
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
        have = {
            p.get("context_id"): [p.get("bytes", 0), p.get("events", 0)]
            for p in parsed.get("contexts") or ()
            if isinstance(p, dict)
        }
        known = self.journaler
        if isinstance(token, str) and token not in self.hub.resume_tokens and token in known.local:
            token = known.latest.get(known.local[token], token)  # a token a replay here gave: the server's own
            message = {**message, "text": json.dumps({**parsed, "token": token})}
        if not isinstance(token, str) or token in self.hub.resume_tokens:
            sock.jid = known.local.get(token)
            sock.untracked = sock.jid is None  # no journal of its past here: it gets none (a replay would miss it)
            sock.shift = known.shifts.get(sock.jid, sock.shift)
            sock.sent = have
            return shifted_message(message, json.loads(message["text"]), sock.shift)
        claimed = await self.journaler.claim(token)
        if claimed is None:
            return message  # the server answers resume_expired
        sock.jid, entries, checkpoints = claimed
        engine = self.engine
        sock.replay = Replay(
            entries, have, checkpoints if engine else (), engine and engine.fingerprint, engine and engine.expect
        )
        known.follow(sock.jid, entries, sock.replay)
        known.replayed(sock.replay)
        sock.shift = known.shifts[sock.jid] = sock.replay.shift
        sock.sent = {context_id: list(at) for context_id, at in sock.shift.offsets.items()}
        answer = secrets.token_urlsafe(16)  # the server's token comes with its first ready; until then, this one
        known.local[answer] = sock.jid
        known.socket_started(sock)
        known.add(sock.jid, tokens=[answer])
        await send(
            {
                "type": "websocket.send",
                "text": json.dumps(
                    {
                        "type": "resumed",
                        "resume_token": answer,
                        "resume_window_s": self.hub.limits.resume_window_s,
                        "received": sock.replay.received,
                    }
                ),
            }
        )
        log.info(
            "session %s… resumed from its journal: %d of its %d messages again, %d checkpoints",
            sock.jid[:6],
            len(sock.replay.feed),
            sock.replay.received,
            len(sock.replay.standins),
        )
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
                message = {**message, "text": json.dumps({**event, "received": event["received"] + sock.shift.dropped})}
            if kind == "error" and sock.jid is not None:  # its audio no longer follows from its messages alone
                self.journaler.spoil(sock.jid, context_id)
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
