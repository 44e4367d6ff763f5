"""Issue 25's table of hostile and careless clients, each row re-tried against a real `tts serve` (a child process,
default flags but where a row names its own) on a real loopback socket. One JSON line per row, then a summary:

    python -m bench.hostile          # about 2 minutes on 2 cores (30 s of it waiting for dropped sessions to expire)

Each row says what it did, what came back and `ok` (the issue's fix holds). Rows:
nul_ws, number_ws (a NUL byte / a 400-digit number in one client's text while another client speaks: the other
completes), nul_http, number_http (the same on POST /v1/audio/speech: a 4xx in OpenAI's shape or audio, never a
500), http_16_default (16 concurrent speech requests on the default server: all complete), http_12_on_4_slots
(12 on a 4-slot server: all complete, queued), idle_noop_cancels (16 idle sockets sending a no-op cancel every
second: each is closed at the idle timeout all the same, and a newcomer from another address is served meanwhile),
origin_evil, origin_null (the upgrade refused with 403; the server's own origin is accepted), aborts_30
(30 connections aborted in a tight loop: nothing fails, another utterance completes, every dropped session
expires), threads_8_api (8 threads calling tts.synthesize_stream() at once on a 4-slot engine: all complete),
voice_empty (WebSocket and HTTP: unknown_voice), put_speech (405 with Allow: POST), server_log (no traceback
in either server's log).
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections import Counter

import httpx2 as httpx
import websockets

from bench.common import ServeProcess

OTHER = "The other client is speaking, and it goes on all the way to the end."
NUMBER = "The number is " + "7" * 400 + "."
SPEECH = "Please call me back when you have a moment this afternoon."


async def utterance(url: str, text: str, start: dict | None = None, audio_enough: int | None = None, **connect) -> dict:
    """One WebSocket utterance: start, the text, end; reads to its done (or, with `audio_enough`, cancels once
    that much audio came). Returns the error codes, the audio bytes and the done."""
    got = {"errors": [], "audio": 0, "done": None}
    async with websockets.connect(url, **connect) as ws:
        await ws.send(json.dumps({"type": "start", **(start or {})}))
        await ws.send(json.dumps({"type": "text", "text": text}))
        await ws.send(json.dumps({"type": "end"}))
        async with asyncio.timeout(120):
            async for message in ws:
                if isinstance(message, bytes):
                    got["audio"] += len(message)
                    if audio_enough and got["audio"] >= audio_enough:
                        audio_enough = None
                        await ws.send(json.dumps({"type": "cancel"}))
                    continue
                event = json.loads(message)
                if event["type"] == "error":
                    got["errors"].append(event["code"])
                elif event["type"] == "done":
                    got["done"] = event
                    break
    return got


def completed(got: dict) -> bool:
    return got["done"] is not None and not got["done"]["cancelled"] and got["audio"] > 0


async def beside_another(url: str, text: str, audio_enough: int | None = None) -> dict:
    """A hostile utterance while another client speaks: the other must complete."""
    other = asyncio.create_task(utterance(url, OTHER))
    await asyncio.sleep(0.05)
    hostile = await utterance(url, text, audio_enough=audio_enough)
    other = await other
    return {
        "hostile_errors": hostile["errors"],
        "hostile_audio_bytes": hostile["audio"],
        "other_completed": completed(other),
        "other_errors": other["errors"],
        "ok": completed(other) and not {"engine_error", "internal"} & set(hostile["errors"] + other["errors"]),
    }


async def speech(http: httpx.AsyncClient, body: dict, keep: int | None = None) -> dict:
    """POST /v1/audio/speech; a 200's body read to its end (or `keep` bytes), an error's parsed."""
    started = time.perf_counter()
    async with http.stream("POST", "/v1/audio/speech", json=body) as response:
        if response.status_code != 200:
            return {"status": response.status_code, "error": json.loads(await response.aread())["error"]}
        size = 0
        async for part in response.aiter_bytes():
            size += len(part)
            if keep and size >= keep:
                break
        return {"status": 200, "bytes": size, "seconds": round(time.perf_counter() - started, 2)}


async def http_rows(server: ServeProcess) -> list[dict]:
    async with httpx.AsyncClient(base_url=server.url, timeout=300) as http:
        nul = await speech(http, {"input": "Hello\u0000 world.", "voice": "alloy"})
        number = await speech(http, {"input": NUMBER, "voice": "alloy", "response_format": "pcm"}, keep=65536)
        empty = await speech(http, {"input": "Hello.", "voice": ""})
        put = await http.put("/v1/audio/speech", json={"input": "Hello."})
        many = await asyncio.gather(
            *(speech(http, {"input": SPEECH, "voice": "alloy", "response_format": "pcm"}) for _ in range(16))
        )
    return [
        {
            "row": "nul_http",
            "status": nul["status"],
            "code": nul.get("error", {}).get("code"),
            "ok": nul["status"] == 400 and nul["error"]["code"] == "bad_text",
        },
        {"row": "number_http", **number, "ok": number["status"] == 200 or 400 <= number["status"] < 500},
        {
            "row": "voice_empty_http",
            "status": empty["status"],
            "code": empty.get("error", {}).get("code"),
            "ok": empty["status"] == 400 and empty["error"]["code"] == "unknown_voice",
        },
        {
            "row": "put_speech",
            "status": put.status_code,
            "allow": put.headers.get("allow"),
            "ok": put.status_code == 405 and "POST" in put.headers.get("allow", ""),
        },
        _all_complete("http_16_default", many),
    ]


def _all_complete(row: str, results: list[dict]) -> dict:
    statuses = [r["status"] for r in results]
    return {
        "row": row,
        "requests": len(results),
        "completed": statuses.count(200),
        "refused": len(results) - statuses.count(200),
        "slowest_s": max(r.get("seconds", 0) for r in results),
        "ok": statuses.count(200) == len(results),
    }


async def origin_rows(server: ServeProcess) -> list[dict]:
    rows = []
    for row, origin in (("origin_evil", "https://evil.example"), ("origin_null", "null"), ("origin_own", server.url)):
        try:
            got = await utterance(server.ws_url, "Hi.", additional_headers={"Origin": origin})
            answer = {"accepted": True, "completed": completed(got)}
        except websockets.InvalidStatus as refused:
            body = json.loads(refused.response.body or b"{}")
            answer = {
                "accepted": False,
                "status": refused.response.status_code,
                "code": body.get("error", {}).get("code"),
            }
        # a refused upgrade is a plain 403 (docs/protocol.md: uvicorn's answer to a close before accept)
        ok = answer.get("completed") if row == "origin_own" else answer.get("status") == 403
        rows.append({"row": row, "origin": origin, **answer, "ok": bool(ok)})
    return rows


async def voice_empty_ws(server: ServeProcess) -> dict:
    async with websockets.connect(server.ws_url) as ws:
        await ws.send(json.dumps({"type": "start", "voice": ""}))
        event = json.loads(await ws.recv())
    return {"row": "voice_empty_ws", "answer": event, "ok": event.get("code") == "unknown_voice"}


async def aborts(server: ServeProcess, count: int = 30) -> dict:
    """`count` connections aborted in a tight loop (no close frame), at every stage of an utterance's start. A
    dropped session that had its `ready` waits for a resume (30 s by default) and keeps its place in the
    client's connection cap (16), so later ones may be refused with 1013 client_limit: typed, and documented."""
    refused = []
    for i in range(count):
        ws = await websockets.connect(server.ws_url)
        try:
            await ws.send(json.dumps({"type": "start"}))
            if i % 3:
                await ws.send(json.dumps({"type": "text", "text": SPEECH}))
            if i % 3 == 2:
                await ws.recv()  # ready
        except websockets.ConnectionClosed as closed:
            refused.append(f"{closed.rcvd.code} {closed.rcvd.reason}" if closed.rcvd else "no close frame")
        ws.transport.abort()
    after = await utterance(server.ws_url, SPEECH, local_addr=("127.0.0.2", 0))  # another client meanwhile
    waiting = server.health()["awaiting_resume"]
    window = 30.0  # the default resume window: a dropped session waits that long for its client
    deadline = time.monotonic() + window + 15
    while time.monotonic() < deadline and (health := server.health())["connections"]:
        await asyncio.sleep(0.5)
    again = await utterance(server.ws_url, SPEECH)  # the aborting address, once its sessions expired
    return {
        "row": "aborts_30",
        "aborted": count,
        "refused": dict(Counter(refused)),
        "other_client_completed": completed(after),
        "awaiting_resume_after": waiting,
        "connections_after_window": health["connections"],
        "engine_streams_after_window": health["engine"]["active_streams"],
        "same_client_after_window_completed": completed(again),
        "ok": completed(after)
        and completed(again)
        and set(refused) <= {"1013 client_limit"}
        and health["connections"] == 0
        and health["engine"]["active_streams"] == 0,
    }


