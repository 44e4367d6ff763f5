"""Where an agent run's time went (`bench.agent`): the server process's CPU by thread role, how long its event
loop takes to answer a trivial request, the client processes' CPU and event-loop lag, and the slots' capacity
from the tick with the slots full. Cheap enough to run alongside every run (a probe every 0.5 s, two readings
of the threads' CPU).
"""

from __future__ import annotations

import asyncio
import http.client
import threading
import time
from urllib.parse import urlsplit

import numpy as np

from bench.common import percentiles

# Whole-tick p50 with the slots full, last measured (docs/figures.md): 2 cores at 8 slots (`bench.serve
# --agent --offered-only` row), one H200 at 1,024 slots (`bench.latency --device cuda`, latency_cuda_loads.json).
MEASURED_TICK_MS = {"cpu": 9.16, "cuda": 10.9}
FULL = 0.9  # "slots full": at least this share of them in use
BUSY_CORE = 0.85  # a thread (or process) using this much of a core is taken as saturated
SLOW_PROBE_MS = 200.0  # a server answering a trivial request slower than this (p99) is behind
SLOW_LAG_MS = 100.0  # a client loop running this late (p99) is behind
SINGLE_THREADS = ("tts-engine", "tts-text", "tts-codec", "tts-parking")  # the engine's threads, one of each


def capacity_streams(slots: int, tick_ms: float, frame_ms: float) -> float:
    """Real-time streams the slots give when every tick steps every slot one frame. Example: 1,024 slots,
    20 ms frames, a 10.9 ms tick: each slot makes 20 / 10.9 = 1.83 s of audio a second, 1,879 streams."""
    return slots * frame_ms / tick_ms


def thread_cpu() -> dict[str, float] | None:
    """CPU seconds of this process's live threads, summed by role: a `tts-*` thread's name up to its first
    "_" (the server's `tts-io_N` pool threads are one role), "main", "other" Python threads, or "native"
    (threads Python did not start: CUDA, ONNX Runtime, torch's pools). None where the system does not say
    (psutil missing, or no per-thread /proc)."""
    try:
        import psutil  # the bench extra's (imported here: the tests import this module without it)

        threads = psutil.Process().threads()
    except Exception:  # noqa: BLE001 - a figure we can do without, on any system
        return None
    names = {t.native_id: t.name for t in threading.enumerate()}
    roles: dict[str, float] = {}
    for t in threads:
        name = names.get(t.id)
        role = (
            "native"
            if name is None
            else name.split("_")[0]
            if name.startswith("tts-")
            else "main"
            if name == "MainThread"
            else "other"
        )
        roles[role] = roles.get(role, 0.0) + t.user_time + t.system_time
    return roles


class HostLoad:
    """The server process's side of a run, from `start` to `stop`: cores used in all and by thread role, and
    the time the server takes to answer GET /v1/models (its event loop's delay, as a client sees it)."""

    def __init__(self, url: str):
        self.url = urlsplit(url)
        self.probe_ms: list[float] = []
        self.probe_failures = 0
        self._stop = threading.Event()
        self._prober = threading.Thread(target=self._probe, name="agent-probe", daemon=True)

    def start(self) -> HostLoad:
        self._cpu, self._roles, self._wall = time.process_time(), thread_cpu(), time.perf_counter()
        self._prober.start()
        return self

    def stop(self) -> dict:
        self._stop.set()
        self._prober.join()
        wall = time.perf_counter() - self._wall
        used, roles = (time.process_time() - self._cpu) / wall, thread_cpu()
        by_role = (
            None
            if roles is None or self._roles is None
            else {role: round((s - self._roles.get(role, 0.0)) / wall, 3) for role, s in sorted(roles.items())}
        )
        return {
            "server_wall_s": round(wall, 2),
            "server_process_cores": round(used, 3),
            "server_thread_cores": by_role,
            "server_python_cores": by_role and round(sum(v for r, v in by_role.items() if r != "native"), 3),
            "server_probe_ms": {
                **percentiles(self.probe_ms),
                "max": round(max(self.probe_ms), 3),
                "probes": len(self.probe_ms),
            }
            if self.probe_ms
            else None,
            "server_probe_failures": self.probe_failures,
        }

    def _probe(self) -> None:
        connection = None
        while not self._stop.wait(0.5):
            try:
                connection = connection or http.client.HTTPConnection(self.url.hostname, self.url.port, timeout=10)
                start = time.perf_counter()
                connection.request("GET", "/v1/models")
                connection.getresponse().read()
                self.probe_ms.append((time.perf_counter() - start) * 1000)
            except (OSError, http.client.HTTPException):
                self.probe_failures += 1
                connection = None


