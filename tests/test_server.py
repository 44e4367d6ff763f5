"""The real server on a loopback port, driven by a real `websockets` client and by the official `openai` SDK.

Protocol behaviour runs on the tiny random-weight engine (fast, noise for sound, real lengths and rates);
one end-to-end test speaks a sentence with the shipped voice and checks it with the ASR judge.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import json
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import av
import httpx2 as httpx  # the openai SDK's own HTTP client
import numpy as np
import openai
import pytest
import soundfile as sf
import websockets

from testkit import wait_until
from tts.client import ClientError, ServerError, connect, say_via_server, synthesize_via_server

SR = 24_000
SENTENCE = "The quick brown fox jumps over the lazy dog. "


@pytest.fixture(scope="module")
def one_slot_engine():
    """A tiny engine with one slot: the second utterance has to wait."""
    from testkit import tiny_random

    return tiny_random(max_streams=1)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, timeout=120))


async def send(ws, **message):
    await ws.send(json.dumps(message))


async def event(ws, timeout=30) -> dict:
    """The next JSON event, skipping binary frames."""
    async with asyncio.timeout(timeout):
        while isinstance(message := await ws.recv(), bytes):
            pass
    return json.loads(message)


async def alive(ws) -> dict:
    """Open an utterance and cancel it: proof that the connection still serves (the done event)."""
    await send(ws, type="start")
    assert json.loads(await asyncio.wait_for(ws.recv(), 10))["type"] == "ready"
    await send(ws, type="cancel")
    return await event(ws)


async def utterance(ws, text, **start):
    """Speak one utterance on an open connection: (ready, [binary frames], done)."""
    await send(ws, type="start", **start)
    ready = json.loads(await ws.recv())
    assert ready["type"] == "ready", ready
    await send(ws, type="text", text=text)
    await send(ws, type="end")
    frames = []
    async with asyncio.timeout(60):
        while isinstance(message := await ws.recv(), bytes):
            frames.append(message)
    done = json.loads(message)
    assert done["type"] == "done", done
    return ready, frames, done


async def open_long_utterance(ws, sentences=16) -> None:
    """Start an f32le utterance of many sentences and end its text."""
    await send(ws, type="start", format="f32le")
    assert json.loads(await ws.recv())["type"] == "ready"
    await send(ws, type="text", text=SENTENCE * sentences)
    await send(ws, type="end")


def decode(data: bytes) -> tuple[np.ndarray, int]:
    """Any container the server writes -> (float32 samples, sample rate), decoded by FFmpeg."""
    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.audio[0]
        audio = np.concatenate([f.to_ndarray().reshape(-1) for f in container.decode(stream)])
        return audio, stream.rate


# ---- the WebSocket protocol ------------------------------------------------------------------------
def test_pcm_stream_has_the_announced_format_and_length(server):
    async def go():
        async with websockets.connect(server.ws_url) as ws:
            return await utterance(ws, SENTENCE * 2, format="pcm_s16le")

    ready, frames, done = run(go())
    token, window = ready.pop("resume_token"), ready.pop("resume_window_s")  # for a resume (test_resume.py)
    assert len(token) >= 22 and window == 30  # 128 random bits, url-safe; the default window
    assert ready == {"type": "ready", "sample_rate": SR, "format": "pcm_s16le", "voice": "joe", "speed": 1.0}
    assert len(frames) >= 2, "audio arrives in several chunks, not at the end"
    data = b"".join(frames)
    samples = np.frombuffer(data, dtype="<i2")
    assert len(data) % 2 == 0 and len(samples) > SR  # two sentences: over a second of speech
    assert done["audio_seconds"] == pytest.approx(len(samples) / SR, abs=1e-3)
    assert done["cancelled"] is False and done["ttfa_ms"] > 0 and done["rtf"] > 0
    assert np.abs(samples).max() > 0


def test_audio_frames_are_not_compressed(server):
    """The client offers permessage-deflate (websockets does by default); the server declines it."""

    async def go():
        async with websockets.connect(server.ws_url) as ws:
            return [type(e).__name__ for e in ws.protocol.extensions]

    assert run(go()) == []


def test_f32le_and_wav_carry_the_same_audio_length(server):
    async def go():
        async with websockets.connect(server.ws_url) as ws:
            f32 = await utterance(ws, SENTENCE, format="f32le")
            wav = await utterance(ws, SENTENCE, format="wav")
            return f32, wav

    (_, f32_frames, f32_done), (_, wav_frames, wav_done) = run(go())
    f32 = np.frombuffer(b"".join(f32_frames), dtype="<f4")
    assert np.isfinite(f32).all() and f32_done["audio_seconds"] == pytest.approx(len(f32) / SR, abs=1e-3)
    audio, rate = sf.read(io.BytesIO(b"".join(wav_frames)), dtype="float32")
    assert rate == SR and audio.ndim == 1
    assert len(audio) == pytest.approx(wav_done["audio_seconds"] * SR, abs=1)
    assert abs(len(audio) - len(f32)) < 0.5 * len(f32)  # same text, sampled anew: similar length


@pytest.mark.parametrize("fmt, rate", [("mp3", SR), ("opus", 48_000), ("flac", SR), ("aac", SR)])
def test_encoded_formats_decode_to_the_announced_audio(server, fmt, rate):
    async def go():
        async with websockets.connect(server.ws_url) as ws:
            return await utterance(ws, SENTENCE, format=fmt)

    _, frames, done = run(go())
    audio, got_rate = decode(b"".join(frames))
    assert got_rate == rate
    assert len(audio) / rate == pytest.approx(done["audio_seconds"], abs=0.15)  # codec padding only


def test_several_utterances_on_one_connection_with_their_own_voice_and_speed(server):
    async def go():
        async with websockets.connect(server.ws_url) as ws:
            slow = await utterance(ws, "Hello there.", voice="slt", speed=0.5)
            fast = await utterance(ws, "Hello there.", voice="rms", speed=2.0)
            again = await utterance(ws, "Hello there.")
            return slow, fast, again

    slow, fast, again = run(go())
    assert [u[0]["voice"] for u in (slow, fast, again)] == ["slt", "rms", "joe"]
    assert slow[2]["audio_seconds"] > 2 * fast[2]["audio_seconds"] > 0  # speed changes the speaking rate
    assert all(u[2]["cancelled"] is False for u in (slow, fast, again))


def test_audio_starts_before_the_text_ends(server):
    """Pieces (as an LLM would send them) and a flush: speech starts before end is sent."""

    async def go():
        async with websockets.connect(server.ws_url) as ws:
            await send(ws, type="start")
            await ws.recv()
            for word in SENTENCE.split():
                await send(ws, type="text", text=word + " ")
            await send(ws, type="flush")
            first = await asyncio.wait_for(ws.recv(), 30)
            await send(ws, type="text", text="And a little more.")
            await send(ws, type="end")
            done = await event(ws)
            return first, done

    first, done = run(go())
    assert isinstance(first, bytes) and len(first) > 0
    assert done["type"] == "done" and not done["cancelled"]


BAD_MESSAGES = [
    ("{not json", "bad_json"),
    (json.dumps([1, 2]), "bad_message"),
    (json.dumps({"text": "no type"}), "bad_message"),
    (json.dumps({"type": "sing"}), "unknown_type"),
    (json.dumps({"type": "start", "volume": 11}), "unknown_key"),
    (json.dumps({"type": "start", "voice": "nobody"}), "unknown_voice"),
    (json.dumps({"type": "start", "format": "ogg"}), "unsupported_format"),
    (json.dumps({"type": "start", "speed": 9}), "bad_value"),
    (json.dumps({"type": "start", "speed": "fast"}), "bad_message"),
    (json.dumps({"type": "text", "text": "before start"}), "bad_state"),
    (json.dumps({"type": "end"}), "bad_state"),
    (json.dumps({"type": "flush"}), "bad_state"),
    (b"\x00\x01binary", "bad_message"),
]


@pytest.mark.parametrize("message, code", BAD_MESSAGES, ids=[c for _, c in BAD_MESSAGES])
def test_every_bad_message_gets_a_typed_error_and_the_connection_lives_on(server, message, code):
    async def go():
        async with websockets.connect(server.ws_url) as ws:
            await ws.send(message)
            error = json.loads(await asyncio.wait_for(ws.recv(), 10))
            return error, await alive(ws)

    error, done = run(go())
    assert error["type"] == "error" and error["code"] == code and error["message"]
    assert done["type"] == "done" and done["cancelled"] is True


def test_state_errors_inside_an_utterance(server):
    async def go():
        async with websockets.connect(server.ws_url) as ws:
            await send(ws, type="start")
            await ws.recv()
            await send(ws, type="start")
            twice = await event(ws)
            await send(ws, type="text", text="Hello there.")
            await send(ws, type="end")
            await send(ws, type="text", text="after the end")
            late = await event(ws)
            done = await event(ws)
            return twice, late, done

    twice, late, done = run(go())
    assert twice["code"] == "bad_state" and late["code"] == "bad_state"
    assert done["type"] == "done"


def test_an_utterance_with_nothing_speakable_ends_with_bad_text(server):
    async def go():
        async with websockets.connect(server.ws_url) as ws:
            await send(ws, type="start")
            await ws.recv()
            await send(ws, type="text", text="   ")
            await send(ws, type="end")
            return await event(ws), await event(ws), await alive(ws)

    error, done, later = run(go())
    assert error["code"] == "bad_text" and "speakable" in error["message"]
    assert done["type"] == "done" and done["audio_seconds"] == 0 and later["type"] == "done"


def test_a_reader_stalled_past_the_idle_timeout_is_dropped_and_its_slot_freed(make_server, tiny_engine):
    server = make_server(tiny_engine, idle_timeout_s=2.0, send_buffer_bytes=8192)

    async def go():
        async with websockets.connect(server.ws_url, max_queue=1) as ws:
            await open_long_utterance(ws)
            dropped = await asyncio.to_thread(wait_until, lambda: server.hub.admission.connections == 0, 30)
            ws.transport.abort()  # this client never reads: no closing handshake to wait for
            return dropped

    assert run(go()), "the stalled connection was not dropped"
    assert wait_until(lambda: tiny_engine.active_streams == 0)


def test_text_too_long_is_refused_and_the_utterance_goes_on(make_server, tiny_engine):
    server = make_server(tiny_engine, max_text_chars=40)

    async def go():
        async with websockets.connect(server.ws_url) as ws:
            await send(ws, type="start")
            await ws.recv()
            await send(ws, type="text", text="Short and fine. ")
            await send(ws, type="text", text="This piece would take the utterance past forty characters.")
            error = await event(ws)
            await send(ws, type="end")
            done = await event(ws)
            return error, done

    error, done = run(go())
    assert error["code"] == "text_too_long" and "40" in error["message"]
    assert done["type"] == "done" and done["audio_seconds"] > 0


def test_connection_limit_answers_server_full(make_server, tiny_engine):
    server = make_server(tiny_engine, max_connections=1)

    async def go():
        async with websockets.connect(server.ws_url) as first:
            async with websockets.connect(server.ws_url) as second:
                error = json.loads(await asyncio.wait_for(second.recv(), 10))
                with pytest.raises(websockets.ConnectionClosed) as closed:
                    await asyncio.wait_for(second.recv(), 10)
            spoken = await utterance(first, "The first client is unaffected.")
        return error, closed.value.rcvd.code, spoken

    error, code, (_, frames, _) = run(go())
    assert error["code"] == "server_full" and code == 1013
    assert frames


async def queue_behind(a, b) -> dict:
    """On a one-slot server: `a` opens an utterance, `b`'s start queues behind it. b's queued event."""
    await send(a, type="start")
    assert json.loads(await a.recv())["type"] == "ready"
    await send(b, type="start")
    return await event(b)


def test_a_start_on_a_busy_engine_waits_in_the_queue_then_speaks(make_server, one_slot_engine):
    server = make_server(one_slot_engine)

    async def go():
        async with websockets.connect(server.ws_url) as a, websockets.connect(server.ws_url) as b:
            queued = await queue_behind(a, b)
            await send(b, type="text", text="My turn now.")  # text sent while queued is kept
            await send(b, type="end")
            await asyncio.sleep(0.3)
            await send(a, type="cancel")
            await event(a)
            ready = await event(b)
            frames = []
            while isinstance(message := await asyncio.wait_for(b.recv(), 30), bytes):
                frames.append(message)
            return queued, ready, frames, json.loads(message)

    queued, ready, frames, done = run(go())
    assert queued == {"type": "queued", "position": 1}
    assert ready["type"] == "ready" and frames and done["type"] == "done" and not done["cancelled"]


def test_a_queued_start_past_its_deadline_gets_server_full_and_cancel_leaves_the_queue(make_server, one_slot_engine):
    server = make_server(one_slot_engine, queue_timeout_s=0.5)

    async def go():
        async with websockets.connect(server.ws_url) as a, websockets.connect(server.ws_url) as b:
            queued = await queue_behind(a, b)
            refused = await event(b, timeout=10)
            await send(b, type="start", context_id="again")
            await event(b)  # queued
            await send(b, type="cancel", context_id="again")
            cancelled = await event(b)
            await send(a, type="cancel")
            await event(a)
            return queued, refused, cancelled, await alive(b)

    queued, refused, cancelled, later = run(go())
    assert queued["type"] == "queued" and refused["code"] == "server_full"
    assert cancelled == {
        "type": "done",
        "cancelled": True,
        "audio_seconds": 0,
        "ttfa_ms": None,
        "rtf": None,
        "engine_ttfa_ms": None,
        "context_id": "again",
    }
    assert later["type"] == "done" and server.hub.admission.queued == 0


def test_idle_connection_is_closed_with_idle_timeout(make_server, tiny_engine):
    server = make_server(tiny_engine, idle_timeout_s=0.5)

    async def go():
        async with websockets.connect(server.ws_url) as ws:
            error = json.loads(await asyncio.wait_for(ws.recv(), 10))
            with pytest.raises(websockets.ConnectionClosed):
                await asyncio.wait_for(ws.recv(), 10)
            return error

    assert run(go())["code"] == "idle_timeout"
    assert server.hub.admission.connections == 0


def test_cancel_mid_stream_stops_at_once_and_the_connection_goes_on(server, tiny_engine):
    async def go():
        async with websockets.connect(server.ws_url) as ws:
            await open_long_utterance(ws, sentences=8)
            assert isinstance(await asyncio.wait_for(ws.recv(), 30), bytes)
            await send(ws, type="cancel")
            cancelled_at = time.perf_counter()
            done = await event(ws, timeout=5)
            latency = time.perf_counter() - cancelled_at
            _, frames, after = await utterance(ws, "And now something short.")
            return done, latency, frames, after

    done, latency, frames, after = run(go())
    assert done["type"] == "done" and done["cancelled"] is True
    assert done["audio_seconds"] < 8  # eight sentences were never all spoken
    assert latency < 2.0
    assert frames and after["cancelled"] is False
    assert wait_until(lambda: tiny_engine.active_streams == 0)


def test_cancel_with_nothing_to_cancel_is_ignored(server):
    async def go():
        async with websockets.connect(server.ws_url) as ws:
            await send(ws, type="cancel")
            return await alive(ws)

    assert run(go())["type"] == "done"


def test_a_client_that_vanishes_mid_stream_frees_its_slot(make_server, tiny_engine):
    """With resume off; with it on, the slot is freed when the resume window passes (test_resume.py)."""
    server = make_server(tiny_engine, resume_window_s=0)

    async def go():
        ws = await websockets.connect(server.ws_url)
        await open_long_utterance(ws, sentences=6)
        await asyncio.wait_for(ws.recv(), 30)
        ws.transport.abort()

    run(go())
    assert wait_until(lambda: tiny_engine.active_streams == 0 and server.hub.admission.connections == 0)


def test_slow_reader_pauses_generation_and_others_are_unaffected(make_server, tiny_engine):
    """A client that stops reading: the server's sending stalls, generation pauses well before the end of
    the utterance, another client is served meanwhile, and when reading resumes all the audio arrives."""
    server = make_server(tiny_engine, send_buffer_bytes=16384)

    async def plateau(session):
        """Bytes sent once neither sending nor generation has moved for 1.5 s (generation fills the engine's
        queue after sending stalls, later on a loaded machine)."""
        last, still_since = None, time.monotonic()
        async with asyncio.timeout(60):
            while time.monotonic() - still_since < 1.5:
                await asyncio.sleep(0.1)
                now = (session.sent_bytes, session.stream.stats["audio_seconds"])
                if now != last:
                    last, still_since = now, time.monotonic()
        return last[0]

    async def go():
        async with websockets.connect(server.ws_url, max_queue=1) as slow:
            await open_long_utterance(slow)
            session = next(iter(server.hub.sessions))
            sent = await plateau(session)
            generated = session.stream.stats["audio_seconds"]
            async with websockets.connect(server.ws_url) as other:
                _, frames, _ = await utterance(other, "Meanwhile, another client.")
            await asyncio.sleep(1.0)
            assert session.stream.stats["audio_seconds"] == generated, "generation did not pause"
            received = 0
            async with asyncio.timeout(90):
                while isinstance(message := await slow.recv(), bytes):
                    received += len(message)
            return sent, generated, frames, received, json.loads(message)

    sent, generated, other_frames, received, done = run(go())
    assert other_frames
    assert sent < received
    assert done["type"] == "done" and done["audio_seconds"] == pytest.approx(received / 4 / SR, abs=1e-3)
    assert done["audio_seconds"] > generated + 2.0, "generation did not pause well before the utterance's end"


def get(url: str) -> tuple[int, bytes]:
    with urllib.request.urlopen(url, timeout=10) as response:
        return response.status, response.read()


def test_health_and_voices(server):
    health = json.loads(get(server.url + "/health")[1])
    assert health["status"] == "ok" and health["sample_rate"] == SR
    listing = json.loads(get(server.url + "/v1/voices")[1])
    names = [v["name"] for v in listing["voices"]]
    assert listing["default"] in names and len(names) >= 4
    assert set(listing["voices"][0]) == {"name", "description", "teacher", "license", "sample_rate", "default"}


def test_demo_page_is_served(server):
    status, page = get(server.url + "/")
    assert status == 200 and b"app.js" in page
    assert get(server.url + "/player-worklet.js")[0] == 200


# ---- the OpenAI-compatible HTTP endpoint ---------------------------------------------------------
def sdk(server) -> openai.OpenAI:
    return openai.OpenAI(api_key="not-needed", base_url=server.url + "/v1", max_retries=0)


@pytest.fixture
def client(server):
    with sdk(server) as sdk_client:
        yield sdk_client


def fetch(client, **request) -> tuple[str, list[bytes], float, float]:
    """(content type, body parts, seconds to the first part, seconds to the end) of one streamed request."""
    started = time.perf_counter()
    parts, first = [], None
    with client.audio.speech.with_streaming_response.create(model="tts-1", **request) as response:
        for part in response.iter_bytes():
            first = first or time.perf_counter() - started
            parts.append(part)
        kind = response.headers["content-type"]
    return kind, parts, first, time.perf_counter() - started


@pytest.mark.parametrize(
    "fmt, kind, rate",
    [
        ("wav", "audio/wav", SR),
        ("mp3", "audio/mpeg", SR),
        ("flac", "audio/flac", SR),
        ("opus", "audio/ogg", 48_000),
        ("aac", "audio/aac", SR),
    ],
)
def test_openai_sdk_streams_each_format(client, fmt, kind, rate):
    got_kind, parts, _, _ = fetch(client, voice="slt", input=SENTENCE, response_format=fmt)
    audio, got_rate = decode(b"".join(parts))
    assert got_kind == kind and got_rate == rate
    assert 0.5 < len(audio) / rate < 30


def test_openai_sdk_pcm_streams_while_generating(client):
    kind, parts, first, total = fetch(client, voice="joe", input=SENTENCE * 6, response_format="pcm", speed=1.0)
    data = b"".join(parts)
    assert kind == "audio/pcm" and len(data) % 2 == 0 and len(data) / 2 / SR > 3
    assert len(parts) > 1 and first < 0.6 * total  # the body streamed; it did not come at the end


PARAMS = {
    "unknown_voice": "voice",
    "unsupported_format": "response_format",
    "bad_value": "speed",
    "bad_text": "input",
    "unknown_key": "volume",
    "text_too_long": "input",
}


@pytest.mark.parametrize(
    "request_, status, code",
    [
        ({"voice": "nobody", "input": "Hi."}, 400, "unknown_voice"),
        ({"voice": "", "input": "Hi."}, 400, "unknown_voice"),
        ({"voice": "joe", "input": "Hi.", "response_format": "ogg"}, 400, "unsupported_format"),
        ({"voice": "joe", "input": "Hi.", "speed": 9.0}, 400, "bad_value"),
        ({"voice": "joe", "input": "   "}, 400, "bad_text"),
        ({"voice": "joe", "input": "Hi.", "extra_body": {"volume": 11}}, 400, "unknown_key"),
        ({"voice": "joe", "input": "x" * 5000}, 400, "text_too_long"),
        ({"voice": "joe", "input": "Hi.", "extra_body": {"pad": "x" * 70000}}, 413, "body_too_large"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_openai_sdk_errors_are_typed(client, request_, status, code):
    with pytest.raises(openai.APIStatusError) as failure:
        client.audio.speech.create(model="tts-1", **request_)
    assert failure.value.status_code == status
    assert failure.value.body["code"] == code and failure.value.body["message"]
    assert failure.value.body["type"] == "invalid_request_error"
    assert failure.value.body["param"] == PARAMS.get(code), failure.value.body


def test_openai_sdk_server_full_is_503(make_server, tiny_engine):
    server = make_server(tiny_engine, max_connections=1)

    def request_speech():
        with sdk(server) as client, pytest.raises(openai.APIStatusError) as failure:
            client.audio.speech.create(model="tts-1", voice="joe", input="Hi.")
        return failure.value

    async def hold_and_request():
        async with websockets.connect(server.ws_url):
            await asyncio.sleep(0.2)
            return await asyncio.to_thread(request_speech)

    failure = run(hold_and_request())
    assert failure.status_code == 503 and failure.body["code"] == "server_full"
    assert failure.body["type"] == "server_error" and int(failure.response.headers["retry-after"]) >= 1


def test_openai_sdk_with_the_server_full_retries_after_retry_after(make_server, tiny_engine):
    """The SDK's own retry (max_retries=2) honours Retry-After: a request refused while the only connection is
    held succeeds once it is freed."""
    server = make_server(tiny_engine, max_connections=1)

    async def go():
        ws = await websockets.connect(server.ws_url)
        asyncio.get_running_loop().call_later(0.5, lambda: asyncio.ensure_future(ws.close()))
        with openai.OpenAI(api_key="x", base_url=server.url + "/v1", max_retries=2) as client:
            return await asyncio.to_thread(
                lambda: client.audio.speech.create(model="tts-1", input="Hi.", voice="joe", response_format="pcm")
            )

    assert len(run(go()).content) > 0


# ---- OpenAI drop-in: aliases, models, voices, SSE, every format ---------------------------------
def sse_events(lines) -> list[dict]:
    """The JSON of each `data:` line of a server-sent event stream."""
    return [json.loads(line[5:]) for line in lines if line.startswith("data:")]


def speak_openai(client, fmt: str, stream_format: str, **request) -> tuple[bytes, list[dict]]:
    """(audio bytes, SSE events) of one streamed request in the SDK."""
    request = {"model": "tts-1", "voice": "alloy", "input": SENTENCE, **request}
    with client.audio.speech.with_streaming_response.create(
        response_format=fmt, stream_format=stream_format, **request
    ) as response:
        if stream_format == "audio":
            return b"".join(response.iter_bytes()), []
        assert response.headers["content-type"].startswith("text/event-stream")
        events = sse_events(response.iter_lines())
    audio = b"".join(base64.b64decode(e["audio"]) for e in events if e["type"] == "speech.audio.delta")
    return audio, events


@pytest.mark.parametrize("stream_format", ["audio", "sse"])
@pytest.mark.parametrize(
    "fmt, rate", [("mp3", SR), ("opus", 48_000), ("aac", SR), ("flac", SR), ("wav", SR), ("pcm", SR)]
)
def test_openai_sdk_alias_voice_every_format_and_both_stream_formats(client, fmt, rate, stream_format):
    audio, events = speak_openai(client, fmt, stream_format)
    if fmt == "pcm":
        samples, got_rate = np.frombuffer(audio, dtype="<i2"), SR
    else:
        samples, got_rate = decode(audio)
    assert got_rate == rate and 0.5 < len(samples) / rate < 30
    if stream_format == "sse":
        assert [e["type"] for e in events[:-1]] == ["speech.audio.delta"] * (len(events) - 1)
        usage = events[-1]["usage"]
        assert events[-1]["type"] == "speech.audio.done" and usage["input_tokens"] == len(SENTENCE)
        assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"] > len(SENTENCE)


def test_alias_and_custom_voice_forms_speak_the_mapped_voice(server):
    with httpx.Client(base_url=server.url) as http:
        for voice in ("alloy", "ALLOY", {"id": "alloy"}, {"id": "slt"}):
            response = http.post("/v1/audio/speech", json={"input": "Hi.", "voice": voice, "response_format": "pcm"})
            assert response.status_code == 200 and response.content, voice


def test_models_and_voice_listings_have_the_shapes_clients_read(client, server):
    assert "tts-1" in [m.id for m in client.models.list()]
    with httpx.Client(base_url=server.url) as http:
        audio_voices = http.get("/v1/audio/voices").json()["voices"]
        listing = http.get("/v1/voices").json()
        assert http.get("/v1/audio/models").json()["models"][0]["id"]
    ids = {v["id"]: v for v in audio_voices}
    assert all(isinstance(v["name"], str) for v in audio_voices)  # Open WebUI: {v["id"]: v["name"]}
    assert ids["alloy"]["alias_of"] == "joe" and ids["joe"]["alias_of"] is None
    assert listing["aliases"]["alloy"] == "joe"
    assert set(listing["aliases"].values()) <= {v["name"] for v in listing["voices"]}


def test_a_request_whose_client_leaves_while_queued_leaves_the_queue(make_server, one_slot_engine):
    server = make_server(one_slot_engine)

    async def go():
        async with websockets.connect(server.ws_url) as holder:
            await send(holder, type="start")  # takes the only slot, and holds it: no text, no end
            assert json.loads(await holder.recv())["type"] == "ready"
            request = asyncio.to_thread(
                httpx.post,
                server.url + "/v1/audio/speech",
                timeout=2.0,
                json={"input": "Hi.", "response_format": "pcm"},
            )
            request = asyncio.ensure_future(request)
            queued = await asyncio.to_thread(wait_until, lambda: server.hub.admission.queued == 1)
            with pytest.raises(httpx.TimeoutException):
                await request  # the client gives up and closes its connection
            return queued, await asyncio.to_thread(
                wait_until, lambda: server.hub.admission.queued == 0 and server.hub.admission.connections == 1
            )

    assert run(go()) == (True, True), server.hub.stats()


def test_a_failure_mid_stream_is_visible_to_the_client(make_server, one_slot_engine):
    """After the status line, a failure must not look like a short success: the raw body is cut off (the SDK
    raises on the incomplete read) and SSE says error."""
    from streaming.engine import EngineError

    server = make_server(one_slot_engine)

    def fail_the_stream():
        assert wait_until(lambda: server.hub.streams)
        next(iter(server.hub.streams)).finish(EngineError("injected fault"))

    with sdk(server) as client:
        with pytest.raises((httpx.HTTPError, openai.APIError)):
            with client.audio.speech.with_streaming_response.create(
                model="tts-1", voice="joe", input=SENTENCE * 20, response_format="pcm"
            ) as response:
                for i, _ in enumerate(response.iter_bytes()):
                    if i == 0:
                        fail_the_stream()
        with client.audio.speech.with_streaming_response.create(
            model="tts-1", voice="joe", input=SENTENCE * 20, response_format="pcm", stream_format="sse"
        ) as response:
            events = []
            for line in response.iter_lines():
                events += sse_events([line])
                if len(events) == 1:
                    fail_the_stream()
    assert events[-1]["type"] == "error" and events[-1]["error"]["code"] == "engine_error"
    assert "speech.audio.done" not in [e["type"] for e in events]
    assert wait_until(lambda: not server.hub.streams and server.hub.admission.connections == 0)


def test_api_key_is_required_on_every_endpoint_when_set(make_server, tiny_engine):
    server = make_server(tiny_engine, api_keys=("sekrit",))
    with openai.OpenAI(api_key="wrong", base_url=server.url + "/v1", max_retries=0) as wrong:
        with pytest.raises(openai.AuthenticationError) as refused:
            wrong.audio.speech.create(model="tts-1", voice="joe", input="Hi.")
        assert refused.value.body["type"] == "authentication_error"
        assert refused.value.body["code"] == "invalid_api_key"
    with openai.OpenAI(api_key="sekrit", base_url=server.url + "/v1", max_retries=0) as right:
        assert right.audio.speech.create(model="tts-1", voice="joe", input="Hi.", response_format="pcm").content
    with httpx.Client(base_url=server.url) as http:
        for path in ("/v1/voices", "/v1/audio/voices", "/v1/models"):
            assert http.get(path).status_code == 401
            assert http.get(path, headers={"X-API-Key": "sekrit"}).status_code == 200
        assert http.get("/health").status_code == 200 and http.get("/").status_code == 200

    async def ws_attempts():
        with pytest.raises(websockets.InvalidStatus) as no_key:
            await websockets.connect(server.ws_url)
        async with websockets.connect(server.ws_url + "?api_key=sekrit") as ws:
            by_query = await alive(ws)
        async with websockets.connect(server.ws_url, additional_headers={"Authorization": "Bearer sekrit"}) as ws:
            by_header = await alive(ws)
        return no_key.value.response.status_code, by_query, by_header

    status, by_query, by_header = run(ws_attempts())
    assert status == 403 and by_query["type"] == by_header["type"] == "done"


def test_cors_is_opt_in(make_server, tiny_engine):
    preflight = {
        "Origin": "https://app.example",
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "content-type,authorization",
    }
    with httpx.Client(base_url=make_server(tiny_engine).url) as http:
        assert "access-control-allow-origin" not in http.options("/v1/audio/speech", headers=preflight).headers
    with httpx.Client(base_url=make_server(tiny_engine, allow_origins=("https://app.example",)).url) as http:
        answer = http.options("/v1/audio/speech", headers=preflight)
        assert answer.status_code == 200
        assert answer.headers["access-control-allow-origin"] == "https://app.example"
        spoken = http.post(
            "/v1/audio/speech",
            headers={"Origin": "https://app.example"},
            json={"input": "Hi.", "voice": "joe", "response_format": "pcm"},
        )
        assert spoken.status_code == 200 and spoken.headers["access-control-allow-origin"] == "https://app.example"


# ---- issue 25: one client can never hurt another ------------------------------------------------
NASTY_TEXTS = [
    "Hello\u0000 world.",
    "The number is " + "7" * 400 + ".",
    "\x1b[31mred\x1b[0m alert.",
    "Supercalifragilistic" * 50 + ".",
]


async def speak_until_audio(ws, text: str) -> tuple[list[dict], int]:
    """Start, send `text`, end, and cancel once audio comes (a 400-digit number read out is minutes long):
    (every JSON event up to done, audio bytes received)."""
    await send(ws, type="start")
    events, audio = [json.loads(await ws.recv())], 0
    for message in ({"type": "text", "text": text}, {"type": "end"}):
        await ws.send(json.dumps(message))
    async with asyncio.timeout(120):
        while events[-1]["type"] != "done":
            message = await ws.recv()
            if isinstance(message, bytes):
                audio += len(message)
                if audio == len(message):
                    await send(ws, type="cancel")
            else:
                events.append(json.loads(message))
    return events, audio


def test_nasty_text_fails_that_utterance_alone_and_a_concurrent_one_completes(server):
    """A NUL byte, an escape sequence, a 400-digit number, a 1000-letter word: each gets a typed answer on its
    own connection (or is spoken), while another client's utterance, running all along, completes."""

    async def all_of(ws) -> tuple[int, dict]:
        received = 0
        async with asyncio.timeout(120):
            while isinstance(message := await ws.recv(), bytes):
                received += len(message)
        return received, json.loads(message)

    async def go():
        async with websockets.connect(server.ws_url) as other:
            await send(other, type="start", format="f32le")
            assert json.loads(await other.recv())["type"] == "ready"
            await send(other, type="text", text=SENTENCE * 4)  # its text ends only after the nasty ones
            reading = asyncio.create_task(all_of(other))
            answers = []
            for text in NASTY_TEXTS:
                async with websockets.connect(server.ws_url) as ws:
                    answers.append(await speak_until_audio(ws, text))
            await send(other, type="end")
            return answers, *await reading

    answers, received, done = run(go())
    for text, (events, _) in zip(NASTY_TEXTS, answers):
        assert events[0]["type"] == "ready" and events[-1]["type"] == "done", (text[:20], events)
        assert {e["code"] for e in events if e["type"] == "error"} <= {"bad_text"}, (text[:20], events)
    control = [events for text, (events, _) in zip(NASTY_TEXTS, answers) if "\x00" in text or "\x1b" in text]
    assert all(events[1]["code"] == "bad_text" and "U+00" in events[1]["message"] for events in control)
    assert done == {**done, "type": "done", "cancelled": False} and received > 0


