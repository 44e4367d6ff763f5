"""A LiveKit Agents TTS (``pip install "tts[livekit]"``) on a running ``tts serve``.

    from livekit.agents import AgentSession
    from tts.livekit import TTS
    session = AgentSession(stt=..., llm=..., tts=TTS(url="ws://127.0.0.1:8000", voice="joe"))

`TTS.stream()` takes the LLM's text as it is pushed (one segment per stream, as the framework asks) and yields
audio as it is decoded, with the words' timings as timed transcripts (``aligned_transcript``); `TTS.synthesize()`
speaks a whole text. Every stream of one `TTS` (and of every `TTS` given the same ``pool``) is a context on
shared WebSockets (`tts.contexts.ContextPool`): an agent host's sessions reuse a few connections. The server's
errors become the framework's: a refused or failed utterance `APIStatusError` (its HTTP status; ``server_full``
and ``client_limit`` retryable, bad input not), a lost connection `APIConnectionError`, no audio in time
`APITimeoutError`.
"""

from __future__ import annotations

import asyncio

try:
    from livekit.agents import (
        DEFAULT_API_CONNECT_OPTIONS,
        APIConnectionError,
        APIConnectOptions,
        APIStatusError,
        APITimeoutError,
        tts,
    )
    from livekit.agents.types import TimedString
except ImportError as err:  # the extra is not installed
    raise ImportError('tts.livekit needs LiveKit Agents: pip install "tts[livekit]"') from err

from tts.client import RETRY_CODES, ClientError, ServerError
from tts.contexts import ContextPool, SpeechContext

# HTTP statuses of the server's error codes that are not a client's bad input (400), as docs/protocol.md lists them
_STATUS = {"client_limit": 429, "server_full": 503, "engine_error": 500, "internal": 500, "idle_timeout": 408}


class TTS(tts.TTS):
    """``url``: the server (ws://HOST:PORT); ``pool``: a `ContextPool` shared with other TTS instances (default: one
    of its own, from ``url``, ``api_key`` and ``contexts_per_connection``, the server's ``--max-contexts``).
    ``voice``, ``speed``, ``lexicon`` (``{"word": "/IPA/" or "respelling"}``) and ``seed`` as for the server's
    ``start``."""

    def __init__(
        self,
        *,
        url: str | None = None,
        pool: ContextPool | None = None,
        voice: str | None = None,
        speed: float = 1.0,
        lexicon: dict | None = None,
        seed: int | None = None,
        api_key: str | None = None,
        contexts_per_connection: int = 4,
        sample_rate: int = 24_000,
    ):
        pool, self._own_pool = ContextPool.given(
            pool,
            url,
            "tts.livekit.TTS",
            api_key=api_key,
            contexts_per_connection=contexts_per_connection,
            sample_rate=sample_rate,
        )
        self.pool = pool
        super().__init__(
            capabilities=tts.TTSCapabilities(streaming=True, aligned_transcript=True),
            sample_rate=self.pool.sample_rate,
            num_channels=1,
        )
        self.voice, self.speed, self.lexicon, self.seed = voice, speed, lexicon, seed

    @property
    def model(self) -> str:
        return "tts"

    @property
    def provider(self) -> str:
        return "tts"

    def synthesize(self, text: str, *, conn_options: APIConnectOptions = DEFAULT_API_CONNECT_OPTIONS) -> ChunkedStream:
        return ChunkedStream(tts=self, input_text=text, conn_options=conn_options)

    def stream(self, *, conn_options: APIConnectOptions = DEFAULT_API_CONNECT_OPTIONS) -> SynthesizeStream:
        return SynthesizeStream(tts=self, conn_options=conn_options)

    async def open(self) -> SpeechContext:
        """A started context on the pool, the server's refusal as the framework's error."""
        try:
            return await self.pool.open(self.voice, self.speed, lexicon=self.lexicon, seed=self.seed)
        except ClientError as err:
            raise framework_error(err) from None

    async def aclose(self) -> None:
        if self._own_pool:
            await self.pool.aclose()


class ChunkedStream(tts.ChunkedStream):
    """A whole text, spoken as one utterance."""

    async def _run(self, output_emitter: tts.AudioEmitter) -> None:
        context = await self._tts.open()  # type: ignore[attr-defined]
        output_emitter.initialize(
            request_id=context.context_id, sample_rate=context.sample_rate, num_channels=1, mime_type="audio/pcm"
        )
        await speak(context, output_emitter, self._conn_options.timeout, self._input_text)


class SynthesizeStream(tts.SynthesizeStream):
    """Pushed text, spoken as it comes: one segment (the framework's flush ends it), one utterance."""

    async def _run(self, output_emitter: tts.AudioEmitter) -> None:
        context = await self._tts.open()  # type: ignore[attr-defined]
        output_emitter.initialize(
            request_id=context.context_id,
            sample_rate=context.sample_rate,
            num_channels=1,
            mime_type="audio/pcm",
            stream=True,
        )
        output_emitter.start_segment(segment_id=context.context_id)
        await speak(context, output_emitter, self._conn_options.timeout, self._pushed(context), timed=True)
        output_emitter.end_segment()

    async def _pushed(self, context: SpeechContext) -> None:
        """The framework's pushed text to the utterance; its first flush (or the input's end) ends it."""
        async for data in self._input_ch:
            if isinstance(data, self._FlushSentinel):
                break
            self._mark_started()
            await context.push(data)


async def speak(context: SpeechContext, output_emitter, timeout_s: float, text, timed: bool = False) -> None:
    """Send ``text`` (a string, or a coroutine that pushes it) and end the utterance, while its audio (and, if
    ``timed``, its words' timings) go to the emitter. Cancelled (the session interrupted it): the utterance is
    cancelled where it is generated, freeing its slot."""

    async def send() -> None:
        if isinstance(text, str):
            await context.push(text)
        else:
            await text
        await context.end()

    sender = asyncio.create_task(send())
    try:
        events = context.events()
        while True:
            try:
                event = await asyncio.wait_for(anext(events), timeout_s)
            except StopAsyncIteration:
                break
            except TimeoutError:
                raise APITimeoutError(f"no audio from the tts server for {timeout_s} s") from None
            if event["type"] == "audio":
                output_emitter.push(event["pcm"])
            elif event["type"] == "words" and timed:
                output_emitter.push_timed_transcript(
                    [TimedString(f"{w['word']} ", start_time=w["start"], end_time=w["end"]) for w in event["words"]]
                )
        await sender
    except ClientError as err:
        raise framework_error(err) from None
    finally:
        sender.cancel()
        if not context.finished:  # left early (interrupted, timed out): stop generating at once
            await context.cancel()


def framework_error(err: ClientError) -> Exception:
    """The server's (or the connection's) failure as LiveKit's error type."""
    if isinstance(err, ServerError):
        return APIStatusError(
            f"tts server: {err.code}: {err.message}",
            status_code=_STATUS.get(err.code, 400),
            body={"code": err.code},
            retryable=err.code in RETRY_CODES,
        )
    return APIConnectionError(f"tts server: {err}")


__all__ = ["TTS", "ChunkedStream", "SynthesizeStream"]