async def idle_noop_cancels(server: ServeProcess, idle_timeout_s: float, count: int = 16) -> dict:
    """`count` sockets that never speak but send a cancel every second; a newcomer from another loopback
    address meanwhile."""

    async def idler() -> tuple[float, int | None, str | None]:
        opened = time.monotonic()
        async with websockets.connect(server.ws_url) as ws:
            try:
                while True:
                    await ws.send(json.dumps({"type": "cancel"}))
                    try:
                        async with asyncio.timeout(1.0):
                            await ws.recv()
                    except TimeoutError:
                        pass
            except websockets.ConnectionClosed:
                pass
            return time.monotonic() - opened, ws.close_code, ws.close_reason

    idlers = [asyncio.create_task(idler()) for _ in range(count)]
    await asyncio.sleep(0.5)
    newcomer = await utterance(server.ws_url, SPEECH, local_addr=("127.0.0.2", 0))
    closed = await asyncio.gather(*idlers)
    lived = [round(s, 1) for s, _, _ in closed]
    reasons = sorted({reason for _, _, reason in closed})
    return {
        "row": "idle_noop_cancels",
        "idle_sockets": count,
        "idle_timeout_s": idle_timeout_s,
        "newcomer_completed": completed(newcomer),
        "closed_after_s": [min(lived), max(lived)],
        "close_reasons": reasons,
        "ok": completed(newcomer) and reasons == ["idle_timeout"] and max(lived) < idle_timeout_s + 3,
    }


