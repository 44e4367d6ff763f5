"""A property-based fuzzer of the server, against the real server on loopback and the tiny engine.

Hypothesis draws WebSocket plans (valid, half-valid and garbage messages in random order, several contexts,
arbitrary Unicode, control characters, huge numbers, huge words; acks right and wrong; dropped connections
resumed exactly, resumed wrongly first, or not at all) and HTTP speech requests. For each: every event the
server sends is typed (a documented event type, a documented error code), the connection ends only with a
documented close code, every utterance that was started ends with one `done` (across a resume too), another
client's utterance running at the same time completes, and nothing leaks (connections, sessions, resume tokens,
admission slots, queue places, engine streams, parked states).

One server, one client event loop and one other client (the witness) serve the whole run; every wait is on an
event (an answer, a `done`), never a fixed sleep. The engine parks a stream that waits 20 ms and spills parked
states to disk after 100 ms, so streams park, spill and come back within examples.

CI runs a small budget; a thorough run is one variable away:

    TTS_FUZZ_EXAMPLES=10000 python -m pytest -q tests/test_fuzz.py     # each test draws this many examples
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import string
import threading
import time
from collections import Counter
from dataclasses import dataclass

import httpx2 as httpx  # the openai SDK's own HTTP client
import pytest
import websockets
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from serving.protocol import ERRORS, OUTPUT_RATES, UNCOUNTED, WS_FORMATS
from streaming.engine import Engine
from streaming.parking import ParkingConfig

EXAMPLES = int(os.environ.get("TTS_FUZZ_EXAMPLES", "10"))
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    database=None,
    derandomize=EXAMPLES <= 100,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture, HealthCheck.data_too_large],
)
EVENTS = {"ready", "queued", "timing", "audio", "done", "error", "resumed"}
CLOSE_CODES = {1000, 1009, 1013}  # idle_timeout, message too big, server full / client limit
LIMITS = {
    "max_text_chars": 600,
    "max_contexts": 3,
    "queue_timeout_s": 1.0,
    "idle_timeout_s": 60.0,
    "max_message_bytes": 16384,
    "resume_window_s": 1.0,
    "resume_buffer_bytes": 16 << 20,
}
PARKING = ParkingConfig(park_after_s=0.02, disk_after_s=0.1)  # park, spill and restore within an example
SPOKEN_S = 0.3  # after its end, an open utterance speaks this long (or to its done) before it is cancelled


def fuzz_engine() -> Engine:
    """The tiny random engine, 3 slots and 8 open streams (the rest parked, as `tts serve` runs)."""
    from testkit import tiny_model_and_codec

    model, codec, voices = tiny_model_and_codec()
    return Engine(model, codec, voices, max_streams=3, max_open=8, parking=PARKING, max_queued_seconds=1.0)


class ClientLoop:
    """One event loop for the clients of the whole run, in a thread: the witness's socket outlives examples."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="fuzz-clients", daemon=True)
        self.thread.start()

    def run(self, coro, timeout: float = 300):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)


class Witness:
    """Another client, on one socket for the whole run. Each example runs inside one of its utterances:
    `begin` starts it (ready, and text it speaks meanwhile), `finish` ends it and returns its `done` and the
    audio bytes it got; anything but ready, audio and done fails the example."""

    def __init__(self, url: str):
        self.url = url

    async def connect(self) -> Witness:
        self.ws = await websockets.connect(self.url)
        self.inbox: asyncio.Queue = asyncio.Queue()
        self.reader = asyncio.create_task(self._read())
        return self

    async def _read(self) -> None:
        async for message in self.ws:
            self.inbox.put_nowait(message)

    async def _next(self) -> dict | int:
        async with asyncio.timeout(60):
            message = await self.inbox.get()
        if isinstance(message, bytes):
            return len(message)
        event = json.loads(message)
        assert event["type"] in ("ready", "done"), event
        return event

    async def begin(self) -> None:
        await self.ws.send(json.dumps({"type": "start", "speed": 4.0}))  # short: it is spoken in every example
        await self.ws.send(json.dumps({"type": "text", "text": "Hi there. "}))
        event = await self._next()
        assert not isinstance(event, int) and event["type"] == "ready", event  # nothing else is open: no queue
        self.audio = 0

    async def finish(self) -> tuple[dict, int]:
        await self.ws.send(json.dumps({"type": "text", "text": "On."}))
        await self.ws.send(json.dumps({"type": "end"}))
        while isinstance(event := await self._next(), int):
            self.audio += event
        return event, self.audio

    async def close(self) -> None:
        await self.ws.close()
        await asyncio.gather(self.reader, return_exceptions=True)

    async def reconnect(self) -> None:
        await self.close()
        await self.connect()


