"""Scale-out on Ray Serve (serving/ray_serve.py): a real two-replica local Ray cluster on the CPU, each replica
a tiny engine behind the server's own app, reached through Ray Serve's proxy with real clients (websockets, the
OpenAI SDK). Seeded utterances are bit-identical whatever else runs, so audio through any replica can be compared
sample for sample."""

from __future__ import annotations

import asyncio
import json
import socket
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("ray.serve", reason="ray[serve] is not installed (pip install -e '.[ray]')")
import openai  # noqa: E402
import ray  # noqa: E402
import websockets  # noqa: E402
from ray import serve  # noqa: E402

from server import create_app  # noqa: E402
from serving import failover, ray_serve  # noqa: E402
from serving.limits import Limits  # noqa: E402
from testkit import tiny_random  # noqa: E402
from tts.client import StreamClient, connect  # noqa: E402

# Ray copies the autoscaling config as it deploys, warning each time about a field it is retiring (see ScaleConfig)
pytestmark = pytest.mark.filterwarnings("ignore:The `metrics_interval_s` field:DeprecationWarning")
ROOT = Path(__file__).resolve().parents[1]
SENTENCE = "The quick brown fox jumps over the lazy dog. "
TEXT = SENTENCE * 2
REPLICA = "x-tts-replica"


def scale(replicas: int) -> ray_serve.ScaleConfig:
    return ray_serve.ScaleConfig(replicas=replicas, num_cpus=0.5, graceful_shutdown_timeout_s=30)


def application(replicas: int):
    # The drain, not the idle timeout, is to end the redeploy test's sockets: on a loaded machine the new replicas
    # may take longer than the default 30 s to start while the old sockets, their audio all sent, wait for it.
    return ray_serve.application(
        tiny_random, create_app, scale(replicas), {"max_streams": 4}, {"limits": Limits(idle_timeout_s=300)}
    )


def replica_states() -> dict[str, int]:
    """How many replicas are in each state ("RUNNING", "STOPPING", "STARTING", ...)."""
    states = serve.status().applications["tts"].deployments["tts"].replica_states
    return {str(getattr(state, "value", state)): n for state, n in states.items()}


def replica_names() -> set[str]:
    """The ids of the replica actors alive now."""
    prefix = "SERVE_REPLICA::tts#tts#"
    return {
        a["name"][len(prefix) :]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["name"].startswith(prefix)
    }


def wait_for(condition, seconds: float = 120) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"not within {seconds} s: {replica_states()}"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def cluster():
    """Ray Serve on a local two-core cluster with two replicas: (http url, ws url)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": {"PYTHONPATH": f"{ROOT}:{ROOT / 'tests'}"}},
    )
    try:
        ray_serve.start(application(2), port=port)
        yield f"http://127.0.0.1:{port}", f"ws://127.0.0.1:{port}/v1/stream"
    finally:
        serve.shutdown()
        ray.shutdown()


def run(coro, seconds: float = 120):
    return asyncio.run(asyncio.wait_for(coro, seconds))


async def send(ws, **message) -> None:
    await ws.send(json.dumps(message))


async def start(ws, seed: int, text: str = SENTENCE, context_id: str | None = None) -> None:
    """Open a seeded pcm utterance and send its first text, leaving it open (an active stream)."""
    ids = {} if context_id is None else {"context_id": context_id}
    await send(ws, type="start", format="pcm_s16le", seed=seed, **ids)
    ready = json.loads(await ws.recv())
    assert ready["type"] == "ready", ready
    await send(ws, type="text", text=text, **ids)


async def finish(ws) -> tuple[bytes, dict]:
    """End the default utterance's text: (all its audio, the done event)."""
    await send(ws, type="end")
    audio = b""
    while isinstance(message := await asyncio.wait_for(ws.recv(), 60), bytes):
        audio += message
    done = json.loads(message)
    assert done["type"] == "done" and not done["cancelled"], done
    return audio, done


async def speak(url: str, seed: int, text: str) -> tuple[bytes, str]:
    """One whole seeded utterance on a new connection: (audio, the replica that spoke it)."""
    async with websockets.connect(url) as ws:
        await start(ws, seed, text)
        audio, _ = await finish(ws)
        return audio, ws.response.headers[REPLICA]


def same_audio(a: bytes, b: bytes) -> bool:
    """Two pcm_s16le utterances hold the same samples: equal length, each within 1e-4 of full scale (3 steps of
    16 bits). Seeded streams are bit-identical unless one was parked while it waited for text: restored into
    another batch, it may differ by float rounding (the engine's parking bound)."""
    x, y = np.frombuffer(a, np.int16).astype(int), np.frombuffer(b, np.int16).astype(int)
    return len(x) == len(y) and (len(x) == 0 or int(np.abs(x - y).max()) <= 3)