@pytest.mark.parametrize("text", NASTY_TEXTS, ids=["nul", "400 digits", "escape", "huge word"])
def test_nasty_text_over_http_is_a_400_or_audio_never_a_500(client, text):
    try:
        with client.audio.speech.with_streaming_response.create(
            model="tts-1", voice="joe", input=text, response_format="pcm"
        ) as response:
            audio = next(response.iter_bytes())  # enough: a 400-digit number read out is minutes long
    except openai.APIStatusError as failure:
        assert failure.status_code == 400 and failure.body["code"] == "bad_text"
        assert failure.body["param"] == "input" and failure.body["type"] == "invalid_request_error"
    else:
        assert "\x00" not in text and "\x1b" not in text and len(audio) > 0


def test_twelve_concurrent_requests_on_four_slots_all_complete(server, tiny_engine):
    assert tiny_engine.max_streams == 4

    def request(i):
        with sdk(server) as client:
            return client.audio.speech.create(model="tts-1", voice="joe", input=SENTENCE, response_format="pcm")

    with ThreadPoolExecutor(12) as pool:
        answers = list(pool.map(request, range(12)))
    assert all(len(a.content) > SR for a in answers)  # each over half a second of 16-bit audio


def test_a_no_op_message_does_not_keep_a_connection_alive(make_server, tiny_engine):
    server = make_server(tiny_engine, idle_timeout_s=1.0)

    async def go():
        async with websockets.connect(server.ws_url) as ws:
            started = time.monotonic()
            with contextlib.suppress(websockets.ConnectionClosed):
                while time.monotonic() - started < 6:
                    await send(ws, type="cancel")  # nothing to cancel
                    with contextlib.suppress(TimeoutError):
                        if (error := json.loads(await asyncio.wait_for(ws.recv(), 0.25)))["type"] == "error":
                            return error, time.monotonic() - started

    error, after = run(go())
    assert error["code"] == "idle_timeout" and after < 3


