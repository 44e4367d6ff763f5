"""Issue 48's doors, each re-tried against a real `tts serve` (bench/hostile.py runs them with issue 25's rows).

Rows: resume_other_address (a resume from another address: resume_forbidden), held_over_cap (300 connections
from one address while one of its sessions waits for a resume, on a server of 2 connections: refused at once, the
server's open files back), resume_one_of_two (a resume listing one of two open contexts: resume_offset),
spent_token_after_end (resume_used), unspeakable_http / unspeakable_ws ("?", "...", "$", an emoji, a zero-width
space: bad_text before any audio), speed_strings ("2", true: 400), audio_cap ("ﷺ": audio_too_long within 10 s of
audio), body_cut_short (one log line), wyoming_malformed (every malformed line: an error event, the connection
lives on), wyoming_huge_payload (a declared 1 TB payload: refused before it is read, memory flat), wyoming_nul
(bad_text), wyoming_connections (past max_connections: server_full), say_file_mode (0666 less the umask),
park_dir (dropped sessions spill under --park-dir).
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx2 as httpx
import psutil
import websockets

from bench.common import ServeProcess

UNSPEAKABLE = ["?", "...", "$", "\U0001f600", "\u200b"]
SPEECH = "Please call me back when you have a moment this afternoon. " * 3


async def _dropped(url: str, contexts=(None,)) -> tuple[str, dict]:
    """A session with an utterance open on each of ``contexts``, read a little, then cut (no close frame)."""
    ws = await websockets.connect(url)
    received = {c: {"bytes": 0, "events": 0} for c in contexts}
    for c in contexts:
        await ws.send(json.dumps({"type": "start", **({"context_id": c} if c else {})}))
        await ws.send(json.dumps({"type": "text", "text": SPEECH, **({"context_id": c} if c else {})}))
    token = None
    while sum(r["bytes"] for r in received.values()) < 20_000 or token is None:
        message = await asyncio.wait_for(ws.recv(), 60)
        if isinstance(message, bytes):
            received[None]["bytes"] += len(message)
            continue
        event = json.loads(message)
        c = event.get("context_id")
        if event["type"] == "audio":
            received[c]["bytes"] += len(__import__("base64").b64decode(event["audio"]))
        elif event["type"] != "queued":
            received[c]["events"] += 1
            token = event.get("resume_token", token)
    ws.transport.abort()
    return token, received


async def _resume(url: str, token: str, contexts: list[dict], **connect) -> dict:
    async with websockets.connect(url, **connect) as ws:
        await ws.send(json.dumps({"type": "resume", "token": token, "contexts": contexts}))
        answer = json.loads(await asyncio.wait_for(ws.recv(), 10))
        if answer["type"] == "resumed":
            await ws.send(
                json.dumps(
                    {
                        "type": "cancel",
                        **(
                            {"context_id": contexts[0].get("context_id")}
                            if contexts and contexts[0].get("context_id")
                            else {}
                        ),
                    }
                )
            )
    return answer


def _positions(received: dict) -> list[dict]:
    return [{**({"context_id": c} if c else {}), **r} for c, r in received.items()]


async def resume_rows(server: ServeProcess) -> list[dict]:
    token, got = await _dropped(server.ws_url)
    other = await _resume(server.ws_url, token, _positions(got), local_addr=("127.0.0.2", 0))
    own = await _resume(server.ws_url, token, _positions(got))
    await asyncio.sleep(1.0)
    spent = await _resume(server.ws_url, token, _positions(got))
    token2, got2 = await _dropped(server.ws_url, contexts=("a", "b"))
    partial = await _resume(server.ws_url, token2, _positions({"a": got2["a"]}))
    whole = await _resume(server.ws_url, token2, _positions(got2))
    return [
        {
            "row": "resume_other_address",
            "answer": other.get("code"),
            "own_after": own["type"],
            "ok": other.get("code") == "resume_forbidden" and own["type"] == "resumed",
        },
        {"row": "spent_token_after_end", "answer": spent.get("code"), "ok": spent.get("code") == "resume_used"},
        {
            "row": "resume_one_of_two",
            "answer": partial.get("code"),
            "full_resume_after": whole["type"],
            "ok": partial.get("code") == "resume_offset" and whole["type"] == "resumed",
        },
    ]


async def held_over_cap(count: int = 300) -> dict:
    """A server of 2 connections: one session dropped (waiting for its resume), one live; then ``count``
    connections at once from the same address."""
    with ServeProcess("--max-connections", "2", "--max-streams", "2").wait() as server:
        child = psutil.Process(server.child.pid)
        token, got = await _dropped(server.ws_url)
        live = await websockets.connect(server.ws_url)
        fds_before = child.num_fds()

        async def one() -> float:
            started = time.monotonic()
            try:
                async with websockets.connect(server.ws_url, open_timeout=30) as ws:
                    await asyncio.wait_for(ws.recv(), 30)
            except (websockets.ConnectionClosed, OSError, TimeoutError):
                pass
            return time.monotonic() - started

        started = time.monotonic()
        took = await asyncio.gather(*(one() for _ in range(count)))
        wall = time.monotonic() - started
        resumed = await _resume(server.ws_url, token, _positions(got))
        await live.close()
        await asyncio.sleep(1.0)
        fds_after = child.num_fds()
        held = sum(t > 2.0 for t in took)
    return {
        "row": "held_over_cap",
        "connections": count,
        "held_over_2s": held,
        "wall_s": round(wall, 1),
        "server_fds_before": fds_before,
        "server_fds_after": fds_after,
        "resumed_after": resumed["type"],
        "ok": held <= 1 and resumed["type"] == "resumed" and fds_after <= fds_before + 5,
    }


async def text_rows(server: ServeProcess) -> list[dict]:
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
        http_answers = [
            (await http.post("/v1/audio/speech", json={"input": t, "response_format": "pcm"})) for t in UNSPEAKABLE
        ]
        speeds = [
            (await http.post("/v1/audio/speech", json={"input": "Hi.", "speed": s})).status_code for s in ("2", True)
        ]
        cap = await http.post(
            "/v1/audio/speech", json={"input": "\ufdfa", "response_format": "pcm", "stream_format": "sse"}
        )
    ws_answers = []
    for text in UNSPEAKABLE:
        async with websockets.connect(server.ws_url) as ws:
            for message in ({"type": "start"}, {"type": "text", "text": text}, {"type": "end"}):
                await ws.send(json.dumps(message))
            got = []
            while not got or got[-1].get("type") != "done":
                message = await asyncio.wait_for(ws.recv(), 30)
                got.append({"type": "audio"} if isinstance(message, bytes) else json.loads(message))
            ws_answers.append([m.get("code", m["type"]) for m in got])
    codes = [(a.status_code, a.json()["error"]["code"]) for a in http_answers]
    cap_codes = [
        json.loads(line[6:]).get("error", {}).get("code") for line in cap.text.splitlines() if line.startswith("data: ")
    ]
    cap_audio = sum(
        len(json.loads(line[6:]).get("audio", "")) * 3 // 4
        for line in cap.text.splitlines()
        if line.startswith("data: ")
    )
    return [
        {"row": "unspeakable_http", "answers": codes, "ok": all(c == (400, "bad_text") for c in codes)},
        {
            "row": "unspeakable_ws",
            "answers": ws_answers,
            "ok": all(a == ["ready", "bad_text", "done"] for a in ws_answers),
        },
        {"row": "speed_strings", "statuses": speeds, "ok": speeds == [400, 400]},
        {
            "row": "audio_cap",
            "input": "\ufdfa",
            "codes": [c for c in cap_codes if c],
            "audio_s": round(cap_audio / 48000, 2),
            "ok": "audio_too_long" in cap_codes and cap_audio <= 10.5 * 48000,
        },
    ]


def body_cut_short(server: ServeProcess) -> dict:
    before = server.tracebacks()
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(
            b"POST /v1/audio/speech HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 1000\r\n\r\n{\"input\": \"Hel"
        )
        time.sleep(0.3)
    time.sleep(1.0)
    lines = [line for line in server.log_text().splitlines() if "before its body was read" in line]
    return {
        "row": "body_cut_short",
        "tracebacks": server.tracebacks() - before,
        "log_lines": len(lines),
        "ok": server.tracebacks() == before and len(lines) == 1,
    }


async def _wyoming(port: int, data: bytes, answers: int) -> tuple[list[dict], bool]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    with __import__("contextlib").suppress(ConnectionError):
        await writer.drain()
    got = []
    for _ in range(answers):
        line = await asyncio.wait_for(reader.readline(), 10)
        if not line:
            break
        header = json.loads(line)
        if header.get("data_length"):
            header["data"] = json.loads(await reader.readexactly(header["data_length"]))
        if header.get("payload_length"):
            await reader.readexactly(header["payload_length"])
        got.append(header)
    try:
        closed = await asyncio.wait_for(reader.read(1), 2) == b""
    except TimeoutError:
        closed = False
    except ConnectionError:
        closed = True
    writer.close()
    return got, closed


async def wyoming_rows(server: ServeProcess, port: int) -> list[dict]:
    child = psutil.Process(server.child.pid)
    malformed = [b"[1,2,3]\n", b'{"data": {}}\n', b'{"type": "synthesize", "data": [1]}\n', b"not json\n"]
    answers = []
    for line in malformed:
        got, closed = await _wyoming(port, line + b'{"type": "describe"}\n', 2)
        answers.append([g["type"] for g in got] + (["closed"] if closed else []))
    rss = child.memory_info().rss
    huge, huge_closed = await _wyoming(
        port, b'{"type": "synthesize", "payload_length": 1000000000000}\n' + b"x" * (32 << 20), 1
    )
    grown = (child.memory_info().rss - rss) / 2**20
    nul, _ = await _wyoming(port, b'{"type": "synthesize", "data": {"text": "Hello\\u0000 world."}}\n', 1)
    opened = [await asyncio.open_connection("127.0.0.1", port) for _ in range(70)]
    await asyncio.sleep(0.5)
    refused, refused_closed = await _wyoming(port, b"", 1)
    for _, writer in opened:
        writer.close()
    code = lambda got: got[0].get("data", {}).get("code") if got else None  # noqa: E731
    return [
        {"row": "wyoming_malformed", "answers": answers, "ok": all(a == ["error", "info"] for a in answers)},
        {
            "row": "wyoming_huge_payload",
            "answer": code(huge),
            "closed": huge_closed,
            "rss_growth_mb": round(grown, 1),
            "ok": code(huge) == "event_too_large" and huge_closed and grown < 20,
        },
        {"row": "wyoming_nul", "answer": code(nul), "ok": code(nul) == "bad_text"},
        {
            "row": "wyoming_connections",
            "answer": code(refused),
            "closed": refused_closed,
            "ok": code(refused) in ("server_full", "client_limit") and refused_closed,
        },
    ]


def say_file_mode() -> dict:
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "out.wav"
        done = subprocess.run([sys.executable, "-m", "tts.cli", "say", "Hi.", "-o", str(out)], capture_output=True)
        mode = out.stat().st_mode & 0o777 if out.exists() else None
    umask = os.umask(0o022)
    os.umask(umask)
    return {
        "row": "say_file_mode",
        "mode": oct(mode) if mode is not None else None,
        "ok": done.returncode == 0 and mode == 0o666 & ~umask,
    }


def park_dir(folder: str) -> dict:
    spilled = [p.name for p in Path(folder).iterdir()]
    return {
        "row": "park_dir",
        "folder": folder,
        "spill_directories": spilled,
        "ok": any(name.startswith("tts-parked-") for name in spilled),
    }
