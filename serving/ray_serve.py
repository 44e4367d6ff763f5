"""Scale-out on Ray Serve: N engine replicas behind the server's own surface (docs/scale-out.md says how to run it).

    client --WS/HTTP--> Ray Serve's proxy --(StreamRouter)--> EngineServer replica 1..N
                                                              (one Engine + the server's Starlette app each)

Each replica runs the whole server app (`server.create_app`, handed in by the caller: `streaming` does not import
the server) on its own engine, so the WebSocket protocol, the OpenAI speech API, /health and /v1/voices are the
very code `tts serve` runs. Ray's proxy holds the client's socket and relays it to one replica:
  * session affinity: a WebSocket is one ASGI request, so it and every utterance on it stay on one replica;
  * least-loaded placement (`StreamRouter`, a Ray Serve request router): a new connection or speech request goes
    to the replica with the fewest active streams (reported by `EngineServer.record_routing_stats`), ties broken
    by fewer requests in flight from the proxy (open connections);
  * autoscaling on active streams (`streams_policy`): replicas = ceil(active streams / target_ongoing_requests),
    within min_replicas..max_replicas (Ray applies the bounds and the up/down delays);
  * draining (`EngineServer._watch_drain`): a replica Ray removes (scale-down, redeploy) takes no new connection;
    its utterances in progress finish with all their audio; each of its WebSockets is closed with code 1012
    ("service restart") as soon as it has no utterance open, so the client reconnects and lands on a replica
    that stays; Ray stops the replica once no connection is left, or after graceful_shutdown_timeout_s.
  * failover (`serving.failover`): every replica journals its WebSocket sessions' messages, and checkpoints
    their live utterances' engine state, in a Ray actor that outlives it; when a replica dies, its clients resume
    (the proxy drops their sockets, they reconnect through it) on a live replica, which attaches the latest
    checkpoints, replays the journal after them and sends each client the rest of its audio.

Ray is imported by this module; nothing on the default path imports it (`tts serve --ray` does).
"""

from __future__ import annotations

import asyncio
import importlib
import json
import logging
import math
import os
import warnings
from dataclasses import dataclass
from pathlib import Path

from ray import serve
from ray.serve.config import AutoscalingConfig, AutoscalingPolicy, RequestRouterConfig
from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from serving.failover import CHECKPOINT_AUDIO_S, Checkpointing, Failover, journals, stop_journals

log = logging.getLogger("tts.ray")
STATS_PERIOD_S = 0.25  # how often each replica reports its active streams to the routers
DRAIN_POLL_S = 0.1  # how often a draining replica looks for WebSockets with no utterance open
CLOSE_DRAINING = 1012  # WebSocket close code "service restart": reconnect, and the proxy places you elsewhere
OFFERED: dict[str, set[str]] = {}  # see `offered_replicas`