def get(url: str) -> tuple[dict, str]:
    with urllib.request.urlopen(url, timeout=30) as response:
        return json.loads(response.read()), response.headers[REPLICA]


def test_placement_goes_to_the_replica_with_fewer_active_streams_and_both_serve(cluster):
    http, ws_url = cluster

    async def scenario():
        async with websockets.connect(ws_url) as busy:
            await start(busy, 1, SENTENCE * 8, context_id="a")
            await start(busy, 2, SENTENCE * 8, context_id="b")
            await asyncio.sleep(4 * ray_serve.STATS_PERIOD_S)  # the routers hear of the two streams
            loaded = busy.response.headers[REPLICA]
            placed = []
            for _ in range(3):
                async with websockets.connect(ws_url) as ws:
                    placed.append(ws.response.headers[REPLICA])
            health = [await asyncio.to_thread(get, http + "/health") for _ in range(2)]
            return loaded, placed, health

    loaded, placed, health = run(scenario())
    assert all(p != loaded for p in placed), (loaded, placed)  # the idle replica takes every newcomer
    assert all(replica == placed[0] and figures["status"] == "ok" for figures, replica in health)


def test_a_websocket_utterance_and_an_http_speech_request_through_ray(cluster):
    http, ws_url = cluster
    audio, _ = run(speak(ws_url, 7, TEXT))
    client = openai.OpenAI(api_key="not-needed", base_url=http + "/v1", max_retries=0)
    with client.audio.speech.with_streaming_response.create(
        model="tts-1", voice="joe", input=TEXT, response_format="pcm", extra_body={"seed": 7}
    ) as response:
        body = b"".join(response.iter_bytes())
        assert response.headers[REPLICA]
    assert len(audio) > 24_000 and body == audio  # one seeded utterance, the same samples by either surface
    voices, _ = get(http + "/v1/voices")
    assert voices["default"] == "joe" and len(voices["voices"]) == 5


async def words(text: str, gap_s: float):
    """Text as an LLM sends it: a word at a time."""
    for word in text.split():
        yield word + " "
        await asyncio.sleep(gap_s)


async def listen(url: str, seeds: list[int], text: str, on_audio=None) -> tuple[list[bytes], list, StreamClient]:
    """Seeded utterances one after another on one session of the Python client, their text a word every 50 ms:
    (each one's audio, (arrival time, reconnects so far) per frame, the client). ``on_audio(client, utterance,
    bytes of it so far)`` is awaited after each frame."""
    audio, arrivals = [], []
    async with connect(url, backoff_s=0.05) as client:
        for index, seed in enumerate(seeds):
            audio.append(b"")
            async for frame in client.stream(words(text, 0.05), seed=seed):
                audio[-1] += frame
                arrivals.append((time.perf_counter(), client.reconnects))
                if on_audio is not None:
                    await on_audio(client, index, len(audio[-1]))
    return audio, arrivals, client


def kill(replica: str) -> None:
    ray.kill(ray.get_actor(f"SERVE_REPLICA::tts#tts#{replica}", namespace="serve"), no_restart=True)


def test_a_killed_replicas_stream_continues_on_the_other_with_every_sample(cluster):
    """A replica killed (ray.kill) 2 s into a session's second utterance, its client still sending text: the
    Python client resumes through the proxy on the other replica, which continues the second utterance from its
    latest checkpoint that the client holds (the client has the first utterance whole) and replays the
    session's journal after it; the client's audio goes on and equals, sample for sample, the same seeded
    session never interrupted (how soon it goes on is for bench.ray_serve --kill to measure; here only that it
    does not hang). The other replica's own utterance goes on to its last sample, and a new connection is
    served by the survivor."""
    _, ws_url = cluster
    text = SENTENCE * 2  # about 5.7 s of the tiny engine's audio
    killed = {}
    journals = ray.get_actor(failover.JOURNALS_ACTOR, namespace="serve")

    async def kill_at_two_seconds(client, utterance, nbytes):
        if not killed and utterance == 1 and nbytes >= 96_000:
            killed["replica"] = client.ws.response.headers[REPLICA]
            killed["at"] = time.perf_counter()
            await asyncio.to_thread(kill, killed["replica"])

    async def scenario():
        reference, _, _ = await listen(ws_url, [31, 32], text)
        other = await websockets.connect(ws_url)
        await start(other, 22, TEXT)
        await asyncio.sleep(4 * ray_serve.STATS_PERIOD_S)  # the routers hear of its stream: ours goes elsewhere
        audio, arrivals, client = await listen(ws_url, [31, 32], text, kill_at_two_seconds)
        assert other.response.headers[REPLICA] != killed["replica"]
        other_audio, _ = await finish(other)
        again, replica = await speak(ws_url, 22, TEXT)
        return reference, audio, arrivals, client, other_audio, again, replica

    try:
        reference, audio, arrivals, client, other_audio, again, replica = run(scenario(), 240)
    finally:  # Ray starts a replacement: wait until it serves
        wait_for(lambda: len(replica_names() - {killed.get("replica")}) == 2 and replica_states() == {"RUNNING": 2})
    gap = next(at for at, reconnects in arrivals if reconnects) - killed["at"]
    assert client.reconnects == 1 and client.ws.response.headers[REPLICA] != killed["replica"]
    assert len(audio) == len(reference) == 2
    assert all(same_audio(a, b) for a, b in zip(audio, reference))  # no sample lost, repeated or changed
    assert gap < 10, f"the audio went on {gap:.1f} s after the kill"
    assert same_audio(other_audio, again) and replica != killed["replica"]
    replays = ray.get(journals.stats.remote())
    assert replays["utterances"] == replays["from_checkpoints"] == 1, replays  # not regenerated from its start