def test_per_client_caps_on_connections_and_utterances(make_server, tiny_engine):
    server = make_server(tiny_engine, max_connections_per_client=2, max_streams_per_client=1)

    async def go():
        async with websockets.connect(server.ws_url) as a, websockets.connect(server.ws_url) as b:
            async with websockets.connect(server.ws_url) as third:
                refused = json.loads(await asyncio.wait_for(third.recv(), 10))
                with pytest.raises(websockets.ConnectionClosed) as closed:
                    await asyncio.wait_for(third.recv(), 10)
            await send(a, type="start")
            await a.recv()
            await send(b, type="start")
            second_utterance = await event(b)
            await send(a, type="cancel")
            await event(a)
            return refused, closed.value.rcvd.code, second_utterance, await alive(b)

    refused, code, second_utterance, later = run(go())
    assert refused["code"] == "client_limit" and code == 1013
    assert second_utterance["code"] == "client_limit" and later["type"] == "done"


def test_origin_allow_list_on_the_websocket_and_the_api(make_server, tiny_engine):
    server = make_server(tiny_engine, allow_origins=("https://app.example",))
    own = f"http://127.0.0.1:{server.port}"

    async def handshake(origin):
        try:
            async with websockets.connect(server.ws_url, origin=origin) as ws:
                return (await alive(ws))["type"]
        except websockets.InvalidStatus as refused:
            return refused.response.status_code

    async def go():
        return [await handshake(o) for o in ("https://evil.example", "null", own, "https://app.example", None)]

    assert run(go()) == [403, 403, "done", "done", "done"]
    with httpx.Client(base_url=server.url) as http:
        refused = http.post("/v1/audio/speech", headers={"Origin": "https://evil.example"}, json={"input": "Hi."})
        assert refused.status_code == 403 and refused.json()["error"]["type"] == "permission_error"
        assert (
            http.post(
                "/v1/audio/speech", headers={"Origin": own}, json={"input": "Hi.", "response_format": "pcm"}
            ).status_code
            == 200
        )