@dataclass(frozen=True)
class ScaleConfig:
    """How many replicas and what each gets. ``replicas`` fixed, or autoscaling between ``min_replicas`` and
    ``max_replicas`` on ``target_streams`` active streams per replica when ``autoscale`` is set.
    ``num_cpus`` per replica (None: the machine's cores shared evenly by the replicas), ``num_gpus`` per
    replica (fractions allowed: 0.5 puts two replicas on a GPU)."""

    replicas: int = 2
    autoscale: bool = False
    min_replicas: int = 1
    max_replicas: int = 4
    target_streams: float = 6.0
    num_cpus: float | None = None
    num_gpus: float = 0.0
    graceful_shutdown_timeout_s: float = 60.0
    failover: bool = True  # journal WebSocket sessions so that a dead replica's continue on another
    checkpoint_audio_s: float = CHECKPOINT_AUDIO_S  # checkpoint live utterances this often (audio; 0: never)

    def __post_init__(self):
        if self.replicas < 1 or not 1 <= self.max_replicas or not 0 <= self.min_replicas <= self.max_replicas:
            raise ValueError(f"replica counts must satisfy 1 <= replicas and 0 <= min <= max, not {self}")

    def deployment_options(self) -> dict:
        cpus = self.num_cpus
        if cpus is None:
            cpus = max(0.1, (os.cpu_count() or 1) / (self.max_replicas if self.autoscale else self.replicas))
        options = {
            "ray_actor_options": {"num_cpus": cpus, "num_gpus": self.num_gpus},
            "graceful_shutdown_timeout_s": self.graceful_shutdown_timeout_s,
            "graceful_shutdown_wait_loop_s": 0.2,
            "max_ongoing_requests": 10_000,  # admission is the server's own (limits), per replica
            "request_router_config": RequestRouterConfig(
                request_router_class=StreamRouter,
                request_routing_stats_period_s=STATS_PERIOD_S,
                request_routing_stats_timeout_s=5.0,
            ),
        }
        if self.autoscale:
            with warnings.catch_warnings():  # metrics_interval_s is to move to an environment variable; until
                warnings.simplefilter("ignore", DeprecationWarning)  # then it is how the replicas report often
                options["autoscaling_config"] = AutoscalingConfig(
                    min_replicas=self.min_replicas,
                    max_replicas=self.max_replicas,
                    initial_replicas=min(max(self.replicas, self.min_replicas), self.max_replicas),
                    target_ongoing_requests=self.target_streams,
                    metrics_interval_s=STATS_PERIOD_S,
                    look_back_period_s=2.0,
                    upscale_delay_s=1.0,
                    downscale_delay_s=10.0,
                    policy=AutoscalingPolicy(policy_function=streams_policy),
                )
        else:
            options["num_replicas"] = self.replicas
        return options


# ---- the replica ------------------------------------------------------------------------------------
@serve.deployment(name="tts")
@serve.ingress()
class EngineServer:
    """One engine and the server app on it, in a Ray Serve replica. ``engine_factory(**engine_kwargs)`` builds
    the engine (`tts.api.get_engine`; tests pass the tiny engine's); ``app_factory(engine, **app_kwargs)`` the
    ASGI app (`server.create_app`), whose ``state.hub`` is the `serving.context.ServerContext` it serves from."""

    def __init__(
        self,
        engine_factory,
        engine_kwargs: dict,
        app_factory,
        app_kwargs: dict,
        failover: bool = True,
        checkpoint_audio_s: float = CHECKPOINT_AUDIO_S,
    ):
        self.engine = engine_factory(**engine_kwargs)
        if failover:  # a replay feeds the text after a checkpoint at once: the audio must depend on the text alone,
            self.engine.speculative = False  # not on when its pieces came (what speculative encoding reads)
            self.engine.slots.stretch_max = 1.0  # nor on how far the text was ahead (elastic pacing, `Slots.pace`)
        served = Checkpointing(self.engine) if failover else self.engine  # a replay may attach a checkpoint
        self.server_app = app_factory(served, **app_kwargs)
        self.hub = self.server_app.state.hub
        counted = OpenUtterances(self.server_app)  # inside Failover: it sees replayed starts, and sends end there
        self.outer_app = Failover(counted, self.hub, journals(), served, checkpoint_audio_s) if failover else counted
        context = serve.get_replica_context()
        self.replica, self.deployment, self.app_name = context.replica_tag, context.deployment, context.app_name
        self.draining = False
        self._watcher = None

    def __serve_build_asgi_app__(self):
        return ReplicaHeader(self.outer_app, self.replica)

    def active_streams(self) -> int:
        """Streams open for clients here: speaking, or waiting in the engine's queue for a slot."""
        return len(self.hub.streams)

    async def record_routing_stats(self) -> dict:
        """What `StreamRouter` places by (Ray calls it every STATS_PERIOD_S). Also starts the drain watch,
        once, on the replica's own event loop."""
        if self._watcher is None:
            self._watcher = asyncio.get_running_loop().create_task(self._watch_drain())
        return {"active_streams": self.active_streams(), "draining": self.draining}

    async def record_autoscaling_stats(self) -> dict:
        return {"active_streams": self.active_streams()}

    async def _watch_drain(self) -> None:
        """Find out that Ray is removing this replica, then drain it (module docstring). Ray tells a replica
        nothing before it stops routing to it, but every router learns which replicas it may route to: so the
        replica routes to its own deployment (a `ping`), and its own router in this process tells it once it is
        no longer offered."""
        handle = serve.get_deployment_handle(self.deployment, self.app_name)
        await handle.ping.remote()
        seen = False
        while not self.draining:
            offered = offered_replicas().get(self.deployment, set())
            seen = seen or self.replica in offered
            self.draining = seen and self.replica not in offered
            await asyncio.sleep(DRAIN_POLL_S)
        log.info(
            "replica %s is draining: %d streams, %d connections",
            self.replica,
            self.active_streams(),
            len(self.hub.sessions),
        )
        while True:
            for session in list(self.hub.sessions):
                ws = _socket(session)
                if not session.utterances and not OpenUtterances.on(ws):  # its last done has gone out
                    await session.close()  # ended here for good: no resume on this replica, which is going
                    if ws is not None:
                        await _close_quietly(ws, CLOSE_DRAINING, "draining")
            await asyncio.sleep(DRAIN_POLL_S)

    def ping(self) -> str:
        return self.replica


