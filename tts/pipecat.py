"""Pipecat TTS services (``pip install "tts[pipecat]"``): an LLM's text frames in, audio frames and word timestamps
out, as they come.

    from tts.pipecat import TTSServerService
    tts = TTSServerService(url="ws://127.0.0.1:8000", voice="joe")       # a running `tts serve`
    pipeline = Pipeline([transport.input(), stt, user_aggregator, llm, tts, transport.output(), ...])

    from tts.api import get_engine
    from tts.pipecat import TTSLocalService
    tts = TTSLocalService(engine=get_engine(), voice="joe")              # the engine in this process

Each reply (Pipecat's turn context) is one utterance of ours: its text is pushed as the LLM writes it (Pipecat's
token aggregation by default: the engine reads sentences itself and starts speaking once the text's pace allows),
its audio is pushed as TTSAudioRawFrames as it is decoded, and its word timings (``timing`` events) become word
timestamps, from which Pipecat makes the TTSTextFrames the assistant's context is built from, as for its other
word-timestamp services. The reply's end (LLMFullResponseEndFrame) ends the utterance. An interruption cancels the
utterance at once: the server (or engine) stops generating and frees its slot, and audio still in flight is
dropped. `TTSServerService` shares WebSockets between services (`tts.contexts.ContextPool`: pass one ``pool`` to
every service of an agent host) so dozens of conversations use a few connections.
"""

from __future__ import annotations

import asyncio

try:
    from pipecat.frames.frames import ErrorFrame, StartFrame, TTSAudioRawFrame, TTSStoppedFrame
    from pipecat.services.settings import TTSSettings
    from pipecat.services.tts_service import TextAggregationMode, TTSService
except ImportError as err:  # the extra is not installed
    raise ImportError('tts.pipecat needs Pipecat: pip install "tts[pipecat]"') from err

from tts.client import ClientError
from tts.contexts import ContextPool, LocalContexts, SpeechContext


class _ContextsService(TTSService):
    """A Pipecat TTS service over `tts.contexts` (a pool of server contexts, or the engine in this process)."""

    def __init__(
        self,
        contexts,
        *,
        voice: str | None = None,
        speed: float = 1.0,
        lexicon: dict | None = None,
        seed: int | None = None,
        text_aggregation_mode: TextAggregationMode | None = None,
        **kwargs,
    ):
        kwargs.setdefault("settings", TTSSettings(model=None, voice=voice, language=None))
        super().__init__(
            text_aggregation_mode=text_aggregation_mode or TextAggregationMode.TOKEN,
            push_text_frames=False,
            push_start_frame=True,
            sample_rate=contexts.sample_rate,
            **kwargs,
        )
        self._contexts, self._voice, self._speed, self._lexicon, self._seed = contexts, voice, speed, lexicon, seed
        self._speaking: dict[str, SpeechContext] = {}
        self._readers: dict[str, asyncio.Task] = {}

    def can_generate_metrics(self) -> bool:
        return True

    async def run_tts(self, text: str, context_id: str):
        """Push ``text`` to the reply's utterance, opening it with the reply's first text."""
        context = self._speaking.get(context_id)
        try:
            if context is None:
                context = await self._contexts.open(
                    self._voice, self._speed, lexicon=self._lexicon, seed=self._seed, context_id=context_id
                )
                self._speaking[context_id] = context
                self._readers[context_id] = self.create_task(self._read(context))
            await context.push(text)
        except ClientError as err:  # ServerError too: refused (server_full, unknown_voice, bad_text, ...)
            self._speaking.pop(context_id, None)
            yield ErrorFrame(error=f"tts: {err}")
            yield TTSStoppedFrame(context_id=context_id)
            return
        await self.start_tts_usage_metrics(text)
        yield None

    async def flush_audio(self, context_id: str | None = None):
        """The reply's text has all come: the utterance ends (the rest is spoken, then ``done``)."""
        context = self._speaking.get(context_id or self.get_active_audio_context_id() or "")
        if context is not None:
            try:
                await context.end()
            except ClientError as err:
                await self.push_error(error_msg=f"tts: {err}", exception=err)

    async def _read(self, context: SpeechContext) -> None:
        """The utterance's audio and word timings into its audio context, in order, as they come."""
        cid, first = context.context_id, True
        try:
            async for event in context.events():
                if event["type"] == "audio" and event["pcm"]:
                    if first:
                        await self.stop_ttfb_metrics()
                        first = False
                    await self.append_to_audio_context(
                        cid,
                        TTSAudioRawFrame(
                            audio=event["pcm"], sample_rate=context.sample_rate, num_channels=1, context_id=cid
                        ),
                    )
                elif event["type"] == "words":
                    await self.add_word_timestamps([(w["word"], w["start"]) for w in event["words"]], cid)
        except ClientError as err:
            await self.push_error(error_msg=f"tts: {err}", exception=err)
        finally:
            if self._speaking.pop(cid, None) is not None:  # not interrupted: the reply is over
                self._readers.pop(cid, None)
                if self.audio_context_available(cid):
                    await self.append_to_audio_context(cid, TTSStoppedFrame(context_id=cid))
                    await self.remove_audio_context(cid)

    async def on_audio_context_interrupted(self, context_id: str):
        """Stop the utterance at once: cancelled where it is generated (its slot freed), its reader stopped."""
        await self._end_context(context_id)
        await super().on_audio_context_interrupted(context_id)

    async def _end_context(self, context_id: str) -> None:
        context, reader = self._speaking.pop(context_id, None), self._readers.pop(context_id, None)
        if context is not None:
            await context.cancel()
        if reader is not None:
            await self.cancel_task(reader)

    async def cancel(self, frame):
        for context_id in list(self._speaking):
            await self._end_context(context_id)
        await super().cancel(frame)


class TTSServerService(_ContextsService):
    """Speaks through a running ``tts serve`` (``url``: ws://HOST:PORT), over the WebSocket protocol. ``pool``: a
    `tts.contexts.ContextPool` shared with other services (default: one of its own, made from ``url``, ``api_key``
    and ``contexts_per_connection``, the server's ``--max-contexts``). ``voice``, ``speed``, ``lexicon``
    (``{"word": "/IPA/" or "respelling"}``) and ``seed`` as for the server's ``start``; other keywords go to
    Pipecat's TTSService (``text_aggregation_mode``, ...)."""

    def __init__(
        self,
        *,
        url: str | None = None,
        pool: ContextPool | None = None,
        api_key: str | None = None,
        contexts_per_connection: int = 4,
        sample_rate: int = 24_000,
        **kwargs,
    ):
        pool, self._own_pool = ContextPool.given(
            pool,
            url,
            "TTSServerService",
            api_key=api_key,
            contexts_per_connection=contexts_per_connection,
            sample_rate=sample_rate,
        )
        super().__init__(pool, **kwargs)

    async def start(self, frame: StartFrame):
        await super().start(frame)
        await self._call_event_handler("on_connected")

    async def cleanup(self):
        await super().cleanup()
        if self._own_pool:
            await self._contexts.aclose()


class TTSLocalService(_ContextsService):
    """Speaks with an engine of this process (``engine``: ``tts.api.get_engine()``), on `tts.api`'s streams; the
    keywords as for `TTSServerService`."""

    def __init__(self, *, engine, wait_s: float = 30.0, **kwargs):
        super().__init__(LocalContexts(engine, wait_s), **kwargs)


__all__ = ["TTSServerService", "TTSLocalService"]
