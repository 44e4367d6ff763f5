"""A Wyoming protocol server (Home Assistant's voice protocol) on the engine, built on the `wyoming` package.

One connection, one utterance at a time:

- ``describe`` -> ``info``: every voice, language en_US, with its teacher and licence as attribution.
- ``synthesize`` (whole text) -> ``audio-start``, ``audio-chunk``..., ``audio-stop``.
- ``synthesize-start``, ``synthesize-chunk``..., ``synthesize-stop`` (text streamed from an LLM) -> the same
  audio events, then ``synthesize-stopped``. Every chunk goes straight into one engine stream
  (``push_text``), so speech starts as soon as the engine's text front end has enough text, not after the
  whole message. A ``synthesize`` that arrives inside a stream is the copy Home Assistant sends for older
  servers, and is ignored.
- Failures are ``error`` events with a code (``unknown_voice``, ``unsupported_language``,
  ``unsupported_text_format``, ``bad_text``, ``server_full``, ``engine_error``, ``bad_event``); a stream that
  fails still ends with ``synthesize-stopped`` once the client sends ``synthesize-stop``. A client that
  disconnects mid-utterance cancels its engine stream, which frees the slot.

Audio is s16le mono at the engine's sample rate (24 kHz). Uses only the engine's public API, so one engine
can serve the HTTP/WebSocket server and this one at once (``tts serve --wyoming-uri``).

The server's limits hold here too (`serving.limits.Limits`, the same flags): an event (its header line, its
declared ``data_length`` and ``payload_length`` together) over ``max_message_bytes`` is refused before any of it
is read (``error`` ``event_too_large``, then the connection closes: it cannot be skipped without reading it);
``max_connections`` / ``max_connections_per_client`` connections (``server_full`` / ``client_limit``, then
closed); ``max_text_chars`` (``text_too_long``); ``idle_timeout_s`` with no event received and no audio sent
(``idle_timeout``, closed), also for a client that stops reading; and the audio cap (``audio_too_long``). Every
malformed event (not JSON, not an object, no ``type``, ``data`` not an object, a length that is not a
non-negative integer, fields of the wrong type) gets an ``error`` event (``bad_event``) and the connection goes
on; text is checked as on every front end (`tts.text.validate_text`: NUL and other control characters, nothing
speakable: ``bad_text``). A client that goes away is one line in the log, never a traceback.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from urllib.parse import urlparse

from wyoming.audio import AudioChunk, AudioStart, AudioStop
from wyoming.error import Error
from wyoming.event import Event
from wyoming.info import Attribution, Describe, Info, TtsProgram, TtsVoice
from wyoming.server import AsyncEventHandler, AsyncServer
from wyoming.tts import Synthesize, SynthesizeChunk, SynthesizeStart, SynthesizeStop, SynthesizeStopped
from zeroconf.asyncio import AsyncServiceInfo, AsyncZeroconf

from serving.admission import Admission
from serving.limits import Limits
from serving.protocol import ProtocolError
from serving.text_gate import SpeakableGate
from serving.wyoming_events import BadEvent, read_event
from streaming.errors import EngineError, ServerFull, UnknownVoice
from tts.containers import AudioEncoder
from tts.text import TextError, validate_text
from tts.voices import attribution

LANGUAGE = "en_US"
OPEN_WAIT_S = 5.0  # how long a request waits for a free engine slot before `server_full`
LINGER_S = 0.5  # after an event it cannot frame, how long the server reads and discards before it closes
SAMPLE_WIDTH, CHANNELS = 2, 1  # s16le mono
SERVICE_TYPE = "_wyoming._tcp.local."  # what Home Assistant browses for
_LOG = logging.getLogger(__name__)


class RequestError(Exception):
    """A request the server refuses; sent to the client as an ``error`` event with ``code``."""

    def __init__(self, code: str, text: str):
        super().__init__(text)
        self.code = code


def describe(engine) -> Info:
    """The ``info`` answer: one TTS program with every voice of the engine."""
    voices = [
        TtsVoice(
            name=name,
            attribution=Attribution(name=attribution(preset), url=""),
            installed=True,
            description=preset.get("description"),
            version=None,
            languages=[LANGUAGE],
        )
        for name, preset in engine.voices.items()
    ]
    program = TtsProgram(
        name="tts",
        attribution=Attribution(name="tts (streaming text-to-speech)", url=""),
        installed=True,
        description="Streaming text-to-speech that speaks while text arrives",
        version=_version(),
        voices=voices,
        supports_synthesize_streaming=True,
    )
    return Info(tts=[program])


def _version() -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("tts")
    except PackageNotFoundError:
        return None


class WyomingHandler(AsyncEventHandler):
    """One client connection. ``self.stream`` is the engine stream of the utterance being spoken, if any;
    ``self.pump`` the task that sends its audio; ``self.streaming`` whether a synthesize-start is open."""

    def __init__(
        self, engine, info: Info, pool: ThreadPoolExecutor, limits: Limits, admission: Admission, *args, **kwargs
    ):
        super().__init__(*args, **kwargs)
        self.engine, self.info, self.pool, self.limits, self.admission = engine, info, pool, limits, admission
        self.stream = self.pump = self.gate = None
        self.streaming = False
        self.failed = False  # the open stream has already reported an error
        self.chars = 0  # text of the utterance being spoken
        self.last_active = time.monotonic()  # an event received or audio sent
        peer = self.writer.get_extra_info("peername")
        self.clients = (("addr", peer[0] if isinstance(peer, tuple) else "local"),)

    async def run(self) -> None:
        """The connection: admitted against the limits, then events until the client leaves, idles or sends
        something that cannot be framed. Every failure ends here as an event or one log line."""
        try:
            place = self.admission.connect(self.clients)
        except ProtocolError as refusal:
            with contextlib.suppress(ConnectionError, TimeoutError):
                await self._report(RequestError(refusal.code, refusal.message))
            self.writer.close()
            return
        try:
            await self._serve()
        except (ConnectionError, TimeoutError) as gone:  # a reset, a broken pipe, a reader that stopped
            _LOG.info("wyoming client %s gone: %s", self.clients[0][1], gone or type(gone).__name__)
        finally:
            place.release()
            await self.disconnect()
            self.writer.close()

    async def _serve(self) -> None:
        while (event := await self._next_event()) is not None:
            await self.handle_event(event)

    async def _next_event(self) -> Event | None:
        """The next event, or None when the client has gone, idled past idle_timeout_s or sent one that cannot
        be framed (told why first). A malformed event that can be framed is answered here and skipped."""
        while True:
            wait = self.limits.idle_timeout_s - (time.monotonic() - self.last_active)
            try:
                if wait <= 0:
                    raise TimeoutError
                event = await read_event(self.reader, self.limits.max_message_bytes, wait)
            except TimeoutError:
                if time.monotonic() - self.last_active < self.limits.idle_timeout_s:
                    continue  # audio went out meanwhile
                await self._report(
                    RequestError("idle_timeout", f"no event and no audio for {self.limits.idle_timeout_s:g} s")
                )
                return None
            except BadEvent as err:
                await self._report(RequestError(err.code, str(err)))
                if err.fatal:
                    await self._linger()
                    return None
                continue
            if event is not None:
                self.last_active = time.monotonic()
            return event

    async def _linger(self) -> None:
        """Before closing on an event it cannot frame: end our side after the error event (FIN), and discard what
        the client still sends for up to LINGER_S, so that the close is not a reset that could take the error
        event with it out of the client's buffer."""
        with contextlib.suppress(OSError, RuntimeError, TimeoutError):
            self.writer.write_eof()
            async with asyncio.timeout(LINGER_S):
                while await self.reader.read(1 << 16):
                    pass

    async def write_event(self, event: Event) -> None:
        """Send an event; a client that reads nothing for idle_timeout_s is gone (TimeoutError)."""
        async with asyncio.timeout(self.limits.idle_timeout_s):
            await super().write_event(event)

    async def handle_event(self, event: Event) -> bool:
        try:
            if Describe.is_type(event.type):
                await self.write_event(self.info.event())
            elif Synthesize.is_type(event.type):
                if not self.streaming:  # inside a stream it is the compatibility copy of the chunks
                    await self._synthesize(Synthesize.from_event(event))
            elif SynthesizeStart.is_type(event.type):
                await self._start(SynthesizeStart.from_event(event))
            elif SynthesizeChunk.is_type(event.type):
                self._chunk(SynthesizeChunk.from_event(event).text)
            elif SynthesizeStop.is_type(event.type):
                await self._stop()
        except RequestError as err:
            await self._report(err)
        except (ConnectionError, TimeoutError):
            raise  # the client has gone (`run`)
        except (AttributeError, KeyError, TypeError, ValueError) as err:  # malformed: missing or mistyped fields
            await self._report(RequestError("bad_event", f"malformed {event.type} event: {err!r}"))
        except Exception as err:  # a bug costs this request, never the connection's log a stray traceback
            _LOG.exception("wyoming request failed")
            await self._report(RequestError("internal", f"internal error: {err}"))
        return True

    async def disconnect(self) -> None:
        """The client went away: stop generating for it, and wait for its audio task to end."""
        if self.stream is not None:
            self.stream.cancel()
        if self.pump is not None:
            self.pump.cancel()
            await asyncio.gather(self.pump, return_exceptions=True)

    # ---- the two request flows -----------------------------------------------------------------
    async def _synthesize(self, request: Synthesize) -> None:
        _check_format(request.text_format)
        try:
            validate_text(request.text, self.limits.max_text_chars)  # as every front end checks a whole text
        except TextError as err:
            code = "text_too_long" if len(request.text) > self.limits.max_text_chars else "bad_text"
            raise RequestError(code, str(err)) from None
        stream = await self._open(request.voice)
        self.chars = len(request.text)
        try:
            stream.push_text(request.text)
            stream.end()
        except TextError as err:
            stream.cancel()
            raise RequestError("bad_text", str(err)) from None
        await self._send_audio(stream)

    async def _start(self, request: SynthesizeStart) -> None:
        if self.streaming:
            raise RequestError("bad_event", "synthesize-start while a stream is open; send synthesize-stop first")
        self.streaming, self.failed, self.chars, self.gate = True, False, 0, SpeakableGate()
        _check_format(request.text_format)
        self.stream = await self._open(request.voice)
        self.pump = asyncio.create_task(self._send_audio(self.stream, self.gate))

    def _chunk(self, text: str) -> None:
        if not self.streaming:
            raise RequestError("bad_event", "synthesize-chunk without synthesize-start")
        if not isinstance(text, str):
            raise RequestError("bad_event", f"synthesize-chunk text must be a string, not {type(text).__name__}")
        if self.stream is None or self.failed:
            return  # the stream already failed and said so; its synthesize-stop still gets an answer
        if self.chars + len(text) > self.limits.max_text_chars:  # the stream fails, as on a bad chunk
            self.stream.cancel()
            raise RequestError(
                "text_too_long",
                f"this chunk would make the text {self.chars + len(text)} "
                f"characters; the limit is {self.limits.max_text_chars}",
            )
        try:
            self.stream.push_text(text)  # a control character: TextError, as on every front end
        except TextError as err:
            self.stream.cancel()
            raise RequestError("bad_text", str(err)) from None
        self.chars += len(text)
        self.gate.add(text)

    async def _stop(self) -> None:
        if not self.streaming:
            raise RequestError("bad_event", "synthesize-stop without synthesize-start")
        try:
            if self.stream is not None and not self.failed:
                self.stream.end()
            if self.gate is not None:
                self.gate.end()
            if self.pump is not None:
                await self.pump
        finally:
            self.streaming, self.stream, self.pump = False, None, None
            await self.write_event(SynthesizeStopped().event())

    # ---- helpers -------------------------------------------------------------------------------
    async def _report(self, err: RequestError) -> None:
        self.failed = self.streaming
        _LOG.info("wyoming request refused: %s: %s", err.code, err)
        await self.write_event(Error(text=str(err), code=err.code).event())

    async def _open(self, voice):
        """An engine stream for the requested voice (by name, or the default voice for an English language).
        While every slot is busy it waits up to OPEN_WAIT_S for one before answering server_full."""
        name = voice.name if voice is not None else None
        language = voice.language if voice is not None else None
        if name is None and language is not None and not language.lower().replace("-", "_").startswith("en"):
            raise RequestError("unsupported_language", f"language {language!r} is not spoken; only {LANGUAGE}")
        loop, deadline = asyncio.get_running_loop(), time.monotonic() + OPEN_WAIT_S
        while True:
            try:
                return await loop.run_in_executor(self.pool, self.engine.open, name)
            except UnknownVoice as err:
                raise RequestError("unknown_voice", str(err)) from None
            except ServerFull as err:
                if time.monotonic() > deadline:
                    raise RequestError("server_full", str(err)) from None
            await asyncio.sleep(0.02)

    async def _send_audio(self, stream, gate: SpeakableGate | None = None) -> None:
        """Engine -> client: audio-start with the first chunk, every chunk as s16le, audio-stop at the end.
        A stream that fails reports an ``error`` (and ends its audio if it had started). Streamed text (``gate``):
        no audio before the text has something speakable; text that ends with none is bad_text, no text at all
        just stops, quietly."""
        encoder, started, samples = AudioEncoder("pcm_s16le"), False, 0
        audio_format = dict(rate=self.engine.sample_rate, width=SAMPLE_WIDTH, channels=CHANNELS)
        try:
            if gate is not None and not await gate.wait():
                if gate.text_seen:
                    raise TextError("the streamed text has nothing speakable in it")
                return
            while (chunk := await stream.next_chunk()) is not None:
                samples += len(chunk)
                if samples > (cap := self.limits.audio_cap_s(self.chars)) * self.engine.sample_rate:
                    raise RequestError(
                        "audio_too_long",
                        f"the audio would pass {cap:g} s, the most {self.chars} characters of text may become",
                    )
                if not started:
                    await self.write_event(AudioStart(**audio_format).event())
                    started = True
                await self.write_event(AudioChunk(audio=encoder.encode(chunk), **audio_format).event())
                self.last_active = time.monotonic()
        except TextError as err:  # the utterance ended with nothing speakable in it
            if not (self.streaming and stream.first_text_at is None):  # an empty stream just stops, quietly
                await self._report(RequestError("bad_text", str(err)))
        except RequestError as err:
            await self._report(err)
        except EngineError as err:
            await self._report(RequestError("engine_error", f"speech generation failed: {err}"))
        except (ConnectionError, TimeoutError):  # the client went away (or stopped reading): nobody to tell
            return
        finally:
            if not stream.finished:
                stream.cancel()
        if started:
            await self.write_event(AudioStop().event())