@pytest.fixture(scope="module")
def fuzzed():
    """A server of its own (the fuzz must not share its engine with other tests' timing) and the witness."""
    from server import ServerThread

    engine = fuzz_engine()
    clients = ClientLoop()
    try:
        with ServerThread(engine, **LIMITS) as server:
            witness = clients.run(Witness(server.ws_url).connect())
            yield server, engine, clients, witness
            clients.run(witness.close())
    finally:
        clients.close()
        engine.close()


# ---- what is drawn -----------------------------------------------------------------------------------
CONTROL = st.characters(min_codepoint=0, max_codepoint=0x9F).filter(lambda c: not c.isprintable())
TEXT = st.one_of(
    st.text(max_size=80),  # arbitrary Unicode
    st.text(st.characters(codec="utf-8"), max_size=300),
    st.builds(lambda a, c, b: a + c + b, st.text(max_size=20), CONTROL, st.text(max_size=20)),
    st.builds(
        lambda d, n, tail: f"The number is {d * n}{tail}.",
        st.sampled_from("123456789"),  # huge numbers
        st.integers(15, 800),
        st.sampled_from(["", ".5", ",000", "th", " 42"]),
    ),
    st.builds(
        lambda w, n: f"A {w * n} word.",
        st.text(string.ascii_letters, min_size=1, max_size=9),  # huge words
        st.integers(20, 200),
    ),
    st.sampled_from(["Hello there. ", "How are", " you today?", "$3.50 on 3/4/2021 at 10:30.", "   ", ""]),
)
CONTEXTS = ["a", "b", "c", "d"]
CONTEXT = st.sampled_from([None, None, None, *CONTEXTS, "", "x" * 65, "bad id!"])
# allow_subnormal=False: the engine sets flush-to-zero (torch.set_flush_denormal), which hypothesis detects
JUNK = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(allow_nan=False, allow_subnormal=False),
    st.text(max_size=10),
    st.lists(st.integers(), max_size=2),
)
SPEED = st.floats(0.2, 4.2, allow_subnormal=False)


def _message(kind: str, context, extra: dict) -> dict:
    message = {"type": kind, **extra}
    if context is not None:
        message["context_id"] = context
    return message


START = st.builds(
    lambda context, extra: _message("start", context, extra),
    CONTEXT,
    st.fixed_dictionaries(
        {},
        optional={
            "voice": st.one_of(st.sampled_from(["joe", "slt", "alloy", "NOVA", "", "nobody"]), JUNK),
            "format": st.one_of(st.sampled_from(WS_FORMATS), JUNK),
            "sample_rate": st.one_of(st.sampled_from(OUTPUT_RATES), st.integers(-1, 10**6), JUNK),
            "speed": st.one_of(SPEED, JUNK),
            "seed": st.one_of(st.integers(-5, 2**64), JUNK),
            "timings": st.one_of(st.booleans(), JUNK),
            "word_timings": st.one_of(st.booleans(), JUNK),
            "volume": JUNK,
        },
    ),
)
VALID_START = st.builds(
    lambda extra: {"type": "start", **extra},
    st.fixed_dictionaries(
        {},
        optional={
            "voice": st.sampled_from(["joe", "slt", "alloy", "NOVA"]),
            "format": st.sampled_from(WS_FORMATS),
            "sample_rate": st.sampled_from(OUTPUT_RATES),
            "speed": st.floats(0.25, 4.0, allow_subnormal=False),
            "seed": st.integers(0, 2**63 - 1),
            "timings": st.booleans(),
            "word_timings": st.booleans(),
        },
    ),
)
# a resume that is not the first message, or is malformed: its answer names `token` or `contexts` (a client
# tells the answers to a resume apart, as they are no part of the session's output)
JUNK_RESUME = st.builds(
    lambda extra: {"type": "resume", **extra},
    st.fixed_dictionaries(
        {},
        optional={
            "token": st.one_of(st.text(max_size=70), JUNK),
            "contexts": st.one_of(st.lists(st.fixed_dictionaries({"bytes": JUNK, "events": JUNK}), max_size=2), JUNK),
        },
    ),
)
MESSAGE = st.one_of(
    START,
    START,
    st.builds(lambda context, text: _message("text", context, {"text": text}), CONTEXT, TEXT),
    st.builds(lambda context, text: _message("text", context, {"text": text}), CONTEXT, TEXT),
    st.builds(lambda kind, context: _message(kind, context, {}), st.sampled_from(["flush", "end", "cancel"]), CONTEXT),
    st.builds(lambda kind, junk: {"type": kind, "text": junk}, st.sampled_from(["text", "sing", ""]), JUNK),
    st.builds(
        lambda context, extra: _message("ack", context, extra),
        CONTEXT,
        st.fixed_dictionaries({}, optional={"bytes": JUNK, "events": JUNK}),
    ),
    JUNK_RESUME,
    st.dictionaries(st.text(max_size=8), JUNK, max_size=3),  # objects of any keys
    st.text(max_size=40),  # raw text: mostly not JSON
    st.binary(max_size=40),  # binary messages
)


