"""A property-based fuzzer of the server, against the real server on loopback and the tiny engine.

Hypothesis draws WebSocket message sequences (valid, half-valid and garbage messages in random order, several
contexts, arbitrary Unicode, control characters, huge numbers, huge words) and HTTP speech requests. For each:
every event the server sends is typed (a documented event type, a documented error code), the connection ends
only with a documented close code, every utterance that was started ends with one `done`, another client's
utterance running at the same time completes, and nothing leaks (connections, admission slots, queue places,
engine streams).

CI runs a small budget; a thorough run is one variable away:

    TTS_FUZZ_EXAMPLES=10000 python -m pytest -q tests/test_fuzz.py     # each test draws this many examples
"""
from __future__ import annotations

import asyncio
import json
import os
import string
import time

import httpx2 as httpx  # the openai SDK's own HTTP client
import pytest
import websockets
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from streaming.protocol import ERRORS, OUTPUT_RATES, WS_FORMATS

EXAMPLES = int(os.environ.get("TTS_FUZZ_EXAMPLES", "10"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=EXAMPLES <= 100,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                       HealthCheck.data_too_large])
EVENTS = {"ready", "queued", "timing", "audio", "done", "error"}
CLOSE_CODES = {1000, 1009, 1013}  # idle_timeout, message too big, server full / client limit
LIMITS = {"max_text_chars": 600, "max_contexts": 3, "queue_timeout_s": 1.0, "idle_timeout_s": 60.0,
          "max_message_bytes": 16384}


@pytest.fixture(scope="module")
def fuzzed():
    """A server of its own (the fuzz must not share its engine with other tests' timing), 3 slots."""
    from server import ServerThread
    from helpers import tiny_random
    engine = tiny_random(max_streams=3)
    with ServerThread(engine, **LIMITS) as server:
        yield server, engine


# ---- what is drawn -----------------------------------------------------------------------------------
CONTROL = st.characters(min_codepoint=0, max_codepoint=0x9F).filter(lambda c: not c.isprintable())
TEXT = st.one_of(
    st.text(max_size=80),                                                     # arbitrary Unicode
    st.text(st.characters(codec="utf-8"), max_size=300),
    st.builds(lambda a, c, b: a + c + b, st.text(max_size=20), CONTROL, st.text(max_size=20)),
    st.builds(lambda d, n, tail: f"The number is {d * n}{tail}.", st.sampled_from("123456789"),  # huge numbers
              st.integers(15, 800), st.sampled_from(["", ".5", ",000", "th", " 42"])),
    st.builds(lambda w, n: f"A {w * n} word.", st.text(string.ascii_letters, min_size=1, max_size=9),  # huge words
              st.integers(20, 200)),
    st.sampled_from(["Hello there. ", "How are", " you today?", "$3.50 on 3/4/2021 at 10:30.", "   ", ""]),
)
CONTEXT = st.sampled_from([None, None, None, "a", "b", "c", "d", "", "x" * 65, "bad id!"])
# allow_subnormal=False: the engine sets flush-to-zero (torch.set_flush_denormal), which hypothesis detects
JUNK = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False, allow_subnormal=False),
                 st.text(max_size=10), st.lists(st.integers(), max_size=2))
SPEED = st.floats(0.2, 4.2, allow_subnormal=False)


def _message(kind: str, context, extra: dict) -> dict:
    message = {"type": kind, **extra}
    if context is not None:
        message["context_id"] = context
    return message


START = st.builds(
    lambda context, extra: _message("start", context, extra), CONTEXT,
    st.fixed_dictionaries({}, optional={
        "voice": st.one_of(st.sampled_from(["joe", "slt", "alloy", "NOVA", "", "nobody"]), JUNK),
        "format": st.one_of(st.sampled_from(WS_FORMATS), JUNK),
        "sample_rate": st.one_of(st.sampled_from(OUTPUT_RATES), st.integers(-1, 10**6), JUNK),
        "speed": st.one_of(SPEED, JUNK), "seed": st.one_of(st.integers(-5, 2**64), JUNK),
        "timings": st.one_of(st.booleans(), JUNK), "word_timings": st.one_of(st.booleans(), JUNK),
        "volume": JUNK}))
VALID_START = st.builds(lambda extra: {"type": "start", **extra}, st.fixed_dictionaries({}, optional={
    "voice": st.sampled_from(["joe", "slt", "alloy", "NOVA"]), "format": st.sampled_from(WS_FORMATS),
    "sample_rate": st.sampled_from(OUTPUT_RATES), "speed": st.floats(0.25, 4.0, allow_subnormal=False),
    "seed": st.integers(0, 2**63 - 1),
    "timings": st.booleans(), "word_timings": st.booleans()}))