def _check_format(text_format) -> None:
    value = getattr(text_format, "value", text_format)
    if value not in (None, "text"):
        raise RequestError("unsupported_text_format", f"text_format {value!r} is not supported; send plain text")


class WyomingServer:
    """The Wyoming server on its own event loop in a background thread, so that it can share the process's
    engine with the HTTP/WebSocket server (``tts serve --wyoming-uri``), or run alone (``tts wyoming``).

    >>> with WyomingServer(engine, "tcp://127.0.0.1:10200") as server:   # doctest: +SKIP
    ...     server.uri
    'tcp://127.0.0.1:10200'
    """

    def __init__(self, engine, uri: str, zeroconf_name: str | None = None, limits: Limits | None = None):
        if urlparse(uri).scheme not in ("tcp", "unix"):
            raise ValueError(f"serve Wyoming on tcp://HOST:PORT or unix://PATH, not {uri!r}")
        self.engine, self.uri, self.limits = engine, uri, limits or Limits()
        self.admission = Admission(self.limits)  # its own counts, on its own event loop
        self.info = describe(engine)
        self.pool = ThreadPoolExecutor(2 * engine.max_streams + 2, thread_name_prefix="tts-wyoming")
        self._server = AsyncServer.from_uri(uri)
        self.announcement = None if zeroconf_name is None else _Announcement(uri, zeroconf_name)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="tts-wyoming", daemon=True)

    def start(self) -> WyomingServer:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(timeout=30)
        _LOG.info("Wyoming server listening on %s", self.uri)
        return self

    async def _start(self) -> None:
        await self._server.start(
            partial(WyomingHandler, self.engine, self.info, self.pool, self.limits, self.admission)
        )
        if self.announcement is not None:
            await self.announcement.start()

    async def _stop(self) -> None:
        if self.announcement is not None:
            await self.announcement.stop()
        await self._server.stop()

    def stop(self) -> None:
        if self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(self._stop(), self._loop).result(timeout=10)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
        self.pool.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> WyomingServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class _Announcement:
    """A tcp:// server announced over mDNS as a ``_wyoming._tcp`` service, which Home Assistant discovers.
    (The wyoming package's own helper cannot withdraw its announcement, so this uses zeroconf directly.)"""

    def __init__(self, uri: str, name: str):
        parsed = urlparse(uri)
        if parsed.scheme != "tcp":
            raise ValueError(f"zeroconf needs a tcp:// URI, not {uri!r}")
        host = parsed.hostname if parsed.hostname not in ("0.0.0.0", "::", "") else _lan_address()
        self.info = AsyncServiceInfo(
            SERVICE_TYPE,
            f"{name or 'tts-' + socket.gethostname()}.{SERVICE_TYPE}",
            addresses=[socket.inet_aton(host)],
            port=parsed.port,
        )
        self._zeroconf: AsyncZeroconf | None = None

    async def start(self) -> None:
        self._zeroconf = AsyncZeroconf()  # on the server's event loop
        await self._zeroconf.async_register_service(self.info)

    async def stop(self) -> None:
        await self._zeroconf.async_unregister_service(self.info)
        await self._zeroconf.async_close()


def _lan_address() -> str:
    """The address this machine would send multicast from (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect(("224.0.0.251", 5353))
        return probe.getsockname()[0]