@dataclass(frozen=True)
class Ack:
    """An ack of what the client holds of a context: exactly (`held`), less (`older`, harmless), or more than
    was ever sent (`past`: bad_value)."""

    context: str | None
    how: str


@dataclass(frozen=True)
class Drop:
    """The connection is lost (the transport aborted: no close frame). The client connects again and resumes
    `exact`ly; first with a position past what was sent (`offset`, then exactly); first with an unknown token
    (`expired`, then exactly); or not at all (`fresh`: a new session; the old one expires)."""

    how: str


@dataclass(frozen=True)
class Pause:
    """The client says nothing for a while (its streams run dry and park)."""

    seconds: float


ACK = st.builds(Ack, st.sampled_from([None, *CONTEXTS]), st.sampled_from(["held", "held", "older", "past"]))
DROP = st.builds(Drop, st.sampled_from(["exact", "exact", "exact", "offset", "expired", "fresh"]))
PAUSE = st.builds(Pause, st.sampled_from([0.005, 0.03, 0.15]))


@st.composite
def utterance(draw) -> list:
    """A protocol-shaped run: a start, pieces of text, a flush or an end, all on one context (which is what
    gets text as far as the engine)."""
    context = draw(CONTEXT)
    start = draw(st.one_of(VALID_START, VALID_START, VALID_START, START))
    start = {**start, "context_id": context} if context is not None else start
    texts = [_message("text", context, {"text": t}) for t in draw(st.lists(TEXT, min_size=1, max_size=4))]
    return [start, *texts, _message(draw(st.sampled_from(["flush", "end", "end"])), context, {})]


PLAN = st.lists(
    st.one_of(
        MESSAGE.map(lambda m: [m]),
        utterance(),
        utterance(),
        ACK.map(lambda a: [a]),
        DROP.map(lambda d: [d]),
        PAUSE.map(lambda p: [p]),
    ),
    max_size=6,
).map(lambda runs: [step for run in runs for step in run])


def _raw(message) -> str | bytes:
    return message if isinstance(message, (str, bytes)) else json.dumps(message)


def _counted(message) -> bool:
    """Whether the server counts the message in a resume's `received` (all but acks and resumes)."""
    if isinstance(message, bytes):
        return True
    try:
        parsed = json.loads(_raw(message))
    except ValueError:
        return True
    return not (isinstance(parsed, dict) and parsed.get("type") in UNCOUNTED)


# ---- the client ----------------------------------------------------------------------------------
SYNC = "fuzz-sync"  # a context never started: a flush on it is always answered with bad_state
RESUME_ANSWERS = ("resume_expired", "resume_used", "resume_offset")


def _answers_resume(event: dict) -> bool:
    """An answer to a resume message: no part of the session's output, so no event of a position."""
    if event["type"] != "error" or event.get("context_id") is not None:
        return False
    message = event["message"]
    return (
        event["code"] in RESUME_ANSWERS
        or message.startswith("resume must be")
        or (message.startswith(("token", "contexts")) and event["code"] != "unknown_key")
    )


