"""The Pipecat services (`tts.pipecat`) in real Pipecat pipelines (pipecat-ai's own test runner), against the real
server on a real loopback socket (the tiny engine), and in process: a fake LLM's text stream is spoken, an
interruption mid-sentence stops the audio within one chunk and frees the engine slot, word timestamps arrive in
order and name the words written."""

from __future__ import annotations

import asyncio

import pytest

from testkit import wait_until

pytest.importorskip("pipecat", reason='needs pip install "tts[pipecat]"')

from pipecat.frames.frames import (
    InterruptionFrame,
    LLMFullResponseEndFrame,
    LLMFullResponseStartFrame,  # noqa: E402
    LLMTextFrame,
    TTSAudioRawFrame,
    TTSStartedFrame,
    TTSStoppedFrame,
    TTSTextFrame,
)
from pipecat.tests.utils import SleepFrame, run_test  # noqa: E402

from tts.pipecat import TTSLocalService, TTSServerService  # noqa: E402

REPLY = "The birch canoe slid on the smooth planks. Glue the sheet to the dark blue background."
LONG = " ".join(["It is easy to tell the depth of a well."] * 8)


def llm(text: str, gap_s: float = 0.0) -> list:
    """A fake LLM's reply: its tokens (words with their spaces) between the response's start and end frames."""
    tokens = [word + " " for word in text.split()]
    frames = [LLMFullResponseStartFrame()]
    for token in tokens:
        frames += [LLMTextFrame(token)] + ([SleepFrame(gap_s)] if gap_s else [])
    return frames + [LLMFullResponseEndFrame()]


def spoken(frames) -> tuple[int, list[str], list[int]]:
    audio = sum(len(f.audio) for f in frames if isinstance(f, TTSAudioRawFrame))
    words = [f for f in frames if isinstance(f, TTSTextFrame)]
    return audio, [f.text for f in words], [f.pts for f in words]


@pytest.fixture(params=["server", "local"])
def service(request, tiny_engine, server):
    if request.param == "server":
        return lambda: TTSServerService(url=server.ws_url, voice="joe", seed=5)
    return lambda: TTSLocalService(engine=tiny_engine, voice="joe", seed=5)


def test_a_fake_llm_stream_is_spoken_with_words_in_order(service):
    down, _ = asyncio.run(run_test(service(), frames_to_send=llm(REPLY) + [SleepFrame(3.0)]))
    audio, words, pts = spoken(down)
    assert audio > 24_000 * 2 * 2  # 16-bit mono: over two seconds of speech
    assert words == REPLY.split()
    assert all(p is not None for p in pts) and pts == sorted(pts)
    kinds = [type(f) for f in down if isinstance(f, (TTSStartedFrame, TTSAudioRawFrame, TTSStoppedFrame))]
    assert kinds[0] is TTSStartedFrame and kinds[-1] is TTSStoppedFrame and kinds.count(TTSStoppedFrame) == 1


def test_an_interruption_stops_audio_within_a_chunk_and_frees_the_slot(tiny_engine, server):
    service = TTSServerService(url=server.ws_url, voice="joe", seed=5)
    frames = llm(LONG)[:-1] + [SleepFrame(1.0), InterruptionFrame(), SleepFrame(1.5)]
    down, _ = asyncio.run(run_test(service, frames_to_send=frames))
    at = next(i for i, f in enumerate(down) if isinstance(f, InterruptionFrame))
    before = [f for f in down[:at] if isinstance(f, TTSAudioRawFrame)]
    after = [f for f in down[at:] if isinstance(f, TTSAudioRawFrame)]
    assert before, "nothing was spoken before the interruption"
    assert len(after) <= 1 and sum(len(f.audio) for f in after) <= max(len(f.audio) for f in before)
    assert wait_until(lambda: not server.hub.streams, 2)  # the server's stream was cancelled
    assert wait_until(lambda: tiny_engine.stats()["active_streams"] == 0, 2)  # and its engine slot is free


def test_the_local_service_stops_on_interruption_too(tiny_engine):
    service = TTSLocalService(engine=tiny_engine, voice="joe", seed=5)
    frames = llm(LONG)[:-1] + [SleepFrame(1.0), InterruptionFrame(), SleepFrame(1.0)]
    down, _ = asyncio.run(run_test(service, frames_to_send=frames))
    at = next(i for i, f in enumerate(down) if isinstance(f, InterruptionFrame))
    assert any(isinstance(f, TTSAudioRawFrame) for f in down[:at])
    assert sum(isinstance(f, TTSAudioRawFrame) for f in down[at:]) <= 1
    assert wait_until(lambda: tiny_engine.stats()["active_streams"] == 0, 2)