def test_wrong_methods_and_paths_get_openai_shaped_errors(server):
    with httpx.Client(base_url=server.url) as http:
        put = http.put("/v1/audio/speech", json={"input": "Hi."})
        missing = http.get("/v1/nothing-here")
        get_speech = http.get("/v1/audio/speech")
    assert put.status_code == 405 and put.headers["allow"] == "POST"
    assert put.json()["error"]["code"] == "method_not_allowed"
    assert get_speech.status_code == 405 and get_speech.headers["allow"] == "POST"
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "invalid_request_error"


def test_an_empty_voice_name_is_an_unknown_voice_on_the_socket(server):
    async def go():
        async with websockets.connect(server.ws_url) as ws:
            await send(ws, type="start", voice="")
            return await event(ws)

    assert run(go())["code"] == "unknown_voice"


@pytest.mark.parametrize("resume_window_s", [0, 0.3])
def test_aborted_connections_in_a_tight_loop_leak_nothing(make_server, tiny_engine, resume_window_s):
    """With resume off, and on (a dropped session then waits out its window, holding its slot)."""
    server = make_server(tiny_engine, resume_window_s=resume_window_s)

    async def abort_at(step):
        ws = await websockets.connect(server.ws_url)
        for message in ({"type": "start"}, {"type": "text", "text": SENTENCE * 3}, {"type": "end"})[:step]:
            await ws.send(json.dumps(message))
        if step == 3:
            await asyncio.wait_for(ws.recv(), 10)
        ws.transport.abort()

    async def go():
        for i in range(30):
            await abort_at(i % 4)
        await asyncio.to_thread(wait_until, lambda: server.hub.stats()["awaiting_resume"] == 0)  # slots held
        async with websockets.connect(server.ws_url) as ws:
            return await utterance(ws, "Still serving.")

    _, frames, done = run(go())
    assert frames and not done["cancelled"]
    assert wait_until(
        lambda: (
            server.hub.admission.connections == 0
            and server.hub.admission.active == 0
            and not server.hub.streams
            and tiny_engine.active_streams == 0
        )
    )


