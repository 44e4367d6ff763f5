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
"""

from __future__ import annotations

import asyncio
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

from streaming.errors import EngineError, ServerFull, UnknownVoice
from tts.containers import AudioEncoder
from tts.text import TextError
from tts.voices import attribution

LANGUAGE = "en_US"
OPEN_WAIT_S = 5.0  # how long a request waits for a free engine slot before `server_full`
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

    def __init__(self, engine, info: Info, pool: ThreadPoolExecutor, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.engine, self.info, self.pool = engine, info, pool
        self.stream = self.pump = None
        self.streaming = False
        self.failed = False  # the open stream has already reported an error

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
        except (KeyError, TypeError, ValueError) as err:  # a malformed event: missing or mistyped fields
            await self._report(RequestError("bad_event", f"malformed {event.type} event: {err!r}"))
        return True

    async def disconnect(self) -> None:
        """The client went away: stop generating for it."""
        if self.stream is not None:
            self.stream.cancel()
        if self.pump is not None:
            self.pump.cancel()

    # ---- the two request flows -----------------------------------------------------------------
    async def _synthesize(self, request: Synthesize) -> None:
        _check_format(request.text_format)
        stream = await self._open(request.voice)
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
        self.streaming, self.failed = True, False
        _check_format(request.text_format)
        self.stream = await self._open(request.voice)
        self.pump = asyncio.create_task(self._send_audio(self.stream))

    def _chunk(self, text: str) -> None:
        if not self.streaming:
            raise RequestError("bad_event", "synthesize-chunk without synthesize-start")
        if self.stream is None or self.failed:
            return  # the stream already failed and said so; its synthesize-stop still gets an answer
        try:
            self.stream.push_text(text)
        except TextError as err:
            self.stream.cancel()
            raise RequestError("bad_text", str(err)) from None

    async def _stop(self) -> None:
        if not self.streaming:
            raise RequestError("bad_event", "synthesize-stop without synthesize-start")
        try:
            if self.stream is not None and not self.failed:
                self.stream.end()
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

    async def _send_audio(self, stream) -> None:
        """Engine -> client: audio-start with the first chunk, every chunk as s16le, audio-stop at the end.
        A stream that fails reports an ``error`` (and ends its audio if it had started)."""
        encoder, started = AudioEncoder("pcm_s16le"), False
        audio_format = dict(rate=self.engine.sample_rate, width=SAMPLE_WIDTH, channels=CHANNELS)
        try:
            while True:
                chunk = await stream.next_chunk()
                if chunk is None:
                    break
                if not started:
                    await self.write_event(AudioStart(**audio_format).event())
                    started = True
                await self.write_event(AudioChunk(audio=encoder.encode(chunk), **audio_format).event())
        except TextError as err:  # the utterance ended with nothing speakable in it
            if not (self.streaming and stream.first_text_at is None):  # an empty stream just stops, quietly
                await self._report(RequestError("bad_text", str(err)))
        except EngineError as err:
            await self._report(RequestError("engine_error", f"speech generation failed: {err}"))
        except ConnectionError:  # the client went away mid-utterance: nobody to tell
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

    def __init__(self, engine, uri: str, zeroconf_name: str | None = None):
        if urlparse(uri).scheme not in ("tcp", "unix"):
            raise ValueError(f"serve Wyoming on tcp://HOST:PORT or unix://PATH, not {uri!r}")
        self.engine, self.uri = engine, uri
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
        await self._server.start(partial(WyomingHandler, self.engine, self.info, self.pool))
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