class Session:
    """What one server session said to the fuzzed client, checked as it arrives, and what the client holds of
    each context (its position for a resume)."""

    def __init__(self):
        self.events: list[dict] = []
        self.bytes: dict = {}  # context -> audio bytes received
        self.counted: dict = {}  # context -> events received that a position counts
        self.sent: list = []  # the client's messages that `received` counts, to send again after a resume
        self.token: str | None = None
        self.resumed: dict | None = None  # the `resumed` event, once the session has been resumed
        self.changed = asyncio.Event()

    def add(self, message) -> None:
        if isinstance(message, bytes):
            self.bytes[None] = self.bytes.get(None, 0) + len(message)  # audio of the default context
            return
        event = json.loads(message)  # every text message is JSON
        assert event.get("type") in EVENTS, event
        context = event.get("context_id")
        if event["type"] == "error":
            assert event["code"] in ERRORS and isinstance(event["message"], str) and event["message"], event
        elif event["type"] == "audio":
            assert context is not None, event  # the default context's audio comes in binary frames
            self.bytes[context] = self.bytes.get(context, 0) + len(base64.b64decode(event["audio"], validate=True))
        if event.get("resume_token"):
            self.token = event["resume_token"]
        if event["type"] not in ("queued", "audio", "resumed") and not _answers_resume(event):
            self.counted[context] = self.counted.get(context, 0) + 1
        self.events.append(event)
        self.changed.set()

    async def until(self, condition, seconds: float) -> bool:
        """Wait for `condition()` on what has arrived, at most `seconds`; whether it holds."""
        deadline = time.monotonic() + seconds
        while not condition():
            self.changed.clear()
            if (left := deadline - time.monotonic()) <= 0:
                return False
            try:
                async with asyncio.timeout(left):
                    await self.changed.wait()
            except TimeoutError:
                pass
        return True

    def position(self, context: str | None) -> dict:
        where = {"bytes": self.bytes.get(context, 0), "events": self.counted.get(context, 0)}
        return where if context is None else {"context_id": context, **where}

    def open_contexts(self) -> set:
        """Contexts whose utterance started (queued or ready) and has not ended yet."""
        open_ = set()
        for event in self.events:
            context = event.get("context_id")
            if event["type"] in ("queued", "ready"):
                open_.add(context)
            elif event["type"] == "done" or (
                event["type"] == "error" and context in open_ and event["code"] in ("server_full", "client_limit")
            ):
                open_.discard(context)
        return open_