def test_a_dropped_session_gives_its_slot_to_another_client_at_once_and_resumes_exactly(make_server):
    """While a dropped session waits for its resume its engine stream is held: parked at once (not after the
    grace, an hour here), so another client speaks in the one slot meanwhile; resumed, the audio equals the same
    seeded utterance never interrupted, bit for bit."""
    from streaming.parking import ParkingConfig
    from testkit import tiny_random

    engine = tiny_random(max_streams=1, max_open=4, parking=ParkingConfig(park_after_s=3600))
    server = make_server(engine, resume_window_s=30)
    start = {"format": "f32le", "seed": 8}

    async def go():
        async with websockets.connect(server.ws_url) as ws:
            _, frames, _ = await utterance(ws, SENTENCE * 2, **start)
        reference = b"".join(frames)
        ws = await websockets.connect(server.ws_url)
        await send(ws, type="start", **start)
        token = json.loads(await ws.recv())["resume_token"]
        await send(ws, type="text", text=SENTENCE * 2)
        await send(ws, type="end")
        got = bytearray()
        while len(got) < 20_000:
            got += await asyncio.wait_for(ws.recv(), 30)
        ws.transport.abort()
        held = await asyncio.to_thread(
            wait_until, lambda: engine.counters["parks"] == 1 and engine.stats()["slots_used"] == 0
        )
        async with websockets.connect(server.ws_url) as other:
            _, meanwhile, done = await utterance(other, "Meanwhile, another client speaks.")
        async with websockets.connect(server.ws_url) as again:
            await send(again, type="resume", token=token, contexts=[{"bytes": len(got), "events": 1}])
            assert json.loads(await again.recv())["type"] == "resumed"
            while isinstance(message := await asyncio.wait_for(again.recv(), 30), bytes):
                got += message
        return reference, bytes(got), json.loads(message), held, meanwhile, done

    reference, got, done, held, meanwhile, other_done = run(go())
    assert held, "the dropped session's stream kept its slot"
    assert meanwhile and not other_done["cancelled"]
    assert done["type"] == "done" and not done["cancelled"]
    assert got == reference
    assert engine.counters["restores"] == 1
    engine.close()


