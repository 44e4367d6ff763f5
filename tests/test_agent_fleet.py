"""One agent host, many sessions (docs/agents.md, "An agent fleet"): sessions speaking at once from one address
through one `ContextPool`, against the real server on loopback with the documented fleet settings scaled down
(16 sessions for 64; the tiny engine's 4 slots): every reply is spoken, over ceil(16 / max_contexts) sockets, the
replies beyond the engine's slots waiting in the server's queue; with a per-client cap below the sessions, the
ones past it are refused with client_limit, as the docs say."""

from __future__ import annotations

import asyncio
import contextlib

from tts.client import ServerError
from tts.contexts import ContextPool

SESSIONS, CONTEXTS = 16, 8
FLEET = {
    "max_contexts": CONTEXTS,
    "max_connections_per_client": 4,
    "max_streams_per_client": SESSIONS,
    "max_queue": SESSIONS,
    "queue_timeout_s": 60.0,
}


async def _reply(pool: ContextPool, session: int, turn: int) -> int:
    context = await pool.open(voice="joe", seed=session * 10 + turn)
    for word in f"Reply {turn} of session {session}: the birch canoe slid on the smooth planks.".split():
        await context.push(word + " ")
    await context.end()
    return sum(len(e["pcm"]) for e in [e async for e in context.events()] if e["type"] == "audio")


async def _session(pool: ContextPool, session: int) -> list[int]:
    return [await _reply(pool, session, turn) for turn in range(2)]  # two turns of one conversation


def test_sixteen_sessions_share_two_sockets_and_all_speak(tiny_engine, make_server):
    server = make_server(tiny_engine, **FLEET)

    async def go():
        pool = ContextPool(server.ws_url, contexts_per_connection=CONTEXTS)
        spoken = await asyncio.gather(*(_session(pool, s) for s in range(SESSIONS)))
        connections = pool.connections
        await pool.aclose()
        return spoken, connections

    spoken, connections = asyncio.run(go())
    assert all(audio > 24_000 for replies in spoken for audio in replies)
    assert connections == SESSIONS // CONTEXTS


def test_past_the_per_client_cap_sessions_are_refused(tiny_engine, make_server):
    server = make_server(tiny_engine, **{**FLEET, "max_streams_per_client": SESSIONS // 2})

    async def go():
        pool = ContextPool(server.ws_url, contexts_per_connection=CONTEXTS)
        opening = [asyncio.create_task(pool.open(voice="joe")) for _ in range(SESSIONS)]
        slots = 4  # the tiny engine's: 4 ready, 4 queued (they count against the cap too), the rest refused
        while sum(t.done() for t in opening) < SESSIONS - (SESSIONS // 2 - slots):
            await asyncio.wait(opening, return_when=asyncio.FIRST_COMPLETED, timeout=30)
        refused = [t.exception() for t in opening if t.done() and t.exception() is not None]
        for task in asyncio.as_completed(opening):  # then every reply ends: the queued ones get slots and end too
            with contextlib.suppress(ServerError):
                await (await task).cancel()
        await pool.aclose()
        return refused

    refused = asyncio.run(go())
    assert len(refused) == SESSIONS // 2
    assert all(isinstance(e, ServerError) and e.code == "client_limit" for e in refused)
