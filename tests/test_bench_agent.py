"""bench.agent: the capacity arithmetic, what a run names as its limit, merged client loads, and clients against
a real server (tiny engine) whose turn still speaking at the end of the grace is cut and kept."""

from bench import agent
from bench.agent_load import HostLoad, capacity_streams, client_load, cpu_per_audio_s, limited_by
from server import ServerThread
from testkit import tiny_random

QUIET = {
    "server_thread_cores": {"tts-server": 0.2},
    "server_python_cores": 0.5,
    "server_probe_ms": {"p50": 1.0, "p99": 5.0},
    "client_process_cores": {"max": 0.3},
    "client_loop_lag_ms": {"p99": 2.0},
}
SENTENCES = [
    "A small boat left the harbour at dawn.",
    "The garden gate was painted green last week.",
    "Rain fell on the roof all night long.",
    "He carried the books up three flights of stairs.",
    "Our neighbour bakes bread every Sunday morning.",
]


def test_capacity_is_slots_times_frames_per_tick():
    assert round(capacity_streams(1024, 10.9, 20.0), 1) == 1878.9
    assert capacity_streams(8, 20.0, 20.0) == 8


def test_a_run_names_what_limited_it():
    assert limited_by(100.0, 200.0, 10.0, 20.0, QUIET) == []
    busy = {**QUIET, "server_thread_cores": {"tts-server": 0.95, "tts-text": 0.9}, "client_loop_lag_ms": {"p99": 500.0}}
    found = limited_by(300.0, 200.0, 25.0, 20.0, busy)
    assert found[0].startswith("offered load 300 streams > capacity 200")
    assert found[1].startswith("tick with the slots full 25.0 ms")
    assert found[2:] == ["server event loop", "server thread tts-text busy", "client processes"]
    assert limited_by(None, None, None, 20.0, {**QUIET, "server_python_cores": 0.9}) == [
        "server interpreter lock (Python threads near one core)"
    ]
    unknown = {**QUIET, "server_thread_cores": None, "server_python_cores": None}  # no per-thread figures
    assert limited_by(None, None, None, 20.0, unknown) == []


def test_server_cpu_per_second_of_audio():
    host = {
        "server_wall_s": 50.0,
        "server_process_cores": 0.9,
        "server_thread_cores": {"tts-server": 0.1, "tts-io": 0.02, "tts-engine": 0.6},
    }
    assert cpu_per_audio_s(host, 500.0) == {"process": 90.0, "host_side": 12.0}
    assert cpu_per_audio_s({**host, "server_thread_cores": None}, 500.0)["host_side"] is None
    assert cpu_per_audio_s(host, 0.0) is None


def test_client_loads_merge():
    merged = client_load(
        [{"cpu_s": 1.0, "wall_s": 2.0, "lag_ms": [1.0, 2.0]}, {"cpu_s": 3.0, "wall_s": 4.0, "lag_ms": [10.0]}]
    )
    assert merged["client_processes"] == 2
    assert merged["client_process_cores"] == {"max": 0.75, "mean": 0.625}
    assert merged["client_loop_lag_ms"]["max"] == 10.0


def test_a_turn_still_speaking_after_the_grace_is_cut_and_kept(monkeypatch):
    monkeypatch.setattr(agent, "_sentences", lambda: SENTENCES)
    engine = tiny_random(max_streams=2, max_open=4)
    try:
        with ServerThread(engine) as server:  # client 0 arrives after 4.2 s, client 1 after 0.7 s
            host = HostLoad(server.url).start()
            results, load = agent.clients(server.ws_url, [0, 1], seconds=2.0, ahead_s=2.0, grace_s=1.0)
            host = host.stop()
    finally:
        engine.close()
    assert results[0] == []  # arrived after the end
    assert len(results[1]) == 1 and results[1][0]["cut"]  # its turn (2-4 sentences, pauses) outlasts 3 s
    assert results[1][0]["words"] > 0 and load["wall_s"] < 15 and load["lag_ms"]
    assert host["server_probe_ms"]["probes"] >= 4 and host["server_probe_failures"] == 0  # every 0.5 s
    assert host["server_process_cores"] > 0