def test_health_shows_load_and_the_engine_figures(server, tiny_engine):
    health = json.loads(get(server.url + "/health")[1])
    assert health["slots"] == tiny_engine.max_streams and health["queued"] == 0
    if callable(getattr(tiny_engine, "stats", None)):
        assert isinstance(health["engine"], dict)


# ---- WebSocket parity: seed, sample rates, mu-law, word timings, contexts ---------------------------
async def f32_audio(ws, text, **start) -> np.ndarray:
    _, frames, _ = await utterance(ws, text, format="f32le", **start)
    return np.frombuffer(b"".join(frames), dtype="<f4")


def test_the_same_seed_gives_bit_identical_audio(server):
    async def go():
        async with websockets.connect(server.ws_url) as ws:
            return [await f32_audio(ws, SENTENCE, seed=seed) for seed in (1234, 1234, 99)]

    alone, again, other_seed = run(go())
    assert len(alone) > 0 and alone.tobytes() == again.tobytes()
    assert alone.tobytes() != other_seed.tobytes()


def test_the_same_seed_gives_bit_identical_audio_beside_another_stream(server):
    """Issue 23's target: the same audio, bit for bit, whatever else the server is speaking."""

    async def go():
        async with websockets.connect(server.ws_url) as ws:
            alone = await f32_audio(ws, SENTENCE, seed=1234)
            async with websockets.connect(server.ws_url) as busy:
                await open_long_utterance(busy, sentences=4)
                beside = await f32_audio(ws, SENTENCE, seed=1234)
        return alone, beside

    alone, beside = run(go())
    assert len(alone) == len(beside) > 0
    assert alone.tobytes() == beside.tobytes(), f"max difference {np.abs(alone - beside).max():.3g}"


@pytest.mark.parametrize("rate", [16_000, 22_050, 44_100])
def test_output_sample_rate(server, rate):
    async def go():
        async with websockets.connect(server.ws_url) as ws:
            return await utterance(ws, SENTENCE, format="pcm_s16le", sample_rate=rate)

    ready, frames, done = run(go())
    samples = len(b"".join(frames)) // 2
    assert ready["sample_rate"] == rate
    assert samples == pytest.approx(done["audio_seconds"] * rate, abs=2)


