"""Audio pushed to the event loop: `Stream.next_chunk` (awaited, no thread per reader) against the blocking
`Stream.read`, its cancellation, the errors and ends it reports, the batched wake-ups of `LoopWaker`, and a
real server whose idle readers hold no pool thread."""

from __future__ import annotations

import asyncio
import json
import threading

import numpy as np
import pytest
import websockets

from streaming.engine import EngineError
from streaming.stream import NOT_YET, LoopWaker
from testkit import tiny_random
from tts.text import TextError

TEXT = "The quick brown fox jumps over the lazy dog."


@pytest.fixture(scope="module")
def engine():
    engine = tiny_random(max_streams=2, max_open=64)
    yield engine
    engine.close()


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, timeout=120))


async def read_all(stream) -> np.ndarray:
    chunks = []
    while (chunk := await stream.next_chunk()) is not None:
        chunks.append(chunk)
    return np.concatenate(chunks)


def test_awaited_audio_equals_read_audio(engine):
    blocking = engine.open(seed=7)
    blocking.push_text(TEXT)
    blocking.end()
    chunks = []
    while (chunk := blocking.read(timeout=60)) is not None:
        chunks.append(chunk)

    async def go():
        stream = engine.open(seed=7)
        reading = asyncio.ensure_future(read_all(stream))  # waiting before any text
        await asyncio.sleep(0.05)
        stream.push_text(TEXT)
        stream.end()
        return await reading

    np.testing.assert_array_equal(run(go()), np.concatenate(chunks))


def test_a_cancelled_wait_leaves_the_stream_readable(engine):
    async def go():
        stream = engine.open(seed=1)
        waiting = asyncio.ensure_future(stream.next_chunk())
        await asyncio.sleep(0.05)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        stream.push_text(TEXT)
        stream.end()
        return await read_all(stream)

    assert len(run(go())) > 0


def test_news_from_another_thread_ends_a_wait(engine):
    """A cancel, a move (`take_unread`) or a failure from another thread wakes the waiting reader at once."""

    async def wait_while(stream, act):
        waiting = asyncio.ensure_future(stream.next_chunk())
        await asyncio.sleep(0.05)
        assert not waiting.done()
        threading.Thread(target=act).start()
        return await waiting

    async def go():
        cancelled, moved, failed = engine.open(), engine.open(), engine.open()
        assert await wait_while(cancelled, cancelled.cancel) is None
        assert await wait_while(moved, moved.take_unread) is None
        with pytest.raises(EngineError, match="boom"):
            await wait_while(failed, lambda: failed.finish(EngineError("boom")))
        moved.cancel(), failed.cancel()

    run(go())


def test_text_with_nothing_to_speak_is_raised_to_the_awaiting_reader(engine):
    async def go():
        stream = engine.open()
        waiting = asyncio.ensure_future(stream.next_chunk())
        stream.push_text("   ")
        stream.end()
        with pytest.raises(TextError):
            await waiting

    run(go())


def test_poll_says_not_yet_and_calls_its_waker_once():
    engine = tiny_random(max_streams=1)
    try:
        stream, calls = engine.open(), []
        assert stream.poll(lambda: calls.append(1)) is NOT_YET
        stream.cancel()
        stream.cancel()
        assert calls == [1] and stream.poll() is None
    finally:
        engine.close()


def test_wakes_before_the_loop_runs_cost_one_call_on_it(monkeypatch):
    async def go():
        loop = asyncio.get_running_loop()
        calls = []
        original = loop.call_soon_threadsafe
        monkeypatch.setattr(loop, "call_soon_threadsafe", lambda *a: calls.append(a) or original(*a))
        waker, futures = LoopWaker.of(loop), [loop.create_future() for _ in range(100)]
        futures[3].cancel()  # a reader that left: its wake is a no-op
        thread = threading.Thread(target=lambda: [waker.wake(f) for f in futures])
        thread.start()
        thread.join()  # the loop is blocked meanwhile: every wake joins the first one's call
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert len(calls) == 1
        assert all(f.done() for f in futures) and futures[3].cancelled()
        assert LoopWaker.of(loop) is waker

    run(go())


def test_idle_readers_hold_no_pool_thread_and_audio_still_arrives(make_server, engine):
    """50 utterances open and waiting for text: their audio pumps wait on the event loop, not in the pool
    (a pool thread per waiting reader before). Then one speaks and its audio reaches its client."""

    def pool_threads() -> int:
        return sum(t.name.startswith("tts-io") for t in threading.enumerate())

    server = make_server(engine, max_connections=64, max_connections_per_client=64, max_streams_per_client=64)

    async def go():
        sockets = []
        try:
            for _ in range(50):  # one at a time: the opens (in the pool) reuse one thread
                ws = await websockets.connect(server.ws_url)
                sockets.append(ws)
                await ws.send(json.dumps({"type": "start"}))
                assert json.loads(await ws.recv())["type"] == "ready"
            await asyncio.sleep(0.3)  # a reader polling in the pool would hold a thread now
            idle = pool_threads()
            speaker = sockets[-1]
            await speaker.send(json.dumps({"type": "text", "text": TEXT}))
            await speaker.send(json.dumps({"type": "end"}))
            audio = 0
            while isinstance(message := await speaker.recv(), bytes):
                audio += len(message)
            return idle, audio, json.loads(message)
        finally:
            for ws in sockets:
                await ws.close()

    idle, audio, done = run(go())
    assert idle <= 4, f"{idle} pool threads for 50 waiting readers"
    assert audio > 0 and done["type"] == "done" and not done["cancelled"]


class _Socket:
    """A WebSocket whose receive waits until it is given a message (`give`)."""

    def __init__(self):
        self.messages: asyncio.Queue = asyncio.Queue()

    async def receive(self):
        return await self.messages.get()


def test_a_link_times_out_breaks_and_passes_other_cancellations_on():
    """`Link.race`: a wait past its timeout raises TimeoutError, `cut` ends a wait with LinkBroken, a
    cancellation from elsewhere stays a cancellation, and a wait that gets its message returns it."""
    from serving.resume import Link, LinkBroken

    async def go():
        ws = _Socket()
        link = Link(ws, 0, 30.0)
        with pytest.raises(TimeoutError):
            await link.race(ws.receive(), 0.05)
        waiting = asyncio.ensure_future(link.race(ws.receive(), 30.0))
        await asyncio.sleep(0.01)
        ws.messages.put_nowait("hello")
        assert await waiting == "hello"
        elsewhere = asyncio.ensure_future(link.race(ws.receive(), 30.0))
        await asyncio.sleep(0.01)
        elsewhere.cancel()
        with pytest.raises(asyncio.CancelledError):
            await elsewhere
        racing = [asyncio.ensure_future(link.race(ws.receive(), 30.0)) for _ in range(3)]
        await asyncio.sleep(0.01)
        link.cut(dropped=True)
        for waiting in racing:
            with pytest.raises(LinkBroken):
                await waiting
        with pytest.raises(LinkBroken):
            await link.race(ws.receive(), 30.0)  # a broken link waits for nothing
        assert link.dropped

    run(go())
