"""Resuming a WebSocket session after its connection dropped (docs/protocol.md, Resume), on the real server on a
loopback port with the tiny random-weight engine: the connection is cut by aborting the client's transport (no
closing handshake), as a lost network would; a resumed stream must equal, bit for bit, the same seeded request
never interrupted."""

from __future__ import annotations

import asyncio
import json
import os

import httpx2 as httpx
import numpy as np
import pytest
import websockets

from testkit import (
    SENTENCE,
    STARTS,
    Received,
    assert_same_output,
    cut_and_resume,
    open_contexts,
    send,
    uninterrupted,
    wait_until,
)
from tts.client import ServerError, connect


def run(coro, timeout: float = 120):
    return asyncio.run(asyncio.wait_for(coro, timeout))


@pytest.fixture
def resume_server(make_server, tiny_engine):
    return make_server(tiny_engine, resume_window_s=10)


def test_an_aborted_connection_resumes_with_no_gap_and_no_duplicate(resume_server):
    """Two contexts (binary and base64 audio, word timings), acknowledged as they arrive, cut mid-utterance by a
    transport abort, resumed on a new socket: each context's audio equals the uninterrupted stream's, bit for
    bit, and its events come once each."""
    server = resume_server
    cut = run(
        cut_and_resume(
            server.ws_url,
            lambda: server.hub.admission.connections == 1 and not any(s.link for s in server.hub.sessions),
        )
    )
    assert cut.held, "the dropped session was not kept"
    assert cut.resumed["type"] == "resumed" and cut.resumed["resume_token"] != cut.token
    assert cut.resumed["received"] == 6 and cut.resumed["resume_window_s"] == 10  # 2 starts, 2 texts, 2 ends
    assert_same_output(cut.got, cut.reference)
    assert wait_until(lambda: server.hub.admission.connections == 0 and server.hub.admission.active == 0)


def test_resume_takes_over_a_connection_the_server_still_holds(resume_server):
    """A half-open socket (the server has not noticed the drop): the resume takes the session over, and the
    new socket gets exactly what the old one's reader had not taken."""
    server = resume_server

    async def go():
        reference = await uninterrupted(server.ws_url, sentences=2)
        got = Received()
        old = await websockets.connect(server.ws_url)
        token = await open_contexts(old, got, sentences=2)
        await got.read(old, lambda: len(got.audio[None]) > 20_000)
        async with websockets.connect(server.ws_url) as new:
            await send(new, type="resume", token=token, contexts=[got.position(c) for c in STARTS])
            assert json.loads(await new.recv())["type"] == "resumed"
            await got.read(new, lambda: all(got.done(c) for c in STARTS))
        old.transport.abort()
        return reference, got

    reference, got = run(go())
    assert_same_output(got, reference)
    assert wait_until(lambda: server.hub.admission.connections == 0 and not server.hub.sessions)


async def dropped_session(url: str, ack: bool = True, sentences: int = 4) -> tuple[str, Received]:
    """An f32le utterance read for a while (acknowledged as it comes, or not), then cut off."""
    got = Received()
    ws = await websockets.connect(url)
    await send(ws, type="start", format="f32le", seed=5)
    await send(ws, type="text", text=SENTENCE * sentences)
    await send(ws, type="end")
    while len(got.audio[None]) < 100_000:
        got.take(await asyncio.wait_for(ws.recv(), 30))
        if ack:
            await send(ws, type="ack", **got.position())
    ws.transport.abort()
    return got.events[None][0]["resume_token"], got


async def resume(url: str, token: str, *contexts: dict) -> dict:
    async with websockets.connect(url) as ws:
        await send(ws, type="resume", token=token, contexts=list(contexts))
        return json.loads(await asyncio.wait_for(ws.recv(), 10))