async def four_slot_rows(server: ServeProcess, idle_timeout_s: float) -> list[dict]:
    async with httpx.AsyncClient(base_url=server.url, timeout=300) as http:
        many = await asyncio.gather(
            *(speech(http, {"input": SPEECH, "voice": "alloy", "response_format": "pcm"}) for _ in range(12))
        )
    return [_all_complete("http_12_on_4_slots", many), await idle_noop_cancels(server, idle_timeout_s)]


def threads_api(threads: int = 8, slots: int = 4) -> dict:
    """`threads` threads calling tts.synthesize_stream() at once on the process-wide engine with `slots` slots."""
    import tts
    from tts.api import get_engine

    get_engine(max_streams=slots)
    results: list = [None] * threads

    def speak(i: int) -> None:
        started = time.perf_counter()
        try:
            samples = sum(len(chunk) for chunk in tts.synthesize_stream(SPEECH, seed=i))
            results[i] = {"samples": samples, "seconds": time.perf_counter() - started}
        except Exception as err:  # noqa: BLE001 -- what a caller would see is the row's answer
            results[i] = {"error": f"{type(err).__name__}: {err}"}

    workers = [threading.Thread(target=speak, args=(i,)) for i in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    errors = [r["error"] for r in results if "error" in r]
    return {
        "row": "threads_8_api",
        "threads": threads,
        "slots": slots,
        "completed": threads - len(errors),
        "errors": errors,
        "slowest_s": round(max(r.get("seconds", 0) for r in results), 2),
        "ok": not errors,
    }


def main() -> None:
    idle_timeout_s = 3.0
    default = ServeProcess().wait()
    small = ServeProcess("--max-streams", "4", "--idle-timeout-s", str(idle_timeout_s)).wait()
    rows = []

    def emit(row: dict) -> None:
        rows.append(row)
        print(json.dumps(row), flush=True)

    try:

        async def server_rows():
            emit({"row": "nul_ws", **await beside_another(default.ws_url, "Hello\u0000 world.")})
            emit({"row": "number_ws", **await beside_another(default.ws_url, NUMBER, audio_enough=96000)})
            for row in await http_rows(default):
                emit(row)
            emit(await voice_empty_ws(default))
            for row in await origin_rows(default):
                emit(row)
            for row in await four_slot_rows(small, idle_timeout_s):
                emit(row)
            emit(await aborts(default))

        asyncio.run(server_rows())
        emit(
            {
                "row": "server_log",
                "tracebacks": default.tracebacks() + small.tracebacks(),
                "ok": default.tracebacks() + small.tracebacks() == 0,
            }
        )
    finally:
        default.stop()
        small.stop()
    emit(threads_api())
    print(
        json.dumps(
            {"rows": len(rows), "ok": sum(r["ok"] for r in rows), "failed": [r["row"] for r in rows if not r["ok"]]}
        )
    )


if __name__ == "__main__":
    main()
