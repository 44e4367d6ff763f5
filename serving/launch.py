"""Running the server: its listening sockets, uvicorn, one process or a pool of workers behind one port
(serving/workers.py), and the in-process handles tests and benchmarks use (`ServerThread`, `ServerProcesses`)."""

from __future__ import annotations

import asyncio
import functools
import gc
import logging
import socket
import threading
import time

import uvicorn
from starlette.applications import Starlette

from serving import workers
from serving.app import build_app
from serving.context import ServerContext
from serving.limits import Limits

log = logging.getLogger("tts.server")


def _bind(host: str, port: int, limits: Limits, reuse_port: bool = False) -> socket.socket:
    """A listening socket; accepted connections inherit its send buffer size. ``reuse_port``: others may bind
    the same port (SO_REUSEPORT), and the kernel spreads new connections over them."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, limits.send_buffer_bytes)
    sock.bind((host, port))
    return sock


def _server(app: Starlette, limits: Limits, log_level: str) -> uvicorn.Server:
    # No permessage-deflate: audio is most of what we send, and deflate saves ~25 % of a 0.32 s PCM speech chunk
    # for ~0.86 ms of event-loop CPU (zlib, measured here); the event loop is what limits a busy server.
    config = uvicorn.Config(
        app,
        ws="websockets-sansio",
        ws_max_size=limits.max_message_bytes,
        ws_per_message_deflate=False,
        log_level=log_level,
        timeout_graceful_shutdown=2,
    )
    return uvicorn.Server(config)


def run_server(
    host: str = "127.0.0.1",
    port: int = 8000,
    engine=None,
    log_level: str = "info",
    compile: bool = True,
    api_keys=(),
    allow_origins=(),
    workers: int = 1,
    max_streams: int | None = None,
    load_engine=None,
    lexicon=None,
    **limits,
) -> None:
    """Serve until interrupted. `limits` are the fields of `Limits` (max_connections=..., ...); `api_keys`,
    `allow_origins` and `lexicon` as in `create_app`. The engine loads, and compiles its step unless ``compile`` is
    false (or TTS_NO_COMPILE=1), before the socket opens, so missing weights fail here and the first client waits
    for neither.
    ``workers`` > 1: that many server processes behind the one port (`serve_workers`); ``engine`` is then None
    or a picklable ``factory(max_streams=, max_open=) -> Engine`` that each worker calls. ``engine`` None:
    ``load_engine(max_streams=, compile=, max_open=)`` builds it (`server.serve`: `tts.api.get_engine`)."""
    lim = Limits(**limits)
    if workers > 1:
        if engine is None:
            engine = functools.partial(load_engine, compile=compile)
        return serve_workers(
            workers,
            host,
            port,
            engine,
            max_streams,
            compile,
            log_level,
            lim,
            {"api_keys": tuple(api_keys), "allow_origins": tuple(allow_origins), "lexicon": lexicon},
        )
    if engine is None:
        engine = load_engine(max_streams=max_streams, compile=compile, max_open=lim.max_connections)
    sock = _bind(host, port, lim)
    app = build_app(engine, lim, api_keys=api_keys, allow_origins=allow_origins, lexicon=lexicon)
    _freeze_heap()
    _server(app, lim, log_level).run(sockets=[sock])


def serve_workers(
    count: int,
    host: str,
    port: int,
    factory,
    max_streams: int | None,
    compile: bool,
    log_level: str,
    limits: Limits,
    app_options: dict,
) -> None:
    """`count` server processes behind one port (serving/workers.py), until SIGINT/SIGTERM.
    Split over the workers: the engine slots (``max_streams``, default the engine's own: CPU_STREAMS on a CPU,
    GPU_STREAMS_CAP on a GPU), max_connections (each worker's engine opens as many streams) and max_queue. Per
    worker: the per-client caps (a client's connections spread over the workers), and every other limit."""
    pool = _pool(count, host, port, factory, max_streams, limits, log_level, app_options)
    pool.run()


def _pool(
    count: int,
    host: str,
    port: int,
    factory,
    max_streams: int | None,
    limits: Limits,
    log_level: str,
    app_options: dict,
) -> workers.Supervisor:
    """`count` workers started and listening on ``port`` (0: a free one), each with its own socket on it."""
    from streaming.engine import CPU_STREAMS, GPU_STREAMS_CAP

    if not callable(factory) or hasattr(factory, "open"):
        raise TypeError("with workers, `engine` is a factory(max_streams=, max_open=) each worker calls, not an engine")
    if max_streams is None:
        import torch

        max_streams = GPU_STREAMS_CAP if torch.cuda.is_available() else CPU_STREAMS
    if max_streams < count:
        raise ValueError(f"{count} workers need at least {count} engine slots, not {max_streams}")
    # One socket per worker on the one port (SO_REUSEPORT): the kernel hashes each new connection to one of them.
    # One socket shared by all (uvicorn's way) let the first worker to wake take a burst whole: 24 WebSockets
    # opened at once went 16/8, 16/0 (16: its per-client cap, the rest refused); SO_REUSEPORT: 11/13, 12/12.
    public = [_bind(host, port, limits, reuse_port=True)]
    public += [_bind(host, public[0].getsockname()[1], limits, reuse_port=True) for _ in range(count - 1)]
    pool = workers.Supervisor(_worker, public, (factory, max_streams, limits, log_level, app_options))
    pool.start()
    log.info(
        "%d server workers listening on http://%s:%d (%d slots in all); their own addresses: %s",
        count,
        host,
        public[0].getsockname()[1],
        max_streams,
        ", ".join(f"{h}:{p}" for h, p in pool.workers[0].peers),
    )
    return pool


def _worker(
    worker: workers.Worker,
    public: socket.socket,
    private: socket.socket,
    ready,
    factory,
    max_streams: int,
    limits: Limits,
    log_level: str,
    app_options: dict,
) -> None:
    """One worker process of `serve_workers`: its engine, its share of the limits, both its sockets."""
    import dataclasses
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the parent, which stops every worker
    workers.join(worker)
    logging.basicConfig(level=logging.INFO, format=f"%(levelname)s:     [worker {worker.index}] %(message)s")
    i, n = worker.index, worker.count
    limits = dataclasses.replace(
        limits,
        max_connections=workers.split(limits.max_connections, n, i),
        max_queue=workers.split(limits.max_queue, n, i),
    )
    engine = factory(max_streams=workers.split(max_streams, n, i), max_open=limits.max_connections)
    server = _server(build_app(engine, limits, **app_options), limits, log_level)
    _freeze_heap()

    async def run():
        listening = workers.notify_when_listening(server, ready)
        await server.serve(sockets=[public, private])
        listening.cancel()

    with asyncio.Runner(loop_factory=server.config.get_loop_factory()) as runner:  # uvicorn's loop, as in run()
        runner.run(run())
    engine.close()


def _freeze_heap() -> None:
    """Leave the start-up heap (torch, the model, espeak, the web stack: ~190,000 objects, none of them garbage)
    out of every later garbage collection. A full collection walks it with the GIL held: 0.5-1 s on the loaded
    2-core machine, a pause every stream in flight takes into its audio; after the freeze, ~0 ms."""
    gc.collect()
    gc.freeze()


class _Addresses:
    """The URLs of a server listening on ``self.host``, ``self.port``."""

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def ws_url(self) -> str:
        return f"ws://{self.host}:{self.port}/v1/stream"


class ServerThread(_Addresses):
    """The real server in a background thread, on a free loopback port by default (tests, benchmarks).

    >>> with ServerThread(engine) as server:   # doctest: +SKIP
    ...     server.ws_url  # 'ws://127.0.0.1:PORT/v1/stream'
    """

    def __init__(
        self,
        engine=None,
        host: str = "127.0.0.1",
        port: int = 0,
        log_level: str = "warning",
        api_keys=(),
        allow_origins=(),
        aliases: dict[str, str] | None = None,
        lexicon=None,
        **limits,
    ):
        self.limits = Limits(**limits)
        self.app = build_app(
            engine, self.limits, api_keys=api_keys, allow_origins=allow_origins, aliases=aliases, lexicon=lexicon
        )
        self._sock = _bind(host, port, self.limits)
        self.host, self.port = self._sock.getsockname()[:2]
        self._server = _server(self.app, self.limits, log_level)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._sock]}, name="tts-server", daemon=True
        )

    @property
    def hub(self) -> ServerContext:
        return self.app.state.hub

    def start(self, timeout: float = 30.0) -> ServerThread:
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)
        self.hub.pool.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class ServerProcesses(_Addresses):
    """`serve(workers=count)` for a benchmark: worker processes on a free loopback port, each building its engine
    with ``factory(max_streams=, max_open=)`` (picklable), until `stop`. ``hub`` sums what their /health say
    (`serving.workers.PoolView`; ``parking``, the engines' own, is for its readers)."""

    def __init__(
        self,
        factory,
        count: int,
        max_streams: int,
        parking=None,
        host: str = "127.0.0.1",
        port: int = 0,
        log_level: str = "warning",
        **limits,
    ):
        from tts.codec import CodecConfig

        self.limits, self.host, self._view = Limits(**limits), host, (1 / CodecConfig().frame_rate, parking)
        self._start = (count, host, port, factory, max_streams, self.limits, log_level, {})
        self._pool: workers.Supervisor | None = None

    def start(self) -> ServerProcesses:
        self._pool = _pool(*self._start)
        self.port = self._pool.public[0].getsockname()[1]
        self.hub = workers.PoolView(self._pool.workers[0].peers, *self._view)
        return self

    def cpu_seconds(self) -> float:
        """CPU time the workers have used so far, user and system (Linux /proc; 0.0 elsewhere)."""
        return sum(workers.cpu_seconds(p.pid) for p in self._pool.processes)

    def stop(self) -> None:
        self._pool.stop()

    def __enter__(self) -> ServerProcesses:
        return self if self._pool is not None else self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