def offered_replicas() -> dict[str, set[str]]:
    """Deployment name -> the replicas this process's routers may route its requests to (`StreamRouter` keeps
    it). Reached through this module imported by name: Ray ships both the deployment class and the router class
    to their processes by value, each with its own copy of this module's globals, so a plain global would not be
    shared between the router and the replica it runs in."""
    return importlib.import_module("serving.ray_serve").OFFERED


class ReplicaHeader:
    """ASGI middleware naming the replica that answers: header ``x-tts-replica`` on every HTTP response and
    WebSocket accept (for operators and tests: which replica holds a connection)."""

    def __init__(self, app, replica: str):
        self.app, self.header = app, (b"x-tts-replica", replica.encode())

    async def __call__(self, scope, receive, send):
        async def tagged(message):
            if message["type"] in ("http.response.start", "websocket.accept"):
                message = {**message, "headers": [*message.get("headers", []), self.header]}
            await send(message)

        await self.app(scope, receive, tagged)


class OpenUtterances:
    """ASGI middleware around the server app: per WebSocket, the utterances whose `ready` (or `queued`) the app
    has sent and whose `done` (or, refused while queued, whose `error`) it has not yet finished sending. The drain
    closes a socket only when its session has no utterance and none is open here: the server frees an
    utterance's context before its done goes out, and Failover journals before passing the done on, so a socket
    closed as soon as its session showed no utterance could lose that done (seen under load). Inside Failover, it
    sees a replay's events too. Example: queued (b), ready (a), error (b), audio.., done (a): {b} {a, b} {a} {}."""

    SCOPE_KEY = "tts.open_utterances"

    def __init__(self, app):
        self.app = app

    @classmethod
    def on(cls, ws) -> int:
        """How many utterances are open on a starlette WebSocket (0 for None)."""
        return len(ws.scope.get(cls.SCOPE_KEY, ())) if ws is not None else 0

    async def __call__(self, scope, receive, send):
        if scope["type"] != "websocket":
            return await self.app(scope, receive, send)
        opened = scope[self.SCOPE_KEY] = {}  # context id -> whether its ready has gone out

        async def counted(message):
            event = _small_event(message) if message["type"] == "websocket.send" else {}
            kind, context_id = event.get("type"), event.get("context_id")
            if kind in ("queued", "ready"):
                opened[context_id] = opened.get(context_id, False) or kind == "ready"
            await send(message)
            if kind == "done" or kind == "error" and opened.get(context_id) is False:
                opened.pop(context_id, None)

        await self.app(scope, receive, counted)


def _small_event(message: dict) -> dict:
    """A WebSocket text message's JSON object, if it is a small one (events; not base64 audio); else {}."""
    text = message.get("text")
    if not text or len(text) > 4096:
        return {}
    try:
        event = json.loads(text)
    except ValueError:
        return {}
    return event if isinstance(event, dict) else {}


def _socket(session):
    """The WebSocket serving a server session now, if any: ``session.link.ws`` where sessions outlive their socket
    for a resume (``link`` None while one waits for it), else ``session.ws``."""
    if hasattr(session, "link"):
        return session.link.ws if session.link is not None else None
    return session.ws