def cpu_per_audio_s(host: dict, audio_s: float) -> dict | None:
    """CPU ms the server process spent per second of audio it delivered (`HostLoad.stop`'s figures): in all,
    and on its host side alone (the event loop `tts-server` and the `tts-io` pool; the rest is the engine's
    threads). Example: 0.9 cores over a 50 s run that delivered 500 s of audio: 90 ms per audio second."""
    if not audio_s:
        return None
    per_s = 1000 * host["server_wall_s"] / audio_s
    threads = host["server_thread_cores"]
    return {
        "process": round(host["server_process_cores"] * per_s, 2),
        "host_side": threads and round(sum(threads.get(role, 0.0) for role in ("tts-server", "tts-io")) * per_s, 2),
    }


async def loop_lag(samples: list[float], every_s: float = 0.05) -> None:
    """How late this event loop wakes a sleeper (ms), every ``every_s``, until cancelled."""
    while True:
        start = time.perf_counter()
        await asyncio.sleep(every_s)
        samples.append((time.perf_counter() - start - every_s) * 1000)


def client_load(per_process: list[dict]) -> dict:
    """The client processes' reports (`bench.agent.clients`) merged: cores each used, loop lag over all."""
    lag = [ms for p in per_process for ms in p["lag_ms"]]
    cores = [p["cpu_s"] / p["wall_s"] for p in per_process if p["wall_s"] > 0]
    return {
        "client_processes": len(per_process),
        "client_process_cores": {"max": round(max(cores), 3), "mean": round(float(np.mean(cores)), 3)}
        if cores
        else None,
        "client_loop_lag_ms": {**percentiles(lag), "max": round(max(lag), 3)} if lag else None,
    }


def limited_by(
    offered: float | None, capacity: float | None, tick_full_ms: float | None, frame_ms: float, host: dict
) -> list[str]:
    """What held the run back, by these rules (empty: nothing found): the offered load above the slots'
    capacity; the tick with the slots full slower than a frame; the server's event-loop thread busy
    (>= BUSY_CORE of a core) or its answers slow (probe p99 >= SLOW_PROBE_MS); one of the engine's own
    threads (SINGLE_THREADS) busy; the server's Python threads
    together using >= BUSY_CORE of a core (they share one interpreter lock: a hint, as C code they call
    may run without it); a client process busy or its loop late
    (lag p99 >= SLOW_LAG_MS), which would make the clients, not the server, the bottleneck."""
    found = []
    if offered is not None and capacity is not None and offered > capacity:
        found.append(f"offered load {offered:.0f} streams > capacity {capacity:.0f}")
    if tick_full_ms is not None and tick_full_ms > frame_ms:
        found.append(f"tick with the slots full {tick_full_ms:.1f} ms > frame {frame_ms:.0f} ms")
    probe, threads = host.get("server_probe_ms") or {}, host["server_thread_cores"] or {}
    if threads.get("tts-server", 0) >= BUSY_CORE or probe.get("p99", 0) >= SLOW_PROBE_MS:
        found.append("server event loop")
    found += [f"server thread {role} busy" for role in SINGLE_THREADS if threads.get(role, 0) >= BUSY_CORE]
    if (host["server_python_cores"] or 0) >= BUSY_CORE:
        found.append("server interpreter lock (Python threads near one core)")
    clients, lag = host.get("client_process_cores") or {}, host.get("client_loop_lag_ms") or {}
    if clients.get("max", 0) >= BUSY_CORE or lag.get("p99", 0) >= SLOW_LAG_MS:
        found.append("client processes")
    return found
