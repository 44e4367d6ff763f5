"""One utterance (a context) on a WebSocket session: its text to the engine, the engine's audio to the socket."""

from __future__ import annotations

import asyncio
import logging
import time

from starlette.websockets import WebSocketDisconnect, WebSocketDisconnected

from serving.protocol import ProtocolError, Start
from serving.text_gate import SpeakableGate
from tts.containers import AudioEncoder
from tts.rates import SAMPLE_RATE
from tts.text import TextError

log = logging.getLogger("tts.server")


class ContextUtterance:
    """One utterance on a socket: queued (waiting for a slot; its text is kept) -> open -> ending (end received)
    -> gone. It ends with exactly one `done`, or, refused before `ready`, with one `error` alone. Only its own
    task sends those, so a cancel never cuts one in half: a cancel ends the wait or the engine stream, and the
    task then says `done`."""

    def __init__(self, session, start: Start, voice: str | None, lexicon=None):
        self.session, self.start, self.voice, self.context_id = session, start, voice, start.context_id
        self.state, self.ticket, self.stream, self.pending = "queued", None, None, []
        self.chars, self.samples, self.cancelled = 0, 0, False
        self.first_text_at = self.first_audio_at = None
        self.encoder = AudioEncoder(start.format, start.sample_rate)
        self.opening = asyncio.ensure_future(
            session.hub.open(session.clients, voice, start.speed, start.seed, self._queued, lexicon)
        )
        self.left = asyncio.Event()  # set once the context is free for the next start (`_leave`)
        self.gate = SpeakableGate()  # no audio goes out before the text has something speakable
        self.task = asyncio.create_task(self._run())

    def push(self, kind: str, text: str = "") -> None:
        """text / flush / end: to the engine stream, or kept until the stream opens."""
        if kind == "text":
            self.chars += len(text)
            self.gate.add(text)
            if text.strip():
                self.first_text_at = self.first_text_at or time.perf_counter()
        elif kind == "end":
            self.state = "ending"
            self.gate.end()
        if self.stream is None:
            self.pending.append((kind, text))
        else:
            self._apply(kind, text)

    def _apply(self, kind: str, text: str) -> None:
        try:
            {"text": lambda: self.stream.push_text(text), "flush": self.stream.flush, "end": self.stream.end}[kind]()
        except TextError as err:
            raise ProtocolError("bad_text", str(err), "text") from None

    def hold(self, held: bool) -> None:
        """Hold (or release) the engine stream while the session waits for a resume, its slot set aside from
        the client's caps."""
        if self.stream is not None:
            self.stream.hold() if held else self.stream.release()
            self.ticket.set_aside() if held else self.ticket.put_back()

    async def cancel(self) -> None:
        """Stop at once: the wait in the queue ends, or generation stops and queued audio is dropped; then
        `done` with cancelled true. Returns once the utterance is gone."""
        self.cancelled = True
        self.gate.end()
        if self.stream is not None:
            self.stream.cancel()
        else:
            self.opening.cancel()
        # Until the context is free, not until `done` is sent: should the socket drop meanwhile, the sender
        # waits for a resume, and the reader (this caller) must be free to see the drop.
        left = asyncio.ensure_future(self.left.wait())
        await asyncio.wait([self.task, left], return_when=asyncio.FIRST_COMPLETED)
        left.cancel()

    async def stop(self) -> None:
        """The connection is going: end everything, say nothing."""
        if self.stream is not None:
            self.stream.cancel()
        self.opening.cancel()
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)
        self._close_opened()  # should the task have been cancelled before it took the stream
        self.encoder.close()

    def _close_opened(self) -> None:
        opening = self.opening
        if opening.done() and not opening.cancelled() and opening.exception() is None:
            self.session.hub.close(*opening.result())  # idempotent

    async def _run(self) -> None:
        try:
            await self._speak()
        except (WebSocketDisconnect, WebSocketDisconnected, OSError, TimeoutError):
            pass  # the client has gone or stalled (also while being told of a failure); the session ends
        finally:
            self._leave()
            self._close_opened()
            self.encoder.close()

    async def _speak(self) -> None:
        try:
            try:
                self.ticket, self.stream = await self.opening
                if not self.start.hold:
                    self.stream.text.hold_off()
            except asyncio.CancelledError:
                if not self.cancelled or asyncio.current_task().cancelling():
                    raise  # the connection is going
                return await self._finish()  # cancelled while queued
            if self.cancelled:
                return await self._finish()
            if self.state == "queued":
                self.state = "open"
            if self.session.awaiting_resume:  # the socket dropped while it waited for a slot
                self.hold(True)
            for kind, text in self.pending:
                self._apply(kind, text)
            self.pending = []
            seed = {} if self.start.seed is None else {"seed": self.start.seed}
            await self._event(
                {
                    "type": "ready",
                    "sample_rate": self.encoder.rate,
                    "format": self.start.format,
                    "voice": self.stream.voice,
                    "speed": self.start.speed,
                    **seed,
                    **self.session.offer_resume(),
                }
            )
            await self._pump()
        except ProtocolError as err:
            if self.stream is None:  # refused before ready: no utterance was opened
                self._leave()
                await self.session.send_error(err, self.context_id)
            else:  # nothing speakable, or the engine failed
                await self.session.send_error(err, self.context_id)
                await self._finish(failed=True)
        except (WebSocketDisconnect, WebSocketDisconnected, OSError, TimeoutError):
            raise
        except Exception as err:  # a bug ends this utterance, not the connection
            log.exception("utterance failed")
            await self.session.send_error(ProtocolError("internal", f"internal error: {err}"), self.context_id)
            await self._finish(failed=True)

    async def _queued(self, position: int) -> None:
        await self.session.transmit(
            self.context_id, event={"type": "queued", "position": position}, keep=False, wait=False
        )  # a place in the queue is news only while it holds

    async def _pump(self) -> None:
        """Engine -> socket. Each send waits while the socket is backed up, and no read happens meanwhile,
        so the engine's queue fills and it pauses this stream's generation."""
        stream, start = self.stream, self.start
        if not await self.gate.wait() and not self.cancelled:  # the text ended with nothing to say
            raise ProtocolError("bad_text", "the utterance's text has nothing speakable in it", "text")
        async for chunk in self.session.hub.chunks(stream):
            timing = {}
            if start.timings and (phonemes := stream.take_timings()):
                timing["phonemes"] = phonemes  # scheduled just ahead of their audio
            if start.word_timings and (words := stream.take_word_timings()):
                timing["words"] = words
            if timing:
                await self._event({"type": "timing", **timing})
            self.session.hub.check_audio(self.samples + len(chunk), self.chars)
            await self._send_audio(self.encoder.encode(chunk), len(chunk))
        if not self.cancelled:
            await self._send_audio(self.encoder.finish(), 0)
        await self._finish()

    async def _send_audio(self, data: bytes, samples: int) -> None:
        self.samples += samples  # an encoder may hold a chunk back, but it is in the utterance
        if data:
            await self.session.transmit(self.context_id, audio=data)
            self.first_audio_at = self.first_audio_at or time.perf_counter()

    async def _event(self, event: dict) -> None:
        await self.session.transmit(self.context_id, event=event)

    def _leave(self) -> None:
        """Free the context for the next start (before the last event goes, so a client answering it is served)."""
        if self.session.utterances.get(self.context_id) is self:
            del self.session.utterances[self.context_id]
        self.left.set()

    async def _finish(self, failed: bool = False) -> None:
        """The utterance's one `done`, once its context and its slot are free (a client answering it at once
        with the next start is served without waiting)."""
        self._leave()
        self._close_opened()
        ttfa = None
        if self.first_text_at is not None and self.first_audio_at is not None:
            ttfa = round((self.first_audio_at - self.first_text_at) * 1000, 1)
        stats = self.stream.stats if self.stream is not None else {"rtf": None, "ttfa_ms": None}
        await self._event(
            {
                "type": "done",
                "cancelled": self.cancelled or failed,
                "audio_seconds": round(self.samples / SAMPLE_RATE, 3),
                "ttfa_ms": ttfa,
                "rtf": stats["rtf"],
                "engine_ttfa_ms": stats["ttfa_ms"],
            }
        )