def test_mu_law_at_8_khz(server):
    async def go():
        async with websockets.connect(server.ws_url) as ws:
            return await utterance(ws, SENTENCE, format="ulaw_8000")

    ready, frames, done = run(go())
    data = b"".join(frames)
    assert ready["sample_rate"] == 8000 and len(data) == pytest.approx(done["audio_seconds"] * 8000, abs=2)
    with av.open(io.BytesIO(data), format="mulaw", options={"sample_rate": "8000"}) as container:
        audio = np.concatenate([f.to_ndarray().reshape(-1) for f in container.decode(audio=0)])
    assert len(audio) == len(data) and np.abs(audio).max() > 0


def test_http_sample_rate_extension(client):
    audio, _ = speak_openai(client, "wav", "audio", extra_body={"sample_rate": 16_000})
    samples, rate = decode(audio)
    assert rate == 16_000 and len(samples) > 8000


async def timing_events(ws, text: str, **start) -> tuple[list[tuple[dict, float]], float]:
    """Speak `text` in pcm_s16le: ([(timing event, seconds of audio received before it)], seconds in all)."""
    await send(ws, type="start", format="pcm_s16le", **start)
    assert json.loads(await ws.recv())["type"] == "ready"
    await send(ws, type="text", text=text)
    await send(ws, type="end")
    timings, received_s = [], 0.0
    async with asyncio.timeout(60):
        while True:
            message = await ws.recv()
            if isinstance(message, bytes):
                received_s += len(message) / 2 / SR
                continue
            event_ = json.loads(message)
            if event_["type"] == "done":
                return timings, received_s
            assert event_["type"] == "timing", event_
            timings.append((event_, received_s))


def test_word_timings_come_before_the_audio_they_describe(server):
    text = "Timing each word, please, for the captions."

    async def go():
        async with websockets.connect(server.ws_url) as ws:
            return await timing_events(ws, text, word_timings=True)

    timings, total_s = run(go())
    words = [(word, before) for event_, before in timings for word in event_["words"]]
    assert all("phonemes" not in event_ for event_, _ in timings)
    assert [w["word"] for w, _ in words] == text.split()  # every word of the input, as written
    assert all(before <= w["end"] + 1e-3 for w, before in words)  # sent before (or with) its audio
    assert all(0 <= w["start"] < w["end"] <= total_s + 0.05 for w, _ in words)
    assert all(a["start"] <= b["start"] for (a, _), (b, _) in zip(words, words[1:]))


def test_several_contexts_on_one_socket(make_server, tiny_engine):
    server = make_server(tiny_engine, max_contexts=2)

    async def go():
        async with websockets.connect(server.ws_url) as ws:
            for context in ("a", "b"):
                await send(ws, type="start", context_id=context, format="pcm_s16le")
            await send(ws, type="start", context_id="c")
            audio, events = {"a": b"", "b": b""}, []
            await send(ws, type="text", context_id="b", text="The second context speaks first.")
            await send(ws, type="flush", context_id="b")
            await send(ws, type="text", context_id="a", text=SENTENCE)
            await send(ws, type="end", context_id="a")
            await send(ws, type="end", context_id="b")
            async with asyncio.timeout(60):
                while sum(e["type"] == "done" for e in events) < 2:
                    event_ = json.loads(await ws.recv())
                    if event_["type"] == "audio":
                        audio[event_["context_id"]] += base64.b64decode(event_["audio"])
                    else:
                        events.append(event_)
            return audio, events

    audio, events = run(go())
    refused = [e for e in events if e["type"] == "error"]
    assert [(e["code"], e["context_id"]) for e in refused] == [("too_many_contexts", "c")]
    done = {e["context_id"]: e for e in events if e["type"] == "done"}
    assert {e["context_id"] for e in events if e["type"] == "ready"} == {"a", "b"}
    for context in ("a", "b"):
        assert not done[context]["cancelled"]
        assert len(audio[context]) / 2 / SR == pytest.approx(done[context]["audio_seconds"], abs=1e-3)


# ---- the Python client -----------------------------------------------------------------------------
def test_say_via_server_writes_a_wav_atomically(server, tmp_path):
    out = tmp_path / "hello.wav"
    done = say_via_server(server.ws_url, SENTENCE, voice="kal", out=out, speed=1.25)
    info = sf.info(out)
    assert info.samplerate == SR and info.channels == 1 and info.format == "WAV"
    assert info.frames == pytest.approx(done["audio_seconds"] * SR, abs=1)
    assert [p.name for p in tmp_path.iterdir()] == ["hello.wav"]  # no temporary file left behind


def test_say_via_server_failures_are_typed_and_leave_no_file(server, tmp_path):
    out = tmp_path / "never.wav"
    with pytest.raises(ServerError) as refused:
        say_via_server(server.url, "Hello.", voice="nobody", out=out)
    assert refused.value.code == "unknown_voice"
    with pytest.raises(ClientError, match="cannot reach"):
        say_via_server("ws://127.0.0.1:9", "Hello.", out=out)
    with pytest.raises(ClientError, match="not a server URL"):
        say_via_server("ftp://127.0.0.1", "Hello.", out=out)
    assert list(tmp_path.iterdir()) == []


def test_say_via_server_without_a_sound_device_says_how_to_write_a_file(server):
    try:
        import sounddevice

        if sounddevice.query_devices(kind="output"):
            pytest.skip("this machine has a sound device")
    except Exception:  # no package, no PortAudio library, or PortAudio without an output device (PortAudioError)
        pass
    with pytest.raises(ClientError, match="-o out.wav"):
        say_via_server(server.ws_url, "Hello.")


def test_client_speaks_llm_pieces_and_stops_early(server):
    pieces = iter(["The quick ", "brown fox ", "jumps over ", "the lazy dog."])
    audio = synthesize_via_server(server.url, pieces, voice="awb")
    assert audio.dtype == np.float32 and len(audio) > SR // 2

    async def stop_early():
        async with connect(server.url) as client:
            async with contextlib.aclosing(client.speak(SENTENCE * 8)) as chunks:
                async for _ in chunks:
                    break
            stopped = client.done
            async for _ in client.speak(SENTENCE * 8):
                break  # dropped without aclosing: the next utterance waits for its cancel
            after = [c async for c in client.speak("Next.")]
            return stopped, after

    stopped, after = run(stop_early())
    assert stopped["cancelled"] is True and after


def test_client_waits_in_the_server_queue_and_sends_its_api_key(make_server, one_slot_engine):
    server = make_server(one_slot_engine, api_keys=("k",))

    async def go():
        async with websockets.connect(server.ws_url + "?api_key=k") as holder:
            await open_long_utterance(holder, sentences=2)  # takes the only slot
            asyncio.get_running_loop().call_later(0.5, lambda: asyncio.ensure_future(send(holder, type="cancel")))
            async with connect(server.url, api_key="k") as client:
                chunks = [c async for c in client.speak("Waiting my turn.", seed=7, timings=True)]
                return chunks, client.done, client.timings

    chunks, done, timings = run(go())
    assert chunks and not done["cancelled"] and timings and "phonemes" in timings[0]
    with pytest.raises(ClientError, match="API key"):
        synthesize_via_server(server.url, "No key.")


# ---- end to end, with the shipped voice --------------------------------------------------------------
def test_shipped_voice_over_the_socket_is_understood(make_server, shipped_engine):
    from tts.asr import transcribe, wer

    server = make_server(shipped_engine)
    text = "Please call me back when you have a moment this afternoon."

    async def go():
        async with websockets.connect(server.ws_url) as ws:
            await utterance(ws, "Warm up.")
            return await utterance(ws, text, format="f32le")

    _, frames, done = run(go())
    audio = np.frombuffer(b"".join(frames), dtype="<f4")
    heard = transcribe(audio)
    assert 1.0 < len(audio) / SR < 8.0
    assert wer(text, heard) <= 0.2, heard
    assert done["ttfa_ms"] < 2000


