"""`tts serve --workers N` (serving/workers.py): real server processes on real sockets, the tiny random-weight
engine on the CPU. Two workers share the public port; a session's resume that lands on the other worker is relayed
to its owner and gets exactly the rest of the audio; the parent's stop (or death) stops every worker."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path

import pytest
import websockets

from testkit import STARTS, Received, assert_same_output, cut_and_resume, open_contexts, send, uninterrupted, wait_until

TESTS = Path(__file__).resolve().parent
# The real `serve(workers=2)`, with each worker's engine the tiny one (a picklable factory the workers call)
SERVE = (
    "import functools, logging, sys; sys.path.insert(0, {tests!r}); import testkit, server; "
    "logging.basicConfig(level=logging.INFO); "
    "server.serve(port=0, workers=2, max_streams=4, engine=functools.partial(testkit.tiny_random), "
    "log_level='warning', resume_window_s=10)"
)


class Pool:
    """A `serve(workers=2)` parent process: its public port and its workers' private ports, read from its log."""

    def __init__(self):
        self.process = subprocess.Popen(
            [sys.executable, "-c", SERVE.format(tests=str(TESTS))], cwd=TESTS.parent, stderr=subprocess.PIPE, text=True
        )
        self.log: list[str] = []
        threading.Thread(target=self._read_log, daemon=True).start()  # drained, so that no worker blocks on it
        if (
            not wait_until(lambda: self.said("listening on") or self.process.poll() is not None, 120)
            or self.process.poll() is not None
        ):
            self.stop()
            raise RuntimeError("the workers did not start:\n" + "".join(self.log))
        match = re.search(r"listening on http://127\.0\.0\.1:(\d+) .*addresses: (.*)", self.said("listening on"))
        self.port, self.peers = int(match[1]), [int(p) for p in re.findall(r":(\d+)", match[2])]

    def _read_log(self) -> None:
        for line in self.process.stderr:
            self.log.append(line)

    def said(self, words: str) -> str | None:
        return next((line for line in self.log if words in line), None)

    def ws_url(self, port: int) -> str:
        return f"ws://127.0.0.1:{port}/v1/stream"

    def health(self, port: int) -> tuple[dict, str]:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10) as response:
            return json.load(response), response.headers["x-tts-worker"]

    def workers(self) -> list[int]:
        """The pids of the parent's workers (its spawned children; multiprocessing's resource tracker aside)."""
        out = subprocess.run(
            ["ps", "-ww", "-o", "pid=,args=", "--ppid", str(self.process.pid)], capture_output=True, text=True
        ).stdout
        return [int(line.split()[0]) for line in out.splitlines() if "spawn_main" in line]

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 120))


def gone(pids: list[int]) -> bool:
    def alive(pid):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        with open(f"/proc/{pid}/stat") as stat:  # a zombie has exited (its parent has not reaped it yet)
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"

    return not any(alive(pid) for pid in pids)


@pytest.fixture(scope="module")
def pool():
    started = Pool()
    yield started
    started.stop()


def test_two_workers_share_the_port_each_with_half_the_slots(pool):
    seen = {pool.health(pool.port)[1] for _ in range(40)}  # the kernel hashes each connection to a worker
    assert seen == {"0/2", "1/2"}
    for index, port in enumerate(pool.peers):
        figures, worker = pool.health(port)
        assert worker == f"{index}/2" and figures["slots"] == 2
        assert figures["max_connections"] == 32 and figures["max_queue"] == 16  # 64 and 32, split


def test_a_resume_landing_on_the_other_worker_is_relayed_with_no_gap_and_no_duplicate(pool):
    """A session on worker 0, cut by a transport abort after part of its audio was acknowledged, resumed on
    worker 1's address: worker 1 relays it to worker 0, and the audio equals the uninterrupted stream's."""
    owner, other = (pool.ws_url(port) for port in pool.peers)
    cut = run(
        cut_and_resume(
            owner,
            lambda: pool.health(pool.peers[0])[0]["awaiting_resume"] == 1,
            resume_url=other,
            watch=lambda: pool.health(pool.peers[1])[0],
        )
    )
    assert cut.held, "the owner did not hold the dropped session"
    assert cut.token.startswith("0.") and len(cut.token) == 24  # worker 0's index, then 128 random bits
    assert cut.resumed["type"] == "resumed" and cut.resumed["resume_token"].startswith("0.")
    assert cut.resumed["received"] == 6
    assert cut.watched["connections"] == 0 and cut.watched["streams"] == 0  # the relay holds no place on its worker
    assert_same_output(cut.got, cut.reference)
    assert wait_until(lambda: pool.health(pool.peers[0])[0]["connections"] == 0)


def test_a_relayed_session_dropped_again_is_held_by_its_owner_for_the_next_resume(pool):
    """The relay passes a drop on as a drop: the owner keeps the session, and a resume on the owner itself
    (with the token `resumed` gave) gets the rest."""
    owner, other = (pool.ws_url(port) for port in pool.peers)

    async def go():
        reference = await uninterrupted(owner, sentences=4)
        got = Received()
        async with websockets.connect(owner) as ws:
            token = await open_contexts(ws, got, sentences=4)
            await got.read(ws, lambda: len(got.audio[None]) > 10_000)
            ws.transport.abort()
        assert await asyncio.to_thread(wait_until, lambda: pool.health(pool.peers[0])[0]["awaiting_resume"] == 1)
        again = await websockets.connect(other)
        await send(again, type="resume", token=token, contexts=[got.position(c) for c in STARTS])
        token = json.loads(await again.recv())["resume_token"]
        await got.read(again, lambda: len(got.audio[None]) > 30_000)
        again.transport.abort()
        assert await asyncio.to_thread(wait_until, lambda: pool.health(pool.peers[0])[0]["awaiting_resume"] == 1)
        async with websockets.connect(owner) as third:
            await send(third, type="resume", token=token, contexts=[got.position(c) for c in STARTS])
            assert json.loads(await third.recv())["type"] == "resumed"
            await got.read(third, lambda: all(got.done(c) for c in STARTS))
        return reference, got

    reference, got = run(go())
    assert_same_output(got, reference)


def test_a_dead_worker_is_restarted_and_stopping_the_parent_stops_all(pool):
    first = pool.workers()
    assert len(first) == 2
    os.kill(first[1], signal.SIGKILL)
    assert wait_until(lambda: len(pool.workers()) == 2 and set(pool.workers()) != set(first), 60)
    assert pool.said("restarting it")
    assert wait_until(lambda: _answers(pool), 60)  # the new worker listens on the same private address
    workers = pool.workers()
    pool.process.send_signal(signal.SIGTERM)
    assert pool.process.wait(30) == 0
    assert wait_until(lambda: gone(workers), 10)


def test_workers_die_with_a_killed_parent():
    pool = Pool()
    try:
        workers = pool.workers()
        assert len(workers) == 2
        pool.process.kill()  # no chance to stop them: PR_SET_PDEATHSIG does
        assert wait_until(lambda: gone(workers), 20)
    finally:
        pool.stop()


def _answers(pool) -> bool:
    try:
        return all(pool.health(port)[0]["status"] == "ok" for port in pool.peers)
    except OSError:
        return False
