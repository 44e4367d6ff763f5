"""Several server processes on one host behind one port (`tts serve --workers N`).

One Python process serves a few hundred real-time streams before its event loop and its interpreter lock are
full (docs/scale-out.md). N worker processes, each its own interpreter, event loop and engine (on a GPU: its own
CUDA context; the workers time-share the device), accept on one port: the parent binds one socket per worker on
it (SO_REUSEPORT) and hands each its own, and the kernel hashes each new connection to one of them. (One socket
shared by all, as uvicorn's own workers have it, let the first worker to wake take a burst of connections
whole: see docs/scale-out.md.)

A WebSocket session lives in the worker that accepted it. Its resume token starts with that worker's index
(``"2." + 128 random bits``), and every worker also listens on a private loopback address of its own; a resume
that lands on another worker is relayed there (`Relay`): the landing worker opens a WebSocket to the owner's
private address, sends the resume, and copies messages both ways until either side ends, so the client gets
exactly what a resume on the owner would have given.

The parent (`Supervisor`) starts the workers, reports ready once every one listens, restarts a worker that dies
after it was ready (its sessions are lost: a resume of one gets resume_expired), stops everything with an error
when one dies while starting (missing weights, say: a restart would fail again), and on SIGINT/SIGTERM stops
all of them. A worker dies with its parent (PR_SET_PDEATHSIG), so even a killed parent leaves no orphan.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import logging
import multiprocessing
import multiprocessing.connection
import os
import secrets
import signal
import socket
import time
import urllib.request
from dataclasses import dataclass

import numpy as np
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake
from websockets.protocol import State

from serving.resume import dropped

log = logging.getLogger("tts.workers")
FORWARDED_HEADERS = ("authorization", "x-api-key")  # the client's credentials, for the owner's access check
RELAY_OPEN_TIMEOUT_S = 5.0
STOP_TIMEOUT_S = 10.0  # a worker still running this long after SIGTERM is killed
PERCENTILES = ("p50", "p99")
STATS_REUSE_S = 0.05  # PoolView: figures this fresh are not asked for again


@dataclass(frozen=True)
class Worker:
    """One worker's place in the pool: its index and every worker's private loopback address, by index."""

    index: int
    peers: tuple[tuple[str, int], ...]

    @property
    def count(self) -> int:
        return len(self.peers)


_this: Worker | None = None  # this process's place in the pool; None: a single-process server


def join(worker: Worker) -> None:
    """Make this process the pool's worker ``worker.index`` (its resume tokens name it), and let it die with the
    parent that started it (Linux: PR_SET_PDEATHSIG; elsewhere the parent's own stop must do)."""
    global _this
    _this = worker
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # 1: PR_SET_PDEATHSIG
    if os.getppid() == 1:  # the parent died before prctl: nobody would stop us
        os.kill(os.getpid(), signal.SIGTERM)


def this_worker() -> Worker | None:
    return _this


def resume_token() -> str:
    """A new resume token: 128 random bits (URL-safe base64, no dots), after ``"INDEX."`` in a worker.
    Example: worker 2 of 4 -> "2.kq3v...Q" (24 characters); one process alone -> "kq3v...Q" (22)."""
    token = secrets.token_urlsafe(16)
    return token if _this is None else f"{_this.index}.{token}"


def owner_of(token: str) -> int | None:
    """The index of the worker whose session ``token`` resumes, when it is another worker of this pool, else
    None (this worker's own token, a single-process server, or a token no worker made: the caller's lookup
    then finds nothing and answers resume_expired). Example: in worker 0 of 2, "1.abc" -> 1; "0.abc",
    "abc", "7.abc" -> None."""
    if _this is None:
        return None
    tag, dot, _ = token.partition(".")
    if not dot or not tag.isdigit() or int(tag) == _this.index or int(tag) >= _this.count:
        return None
    return int(tag)


def relay_for(message) -> Relay | None:
    """A `Relay` to the worker that owns the session ``message`` (a `Resume`) names, when another worker does."""
    owner = owner_of(message.token)
    return None if owner is None else Relay(_this.peers[owner], message.model_dump_json())


class Relay:
    """A resume that landed on the wrong worker, carried to its owner. It stands where a session stands in the
    server's connection loop (`serve(ws, resume)`, `close()`), so the hook there is one call (`relay_for`)."""

    def __init__(self, owner: tuple[str, int], resume: str):
        self.owner, self.resume = owner, resume

    async def serve(self, ws, resume=None) -> None:
        """Copy the client's WebSocket to the owner's private address and back until either side ends. A client
        that drops (no close frame) makes the owner's side drop too, so the owner holds the session for the
        next resume; a clean close is passed on with its code. The client's credentials go along (the owner
        checks them again); its Origin does not (this worker has checked it against the public host)."""
        query = ws.scope.get("query_string", b"").decode("latin-1")
        url = f"ws://{self.owner[0]}:{self.owner[1]}{ws.scope['path']}" + (f"?{query}" if query else "")
        headers = [(k, v) for k, v in ws.headers.items() if k in FORWARDED_HEADERS]
        try:
            owner = await connect(
                url,
                additional_headers=headers,
                compression=None,
                max_size=None,
                open_timeout=RELAY_OPEN_TIMEOUT_S,
                ping_interval=None,
            )
        except (OSError, InvalidHandshake, TimeoutError) as err:
            log.warning("resume relay to worker at %s:%d failed: %s", *self.owner, err)
            with contextlib.suppress(Exception):
                await ws.send_text(
                    json.dumps(
                        {
                            "type": "error",
                            "code": "resume_expired",
                            "message": "no session to resume: the worker that served it is not running",
                        }
                    )
                )
                await ws.close(1013, "resume_expired")
            return None
        legs = [
            asyncio.create_task(_client_to_owner(ws, owner, self.resume)),
            asyncio.create_task(_owner_to_client(owner, ws)),
        ]
        _, pending = await asyncio.wait(legs, return_when=asyncio.FIRST_COMPLETED)
        for leg in pending:
            leg.cancel()
        await asyncio.gather(*legs, return_exceptions=True)
        if owner.state is not State.CLOSED:  # not closed cleanly by either side (a send to the client failed,
            owner.transport.abort()  # say): to the owner a drop, so that it holds the session for a resume
        return None

    async def close(self) -> None:
        """Nothing to free: the relay holds no session, slot or place in the caps (the owner's session does)."""


async def _client_to_owner(ws, owner, resume: str) -> None:
    await owner.send(resume)
    while True:
        message = await ws.receive()
        if message["type"] == "websocket.disconnect":
            if dropped(message):
                owner.transport.abort()  # the owner must see a drop, not a close: it then waits for a resume
            else:  # 1005: a close frame without a code, which cannot be sent on
                code = message.get("code") or 1000
                await owner.close(1000 if code == 1005 else code, message.get("reason") or "")
            return
        if message.get("text") is not None:
            await owner.send(message["text"])
        elif message.get("bytes") is not None:
            await owner.send(message["bytes"])


async def _owner_to_client(owner, ws) -> None:
    with contextlib.suppress(ConnectionClosed):
        async for data in owner:  # one message at a time: the client's backpressure reaches the owner
            await (ws.send_text(data) if isinstance(data, str) else ws.send_bytes(data))
    code, reason = owner.close_code, owner.close_reason or None
    if code is None or code in (1005, 1006):  # the owner's side was lost (its worker died, say): so is the session
        code, reason = 1011, "the worker serving this session stopped"
    with contextlib.suppress(Exception):
        await ws.close(code, reason)


# ---- the parent -----------------------------------------------------------------------------------
def split(total: int, parts: int, index: int) -> int:
    """Worker ``index``'s share of ``total`` over ``parts`` workers, at least 1; the first ``total % parts``
    get one more. Example: 10 slots over 4 workers -> 3, 3, 2, 2; 2 over 4 -> 1, 1, 1, 1."""
    return max(1, total // parts + (index < total % parts))


def loopback_socket() -> socket.socket:
    """A worker's private address: loopback, a free port, listening (connections queue until it accepts)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(2048)
    return sock


class Supervisor:
    """Runs ``target(worker, public, private, ready, *args)`` in ``count`` spawned processes (spawned, not
    forked: a CUDA context cannot cross a fork). ``target`` serves ``public`` and ``private`` and sends one
    message on ``ready`` once it listens. The parent keeps every socket open, so a restarted worker listens on
    the same addresses and connections meanwhile wait in the kernel's queue."""

    def __init__(self, target, public: list[socket.socket], args: tuple = (), start_timeout_s: float = 600):
        self.count, self.target, self.public, self.args = len(public), target, public, args
        count = self.count
        self.private = [loopback_socket() for _ in range(count)]
        peers = tuple(s.getsockname()[:2] for s in self.private)
        self.workers = [Worker(i, peers) for i in range(count)]
        self.processes: list = [None] * count
        self.ready: list = [None] * count
        self.start_timeout_s = start_timeout_s
        self.restarts = 0
        self._stopping = False
        self._context = multiprocessing.get_context("spawn")

    def start(self) -> None:
        """Start every worker and return once each listens; ChildProcessError (after stopping the rest) if one
        dies or does not listen within start_timeout_s."""
        for i in range(self.count):
            self._spawn(i)
        try:
            for i in range(self.count):
                self._await_ready(i)
        except BaseException:
            self.stop()
            raise

    def _spawn(self, i: int) -> None:
        parent_end, child_end = self._context.Pipe(duplex=False)
        process = self._context.Process(
            target=self.target,
            name=f"tts-worker-{i}",
            daemon=False,
            args=(self.workers[i], self.public[i], self.private[i], child_end, *self.args),
        )
        process.start()
        child_end.close()
        self.processes[i], self.ready[i] = process, parent_end

    def _await_ready(self, i: int) -> None:
        process, ready = self.processes[i], self.ready[i]
        waited = multiprocessing.connection.wait([ready, process.sentinel], self.start_timeout_s)
        if ready in waited:
            with contextlib.suppress(EOFError):
                ready.recv()
                return
        process.join(1)
        why = (
            f"exit code {process.exitcode}"
            if process.exitcode is not None
            else f"not listening after {self.start_timeout_s:g} s"
        )
        raise ChildProcessError(f"server worker {i} failed to start ({why}); see its log above")

    def run(self) -> None:
        """Until SIGINT/SIGTERM: restart a worker that dies; then stop them all."""
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            while not self._stopping:
                for i, process in enumerate(self.processes):
                    if process.exitcode is not None and not self._stopping:
                        log.error(
                            "server worker %d (pid %d) died with exit code %s: restarting it (its sessions are lost)",
                            i,
                            process.pid,
                            process.exitcode,
                        )
                        self.restarts += 1
                        self._spawn(i)
                        self._await_ready(i)  # ChildProcessError (the server stops) if it cannot start again
                multiprocessing.connection.wait([p.sentinel for p in self.processes], 0.5)
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
            self.stop()

    def _on_signal(self, signum, frame) -> None:
        self._stopping = True

    def stop(self) -> None:
        """SIGTERM to every worker (uvicorn's graceful stop), SIGKILL to any still running STOP_TIMEOUT_S later."""
        self._stopping = True
        live = [p for p in self.processes if p is not None and p.exitcode is None]
        for process in live:
            with contextlib.suppress(ProcessLookupError):
                os.kill(process.pid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for process in live:
            process.join(max(0.0, deadline - time.monotonic()))
            if process.exitcode is None:
                log.error("server worker %s did not stop: killed", process.name)
                process.kill()
                process.join()
        for sock in self.private + self.public:
            sock.close()


def cpu_seconds(pid: int) -> float:
    """CPU time process ``pid`` has used, user and system (Linux /proc; 0.0 where unreadable)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime (fields 14, 15)


def notify_when_listening(server, ready) -> asyncio.Task:
    """A task that sends one message on ``ready`` once the uvicorn ``server`` listens on all its sockets."""

    async def watch():
        while not server.started:
            await asyncio.sleep(0.01)
        ready.send(os.getpid())
        ready.close()

    return asyncio.get_running_loop().create_task(watch())


class PoolView:
    """What the workers' /health say, summed, in the shape one engine's and one hub's figures have, for a
    benchmark that watches a pool as it watches one process: ``stats()`` (an engine's: counts summed,
    percentiles the highest worker's, as the slowest worker bounds the pool), ``admission.stats()`` (a hub's
    connections), ``max_streams``, ``frame_seconds``, and ``tick_ms.values(last)`` (each worker's recent tick p50:
    a worker's single ticks are not on /health)."""

    def __init__(self, peers: tuple[tuple[str, int], ...], frame_seconds: float, parking=None):
        self.peers, self.frame_seconds, self.parking = peers, frame_seconds, parking
        self.max_streams = sum(h["slots"] for h in self._health())
        self.admission, self.tick_ms = self, self
        self._last = (0.0, {})  # (when, figures): a sampler reads engine and admission figures back to back

    def _health(self) -> list[dict]:
        figures = []
        for host, port in self.peers:
            with urllib.request.urlopen(f"http://{host}:{port}/health", timeout=10) as response:
                figures.append(json.load(response))
        return figures

    def stats(self) -> dict:
        if time.monotonic() - self._last[0] < STATS_REUSE_S:
            return self._last[1]
        healths = self._health()
        figures = {**merge([h["engine"] for h in healths]), "connections": sum(h["connections"] for h in healths)}
        self._last = (time.monotonic(), figures)
        return figures

    def close(self) -> None:
        """Nothing: the workers' engines end with their processes."""

    def values(self, last: int) -> np.ndarray:
        ticks = [h["engine"]["tick_ms"]["p50"] for h in self._health()]
        return np.array([t for t in ticks if t is not None][:last])


def merge(figures: list[dict]):
    """Several workers' figures as one: numbers summed, percentiles (p50, p99) the highest, texts the first's
    (or all, joined, when they differ). Example: [{"parks": 2, "tick_ms": {"p50": 3}}, {"parks": 1, "tick_ms":
    {"p50": 5}}] -> {"parks": 3, "tick_ms": {"p50": 5}}."""
    first = figures[0]
    if isinstance(first, dict):
        return {
            key: max((f[key] for f in figures if f.get(key) is not None), default=None)
            if key in PERCENTILES
            else merge([f[key] for f in figures if key in f])
            for key in first
        }
    if isinstance(first, (int, float)) or first is None:
        numbers = [f for f in figures if f is not None]
        return sum(numbers) if numbers else None
    return first if len(set(map(str, figures))) == 1 else "+".join(map(str, figures))