def test_stale_offsets_unknown_and_spent_tokens_get_typed_errors(resume_server):
    server = resume_server

    async def go():
        token, got = await dropped_session(server.ws_url)
        unknown = await resume(server.ws_url, "no-such-token")
        acked_away = await resume(server.ws_url, token, {"bytes": 0, "events": 0})  # acknowledged: not held
        past_the_end = await resume(server.ws_url, token, {"bytes": 10**9, "events": 1})
        first = websockets.connect(server.ws_url)
        async with first as ws:  # a good resume, holding the session...
            await send(ws, type="resume", token=token, contexts=[got.position()])
            resumed = json.loads(await ws.recv())
            spent = await resume(server.ws_url, token, got.position())  # ...and a second one with its token
            await send(ws, type="cancel")
            await got.read(ws, got.done)
            not_first = await resume_after_start(server.ws_url, resumed["resume_token"])
        return unknown, acked_away, past_the_end, resumed, spent, not_first

    unknown, acked_away, past_the_end, resumed, spent, not_first = run(go())
    assert (unknown["type"], unknown["code"]) == ("error", "resume_expired")
    assert acked_away["code"] == "resume_offset" and "no longer held" in acked_away["message"]
    assert past_the_end["code"] == "resume_offset" and "past what was sent" in past_the_end["message"]
    assert resumed["type"] == "resumed"  # the failed tries did not spend the token
    assert spent["code"] == "resume_used"
    assert not_first["code"] == "bad_state"
    assert wait_until(lambda: server.hub.admission.connections == 0 and not server.hub.resume_tokens)


async def resume_after_start(url: str, token: str) -> dict:
    async with websockets.connect(url) as ws:
        await send(ws, type="start")
        assert json.loads(await ws.recv())["type"] == "ready"
        await send(ws, type="resume", token=token)
        return json.loads(await ws.recv())


def test_without_acks_the_replay_log_is_bounded(make_server, tiny_engine):
    """A client that never acknowledges: the server keeps only about the last resume_buffer_bytes of a context;
    a resume from before them is refused, one from within them gets the rest of the audio exactly."""
    server = make_server(tiny_engine, resume_window_s=10, resume_buffer_bytes=32_768)

    async def go():
        reference = Received()
        async with websockets.connect(server.ws_url) as ws:
            await send(ws, type="start", format="f32le", seed=5)
            await send(ws, type="text", text=SENTENCE * 4)
            await send(ws, type="end")
            await reference.read(ws, reference.done)
        token, _ = await dropped_session(server.ws_url, ack=False)
        await asyncio.to_thread(wait_until, lambda: len(server.hub.sessions) == 1)
        log = next(iter(server.hub.sessions)).logs[None]
        # the newest entry held: it stays even should the pump log one more chunk that it read before the drop
        nbytes, events, held = log.entries[-1].at_bytes, log.entries[-1].at_events, log.size
        refused = await resume(server.ws_url, token, {"bytes": 0, "events": events})
        got = Received()
        async with websockets.connect(server.ws_url) as ws:
            await send(ws, type="resume", token=token, contexts=[{"bytes": nbytes, "events": events}])
            resumed = json.loads(await ws.recv())
            await got.read(ws, got.done)
        return reference, nbytes, held, refused, resumed, got

    reference, nbytes, held, refused, resumed, got = run(go())
    assert nbytes > 0 and held <= 32_768 + 2 * 40_000  # the budget, and the newest entries whatever their size
    assert refused["code"] == "resume_offset" and "no longer held" in refused["message"]
    assert resumed["type"] == "resumed"
    assert bytes(got.audio[None]) == bytes(reference.audio[None][nbytes:])
    assert [e["type"] for e in got.events[None]] == ["done"]  # ready and the timings before it: acknowledged


def test_a_session_that_is_not_resumed_expires_and_frees_everything(make_server, tiny_engine):
    """While it waits, a dropped session holds its slot and counts as a connection; when the window passes it
    frees both, its engine stream and its token, and its token is then refused."""
    server = make_server(tiny_engine, resume_window_s=1.0)
    admission = server.hub.admission

    async def go():
        token, _ = await dropped_session(server.ws_url)
        await asyncio.sleep(0.3)
        waiting = (admission.connections, admission.active, len(server.hub.sessions))
        freed = await asyncio.to_thread(
            wait_until,
            lambda: (
                admission.connections == 0
                and admission.active == 0
                and not server.hub.sessions
                and not server.hub.streams
                and tiny_engine.active_streams == 0
            ),
            10,
        )
        return (
            waiting,
            freed,
            server.hub.resume_tokens.copy(),
            await resume(server.ws_url, token, {"bytes": 0, "events": 0}),
        )

    waiting, freed, tokens, late = run(go())
    assert waiting == (1, 1, 1)
    assert freed and tokens == {}
    assert late["code"] == "resume_expired"


