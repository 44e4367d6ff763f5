"""WebSocket sessions (/v1/stream, docs/protocol.md): a client's session, its utterances and their audio pumps."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time

from pydantic import ValidationError
from starlette.websockets import WebSocket, WebSocketDisconnect, WebSocketDisconnected

from serving import workers
from serving.admission import owner
from serving.context import ServerContext
from serving.protocol import (
    CLIENT_MESSAGE,
    UNCOUNTED,
    Ack,
    Cancel,
    End,
    Flush,
    ProtocolError,
    Resume,
    Start,
    Text,
    check_text,
    validation_error,
)
from serving.resume import Link, LinkBroken, ReplayLog, dropped
from serving.utterance import ContextUtterance

log = logging.getLogger("tts.server")


class Session:
    """One client's WebSocket session: a loop over its messages and up to max_contexts utterances, each with
    its own audio pump. Messages name their utterance by context_id (none: the default one).

    A session outlives its socket (serving/resume.py). Everything it sends goes through `transmit`, which keeps
    it in the context's replay log until the client acknowledges it. When the socket drops without a clean close,
    the pumps wait and their engine streams are held (parked at once: their slots serve other clients), and a
    client that resumes within resume_window_s on a new socket gets exactly the rest; otherwise the session
    expires and frees everything. Meanwhile it is set aside from its client's caps (serving/admission.py):
    it never locks its own client out, and the client's oldest waiting session gives way to one more."""

    def __init__(self, hub: ServerContext, clients: tuple, place):
        self.hub, self.limits, self.clients, self.place = hub, hub.limits, clients, place
        self.utterances: dict[str | None, ContextUtterance] = {}
        self.logs: dict[str | None, ReplayLog] = {}
        self.link: Link | None = None  # the socket serving the session; None while it waits for a resume
        self.linked = asyncio.Event()
        self.received = 0  # client messages taken, acks and resumes aside: a resume's `received`
        self.seq = 0  # log entries so far
        self.token, self.tokens = None, []  # the token ready names; every one it has had (to forget them)
        self.expiry: asyncio.Task | None = None
        self.closed = self.resumable = False
        self.last_active = time.monotonic()
        self.sent_bytes = 0
        hub.sessions.add(self)
        if self.limits.resume_window_s > 0:
            self._new_token()

    @property
    def stream(self):
        """The default utterance's engine stream, if any (tests watch it)."""
        utterance = self.utterances.get(None)
        return utterance.stream if utterance else None

    def offer_resume(self) -> dict:
        """What `ready` says about resuming (nothing when the server keeps no sessions for a resume). Once it
        has been said, a drop leaves the session waiting for the client to resume it."""
        if self.token is None:
            return {}
        self.resumable = True
        return {"resume_token": self.token, "resume_window_s": self.limits.resume_window_s}

    async def serve(self, ws: WebSocket, resume: tuple | None = None) -> tuple | None:
        """Serve the session on `ws` until the socket ends. `resume`: (the client's positions per context, the
        token it used); the rest of each context's output is sent first. Returns (session, resume) when the
        client resumed another session on this socket, else None."""
        if self.closed:  # expired just as a resume named it
            await ws.send_text(json.dumps(error_message(ProtocolError("resume_expired", "the session has expired"))))
            return None
        if self.link is not None:
            self.link.cut(replaced=True)  # the server still thought the old socket alive: it is half-open
        self._unlink(self.link)
        self._stop_expiry()
        self.hold_streams(False)
        self.place.put_back()
        link, moving = Link(ws, self.seq, self.limits.idle_timeout_s), None
        try:
            if resume is not None:
                await self._replay(link, resume[0])
            self.link = link
            self.linked.set()
            self.last_active = time.monotonic()
            moving = await self._read(link)
        except (WebSocketDisconnect, WebSocketDisconnected, OSError):
            link.cut(dropped=True)
        finally:
            self._unlink(link)
            link.close()  # its timer goes, and with it the last reference to the socket
        if link.replaced:
            return None  # another socket serves the session now
        if resume is not None and not link.heard:  # dropped before the client said a word: it may not have
            self._accept_token(resume[1])  # had `resumed`, so the token it resumed with still works
        if link.dropped and moving is None and self.resumable and not self.closed:
            self.hold_streams(True)
            self.expiry = asyncio.create_task(self._expire(self.limits.resume_window_s))
            self.place.set_aside(self._give_way)
        else:
            await self.close()
        return moving

    @property
    def awaiting_resume(self) -> bool:
        return self.expiry is not None

    def hold_streams(self, held: bool) -> None:
        """While the session waits for a resume its engine streams generate nothing and hold no slot
        (`Stream.hold`) and count against no client cap; a resume releases them, to go on exactly where they
        stopped."""
        for utterance in self.utterances.values():
            utterance.hold(held)

    async def close(self) -> None:
        """End the session: its utterances stop, and its slots, its place in the connection caps and its tokens
        are freed. Idempotent."""
        if self.closed:
            return
        self.closed = True
        self.linked.set()  # senders waiting for a resume wake, find the session closed, and give up
        self._stop_expiry()
        for utterance in list(self.utterances.values()):
            await utterance.stop()
        self._forget_tokens()
        self.hub.sessions.discard(self)
        self.place.release()

    async def transmit(
        self,
        context_id: str | None,
        *,
        event: dict | None = None,
        audio: bytes | None = None,
        keep: bool = True,
        wait: bool = True,
    ) -> None:
        """Send an event or audio on a context. `keep`: log it for a resume (all but `queued` and the answers to
        a resume). While there is no socket: a pump (`wait`) waits for the resume (meanwhile its engine stream
        fills and pauses); the others leave a kept message to the resume's replay."""
        if event is not None and context_id is not None:
            event = {**event, "context_id": context_id}
        entry = None
        if keep:
            if (log := self.logs.get(context_id)) is None:
                log = self.logs[context_id] = ReplayLog(self.limits.resume_buffer_bytes)
            entry, self.seq = log.add(self.seq, audio=audio, event=event), self.seq + 1
        while (link := self.link) is not None or (entry is not None and wait):
            if self.closed:  # (a sender whose cancellation was lost on the way, say) nothing more goes out
                raise LinkBroken("the session has ended")
            if link is None:
                await self.linked.wait()
            elif entry is not None and entry.seq < link.first_seq:
                return  # the resume has replayed it, or the client had it
            else:
                try:
                    await self._send(link, context_id, event, audio)
                    return
                except TimeoutError:  # the client read nothing for idle_timeout_s: dropped for good
                    link.cut()
                    return self._unlink(link)
                except (WebSocketDisconnect, WebSocketDisconnected, OSError):
                    link.cut(dropped=True)
                    self._unlink(link)

    async def send_error(self, err: ProtocolError, context_id: str | None = None, **how) -> None:
        await self.transmit(context_id, event=error_message(err), **how)

    async def _send(self, link: Link, context_id: str | None, event: dict | None, audio: bytes | None) -> None:
        if audio is None:
            if "resume_token" in event:  # a ready sent before a resume: the token it names is spent
                event = {**event, "resume_token": self.token}
            return await link.send_text(json.dumps(event))
        await link.send_audio(audio, context_id)
        self.sent_bytes += len(audio)
        self.last_active = time.monotonic()

    def _unlink(self, link: Link | None) -> None:
        if link is not None and self.link is link:
            self.link = None
            self.linked.clear()

    def _new_token(self) -> None:
        """Spend the tokens that resume the session (a second resume with one is resume_used) and make one."""
        for token in self.tokens:
            self.hub.resume_tokens[token] = None
        self.token = workers.resume_token()  # 128 random bits (after the worker's index, in a pool of workers)
        self._accept_token(self.token)

    def _accept_token(self, token: str) -> None:
        self.tokens.append(token)
        self.hub.resume_tokens[token] = self

    def _forget_tokens(self) -> None:
        """The session has ended: its live token is forgotten (resume_expired), its spent ones are remembered
        as spent (resume_used), in a bounded record (`SpentTokens`)."""
        for token in self.tokens:
            if token in self.hub.resume_tokens and self.hub.resume_tokens.pop(token) is None:
                self.hub.spent_tokens.add(token)

    async def _expire(self, after_s: float) -> None:
        await asyncio.sleep(after_s)
        self.expiry = None
        await self.close()

    def _give_way(self) -> None:
        """Its client has max_connections_per_client newer sessions waiting for a resume: this one, the oldest,
        expires now (its tokens at once: a resume racing the close gets resume_expired)."""
        self._stop_expiry()
        self._forget_tokens()
        self.expiry = asyncio.create_task(self._expire(0))

    def _stop_expiry(self) -> None:
        if self.expiry is not None:
            self.expiry.cancel()
            self.expiry = None

    # ---- resuming --------------------------------------------------------------------------------
    @staticmethod
    def claim(hub: ServerContext, msg: Resume, clients: tuple) -> tuple[Session, tuple]:
        """(the session `msg.token` names, (where each of its contexts resumes, the token)), or resume_expired /
        resume_used / resume_forbidden (another identity's session) / resume_offset. Claiming spends the token
        (synchronously: of two resumes racing with one token, one wins); a refused claim spends nothing."""
        if (relay := workers.relay_for(msg)) is not None:  # another worker's session: carried to it
            return relay, None
        tokens = hub.resume_tokens
        if hub.spent_tokens.spent(msg.token) or (msg.token in tokens and tokens[msg.token] is None):
            raise ProtocolError(
                "resume_used",
                "this resume token has been used; a resumed session's token is the one its `resumed` event gave",
            )
        target = tokens.get(msg.token)
        if target is not None and not target.closed and owner(target.clients) != owner(clients):
            raise ProtocolError(
                "resume_forbidden",
                "this session was opened by another client (another API key, "
                "or without keys another address); only its own client may resume it",
            )
        if target is None or target.closed:
            window = (
                f"{hub.limits.resume_window_s:g} s, and a client keeps at most "
                f"{hub.limits.max_connections_per_client} sessions waiting, the oldest expiring first"
                if hub.limits.resume_window_s
                else "off on this server"
            )
            raise ProtocolError(
                "resume_expired",
                f"no session to resume: the token is unknown, or its session "
                f"has ended or expired (the resume window is {window})",
            )
        positions = {p.context_id: (p.bytes, p.events) for p in msg.contexts}
        if unlisted := [c for c in target.utterances if c not in positions]:
            names = ", ".join(c or "(default)" for c in unlisted)
            raise ProtocolError(
                "resume_offset",
                f"the resume does not list {names}, where an utterance is open: "
                "list every open context, with what was received of it ({\"bytes\": 0, "
                "\"events\": 0} if nothing)",
            )
        for context_id, (nbytes, events) in positions.items():
            try:
                target._log_or_empty(context_id).check(nbytes, events)
            except ValueError as err:
                raise ProtocolError("resume_offset", f"context {context_id or '(default)'}: {err}") from None
        target._stop_expiry()
        target.place.put_back()  # taken: no longer among its client's waiting sessions, to give way
        target._new_token()
        return target, (positions, msg.token)

    def _log_or_empty(self, context_id: str | None) -> ReplayLog:
        return self.logs.get(context_id) or ReplayLog(self.limits.resume_buffer_bytes)

    async def _replay(self, link: Link, positions: dict) -> None:
        """`resumed`, then what each context's client lacks, in order. Only entries logged before this socket:
        later ones are their senders' to send."""
        await link.send_text(
            json.dumps(
                {
                    "type": "resumed",
                    "resume_token": self.token,
                    "resume_window_s": self.limits.resume_window_s,
                    "received": self.received,
                }
            )
        )
        for context_id, (nbytes, events) in positions.items():
            for entry in self._log_or_empty(context_id).since(nbytes, events):
                if entry.seq < link.first_seq:
                    await self._send(link, context_id, entry.event, entry.audio)

    # ---- the client's messages -------------------------------------------------------------------
    async def _read(self, link: Link) -> tuple | None:
        while (message := await self._receive(link)) is not None:
            try:
                await self._handle(message)
            except _Resumed as resumed:
                return resumed.args
            except ProtocolError as err:
                keep = getattr(err, "keep", True)
                await self.send_error(err, getattr(err, "context_id", None), keep=keep, wait=False)
        return None

    async def _receive(self, link: Link) -> dict | None:
        """The next client message, or None when the client has gone or has been idle too long. Idle means no
        text received and no audio sent; other messages do not count, and waiting in the queue is not idle."""
        while True:
            wait = self.limits.idle_timeout_s - (time.monotonic() - self.last_active)
            if wait <= 0 and any(u.state == "queued" for u in self.utterances.values()):
                self.last_active, wait = time.monotonic(), self.limits.idle_timeout_s
            if wait <= 0:
                await self.close()
                with contextlib.suppress(WebSocketDisconnect, WebSocketDisconnected, OSError, TimeoutError):
                    async with asyncio.timeout(1.0):  # a client that reads nothing gets no goodbye
                        await link.send_text(
                            json.dumps(
                                error_message(
                                    ProtocolError(
                                        "idle_timeout", f"no text and no audio for {self.limits.idle_timeout_s:g} s"
                                    )
                                )
                            )
                        )
                        await link.ws.close(1000, "idle_timeout")
                return None
            try:
                message = await link.race(link.ws.receive(), wait)
            except TimeoutError:
                continue  # audio may have been sent meanwhile: check again
            except LinkBroken:
                return None
            if message["type"] == "websocket.disconnect":
                link.cut(dropped=dropped(message))
                return None
            link.heard = True
            return message

    async def _handle(self, message: dict) -> None:
        if (text := message.get("text")) is None:
            self.received += 1
            raise ProtocolError("bad_message", "messages must be JSON text; binary messages are not accepted")
        try:
            parsed = CLIENT_MESSAGE.validate_json(text)
        except ValidationError as err:
            kind = _type_of(text)
            self.received += kind not in UNCOUNTED
            error = validation_error(err)
            error.keep = kind != "resume"  # an answer to a resume is no part of the session's output
            raise error from None
        self.received += parsed.type not in UNCOUNTED
        try:
            await getattr(self, f"_on_{parsed.type}")(parsed)
        except ProtocolError as err:
            err.context_id = parsed.context_id  # the error belongs to the utterance the message named
            err.keep = parsed.type != "resume"
            raise

    def _utterance(self, context_id: str | None, what: str) -> ContextUtterance:
        utterance = self.utterances.get(context_id)
        if utterance is None:
            raise ProtocolError("bad_state", f"{what} is not allowed now: send start first")
        if utterance.state == "ending":
            raise ProtocolError("bad_state", f"{what} is not allowed now: the utterance is ending")
        return utterance

    async def _on_start(self, msg: Start) -> None:
        if (current := self.utterances.get(msg.context_id)) is not None:
            raise ProtocolError(
                "bad_state",
                f"an utterance is {current.state} here: end or cancel it and wait for done, or use another context_id",
            )
        if len(self.utterances) >= self.limits.max_contexts:
            raise ProtocolError(
                "too_many_contexts",
                f"{len(self.utterances)} utterances are open on this socket, the most one may have; end one first",
            )
        await self.hub.engine()
        voice = self.hub.resolve_voice(msg.voice)
        self.utterances[msg.context_id] = ContextUtterance(self, msg, voice, self.hub.lexicon_for(msg.lexicon))

    async def _on_text(self, msg: Text) -> None:
        utterance = self._utterance(msg.context_id, "text")
        check_text(msg.text)
        self.hub.check_length(utterance.chars + len(msg.text), "this text would make the utterance")
        if msg.text.strip():
            self.last_active = time.monotonic()  # text is activity; an empty piece is not
        utterance.push("text", msg.text)

    async def _on_flush(self, msg: Flush) -> None:
        self._utterance(msg.context_id, "flush").push("flush")

    async def _on_end(self, msg: End) -> None:
        self._utterance(msg.context_id, "end").push("end")

    async def _on_cancel(self, msg: Cancel) -> None:
        utterance = self.utterances.get(msg.context_id)
        if utterance is not None:  # none: the cancel crossed a done on the wire
            await utterance.cancel()

    async def _on_ack(self, msg: Ack) -> None:
        try:
            self._log_or_empty(msg.context_id).ack(msg.bytes, msg.events)
        except ValueError as err:
            raise ProtocolError("bad_value", f"ack: {err}") from None

    async def _on_resume(self, msg: Resume) -> None:
        if self.received or self.utterances:
            raise ProtocolError("bad_state", "resume must be the first message on a new connection")
        raise _Resumed(*self.claim(self.hub, msg, self.clients))


class _Resumed(Exception):
    """The client resumed another session on this socket: args (session, (positions, token))."""


def error_message(err: ProtocolError) -> dict:
    return {"type": "error", "code": err.code, "message": err.message}


def _type_of(text: str):
    """The `type` of a message that failed validation, if it has one (a resume's answers are not logged)."""
    with contextlib.suppress(ValueError):
        if isinstance(message := json.loads(text), dict):
            return message.get("type")
    return None