class FuzzClient:
    """The fuzzed client: sends a plan's messages while a reader takes in everything the server says."""

    def __init__(self, url: str):
        self.url = url
        self.session = Session()
        self.sessions = [self.session]
        self.closed: int | None = None  # the close code, when the server closed the connection
        self.closing = False
        self.resuming: Session | None = None  # the session a resume sent on this connection would go on with

    async def connect(self) -> None:
        self.ws = await websockets.connect(self.url, max_size=None)
        self.reader = asyncio.create_task(self._read(self.ws))

    async def _read(self, ws) -> None:
        try:
            async for message in ws:
                answers = self.session
                if (
                    self.resuming is not None
                    and isinstance(message, str)
                    and json.loads(message).get("type") == "resumed"
                ):
                    answers.add(message)  # the answer to the resume; what follows is the old session's
                    self.session, self.resuming = self.resuming, None
                    self.session.token, self.session.resumed = answers.token, answers.events[-1]
                    answers.changed.set()
                else:
                    answers.add(message)
        except websockets.ConnectionClosedError:
            pass  # an aborted transport (a drop), or the server's own close, seen below
        if not self.closing and ws.close_code is not None and ws.close_code != 1006:
            self.closed = ws.close_code
        self.session.changed.set()

    async def send(self, message) -> None:
        if _counted(message):
            self.session.sent.append(message)
        await self.ws.send(_raw(message))

    async def sync(self) -> None:
        """The server answers messages in order: once it refuses this one, every earlier answer is in."""
        session = self.session
        answered = sum(1 for e in session.events if e.get("context_id") == SYNC)
        await self.send({"type": "flush", "context_id": SYNC})
        assert await session.until(
            lambda: self.closed or sum(1 for e in session.events if e.get("context_id") == SYNC) > answered, 30
        ), session.events

    async def ack(self, step: Ack) -> None:
        where = self.session.position(step.context)
        if step.how == "older":
            where = {**where, "bytes": where["bytes"] // 2, "events": max(0, where["events"] - 1)}
        elif step.how == "past":
            where = {**where, "bytes": where["bytes"] + 2**40}
        await self.send({"type": "ack", **where})

    async def drop(self, step: Drop) -> None:
        """Lose the connection, connect again and resume (or not), as `step` says."""
        self.ws.transport.abort()
        await self.reader
        if self.closed:
            return
        old, self.session = self.session, Session()
        await self.connect()
        if old.token is None or step.how == "fresh":  # a new session; the old one expires, or has closed
            self.sessions.append(self.session)
            return
        answers = self.session  # what this connection says before `resumed` is no part of the session
        wrong = {
            "offset": {"token": old.token, "contexts": [{"bytes": 2**40, "events": 0}]},
            "expired": {"token": "not-a-resume-token"},
        }.get(step.how)
        if wrong:
            await self.ws.send(json.dumps({"type": "resume", **wrong}))
            code = "resume_offset" if step.how == "offset" else "resume_expired"
            assert await answers.until(lambda: self.closed or answers.events, 10), "no answer to a resume"
            assert self.closed or [e.get("code") for e in answers.events] == [code], answers.events
        self.resuming = old
        positions = [old.position(c) for c in (None, *CONTEXTS, SYNC)]
        await self.ws.send(json.dumps({"type": "resume", "token": old.token, "contexts": positions}))
        assert await answers.until(
            lambda: self.closed or self.session is old or len(answers.events) > bool(wrong), 10
        ), "no answer to a resume"
        if self.closed:
            return
        assert self.session is old, answers.events  # resumed
        for message in old.sent[old.resumed["received"] :]:  # what the server had not taken: again
            await self.ws.send(_raw(message))

    async def finish(self) -> None:
        """Every started utterance must end: end what is open (its text is spoken, for a while: a 400-digit
        number read out takes minutes), then cancel what is still open; each says done."""
        await self.sync()
        session = self.session
        for close, seconds in (("end", SPOKEN_S), ("cancel", 30)):
            for context in session.open_contexts():
                await self.send(_message(close, context, {}))
            await session.until(lambda: self.closed or not session.open_contexts(), seconds)
        assert self.closed or not session.open_contexts(), session.events

    async def close(self) -> None:
        self.closing = True
        await self.ws.close()
        await self.reader
        if self.closed is not None:
            assert self.closed in CLOSE_CODES, (self.closed, self.session.events)


async def _fuzz_socket(url: str, plan: list) -> FuzzClient:
    client = FuzzClient(url)
    await client.connect()
    for step in plan:
        if client.closed:
            break
        try:
            if isinstance(step, Ack):
                await client.ack(step)
            elif isinstance(step, Drop):
                await client.drop(step)
            elif isinstance(step, Pause):
                await asyncio.sleep(step.seconds)
            else:
                await client.send(step)
        except websockets.ConnectionClosed:
            await client.reader
            break
    if not client.closed:
        try:
            await client.finish()
        except websockets.ConnectionClosed:
            await client.reader
    await client.close()
    for session in client.sessions:
        assert _one_done_each(session), session.events
    return client


def _one_done_each(session: Session) -> bool:
    """No context says done more often than the client started utterances on it (a cancel may come before the
    ready, and after a resume a queued may be lost: a place in the queue is not replayed)."""
    starts, dones = Counter(), Counter(e.get("context_id") for e in session.events if e["type"] == "done")
    for message in session.sent:
        if isinstance(message, dict) and message.get("type") == "start":
            starts[message.get("context_id")] += 1
    return all(count <= starts[context] for context, count in dones.items())


def _quiet(server, engine, witness_only: bool = True, seconds: float = 10) -> bool:
    """Nothing is left but the witness: no other connection, session, token, stream, queue place or parked
    state (a dropped session that was not resumed goes when its window, 1 s, has passed)."""
    hub, deadline = server.hub, time.monotonic() + seconds
    while time.monotonic() < deadline:
        parking = engine.store.stats()
        if (
            hub.admission.connections == 1
            and hub.admission.active == hub.admission.queued == 0
            and not hub.streams
            and len(hub.sessions) == 1
            and len(hub.resume_tokens) == 1
            and engine.active_streams == 0
            and parking["host_bytes"] == parking["disk_bytes"] == 0
            and sum(parking["parked"].values()) == 0
        ):
            return True
        time.sleep(0.005)
    return False


ISSUE_25 = [  # the cases that once failed every stream on the server: always tried, whatever the budget
    [{"type": "start"}, {"type": "text", "text": "Hello\u0000 world."}, {"type": "end"}],
    [{"type": "start"}, {"type": "text", "text": "The number is " + "7" * 400 + "."}, {"type": "flush"}],
    [{"type": "start", "voice": ""}, {"type": "start", "context_id": "a"}, {"type": "cancel", "context_id": "a"}],
]
RESUMED = [  # a drop in the middle of two utterances, resumed after a wrong first try; a resume mid-session
    [
        {"type": "start"},
        {"type": "start", "context_id": "a"},
        {"type": "text", "text": "Hello there. "},
        {"type": "text", "context_id": "a", "text": "How are you today?"},
        Pause(0.05),
        Ack(None, "held"),
        Drop("offset"),
        {"type": "end"},
        {"type": "end", "context_id": "a"},
    ],
    [
        {"type": "start", "format": "wav"},
        {"type": "text", "text": "Hello there. "},
        Drop("exact"),
        {"type": "resume", "token": "x"},
        Drop("fresh"),
        {"type": "start"},
        {"type": "end"},
    ],
]


def _witnessed(fuzzed, work):
    """Run `work()` (a coroutine) inside an utterance of the witness; the witness's utterance must complete and
    nothing may be left over."""
    server, engine, clients, witness = fuzzed

    async def go():
        await witness.begin()
        result = await work()
        return result, await witness.finish()

    try:
        result, (done, audio) = clients.run(go())
    except BaseException:
        clients.run(witness.reconnect())  # the next example (hypothesis shrinking this one) starts clean
        raise
    assert done["type"] == "done" and not done["cancelled"] and audio > 0, (done, result)
    assert _quiet(server, engine), (server.hub.stats(), engine.stats(), len(server.hub.resume_tokens))
    return result


@FUZZ
@given(plan=PLAN)
@example(plan=ISSUE_25[0])
@example(plan=ISSUE_25[1])
@example(plan=ISSUE_25[2])
@example(plan=RESUMED[0])
@example(plan=RESUMED[1])
def test_fuzzed_websocket_messages(fuzzed, plan):
    client = _witnessed(fuzzed, lambda: _fuzz_socket(fuzzed[0].ws_url, plan))
    if any(isinstance(m, bytes) for m in plan) and not any(isinstance(m, Drop) for m in plan) and not client.closed:
        assert any(e["type"] == "error" and e["code"] == "bad_message" for e in client.session.events)


SPEECH_BODY = st.fixed_dictionaries(
    {},
    optional={
        "input": st.one_of(TEXT, JUNK),
        "voice": st.one_of(
            st.sampled_from(["joe", "alloy", "", "nobody"]),
            st.fixed_dictionaries({"id": st.sampled_from(["slt", "x"])}),
            JUNK,
        ),
        "model": st.one_of(st.just("tts-1"), JUNK),
        "response_format": st.one_of(st.sampled_from(["mp3", "opus", "aac", "flac", "wav", "pcm", "ogg"]), JUNK),
        "stream_format": st.one_of(st.sampled_from(["audio", "sse", "raw"]), JUNK),
        "speed": st.one_of(SPEED, JUNK),
        "seed": st.one_of(st.integers(-5, 2**64), JUNK),
        "sample_rate": st.one_of(st.sampled_from(OUTPUT_RATES), st.integers(0, 10**5)),
        "volume": JUNK,
    },
)


async def _speech(url: str, body, keep: int) -> int:
    """POST the body; read a 200's audio up to `keep` bytes and leave (a number read out can last minutes, and
    the server must clean up after a client that leaves). Returns the status."""
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        async with http.stream(
            "POST", "/v1/audio/speech", content=body, headers={"Content-Type": "application/json"}
        ) as response:
            if response.status_code == 200:
                received = 0
                async for part in response.aiter_bytes():
                    received += len(part)
                    if received > keep:
                        break
                assert received
            else:
                content = await response.aread()
                assert response.status_code in {400, 413, 429, 503}, (response.status_code, content[:300])
                error = json.loads(content)["error"]
                assert error["code"] in ERRORS and error["type"] and error["message"], error
            return response.status_code


@FUZZ
@given(
    body=st.one_of(SPEECH_BODY.map(json.dumps), st.text(max_size=50), st.binary(max_size=50)),
    keep=st.sampled_from([0, 16384]),
)
@example(body=json.dumps({"input": "Hello\u0000 world.", "voice": "joe"}), keep=16384)
@example(body=json.dumps({"input": "The number is " + "7" * 400 + ".", "voice": "joe"}), keep=16384)
def test_fuzzed_speech_requests(fuzzed, body, keep):
    _witnessed(fuzzed, lambda: _speech(fuzzed[0].url, body, keep))


# ---- Wyoming (issue 48): the same kind of fuzz on the Wyoming server ----------------------------------------
WYOMING_EVENTS = {"info", "audio-start", "audio-chunk", "audio-stop", "synthesize-stopped", "error"}
WYOMING_CODES = {
    "unknown_voice",
    "unsupported_language",
    "unsupported_text_format",
    "bad_text",
    "text_too_long",
    "audio_too_long",
    "server_full",
    "client_limit",
    "idle_timeout",
    "event_too_large",
    "engine_error",
    "bad_event",
    "internal",
}
# max_audio_s: a synthesize is answered whole before the next event is read, and a huge word read out can last
# minutes; capped, every reply is short (and audio_too_long is drawn too)
WYOMING_LIMITS = {
    "max_text_chars": 600,
    "max_message_bytes": 16384,
    "idle_timeout_s": 60.0,
    "max_connections": 8,
    "max_connections_per_client": 4,
    "max_audio_s": 3.0,
}


class _LogTap:
    """Every log record at WARNING or above, and any traceback, from the whole process while the fuzz runs."""

    def __init__(self):
        import logging

        self.records: list[str] = []
        self.handler = logging.Handler(logging.WARNING)
        self.handler.emit = lambda record: self.records.append(
            f"{record.name}: {record.getMessage()}" + (" [traceback]" if record.exc_info else "")
        )
        logging.getLogger().addHandler(self.handler)

    def close(self) -> None:
        import logging

        logging.getLogger().removeHandler(self.handler)


@pytest.fixture(scope="module")
def wyoming_fuzzed():
    from serving.limits import Limits
    from serving.wyoming import WyomingServer
    from testkit import tiny_random

    engine = tiny_random(max_streams=3, max_open=8)
    tap = _LogTap()
    with (
        socket_port() as port,
        WyomingServer(engine, f"tcp://127.0.0.1:{port}", limits=Limits(**WYOMING_LIMITS)) as server,
    ):
        yield server, engine, port, tap
    tap.close()
    engine.close()


@contextlib.contextmanager
def socket_port():
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    yield port


def _wire(event: dict, data: dict | None = None, payload: bytes = b"") -> bytes:
    """One Wyoming event as the package writes it: header line, data, payload."""
    header = dict(event)
    extra = json.dumps(data).encode() if data else b""
    if extra:
        header["data_length"] = len(extra)
    if payload:
        header["payload_length"] = len(payload)
    return json.dumps(header).encode() + b"\n" + extra + payload


WYOMING_TEXT = st.one_of(TEXT, JUNK)
VOICE = st.one_of(
    st.none(),
    st.fixed_dictionaries(
        {},
        optional={
            "name": st.one_of(st.sampled_from(["joe", "x"]), JUNK),
            "language": st.one_of(st.sampled_from(["en_US", "de"]), JUNK),
        },
    ),
    JUNK,
)
WYOMING_EVENT = st.one_of(
    st.just(_wire({"type": "describe"})),
    st.builds(lambda t, v: _wire({"type": "synthesize", "data": {"text": t, "voice": v}}), WYOMING_TEXT, VOICE),
    st.builds(lambda v: _wire({"type": "synthesize-start", "data": {"voice": v}}), VOICE),
    st.builds(lambda t: _wire({"type": "synthesize-chunk", "data": {"text": t}}), WYOMING_TEXT),
    st.just(_wire({"type": "synthesize-stop"})),
    st.builds(lambda t: _wire({"type": "synthesize"}, {"text": t}), WYOMING_TEXT),  # text in the data part
    st.builds(lambda p: _wire({"type": "audio-chunk"}, payload=p), st.binary(min_size=1, max_size=64)),
    st.builds(
        lambda h: json.dumps(h).encode() + b"\n",  # headers of every wrong shape
        st.one_of(
            JUNK,
            st.dictionaries(
                st.sampled_from(["type", "data", "data_length", "payload_length", "version"]), JUNK, max_size=4
            ),
        ),
    ),
    st.binary(max_size=40).map(lambda b: b.replace(b"\n", b"") + b"\n"),
)
WYOMING_PLAN = st.tuples(st.lists(WYOMING_EVENT, max_size=8), st.sampled_from(["close", "abort", "describe"]))


async def _wyoming_plan(port: int, events: list[bytes], end: str) -> list[dict]:
    """Send the events, then end as planned ("describe": ask for info and read until it comes). Returns what the
    server sent (header fields, data merged); a close by the server must follow an error event."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    got, closed, reset = [], False, False

    async def read() -> None:
        nonlocal closed, reset
        try:
            await read_events()
        except ConnectionError:  # the server closed with our bytes unread: a reset (what it said may be lost)
            closed = reset = True

    async def read_events() -> None:
        nonlocal closed
        while line := await reader.readline():
            header = json.loads(line)
            if header.get("data_length"):
                more = json.loads(await reader.readexactly(header["data_length"]))
                header["data"] = {**header.get("data", {}), **more}
            if header.get("payload_length"):
                await reader.readexactly(header["payload_length"])
            got.append(header)
            if end == "describe" and header["type"] == "info" and sent_all.is_set():
                return
        closed = True

    sent_all = asyncio.Event()
    reading = asyncio.create_task(read())
    try:
        for event in events:
            writer.write(event)
        if end == "describe":
            writer.write(_wire({"type": "describe"}))
        sent_all.set()
        with contextlib.suppress(ConnectionError):
            await writer.drain()
        if end == "describe":
            async with asyncio.timeout(60):
                await reading
        else:
            await asyncio.sleep(0.05)
    finally:
        reading.cancel()
        if end == "abort":
            writer.transport.abort()
        else:
            writer.close()
    if closed and not reset:
        assert any(e["type"] == "error" for e in got), ("closed without an error event", got)
    return got


@FUZZ
@given(plan=WYOMING_PLAN)
@example(plan=([b"[1,2,3]\n", b'{"data": {}}\n', b'{"type": "synthesize", "data": [1]}\n'], "describe"))
@example(plan=([b'{"type": "synthesize", "data_length": "12"}\n'], "describe"))
@example(plan=([_wire({"type": "synthesize", "data": {"text": "Hello\u0000 world."}})], "describe"))
@example(plan=([b'{"type": "synthesize", "payload_length": 1000000000000}\n' + b"x" * 4096], "describe"))
@example(plan=([_wire({"type": "synthesize"}, {"text": "A " + "kzuCeOsVN" * 55 + " word."})] * 2, "describe"))
def test_fuzzed_wyoming_events(wyoming_fuzzed, plan):
    server, engine, port, tap = wyoming_fuzzed
    events, end = plan
    got = asyncio.run(asyncio.wait_for(_wyoming_plan(port, events, end), 120))
    for event in got:
        assert event["type"] in WYOMING_EVENTS, event
        if event["type"] == "error":
            assert event["data"]["code"] in WYOMING_CODES and event["data"]["text"], event
    # the server still serves, and nothing is left: no connection, no engine stream, nothing in the log
    after = asyncio.run(
        asyncio.wait_for(_wyoming_plan(port, [_wire({"type": "synthesize", "data": {"text": "Hi."}})], "describe"), 60)
    )
    assert [e["type"] for e in after if e["type"] in ("audio-start", "audio-stop")] == ["audio-start", "audio-stop"]
    deadline = time.monotonic() + 10
    while (engine.active_streams or server.admission.connections) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine.active_streams == 0 and server.admission.connections == 0
    assert not [r for r in tap.records if "traceback" in r or "never retrieved" in r], tap.records