def test_a_clean_close_ends_the_session_at_once(resume_server, tiny_engine):
    server = resume_server

    async def go():
        async with websockets.connect(server.ws_url) as ws:
            await send(ws, type="start", format="f32le")
            token = json.loads(await ws.recv())["resume_token"]
            await send(ws, type="text", text=SENTENCE * 6)
            await asyncio.wait_for(ws.recv(), 30)
        freed = await asyncio.to_thread(
            wait_until, lambda: server.hub.admission.connections == 0 and tiny_engine.active_streams == 0, 5
        )
        return freed, await resume(server.ws_url, token)

    freed, late = run(go())
    assert freed and late["code"] == "resume_expired"


def test_resume_off_sends_no_token_and_frees_a_dropped_session_at_once(make_server, tiny_engine):
    server = make_server(tiny_engine, resume_window_s=0)

    async def go():
        ws = await websockets.connect(server.ws_url)
        await send(ws, type="start")
        ready = json.loads(await ws.recv())
        await send(ws, type="text", text=SENTENCE * 6)
        await asyncio.wait_for(ws.recv(), 30)
        ws.transport.abort()
        return ready

    assert "resume_token" not in run(go())
    assert wait_until(lambda: server.hub.admission.connections == 0 and tiny_engine.active_streams == 0, 5)


# ---- the Python client ---------------------------------------------------------------------------
async def client_audio(url: str, text, abort_after: int | None = None, **options) -> tuple[np.ndarray, int]:
    """The utterance through tts.client; its connection aborted after `abort_after` chunks."""
    chunks = []
    async with connect(url, backoff_s=0.05) as client:
        async for chunk in client.speak(text, seed=7, **options):
            chunks.append(chunk)
            if len(chunks) == abort_after:
                client.ws.transport.abort()
        return np.concatenate(chunks), client.reconnects


def test_the_client_reconnects_and_its_caller_sees_one_uninterrupted_stream(resume_server):
    url = resume_server.ws_url
    reference, _ = run(client_audio(url, SENTENCE * 2))
    for abort_after in (1, 4):
        audio, reconnects = run(client_audio(url, SENTENCE * 2, abort_after=abort_after))
        assert reconnects == 1
        assert len(audio) == len(reference) and audio.tobytes() == reference.tobytes(), abort_after


def test_the_client_resends_text_the_server_did_not_get(resume_server):
    """Text still arriving (an LLM's pieces) when the connection drops: whatever the server had not received
    is sent again, once; the utterance ends whole."""

    async def pieces():
        for word in (SENTENCE * 2).split():
            yield word + " "
            await asyncio.sleep(0.02)

    async def go():
        chunks, done = [], None
        async with connect(resume_server.ws_url, backoff_s=0.05) as client:
            async for chunk in client.speak(pieces(), word_timings=True):
                chunks.append(chunk)
                if len(chunks) == 1:
                    client.ws.transport.abort()
            done = client.done
            words = [w["word"] for e in client.timings for w in e["words"]]
            return np.concatenate(chunks), done, words, client.reconnects

    audio, done, words, reconnects = run(go())
    assert reconnects == 1 and not done["cancelled"]
    assert len(audio) == round(done["audio_seconds"] * 24_000)
    assert words == (SENTENCE * 2).split()  # every word spoken once, in order


def test_the_client_reports_a_session_it_cannot_resume(make_server, tiny_engine):
    server = make_server(tiny_engine, resume_window_s=0.2)

    async def go():
        async with connect(server.ws_url, backoff_s=0.5, retries=2) as client:
            async for _ in client.speak(SENTENCE * 6):
                await asyncio.to_thread(wait_until, lambda: bool(server.hub.sessions))
                client.ws.transport.abort()

    with pytest.raises(ServerError) as failure:
        run(go())
    assert failure.value.code == "resume_expired"


