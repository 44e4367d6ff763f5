"""Server fixtures: the real server (server.ServerThread) on a free loopback port, in this process."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny_engine():
    """An engine on a tiny random-weight model: real scheduling and audio shapes, noise for sound."""
    from testkit import tiny_random

    return tiny_random(max_streams=4)


@pytest.fixture(scope="session")
def shipped_engine():
    """The process-wide engine on the shipped voices (skipped, saying why, while no weights are shipped)."""
    from tts.api import get_engine

    try:
        return get_engine()
    except FileNotFoundError as err:
        pytest.skip(f"no shipped voice weights yet: {err}")


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    """A fresh, empty disk cache for the fast paths' exports (TTS_CACHE_DIR): the folder they write to."""
    monkeypatch.setenv("TTS_CACHE_DIR", str(tmp_path))
    return tmp_path / "kernels"


@pytest.fixture
def make_server():
    """Start a real server: make_server(engine, **limits) -> started ServerThread, stopped at teardown."""
    from server import ServerThread

    started = []

    def start(engine, **limits):
        server = ServerThread(engine, **limits).start()
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()


@pytest.fixture(scope="session")
def server(tiny_engine):
    """A server on the tiny engine with the default limits, shared by the tests that need no others."""
    from server import ServerThread

    with ServerThread(tiny_engine) as running:
        yield running