MESSAGE = st.one_of(
    START, START,
    st.builds(lambda context, text: _message("text", context, {"text": text}), CONTEXT, TEXT),
    st.builds(lambda context, text: _message("text", context, {"text": text}), CONTEXT, TEXT),
    st.builds(lambda kind, context: _message(kind, context, {}), st.sampled_from(["flush", "end", "cancel"]),
              CONTEXT),
    st.builds(lambda kind, junk: {"type": kind, "text": junk}, st.sampled_from(["text", "sing", ""]), JUNK),
    st.dictionaries(st.text(max_size=8), JUNK, max_size=3),  # objects of any keys
    st.text(max_size=40),                                     # raw text: mostly not JSON
    st.binary(max_size=40),                                   # binary messages
)


@st.composite
def utterance(draw) -> list:
    """A protocol-shaped run: a start, pieces of text, a flush or an end, all on one context (which is what
    gets text as far as the engine)."""
    context = draw(CONTEXT)
    start = draw(st.one_of(VALID_START, VALID_START, VALID_START, START))
    start = {**start, "context_id": context} if context is not None else start
    texts = [_message("text", context, {"text": t}) for t in draw(st.lists(TEXT, min_size=1, max_size=4))]
    return [start, *texts, _message(draw(st.sampled_from(["flush", "end", "end"])), context, {})]


MESSAGES = st.lists(st.one_of(MESSAGE.map(lambda m: [m]), utterance()), max_size=6).map(
    lambda runs: [m for run in runs for m in run])


def _raw(message) -> str | bytes:
    return message if isinstance(message, (str, bytes)) else json.dumps(message)


# ---- the properties -------------------------------------------------------------------------------
async def _canary(url: str, fuzzed: asyncio.Event) -> tuple[dict, int]:
    """Another client's utterance, open all the while the fuzzed client runs: it must complete."""
    async with websockets.connect(url) as ws:
        await ws.send(json.dumps({"type": "start"}))
        while json.loads(await ws.recv())["type"] != "ready":
            pass
        await ws.send(json.dumps({"type": "text", "text": "The other client is speaking. "}))
        reading = asyncio.create_task(_audio_until_done(ws))
        await fuzzed.wait()
        await ws.send(json.dumps({"type": "text", "text": "And it goes on to the end."}))
        await ws.send(json.dumps({"type": "end"}))
        return await reading


async def _audio_until_done(ws) -> tuple[dict, int]:
    audio = 0
    while isinstance(message := await ws.recv(), bytes):
        audio += len(message)
    return json.loads(message), audio


SYNC = {"type": "flush", "context_id": "fuzz-sync"}  # never started: always answered with bad_state


class Transcript:
    """What the server said to the fuzzed client, checked as it arrives."""

    def __init__(self):
        self.events: list[dict] = []
        self.audio = 0
        self.closed: int | None = None

    def add(self, message) -> None:
        if isinstance(message, bytes):
            self.audio += len(message)  # audio of the default context
            return
        event = json.loads(message)  # every text message is JSON
        assert event.get("type") in EVENTS, event
        if event["type"] == "error":
            assert event["code"] in ERRORS and isinstance(event["message"], str) and event["message"], event
        self.events.append(event)

    def open_contexts(self) -> set:
        """Contexts whose utterance started (queued or ready) and has not ended yet."""
        open_ = set()
        for event in self.events:
            context = event.get("context_id")
            if event["type"] in ("queued", "ready"):
                open_.add(context)
            elif event["type"] == "done" or (event["type"] == "error" and context in open_
                                               and event["code"] in ("server_full", "client_limit")):
                open_.discard(context)
        return open_


async def _drain(ws, transcript: Transcript, seconds: float) -> None:
    try:
        async with asyncio.timeout(seconds):
            while True:
                transcript.add(await ws.recv())
    except TimeoutError:
        pass


async def _fuzz_socket(url: str, messages: list) -> Transcript:
    transcript = Transcript()
    try:
        async with websockets.connect(url, max_size=None) as ws:
            for message in messages:
                await ws.send(_raw(message))
                await _drain(ws, transcript, 0.02)
            # the server answers messages in order: once it refuses this one, every earlier answer is in
            await ws.send(json.dumps(SYNC))
            async with asyncio.timeout(30):
                while not any(e.get("context_id") == SYNC["context_id"] for e in transcript.events):
                    transcript.add(await ws.recv())
            # every started utterance must end: end what is open (its text is spoken, for a few seconds: a
            # 400-digit number read out takes minutes), then cancel what is still open; each says done
            for close, seconds in (("end", 5), ("cancel", 30)):
                for context in transcript.open_contexts():
                    await ws.send(json.dumps(_message(close, context, {})))
                deadline = time.monotonic() + seconds
                while transcript.open_contexts() and time.monotonic() < deadline:
                    await _drain(ws, transcript, 0.1)
            assert not transcript.open_contexts(), transcript.events
    except websockets.ConnectionClosed as closed:
        transcript.closed = closed.rcvd.code if closed.rcvd else None
        assert transcript.closed in CLOSE_CODES, (transcript.closed, transcript.events)
    return transcript