async def _close_quietly(ws, code: int, reason: str) -> None:
    try:
        await ws.close(code, reason)
    except Exception:  # already closing, or gone: either way it is no longer ours
        pass


# ---- placement and scaling ---------------------------------------------------------------------------
class StreamRouter(RequestRouter):
    """Least-loaded placement by active streams: the replicas ranked by the active streams each reported (Ray's
    controller polls them every STATS_PERIOD_S and passes the figures on, so they lag by about a second), then
    by the requests this router has in flight on each (its open connections: exact at once, so a burst of new
    connections spreads before the stream counts catch up). A connection stays where it was placed (Ray's proxy
    relays it to that replica for its whole life), so affinity needs nothing here. Replicas that report that
    they are draining are chosen only when no other is offered.

    Example: a (2 streams, 1 connection), b (0, 3), c (0, 1), d (0, 0, draining) -> [[c], [b], [a], [d]]."""

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        offered_replicas()[self._deployment_id.name] = {r.replica_id.unique_id for r in replicas}

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        ranks: dict[tuple, list[RunningReplica]] = {}
        for replica in candidate_replicas:
            stats = replica.routing_stats or {}
            in_flight = self.replica_queue_len_cache.get(replica.replica_id) or 0
            key = (bool(stats.get("draining")), stats.get("active_streams", 0), in_flight)
            ranks.setdefault(key, []).append(replica)
        return [ranks[key] for key in sorted(ranks)]


def streams_policy(ctx) -> tuple[int, dict]:
    """Ray Serve autoscaling policy: enough replicas for every active stream at the target per replica
    (`ScaleConfig.target_streams`, passed as target_ongoing_requests). Ray then clamps it to
    min..max_replicas and applies the up/down delays. Example: 13 streams, target 6 -> 3 replicas."""
    streams = sum((ctx.aggregated_metrics or {}).get("active_streams", {}).values())
    return math.ceil(streams / ctx.config.get_target_ongoing_requests()), ctx.policy_state


# ---- building and running it ---------------------------------------------------------------------------
def application(
    engine_factory,
    app_factory,
    scale: ScaleConfig = ScaleConfig(),
    engine_kwargs: dict | None = None,
    app_kwargs: dict | None = None,
):
    """The Ray Serve application: `EngineServer` replicas as ``scale`` says."""
    return EngineServer.options(**scale.deployment_options()).bind(
        engine_factory, engine_kwargs or {}, app_factory, app_kwargs or {}, scale.failover, scale.checkpoint_audio_s
    )


def start(
    app,
    host: str = "127.0.0.1",
    port: int = 8000,
    address: str | None = None,
    name: str = "tts",
    num_cpus: float | None = None,
):
    """Deploy ``app`` on the Ray cluster at ``address`` (None: a local one started here, or the one this
    process is already connected to) with Serve's HTTP proxy on host:port. Returns the deployment's handle
    once every replica is up."""
    import ray

    if not ray.is_initialized():  # replicas import this checkout's code, as this process does
        ray.init(
            address=address,
            num_cpus=num_cpus,
            include_dashboard=False,
            log_to_driver=False,
            runtime_env={"env_vars": {"PYTHONPATH": str(Path(__file__).resolve().parents[1])}},
        )
    serve.start(http_options={"host": host, "port": port})
    return serve.run(app, name=name, route_prefix="/")


def run(app, host: str = "127.0.0.1", port: int = 8000, address: str | None = None) -> None:
    """`start`, then serve until Ctrl-C or SIGTERM; then Serve shuts down, draining its replicas (`tts serve
    --ray`)."""
    import signal
    import time

    signal.signal(signal.SIGTERM, _interrupt)
    try:
        start(app, host, port, address)
        log.info(
            "Ray Serve is serving on http://%s:%d (WebSocket ws://%s:%d/v1/stream); Ctrl-C stops it",
            host,
            port,
            host,
            port,
        )
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        import ray

        if ray.is_initialized():
            serve.shutdown()
            stop_journals()


def _interrupt(*_) -> None:
    raise KeyboardInterrupt