def test_tts_serve_and_tts_say_through_it(shipped_engine, tmp_path):
    """The command lines: `tts serve` in its own process, and `tts say --server` writing a WAV from it."""
    import os
    import socket
    import subprocess
    import sys

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    served = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tts.cli",
            "serve",
            "--port",
            str(port),
            "--api-key",
            "sekrit",
            "--max-contexts",
            "1",
            "--queue-timeout-s",
            "5",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        # start-up loads the model and compiles the decode step (cold inductor cache on CI: tens of seconds)
        wait_until(lambda: _healthy(port) or served.poll() is not None, 240)
        assert _healthy(port), f"tts serve did not come up (exit code {served.poll()})"
        out = tmp_path / "cli.wav"
        say = [
            sys.executable,
            "-m",
            "tts.cli",
            "say",
            "Hello from the server.",
            "--server",
            f"ws://127.0.0.1:{port}",
            "-o",
            str(out),
        ]
        refused = subprocess.run(say, timeout=120, capture_output=True, text=True)
        assert refused.returncode != 0 and "API key" in refused.stderr and not out.exists()
        said = subprocess.run(say, timeout=120, env={**os.environ, "TTS_API_KEY": "sekrit"})
        assert said.returncode == 0
        info = sf.info(out)
        assert info.samplerate == SR and info.channels == 1 and 0.5 < info.duration < 6
    finally:
        served.terminate()
        served.wait(timeout=15)


def _healthy(port: int) -> bool:
    try:
        return get(f"http://127.0.0.1:{port}/health")[0] == 200
    except OSError:
        return False


def test_phoneme_timings_on_request(server):
    async def go():
        async with websockets.connect(server.ws_url) as ws:
            return await timing_events(ws, "Timing, please.", timings=True)

    timings, total_s = run(go())
    phonemes = [p for event_, _ in timings for p in event_["phonemes"]]
    assert phonemes and all(len(p) == 3 and p[1] < p[2] for p in phonemes)
    assert phonemes[-1][2] <= total_s + 0.2


def test_timeline_log_marks_each_stage_on_the_way_to_the_first_audio(tiny_engine, make_server, tmp_path, monkeypatch):
    """TTS_TIMELINE_LOG (a diagnosis, `bench.soak --timeline`): one line per stream, every stage from the request
    to the first audio sent, each at or after the stages it follows."""
    log = tmp_path / "timeline.jsonl"
    monkeypatch.setenv("TTS_TIMELINE_LOG", str(log))
    server = make_server(tiny_engine)

    async def go():
        async with websockets.connect(server.ws_url) as ws:
            return await utterance(ws, SENTENCE)

    run(go())
    assert wait_until(lambda: log.exists() and log.read_text().strip())
    line = json.loads(log.read_text().splitlines()[0])
    marks = line["timeline_ms"]
    assert list(marks) == [
        "request",
        "opened",
        "slot",
        "text",
        "units",
        "prefill",
        "stepped",
        "due",
        "codec",
        "delivered",
        "read",
        "sent",
    ]
    after = {
        "opened": ["request"],
        "slot": ["opened"],
        "text": ["opened"],
        "units": ["text"],
        "prefill": ["slot", "units"],
        "stepped": ["prefill"],
        "due": ["stepped"],
        "codec": ["due"],
        "delivered": ["codec"],
        "read": ["delivered"],
        "sent": ["read"],
    }
    for stage, befores in after.items():
        assert all(marks[stage] >= marks[before] for before in befores), (stage, marks)
    assert line["finished"] and line["ticks_to_due"] >= tiny_engine.cfg.codebooks


def test_the_timeline_log_is_closed_when_the_server_stops(tiny_engine, make_server, tmp_path, monkeypatch):
    """TTS_TIMELINE_LOG is open only while the server runs: stopped, the process holds no descriptor on it, its
    lines are whole, and a stream that ends after the stop writes nothing and still frees its slot."""
    import os

    log = tmp_path / "timeline.jsonl"
    monkeypatch.setenv("TTS_TIMELINE_LOG", str(log))
    server = make_server(tiny_engine)
    hub = server.hub

    def open_on_log() -> int:
        fds = os.listdir("/proc/self/fd")
        return sum(
            os.path.realpath(f"/proc/self/fd/{fd}") == str(log.resolve())
            for fd in fds
            if os.path.exists(f"/proc/self/fd/{fd}")
        )

    async def go():
        async with websockets.connect(server.ws_url) as ws:
            return await utterance(ws, SENTENCE)

    run(go())
    assert wait_until(lambda: log.read_text().endswith("\n"))
    while_serving = open_on_log()
    server.stop()
    stream = tiny_engine.open(seed=1)  # a stream ending after the stop (as an HTTP request cancelled at shutdown)
    ticket = run(hub.admission.stream((("addr", "late"),)))
    hub.streams.add(stream)
    hub.close(ticket, stream)
    assert while_serving == 1 and open_on_log() == 0 and hub.timeline_log.closed
    assert [json.loads(line)["finished"] for line in log.read_text().splitlines()] == [True]
    assert hub.admission.active == 0 and not hub.streams
    assert wait_until(lambda: tiny_engine.active_streams == 0)


def test_admission_sets_a_waiting_session_aside_from_its_clients_caps():
    """The rule of serving/admission.py, per identity (address and API key), caps of 2: places and slots
    set aside (sessions waiting for a resume) count against no client cap but still against max_connections;
    a client keeps 2 set aside, the third makes its oldest expire; put back, a place counts again even past the
    cap; a real excess is client_limit; released, every count is back to zero."""
    from serving.admission import Admission
    from serving.limits import Limits
    from serving.protocol import ProtocolError

    admission = Admission(Limits(max_connections=8, max_connections_per_client=2, max_streams_per_client=2), slots=8)
    me, expired = (("addr", "10.0.0.1"), ("key", "k1")), []

    async def go():
        places, tickets = [], []
        for i in range(3):  # three sessions dropped in turn, the client back at once each time
            place = admission.connect(me)
            ticket = await admission.stream(me)
            place.set_aside(lambda i=i: expired.append(i))
            ticket.set_aside()
            places.append(place)
            tickets.append(ticket)
        live = [admission.connect(me), admission.connect(me)]
        live_tickets = [await admission.stream(me), await admission.stream(me)]
        with pytest.raises(ProtocolError) as connection:
            admission.connect(me)
        with pytest.raises(ProtocolError) as utterance_:
            await admission.stream(me)
        refusals = [connection.value.code, utterance_.value.code]
        others = admission.connect((("addr", "10.0.0.2"),))  # another client: its own caps
        places[2].put_back()  # resumed: counts again, past the cap
        tickets[2].put_back()
        counted = admission.stats()
        for item in places + live + [others] + tickets + live_tickets:
            item.release()
        return refusals, counted

    refusals, counted = run(go())
    assert expired == [0]  # the third set aside made the oldest expire
    assert refusals == ["client_limit", "client_limit"]
    assert counted["connections"] == 6 and counted["streams"] == 5
    assert admission.stats() == {"connections": 0, "streams": 0, "queued": 0, "clients": 0}
