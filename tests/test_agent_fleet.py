"""One agent host, many sessions (docs/agents.md, "An agent fleet"): sessions speaking at once from one address
through one `ContextPool`, against the real server on loopback with the documented fleet settings scaled down
(16 sessions for 64; the tiny engine's 4 slots): every reply is spoken, over ceil(16 / max_contexts) sockets, the
replies beyond the engine's slots waiting in the server's queue; with a per-client cap below the sessions, the
ones past it are refused with client_limit, as the docs say."""
from __future__ import annotations

import asyncio

import pytest

from tts.client import ServerError
from tts.contexts import ContextPool

SESSIONS, CONTEXTS = 16, 8
FLEET = {"max_contexts": CONTEXTS, "max_connections_per_client": 4, "max_streams_per_client": SESSIONS,
         "max_queue": SESSIONS, "queue_timeout_s": 60.0}


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
        refused = []
        for opening in asyncio.as_completed([pool.open(voice="joe") for _ in range(SESSIONS)]):
            try:
                context = await opening
            except ServerError as err:
                refused.append(err)
            else:
                await context.cancel()  # a reply ends: a queued one gets its slot
        await pool.aclose()
        return refused
    refused = asyncio.run(go())
    assert len(refused) == SESSIONS // 2
    assert all(isinstance(e, ServerError) and e.code == "client_limit" for e in refused)
