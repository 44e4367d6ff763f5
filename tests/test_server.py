"""The real server on a loopback port, driven by a real `websockets` client and by the official `openai` SDK.

Protocol behaviour runs on the tiny random-weight engine (fast, noise for sound, real lengths and rates);
one end-to-end test speaks a sentence with the shipped voice and checks it with the ASR judge.
"""
from __future__ import annotations

import asyncio
import contextlib
import io
import json
import time
import urllib.request

import av
import numpy as np
import openai
import pytest
import soundfile as sf
import websockets

from tts.client import ClientError, ServerError, connect, say_via_server, synthesize_via_server

SR = 24_000
SENTENCE = "The quick brown fox jumps over the lazy dog. "


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


def wait_until(condition, seconds: float = 10) -> bool:
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.05)
    return condition()


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
    assert ready == {"type": "ready", "sample_rate": SR, "format": "pcm_s16le", "voice": "joe", "speed": 1.0}
    assert len(frames) >= 2, "audio arrives in several chunks, not at the end"
    data = b"".join(frames)
    samples = np.frombuffer(data, dtype="<i2")
    assert len(data) % 2 == 0 and len(samples) > SR  # two sentences: over a second of speech
    assert done["audio_seconds"] == pytest.approx(len(samples) / SR, abs=1e-3)
    assert done["cancelled"] is False and done["ttfa_ms"] > 0 and done["rtf"] > 0
    assert np.abs(samples).max() > 0


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
            dropped = await asyncio.to_thread(wait_until, lambda: server.hub.admitted == 0, 30)
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


def test_busy_engine_answers_server_full_on_start(make_server):
    from helpers import tiny_random
    server = make_server(tiny_random(max_streams=1))

    async def go():
        async with websockets.connect(server.ws_url) as a, websockets.connect(server.ws_url) as b:
            await send(a, type="start")
            await a.recv()
            await send(b, type="start")
            refused = await event(b)
            await send(a, type="cancel")
            await event(a)
            _, frames, _ = await utterance(b, "My turn now.")  # the slot is free again
            return refused, frames

    refused, frames = run(go())
    assert refused["code"] == "server_full" and frames


def test_idle_connection_is_closed_with_idle_timeout(make_server, tiny_engine):
    server = make_server(tiny_engine, idle_timeout_s=0.5)

    async def go():
        async with websockets.connect(server.ws_url) as ws:
            error = json.loads(await asyncio.wait_for(ws.recv(), 10))
            with pytest.raises(websockets.ConnectionClosed):
                await asyncio.wait_for(ws.recv(), 10)
            return error

    assert run(go())["code"] == "idle_timeout"
    assert server.hub.admitted == 0


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


def test_a_client_that_vanishes_mid_stream_frees_its_slot(server, tiny_engine):
    async def go():
        ws = await websockets.connect(server.ws_url)
        await open_long_utterance(ws, sentences=6)
        await asyncio.wait_for(ws.recv(), 30)
        ws.transport.abort()

    run(go())
    assert wait_until(lambda: tiny_engine.active_streams == 0 and server.hub.admitted == 0)


def test_slow_reader_pauses_generation_and_others_are_unaffected(make_server, tiny_engine):
    """A client that stops reading: the server's sending stalls, generation pauses well before the end of
    the utterance, another client is served meanwhile, and when reading resumes all the audio arrives."""
    server = make_server(tiny_engine, send_buffer_bytes=16384)

    async def plateau(session):
        last, still_since = -1, time.monotonic()
        async with asyncio.timeout(60):
            while time.monotonic() - still_since < 1.5:
                await asyncio.sleep(0.1)
                if session.sent_bytes != last:
                    last, still_since = session.sent_bytes, time.monotonic()
        return last

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


@pytest.mark.parametrize("fmt, kind, rate", [("wav", "audio/wav", SR), ("mp3", "audio/mpeg", SR),
                                             ("flac", "audio/flac", SR), ("opus", "audio/ogg", 48_000),
                                             ("aac", "audio/aac", SR)])
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


@pytest.mark.parametrize("request_, status, code", [
    ({"voice": "alloy", "input": "Hi."}, 400, "unknown_voice"),
    ({"voice": "joe", "input": "Hi.", "response_format": "ogg"}, 400, "unsupported_format"),
    ({"voice": "joe", "input": "Hi.", "speed": 9.0}, 400, "bad_value"),
    ({"voice": "joe", "input": "   "}, 400, "bad_text"),
    ({"voice": "joe", "input": "Hi.", "extra_body": {"volume": 11}}, 400, "unknown_key"),
    ({"voice": "joe", "input": "x" * 5000}, 400, "text_too_long"),
    ({"voice": "joe", "input": "Hi.", "extra_body": {"pad": "x" * 70000}}, 413, "body_too_large"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_openai_sdk_errors_are_typed(client, request_, status, code):
    with pytest.raises(openai.APIStatusError) as failure:
        client.audio.speech.create(model="tts-1", **request_)
    assert failure.value.status_code == status
    assert failure.value.body["code"] == code and failure.value.body["message"]


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
    except (ImportError, OSError, ValueError):
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
    import socket
    import subprocess
    import sys
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    served = subprocess.Popen([sys.executable, "-m", "tts.cli", "serve", "--port", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        # start-up loads the model and compiles the decode step (cold inductor cache on CI: tens of seconds)
        wait_until(lambda: _healthy(port) or served.poll() is not None, 240)
        assert _healthy(port), f"tts serve did not come up (exit code {served.poll()})"
        out = tmp_path / "cli.wav"
        said = subprocess.run([sys.executable, "-m", "tts.cli", "say", "Hello from the server.",
                               "--server", f"ws://127.0.0.1:{port}", "-o", str(out)], timeout=120)
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
            await send(ws, type="start", timings=True)
            assert json.loads(await ws.recv())["type"] == "ready"
            await send(ws, type="text", text="Timing, please.")
            await send(ws, type="end")
            phonemes, samples = [], 0
            async with asyncio.timeout(60):
                while True:
                    message = await ws.recv()
                    if isinstance(message, bytes):
                        samples += len(message) // 2
                        continue
                    event = json.loads(message)
                    if event["type"] == "done":
                        return phonemes, samples
                    assert event["type"] == "timing"
                    phonemes += event["phonemes"]
    phonemes, samples = run(go())
    assert phonemes and all(len(p) == 3 and p[1] < p[2] for p in phonemes)
    assert phonemes[-1][2] <= samples / 24_000 + 0.2