def test_a_replay_leaves_out_what_the_client_has_and_cuts_a_chunk_at_its_byte():
    """`failover.compact` and `Replay.filter` on the worked examples of their docstrings."""
    start, text, end = (json.dumps({"type": kind}) for kind in ("start", "text", "end"))
    done = {"done": None, "at": [96_000, 3]}
    journal = [start, text, end, done, start, text]
    feed, shift, chosen = failover.compact(journal, {None: (120_000, 4)})
    assert feed == [start, text] and shift.offsets == {None: [96_000, 3]} and shift.dropped == 3 and not chosen
    feed, shift, _ = failover.compact(journal, {None: (50_000, 2)})  # done not had
    assert len(feed) == 5 and shift.dropped == 0
    # a checkpoint of the second utterance (its start is entry 4) that has taken in entries 0..5, at 20000 B
    checkpoint = failover.Checkpoint(None, 4, 6, 10_000, 20_000, "weights", b"state")
    feed, shift, chosen = failover.compact(journal, {None: (120_000, 4)}, [checkpoint], "weights")
    assert feed == [start] and shift.offsets == {None: [116_000, 3]} and shift.dropped == 4
    assert chosen == {None: (0, checkpoint)}
    for have, weights in (((110_000, 4), "weights"), ((120_000, 3), "weights"), ((120_000, 4), "others")):
        feed, shift, chosen = failover.compact(journal, {None: have}, [checkpoint], weights)  # lacks its audio,
        assert feed == [start, text] and not chosen  # its ready, or has other weights: from the start
    replay = failover.Replay(journal, {None: (120_000, 4)}, [checkpoint], "weights", lambda state: 77)
    assert list(replay.feed) == [json.dumps({"type": "start", "seed": 77})] and replay.standins == {None: (77, 10_000)}

    replay = failover.Replay([start], {None: (9600, 1)})
    position, sent = [0, 0], []
    for message in (
        {"type": "websocket.send", "text": json.dumps({"type": "ready"})},
        {"type": "websocket.send", "bytes": bytes(4800)},
        {"type": "websocket.send", "text": json.dumps({"type": "timing"})},
        {"type": "websocket.send", "bytes": bytes(range(256)) * 37 + bytes(128)},
    ):
        context_id, nbytes, event = failover.outgoing(message)
        sent.append(replay.filter(message, event, position, nbytes, context_id))
        position[0] += nbytes
        position[1] += event is not None
    assert sent[:2] == [None, None] and json.loads(sent[2]["text"])["type"] == "timing"
    assert sent[3]["bytes"] == (bytes(range(256)) * 37 + bytes(128))[4800:]