@pytest.mark.parametrize(
    "cap, other_gets", [("max_connections_per_client", "ready"), ("max_connections", "server_full")]
)
def test_a_resume_gets_past_the_connection_cap_while_another_connection_is_open(
    make_server, tiny_engine, cap, other_gets
):
    """One connection allowed, per client or in all. The dropped session is set aside from its client's cap, so
    the client's next connection is served (its own dropped session never locks it out), but still counts in the
    server's (server_full). Either way the resume, one connection over the cap, is let in and completes the audio
    exactly."""
    server = make_server(tiny_engine, resume_window_s=10, **{cap: 1})

    async def go():
        reference, _ = await client_audio(server.ws_url, SENTENCE * 2)
        await asyncio.to_thread(wait_until, lambda: server.hub.admission.connections == 0)
        chunks, other = [], None
        async with connect(server.ws_url, backoff_s=0.05) as client:
            async for chunk in client.speak(SENTENCE * 2, seed=7):
                chunks.append(chunk)
                if len(chunks) == 2:
                    client.ws.transport.abort()
                    await asyncio.to_thread(wait_until, lambda: any(s.link is None for s in server.hub.sessions))
                    other = await websockets.connect(server.ws_url)  # open while the client resumes
                    await send(other, type="start")
                    answer = json.loads(await other.recv())
        await other.close()
        return reference, np.concatenate(chunks), client.reconnects, answer

    reference, audio, reconnects, answer = run(go())
    assert answer["type" if other_gets == "ready" else "code"] == other_gets
    assert reconnects == 1 and audio.tobytes() == reference.tobytes()


def test_stopping_the_server_ends_the_sessions_waiting_for_a_resume(make_server, tiny_engine):
    server = make_server(tiny_engine, resume_window_s=60)

    async def go():
        await dropped_session(server.ws_url)
        return await asyncio.to_thread(wait_until, lambda: any(s.link is None for s in server.hub.sessions))

    assert run(go()) and tiny_engine.active_streams >= 1
    server.stop()
    assert wait_until(lambda: tiny_engine.active_streams == 0 and not server.hub.sessions, 5)


def test_a_client_that_aborts_and_reconnects_is_never_locked_out_by_its_waiting_sessions(make_server):
    """The soak's rare HTTP 429 client_limit, made certain: caps of 2, one client aborting each utterance after its
    first audio and coming straight back, faster than its dropped sessions expire. Each waiting session is set
    aside from its client's caps, so every new WebSocket and speech request is served; the client keeps at most 2
    waiting (its oldest expires early: resume_expired), the newest still resumes, and 3 live connections are
    still one too many (client_limit)."""
    from testkit import tiny_random

    engine = tiny_random(max_streams=2, max_open=16)
    server = make_server(engine, resume_window_s=30, max_connections_per_client=2, max_streams_per_client=2)
    hub = server.hub

    async def abort_after_first_audio() -> tuple[dict, str | None]:
        ws = await websockets.connect(server.ws_url)
        await send(ws, type="start", format="f32le", seed=3)
        await send(ws, type="text", text=SENTENCE * 4)
        await send(ws, type="end")
        first = json.loads(await asyncio.wait_for(ws.recv(), 30))
        if first["type"] == "ready":
            assert isinstance(await asyncio.wait_for(ws.recv(), 30), bytes)
        ws.transport.abort()
        return first, first.get("resume_token")

    async def go():
        answers, tokens = [], []
        for _ in range(5):
            first, token = await abort_after_first_audio()
            answers.append(first["type"] if first["type"] == "ready" else first["code"])
            tokens.append(token)
        assert answers == ["ready"] * 5, answers  # each reconnection served
        waiting = await asyncio.to_thread(
            wait_until, lambda: hub.stats()["awaiting_resume"] == 2 and len(hub.sessions) == 2
        )
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as http:
            speech = await http.post("/v1/audio/speech", json={"input": "Still here.", "response_format": "pcm"})
        oldest = await resume(server.ws_url, tokens[0], {"bytes": 0, "events": 0})
        async with websockets.connect(server.ws_url) as a, websockets.connect(server.ws_url) as b:
            async with websockets.connect(server.ws_url) as third:
                await send(third, type="start")
                excess = json.loads(await asyncio.wait_for(third.recv(), 10))
            newest = Received()
            await send(a, type="resume", token=tokens[-1], contexts=[{"bytes": 0, "events": 0}])
            await newest.read(a, newest.done)
            await send(b, type="start")
            b_ready = json.loads(await asyncio.wait_for(b.recv(), 10))
        return waiting, speech, oldest, excess, newest, b_ready

    waiting, speech, oldest, excess, newest, b_ready = run(go())
    assert waiting, "the client's waiting sessions were not bounded at its cap"
    assert speech.status_code == 200 and len(speech.content) > 0
    assert oldest["code"] == "resume_expired"
    assert excess["code"] == "client_limit"
    assert newest.done() and not newest.events[None][-1]["cancelled"] and len(newest.audio[None]) > 0
    assert b_ready["type"] == "ready"
    # all that is left: the 4th session, still waiting (set aside: its client's own counts are back to none)
    assert wait_until(
        lambda: (
            hub.admission.stats() == {"connections": 1, "streams": 1, "queued": 0, "clients": 0}
            and len(hub.sessions) == 1
        )
    )
    server.stop()
    assert wait_until(lambda: engine.active_streams == 0 and hub.admission.connections == 0)
    engine.close()


