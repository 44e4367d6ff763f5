"""The LiveKit Agents TTS (`tts.livekit.TTS`) with livekit-agents itself, without a LiveKit server, against the
real server on a real loopback socket (the tiny engine): streamed and whole-text synthesis with aligned
transcripts, truthful capabilities, streams as contexts on one shared WebSocket, an early close freeing the
engine slot, and the server's errors as the framework's error types."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("livekit.agents", reason='needs pip install "tts[livekit]"')

from livekit.agents import APIConnectionError, APIConnectOptions, APIStatusError  # noqa: E402
from livekit.agents.types import USERDATA_TIMED_TRANSCRIPT  # noqa: E402

from testkit import wait_until  # noqa: E402
from tts.livekit import TTS  # noqa: E402

REPLY = "The birch canoe slid on the smooth planks. Glue the sheet to the dark blue background."
NO_RETRY = APIConnectOptions(max_retry=0, timeout=30)


async def _streamed(tts: TTS, text: str) -> tuple[int, list]:
    stream = tts.stream(conn_options=NO_RETRY)
    for word in text.split():
        stream.push_text(word + " ")
    stream.end_input()
    samples, words = 0, []
    async for event in stream:
        assert event.frame.sample_rate == 24_000 and event.frame.num_channels == 1
        samples += event.frame.samples_per_channel
        words += event.frame.userdata.get(USERDATA_TIMED_TRANSCRIPT, [])
    await stream.aclose()
    return samples, words


def test_stream_speaks_pushed_text_with_aligned_words(server):
    async def go():
        tts = TTS(url=server.ws_url, voice="joe", seed=5)
        assert tts.capabilities.streaming and tts.capabilities.aligned_transcript
        samples, words = await _streamed(tts, REPLY)
        await tts.aclose()
        return samples, words

    samples, words = asyncio.run(go())
    assert samples > 2 * 24_000
    assert [w.strip() for w in words] == REPLY.split()
    starts = [w.start_time for w in words]
    assert starts == sorted(starts) and all(w.end_time >= w.start_time for w in words)


def test_synthesize_speaks_a_whole_text(server):
    async def go():
        tts = TTS(url=server.ws_url, voice="slt", seed=5)
        frame = await tts.synthesize("Hello there, how are you?", conn_options=NO_RETRY).collect()
        await tts.aclose()
        return frame

    frame = asyncio.run(go())
    assert frame.samples_per_channel > 24_000 // 2 and frame.sample_rate == 24_000


def test_streams_share_one_websocket_and_an_early_close_frees_the_slot(server, tiny_engine):
    async def go():
        tts = TTS(url=server.ws_url, voice="joe", seed=5, contexts_per_connection=4)
        results = await asyncio.gather(*(_streamed(tts, REPLY) for _ in range(3)))
        connections = tts.pool.connections
        stream = tts.stream(conn_options=NO_RETRY)
        stream.push_text(" ".join(["It is easy to tell the depth of a well."] * 8))
        async for _ in stream:  # the first audio, then the session leaves (an interruption)
            break
        await stream.aclose()
        await tts.aclose()
        return results, connections

    results, connections = asyncio.run(go())
    assert all(samples > 2 * 24_000 for samples, _ in results)
    assert connections == 1
    assert wait_until(lambda: not server.hub.streams, 2)
    assert wait_until(lambda: tiny_engine.stats()["active_streams"] == 0, 2)


@pytest.mark.parametrize("options, status", [({"voice": "nobody"}, 400), ({"lexicon": {"x": "/h@llo/"}}, 400)])
def test_refusals_are_api_status_errors(server, options, status):
    async def go():
        tts = TTS(url=server.ws_url, **options)
        try:
            await tts.synthesize("Hello.", conn_options=NO_RETRY).collect()
        finally:
            await tts.aclose()

    with pytest.raises(APIStatusError) as refused:
        asyncio.run(go())
    assert refused.value.status_code == status and not refused.value.retryable


def test_bad_text_is_an_api_status_error_and_no_server_a_connection_error(server):
    async def go(url, text):
        tts = TTS(url=url)
        try:
            await tts.synthesize(text, conn_options=NO_RETRY).collect()
        finally:
            await tts.aclose()

    with pytest.raises(APIStatusError, match="bad_text"):
        asyncio.run(go(server.ws_url, '<say-as interpret-as="cardinal">abc</say-as>'))
    with pytest.raises(APIConnectionError):
        asyncio.run(go("ws://127.0.0.1:9", "Hello."))