def _quiet(server, engine, seconds: float = 10) -> bool:
    hub, deadline = server.hub, time.monotonic() + seconds
    while time.monotonic() < deadline:
        if (hub.admission.connections == hub.admission.active == hub.admission.queued == 0 and not hub.streams
                and not hub.sessions and engine.active_streams == 0):
            return True
        time.sleep(0.02)
    return False


ISSUE_25 = [  # the cases that once failed every stream on the server: always tried, whatever the budget
    [{"type": "start"}, {"type": "text", "text": "Hello\u0000 world."}, {"type": "end"}],
    [{"type": "start"}, {"type": "text", "text": "The number is " + "7" * 400 + "."}, {"type": "flush"}],
    [{"type": "start", "voice": ""}, {"type": "start", "context_id": "a"}, {"type": "cancel", "context_id": "a"}],
]


@FUZZ
@given(messages=MESSAGES)
@example(messages=ISSUE_25[0])
@example(messages=ISSUE_25[1])
@example(messages=ISSUE_25[2])
def test_fuzzed_websocket_messages(fuzzed, messages):
    server, engine = fuzzed

    async def go():
        fuzzed = asyncio.Event()
        canary = asyncio.create_task(_canary(server.ws_url, fuzzed))
        await asyncio.sleep(0.05)  # the canary's start goes first: it holds a slot throughout
        try:
            transcript = await _fuzz_socket(server.ws_url, messages)
        finally:
            fuzzed.set()
        return transcript, await asyncio.wait_for(canary, 60)

    transcript, (done, audio) = asyncio.run(go())
    assert done["type"] == "done" and not done["cancelled"] and audio > 0, (done, transcript.events)
    if any(isinstance(m, bytes) for m in messages) and transcript.closed is None:
        assert any(e["type"] == "error" and e["code"] == "bad_message" for e in transcript.events)
    assert _quiet(server, engine), (server.hub.stats(), engine.active_streams)


SPEECH_BODY = st.fixed_dictionaries({}, optional={
    "input": st.one_of(TEXT, JUNK),
    "voice": st.one_of(st.sampled_from(["joe", "alloy", "", "nobody"]),
                       st.fixed_dictionaries({"id": st.sampled_from(["slt", "x"])}), JUNK),
    "model": st.one_of(st.just("tts-1"), JUNK),
    "response_format": st.one_of(st.sampled_from(["mp3", "opus", "aac", "flac", "wav", "pcm", "ogg"]), JUNK),
    "stream_format": st.one_of(st.sampled_from(["audio", "sse", "raw"]), JUNK),
    "speed": st.one_of(SPEED, JUNK), "seed": st.one_of(st.integers(-5, 2**64), JUNK),
    "sample_rate": st.one_of(st.sampled_from(OUTPUT_RATES), st.integers(0, 10**5)), "volume": JUNK})


@FUZZ
@given(body=st.one_of(SPEECH_BODY.map(json.dumps), st.text(max_size=50), st.binary(max_size=50)))
@example(body=json.dumps({"input": "Hello\u0000 world.", "voice": "joe"}))
@example(body=json.dumps({"input": "The number is " + "7" * 400 + ".", "voice": "joe"}))
def test_fuzzed_speech_requests(fuzzed, body):
    server, engine = fuzzed
    with httpx.Client(base_url=server.url, timeout=60) as http:
        with http.stream("POST", "/v1/audio/speech", content=body,
                         headers={"Content-Type": "application/json"}) as response:
            if response.status_code == 200:  # a few chunks are enough (a number read out can last minutes),
                received = 0                 # and the server must clean up after a client that leaves
                for part in response.iter_bytes():
                    received += len(part)
                    if received > 65536:
                        break
                assert received
            else:
                assert response.status_code in {400, 413, 429, 503}, (response.status_code, response.read()[:300])
                error = json.loads(response.read())["error"]
                assert error["code"] in ERRORS and error["type"] and error["message"], error
    assert _quiet(server, engine)