# ---- issue 48: resume bound to its identity, bounded grace, spent tokens, every open context listed ----------
def test_a_resume_from_another_api_key_is_refused_and_spends_nothing(make_server, tiny_engine):
    """Issue 48 door 1: a client holding key 2 could resume (and hear) a session opened with key 1."""
    server = make_server(tiny_engine, resume_window_s=10, api_keys=["k1", "k2"])
    url = server.ws_url

    async def go():
        token, got = await dropped_session(url + "?api_key=k1")
        other = await resume(url + "?api_key=k2", token, got.position())
        own = await resume(url + "?api_key=k1", token, got.position())
        return other, own

    other, own = run(go())
    assert (other["type"], other["code"]) == ("error", "resume_forbidden")
    assert own["type"] == "resumed"  # the refused try spent nothing
    assert wait_until(lambda: server.hub.admission.connections == 0)


def test_a_resume_from_another_address_is_refused(make_server, tiny_engine):
    """Without keys a session belongs to the address that opened it (here 127.0.0.1; the thief: 127.0.0.2)."""
    server = make_server(tiny_engine, resume_window_s=10)

    async def go():
        token, got = await dropped_session(server.ws_url)
        async with websockets.connect(server.ws_url, local_addr=("127.0.0.2", 0)) as ws:
            await send(ws, type="resume", token=token, contexts=[got.position()])
            other = json.loads(await asyncio.wait_for(ws.recv(), 10))
        return other, await resume(server.ws_url, token, got.position())

    other, own = run(go())
    assert other["code"] == "resume_forbidden" and own["type"] == "resumed"


def test_connections_over_the_cap_wait_for_a_resume_only_as_many_as_the_client_has_sessions_waiting(make_server):
    """Issue 48 door 2: with one session waiting for its resume, every further connection from that address was
    held ~5 s (3,000 of them: 3,028 open files). Now one at a time waits; the rest are refused at once, and
    another address has nothing waiting, so it is refused at once too; the waiting session still resumes."""
    from testkit import tiny_random

    engine = tiny_random(max_streams=2, max_open=8)
    server = make_server(engine, resume_window_s=30, max_connections=2)

    async def refused_at_once(**connect) -> float:
        started = asyncio.get_running_loop().time()
        async with websockets.connect(server.ws_url, **connect) as ws:
            event = json.loads(await asyncio.wait_for(ws.recv(), 10))
            assert event["code"] == "server_full", event
        return asyncio.get_running_loop().time() - started

    async def go():
        token, got = await dropped_session(server.ws_url)
        live = await websockets.connect(server.ws_url)  # the server's second connection: now it is full
        assert await asyncio.to_thread(wait_until, lambda: server.hub.stats()["awaiting_resume"] == 1)
        held = await websockets.connect(server.ws_url)  # over the cap, may resume: held (it says nothing yet)
        quick = [await refused_at_once() for _ in range(20)]
        stranger = await refused_at_once(local_addr=("127.0.0.2", 0))
        fds_while = len(os.listdir("/proc/self/fd"))
        await send(held, type="resume", token=token, contexts=[got.position()])
        resumed = json.loads(await asyncio.wait_for(held.recv(), 10))
        await send(held, type="cancel")
        await got.read(held, got.done)
        await held.close()
        await live.close()
        return quick, stranger, resumed, fds_while

    quick, stranger, resumed, fds_while = run(go())
    assert max(quick) < 1.0 and stranger < 1.0, (quick, stranger)
    assert resumed["type"] == "resumed"
    assert wait_until(lambda: server.hub.admission.connections == 0)