def test_a_redeploy_drains_the_old_replicas_without_losing_a_sample(cluster):
    """A redeploy (new code: Ray replaces every replica) with an utterance open on each old replica: Ray stops
    routing to the old replicas, which finish their utterances with every sample (equal to the same seeded
    utterance spoken afresh on a new replica), then close their sockets with 1012 so the clients reconnect."""
    _, ws_url = cluster

    async def scenario():
        first = await websockets.connect(ws_url)
        await start(first, 11, TEXT)
        await asyncio.sleep(4 * ray_serve.STATS_PERIOD_S)  # the routers hear of its stream
        second = await websockets.connect(ws_url)
        await start(second, 12, TEXT)
        old = {first.response.headers[REPLICA], second.response.headers[REPLICA]}
        assert len(old) == 2, old  # one utterance on each replica
        serve.run_many(
            [serve.RunTarget(application(2), name="tts", route_prefix="/")], wait_for_applications_running=False
        )
        await asyncio.to_thread(wait_for, lambda: replica_states().get("STOPPING", 0) >= 1)
        results = [await finish(ws) for ws in (first, second)]
        closed = []
        for ws in (first, second):
            try:
                after = await asyncio.wait_for(ws.recv(), 60)
            except websockets.ConnectionClosed as gone:
                closed.append(gone.rcvd.code)
            else:
                raise AssertionError(f"after done, not the close: {after[:300]!r}")
        await asyncio.to_thread(wait_for, lambda: replica_states() == {"RUNNING": 2})
        fresh = [await speak(ws_url, seed, TEXT) for seed in (11, 12)]
        return old, results, closed, fresh

    old, results, closed, fresh = run(scenario(), 300)
    assert closed == [ray_serve.CLOSE_DRAINING] * 2
    assert not old & {replica for _, replica in fresh}  # the new replicas serve the newcomers
    assert all(same_audio(a, b) for (a, _), (b, _) in zip(results, fresh))  # no sample lost or changed


def test_autoscaling_adds_a_replica_for_active_streams_and_removes_it_when_they_end(cluster):
    """Autoscaling between 1 and 2 replicas at 1 active stream per replica: two open streams bring a second
    replica, which takes the next connection; when they end, Ray goes back to one (after its 10 s delay)."""
    _, ws_url = cluster
    scale = ray_serve.ScaleConfig(
        replicas=1,
        autoscale=True,
        min_replicas=1,
        max_replicas=2,
        target_streams=1,
        num_cpus=0.5,
        graceful_shutdown_timeout_s=30,
    )
    serve.run(ray_serve.application(tiny_random, create_app, scale, {"max_streams": 4}), name="tts", route_prefix="/")
    wait_for(lambda: replica_states() == {"RUNNING": 1})

    async def scenario():
        streams = [await websockets.connect(ws_url) for _ in range(2)]
        for seed, ws in enumerate(streams):
            await start(ws, seed, TEXT)
        await asyncio.to_thread(wait_for, lambda: replica_states() == {"RUNNING": 2})
        await asyncio.sleep(4 * ray_serve.STATS_PERIOD_S)
        async with websockets.connect(ws_url) as newcomer:
            placed = newcomer.response.headers[REPLICA]
        for ws in streams:
            await finish(ws)
            await ws.close()
        await asyncio.to_thread(wait_for, lambda: replica_states() == {"RUNNING": 1})
        return {ws.response.headers[REPLICA] for ws in streams}, placed

    busy, placed = run(scenario(), 300)
    assert len(busy) == 1 and placed not in busy  # the streams shared the one replica; the new one took the newcomer


def test_the_autoscaling_policy_asks_for_a_replica_per_target_streams():
    """`streams_policy` on Ray's own AutoscalingContext: 13 active streams at 6 per replica want 3 replicas;
    none want 0 (Ray then holds min_replicas)."""
    from ray.serve.config import AutoscalingConfig, AutoscalingContext

    def context(streams: list[int]) -> AutoscalingContext:
        return AutoscalingContext(
            deployment_id=None,
            deployment_name="tts",
            app_name="tts",
            current_num_replicas=len(streams),
            target_num_replicas=len(streams),
            running_replicas=[],
            total_num_requests=0,
            total_queued_requests=0,
            aggregated_metrics={"active_streams": {f"r{i}": n for i, n in enumerate(streams)}},
            raw_metrics=None,
            capacity_adjusted_min_replicas=1,
            capacity_adjusted_max_replicas=8,
            policy_state={},
            last_scale_up_time=None,
            last_scale_down_time=None,
            current_time=None,
            config=AutoscalingConfig(min_replicas=1, max_replicas=8, target_ongoing_requests=6),
        )

    assert ray_serve.streams_policy(context([7, 6]))[0] == 3
    assert ray_serve.streams_policy(context([6, 0]))[0] == 1
    assert ray_serve.streams_policy(context([0, 0]))[0] == 0


def test_the_scale_bench_makes_room_for_its_clients_on_one_address():
    """`bench.ray_serve` drives every client from one address: above the per-client cap (16) its limits grow with
    the load, so a climb measures the replicas, not `client_limit`; at or below it they are the defaults."""
    from bench.ray_serve import load_limits

    limits = load_limits(48)
    assert (limits.max_connections_per_client, limits.max_streams_per_client) == (48, 48)
    assert limits.max_connections >= 2 * 48 and limits.max_queue >= 48
    assert load_limits(4) == Limits() == load_limits(16)