def test_a_spent_token_answers_resume_used_after_its_session_has_ended(resume_server):
    """Issue 48 door 7: after the resumed session ended, its first token got resume_expired; the docs say
    resume_used."""
    server = resume_server

    async def go():
        token, got = await dropped_session(server.ws_url)
        async with websockets.connect(server.ws_url) as ws:
            await send(ws, type="resume", token=token, contexts=[got.position()])
            assert json.loads(await ws.recv())["type"] == "resumed"
            await send(ws, type="cancel")
            await got.read(ws, got.done)
        await asyncio.to_thread(wait_until, lambda: not server.hub.sessions)
        return await resume(server.ws_url, token, {"bytes": 0, "events": 0})

    assert run(go())["code"] == "resume_used"
    assert not server.hub.resume_tokens and len(server.hub.spent_tokens) >= 1


def test_a_resume_must_list_every_open_context(resume_server):
    """Issue 48 door 7: a resume listing one of two open contexts dropped the other's missing audio and still
    said done (not cancelled). Now it is refused (resume_offset, naming the context) and spends nothing; the
    full resume then gets everything."""
    server = resume_server

    async def go():
        got = Received()
        ws = await websockets.connect(server.ws_url)
        token = await open_contexts(ws, got, sentences=2)
        await got.read(ws, lambda: len(got.audio[None]) > 10_000 and len(got.audio["b"]) > 5_000)
        ws.transport.abort()
        await asyncio.to_thread(wait_until, lambda: server.hub.stats()["awaiting_resume"] == 1)
        partial = await resume(server.ws_url, token, got.position())
        async with websockets.connect(server.ws_url) as again:
            await send(again, type="resume", token=token, contexts=[got.position(c) for c in STARTS])
            resumed = json.loads(await again.recv())
            await got.read(again, lambda: all(got.done(c) for c in STARTS))
        return partial, resumed, got

    partial, resumed, got = run(go())
    assert partial["code"] == "resume_offset" and "'b'" not in partial["message"] and "b" in partial["message"]
    assert resumed["type"] == "resumed"
    assert all(not got.events[c][-1]["cancelled"] for c in STARTS)


def test_a_closed_connection_frees_its_socket_at_once(make_server, tiny_engine):
    """Issue 48 door 7: each closed connection's Link (and through it the socket, scope and buffers) lived
    idle_timeout_s (30 s) more, held by its uncancelled timer."""
    import gc
    import weakref

    server = make_server(tiny_engine, idle_timeout_s=30)
    links = []

    async def go():
        async with websockets.connect(server.ws_url) as ws:
            await send(ws, type="start")
            assert json.loads(await ws.recv())["type"] == "ready"
            await send(ws, type="text", text="Hi.")
            await send(ws, type="end")
            session = next(iter(server.hub.sessions))
            links.append(weakref.ref(session.link))
            while not isinstance(message := await ws.recv(), str) or json.loads(message)["type"] != "done":
                pass

    run(go())
    assert wait_until(lambda: not server.hub.sessions)
    assert wait_until(lambda: gc.collect() is not None and links[0]() is None, 3), "the link outlived its socket"
