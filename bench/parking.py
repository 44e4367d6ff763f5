"""Parked streams, per tier: park/restore time per stream, and a parked stream's audio against the same stream
never parked. One JSON object.

    python -m bench.parking                              # shipped model, CPU, 8 streams
    python -m bench.parking --device cuda --streams 64   # GPU <-> pinned host, host <-> disk
    python -m bench.parking --tiny
    python -m bench.parking --store-only --streams 64          # the disk tier alone
    python -m bench.parking --device cuda --streams 64 --moved-slots 64 --warm-up --trace   # the H200 check

``--store-only``: the disk tier alone, without the model's work beside it: N states of the engine's size (its
packed row and, on the CPU codec path, its decoder's rows) put in a `ParkingStore` at once, spilled, then all
wanted at once and taken; per stream ``spill``, ``load`` and ``load_wait`` as below (``store_rounds`` rounds),
and ``ready_after_asking_all_ms``: from the asks until each state is in memory, as the bench sees it (woken by
the store's ``on_loaded``; also for a store without ``load_wait``).

``--trace``: per stream of the parked rounds, its first sample over 1e-4 from the reference beside its parks and
restores (slot, samples delivered by then); and ``batches``: every park and restore call of the engine (one per
tick that parks or restores), with its round, its number of streams, its device ms (the copies), the device's
wait for the codec stream before it (``wait_ms``) and the engine thread's ms, wall and CPU (``host_ms``,
``host_cpu_ms``: wall well above CPU is waiting, for the GIL or in a blocking call), in total (not per stream):
which parks make the tail. ``--frame-codec``: the GPU's codec path (a frame a tick, one tick in
flight) on the CPU. ``--one-bucket``: every tick steps every slot (an experiment on batch invariance).

Per round, N streams (one slot each) get the first words of a sentence, run dry and are parked together
(``park_after_s`` 0.05); in the disk round they wait until every state has spilled to disk; then each gets the
rest of its text and is restored. Tier times come from the engine's stats: slot <-> host memory per stream
(on a GPU: device time between CUDA events, gather + copy to pinned memory, and copy back + scatter, from
the end of the wait for the last tick's decode on the codec stream, which ``park_wait``/``restore_wait`` give;
``park_host``/``restore_host``: the engine thread's time for all of it, on any device), host
<-> disk per stream (one raw file per state in the temp dir, `streaming.parked_file`: the page cache's speed, no
fsync). ``disk_tier_ms_per_stream``, the disk tier's figures together: ``spill`` (host memory -> file, per
stream, on an I/O thread), ``load`` (file -> host memory) split as ``load_row_wait`` (taking a pool row to read
into: the wait for a device copy out of it, if any) and ``load_read`` (the file read), ``load_wait`` (from the
restore's ask until its state is in memory: the load and its wait behind the other streams' files, all
restored at once), ``slowest_loads`` (the 5 slowest, each split the same way, with its CPU ms), and
``restore_disk_round`` (the disk round's copy from host memory into a slot, as `restore`). ``max_abs_diff``:
the largest difference between a parked-and-restored stream's audio and the same seeded stream speaking
without parking (greedy sampling), over both rounds and one stream detached mid-utterance and attached to a
second engine (`Engine.detach`/`attach`). ``unparked_again``: the control, the reference round run a second
time without parking (streams within 1e-4 of the first run): what timing alone changes. ``row_pool``: the
parked rows' pool at the end (`streaming.parking.RowPool`: rows, rows in use, and misses, parks that found no
free row and allocated one). ``gc_pauses_ms``: the garbage collections after the warm-up, per round and
generation (count, longest, total): each holds the GIL, so every thread waits through it.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import sys
import threading
import time

import numpy as np
import torch

import kernels
from bench.common import harvard
from streaming.engine import Engine, SamplingConfig
from streaming.parking import Parked, ParkingConfig
from testkit import wait_until


def speak(engine: Engine, sentence: str, seed: int, cut: int | None) -> tuple[np.ndarray, object]:
    """Open a stream, give it the first ``cut`` words (all and end, if None)."""
    stream = engine.open(seed=seed)
    words = sentence.split()
    stream.push_text(" ".join(words[:cut]) + " " if cut else sentence)
    if cut is None:
        stream.end()
    return stream


def finish_text(stream, sentence: str) -> None:
    """The rest of the sentence after its first 4 words, and the end, in one read of the text front end. Its
    units can depend on whether it read the rest before the end came (27 of 549 splits of Harvard sentences
    differ), a matter of the text's timing that this bench does not measure: the never-parked reference gets
    its text the same way."""
    stream.text.push(" ".join(sentence.split()[4:]))
    stream.end()


def read_dry(streams, quiet_s=1.0, seconds=120.0) -> list[list[np.ndarray]]:
    """What the streams say until every one has said something and none has for ``quiet_s`` (they ran out of
    text). Quiet before the first chunk is not dry: on a loaded machine the first chunks of a fresh engine can
    take longer than ``quiet_s``, and the rest of the text would then reach the reference before it ran dry
    (a reference unlike the parked rounds: on 2 shared cores at load ~5, every stream differed from ~30 %)."""
    chunks: list[list[np.ndarray]] = [[] for _ in streams]
    last = start = time.monotonic()
    while time.monotonic() - last < quiet_s or not all(chunks):
        if time.monotonic() - start > seconds:
            raise TimeoutError("a stream said nothing of its first words in time")
        for i, stream in enumerate(streams):
            with contextlib.suppress(TimeoutError):
                while (chunk := stream.read(timeout=0.001)) is not None:
                    chunks[i].append(chunk)
                    last = time.monotonic()
    return chunks


def reference_round(engine: Engine, sentences: list[str]) -> list[np.ndarray]:
    """The streams of a parked round, fed the same way, never parked (``park_after_s`` 0)."""
    streams = [speak(engine, s, 100 + i, 4) for i, s in enumerate(sentences)]
    said = read_dry(streams)
    for stream, sentence in zip(streams, sentences):
        finish_text(stream, sentence)
    return [np.concatenate(first + [read_all(s)]) for first, s in zip(said, streams)]


def read_all(stream, timeout=120.0) -> np.ndarray:
    chunks = []
    while (chunk := stream.read(timeout=timeout)) is not None:
        chunks.append(chunk)
    return np.concatenate(chunks)


def reached(condition, seconds=60.0) -> None:
    """Wait for ``condition`` (`testkit.wait_until`); TimeoutError after ``seconds``."""
    if not wait_until(condition, seconds):
        raise TimeoutError("the engine did not get there in time")


def parked_round(engine: Engine, sentences: list[str], disk: bool, restores: dict) -> list[np.ndarray]:
    """One round; adds the round's restore times per stream to ``restores`` (a restore from disk is the load
    and then the same copy to the device as from host memory)."""
    streams = [speak(engine, s, 100 + i, 4) for i, s in enumerate(sentences)]
    tier = "disk" if disk else "host"
    # polled through the store's tier counts: `Engine.stats` every 10 ms (percentiles of every figure, Python on
    # this thread) would compete for the GIL with the engine thread during the very parks being timed
    reached(lambda: engine.store.tiers()[tier] == len(streams))
    done = len(engine.store.times["restore"])
    for stream, sentence in zip(streams, sentences):
        finish_text(stream, sentence)
    audio = [read_all(s) for s in streams]
    engine.stats()  # reads the device's timings
    times = list(engine.store.times["restore"])[done:]
    restores[f"{tier}_round"] = (
        {
            "count": len(times),
            "p50": round(float(np.percentile(times, 50)), 3),
            "p99": round(float(np.percentile(times, 99)), 3),
        }
        if times
        else None
    )
    return audio


def moved_round(engine: Engine, other: Engine, sentence: str) -> np.ndarray:
    """A stream detached mid-utterance and attached to a second engine: the audio read on both."""
    stream = speak(engine, sentence, 100, None)
    first = [stream.read(timeout=60) for _ in range(3)]
    moved = other.attach(engine.detach(stream))
    audio = np.concatenate(first + [read_all(moved)])
    other.close()
    return audio


def trace_slots(engine: Engine) -> dict:
    """Record each stream's parks and restores (engine thread): per stream, by its seed, a list of
    ("park" | "start" | "restore", slot, samples delivered by then, highest live slot + 1 then). Reads the engine's
    host side only; for finding where a parked stream parts from its reference."""
    events: dict = {}
    park, occupy = engine._park, engine._occupy

    def note(kind, u, slot):
        live = np.flatnonzero(engine.table.live)
        events.setdefault(u.stream.seed, []).append(
            (kind, int(slot), u.stream.samples, int(live[-1]) + 1 if len(live) else 0)
        )

    def traced_park(u):
        note("park", u, u.slot)
        park(u)

    def traced_occupy(u):
        why = u.waiting
        occupy(u)
        note(why, u, u.slot)

    engine._park, engine._occupy = traced_park, traced_occupy
    return events


def trace_batches(engine: Engine, where: dict) -> list[dict]:
    """Record every park and restore call of ``engine`` (wrapping `SlotMover._note`, on the engine thread: its
    figures are the last the store noted), tagged with ``where["round"]``; `batch_figures` reads them at the end."""
    batches: list[dict] = []
    note, times = engine.mover._note, engine.store.times

    def traced(kind, started, cpu, timer, count):
        note(kind, started, cpu, timer, count)
        batches.append(
            {
                "round": where["round"],
                "kind": kind,
                "streams": count,
                "own": (timer.marks[1], timer.marks[-1]) if timer.cuda else times[kind][-1] * count,
                "wait": (timer.marks[0], timer.marks[1]) if timer.cuda else None,
                "host_ms": times[f"{kind}_host"][-1] * count,
                "host_cpu_ms": times[f"{kind}_host_cpu"][-1] * count,
            }
        )

    engine.mover._note = traced
    return batches


def batch_figures(batches: list[dict]) -> list[dict]:
    """`trace_batches`' records with their device times read (ms, for the whole call)."""

    def ms(value):
        if isinstance(value, tuple):
            value[1].synchronize()
            return round(value[0].elapsed_time(value[1]), 3)
        return None if value is None else round(value, 3)

    return [
        {
            "round": b["round"],
            "kind": b["kind"],
            "streams": b["streams"],
            "ms": ms(b["own"]),
            "wait_ms": ms(b["wait"]),
            "host_ms": ms(b["host_ms"]),
            "host_cpu_ms": ms(b["host_cpu_ms"]),
        }
        for b in batches
    ]


def traced(rounds: list[dict], got: list[np.ndarray], want: list[np.ndarray]) -> list:
    """Per stream of the parked rounds (host, then disk): the first sample over 1e-4 from its reference (None:
    none; -1: lengths differ), its reference's start (slot, bucket) and its parks and restores (`trace_slots`)."""
    rows = []
    for i, (g, w) in enumerate(zip(got, want)):
        seed = 100 + i % (len(got) // 2)
        bad = np.flatnonzero(np.abs(g[: len(w)] - w[: len(g)]) > 1e-4)
        first = int(bad[0]) if len(bad) else (None if len(g) == len(w) else -1)
        rows.append(
            {
                "round": "host" if i < len(got) // 2 else "disk",
                "stream": i % (len(got) // 2),
                "first_bad": first,
                "length": [len(g), len(w)],
                "reference": rounds[0].get(seed),
                "events": rounds[1 + i // (len(got) // 2)].get(seed),
            }
        )
    return rows


def disk_tier(parking: dict, restores: dict, store=None) -> dict:
    """The host <-> disk tier per stream, p50/p99 ms (see the module's docstring), the store's I/O threads and
    failures, and (given the ``store``) its slowest loads."""
    return {
        "spill": parking["spill_ms"],
        "load": parking["load_ms"],
        "load_row_wait": parking.get("load_row_wait_ms"),
        "load_read": parking.get("load_read_ms"),
        "load_wait": parking.get("load_wait_ms"),
        "spill_cpu": parking.get("spill_cpu_ms"),
        "load_cpu": parking.get("load_cpu_ms"),
        "restore_disk_round": restores.get("disk_round"),
        "io_threads": parking.get("io_threads", 1),
        "failures": parking.get("failures"),
        **({"slowest_loads": slowest_loads(store)} if store else {}),
    }


def slowest_loads(store, n: int = 5) -> list[dict]:
    """The store's ``n`` slowest loads, each split as the store times it (ms): ``ms`` (the load) =
    ``row_wait_ms`` (taking a pool row) + ``read_ms`` (the file read), beside ``cpu_ms`` (the I/O thread's CPU
    time: wall well above it is waiting, for a core, the disk or the GIL). Example: {"ms": 12.1, "row_wait_ms":
    9.8, "read_ms": 2.3, "cpu_ms": 1.1}: the load waited for a device copy out of its row."""
    kinds = ("load", "load_row_wait", "load_read", "load_cpu")  # one value of each per load, at the same index
    loads = sorted(zip(*(list(store.times[kind]) for kind in kinds)), reverse=True)[:n]
    return [
        {"ms": round(ms, 3), "row_wait_ms": round(wait, 3), "read_ms": round(read, 3), "cpu_ms": round(cpu, 3)}
        for ms, wait, read, cpu in loads
    ]


def store_only(engine: Engine, rounds: int) -> dict:
    """The disk tier alone (``--store-only``): per round, every slot's state (its packed row copied out of slot
    0, pinned on a GPU, and its loose rows: the codec worker's decoder rows, or the frame codec's outbox) put in
    the engine's store at once, spilled, wanted at once and taken; the store's per-stream figures over all
    rounds."""
    layout, tensors = engine.mover.layout()
    flat = torch.empty(layout.row_bytes, dtype=torch.uint8, pin_memory=engine.device.type == "cuda")
    layout.copy([layout.packed(flat)], [layout.slot(tensors, 0)])
    if engine.frame_codec:  # the GPU's codec path: the audio outbox travels beside the packed row
        loose = {"outbox": torch.from_numpy(engine.codec_path.outbox.audio[0:1].copy())}
    else:  # the CPU codec worker's decoder rows
        captured = threading.Event()
        decoder: list[dict] = []
        engine.codec_path.worker.capture([0], lambda states: (decoder.extend(states), captured.set()))
        captured.wait(30)
        loose = decoder[0]
    store = engine.store
    store.config.disk_after_s = 0.0
    ready_ms: list[float] = []
    loaded = threading.Event()
    store.on_loaded = loaded.set  # (the engine's wake-up is not needed: no stream is restored here)
    for _ in range(rounds):
        states = []
        for _ in range(engine.max_streams):
            parked = Parked()
            parked.add_packed(torch.empty_like(flat, pin_memory=flat.is_pinned()).copy_(flat), layout)
            parked.add({name: t.clone() for name, t in loose.items()})
            parked.captured.set()
            states.append(parked)
            store.put(parked)
        reached(lambda: store.stats()["parked"]["disk"] == len(states))
        asked = time.perf_counter()
        for parked in states:
            store.want(parked)
        waiting = list(states)
        while waiting:  # each state's time from the asks until it is in memory, seen from here (any store)
            loaded.wait(0.01)
            loaded.clear()
            ready = [p for p in waiting if store.want(p)]
            ready_ms += [(time.perf_counter() - asked) * 1000] * len(ready)
            waiting = [p for p in waiting if p not in ready]
            if time.perf_counter() - asked > 60:
                raise TimeoutError("the states did not come back from disk")
        expected = layout.views(flat) | loose
        for parked in states:  # what comes back is what went
            rows = store.take(parked)
            assert all(torch.equal(rows[name], t) for name, t in expected.items())
    stats = store.stats()
    return {
        "engine": "store_only",
        "states": engine.max_streams,
        "rounds": rounds,
        "state_bytes": states[0].nbytes,
        "cpu_cores": os.cpu_count(),
        "load_avg_1m": round(os.getloadavg()[0], 2),
        "disk_tier_ms_per_stream": disk_tier(stats, {}, store),
        "ready_after_asking_all_ms": {
            "p50": round(float(np.percentile(ready_ms, 50)), 3),
            "p99": round(float(np.percentile(ready_ms, 99)), 3),
        },
    }


class GcPauses:
    """Every garbage collection's pause from its making on (`gc.callbacks`), per round of the bench (``where``)
    and generation: a collection holds the GIL throughout, so every other thread (the engine's, the I/O
    threads') waits through it, and a load whose wall time is well above its CPU time may have waited through
    one."""

    def __init__(self, where: dict):
        self.where = where
        self.pauses: dict[str, dict[int, list[float]]] = {}  # round -> generation -> ms of each collection
        self._started = 0.0
        gc.callbacks.append(self._note)

    def _note(self, phase: str, info: dict) -> None:
        if phase == "start":  # one collection at a time (it holds the GIL): one start time is enough
            self._started = time.perf_counter()
        else:
            ms = (time.perf_counter() - self._started) * 1000
            self.pauses.setdefault(self.where["round"], {}).setdefault(info["generation"], []).append(ms)

    def figures(self) -> dict:
        """Per round, per generation: collections, the longest and the total pause (ms)."""
        return {
            where: {
                f"gen{g}": {"count": len(ms), "max": round(max(ms), 3), "total": round(sum(ms), 3)}
                for g, ms in sorted(gens.items())
            }
            for where, gens in self.pauses.items()
        }


def max_diff(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.abs(got - want).max()) if len(got) == len(want) else float("inf")


def parting(got: np.ndarray, want: np.ndarray):
    """Where a stream's audio first differs from the reference by more than 1e-4, as a share of its length,
    and the share of samples that differ (None: none do)."""
    if len(got) != len(want):
        return f"length {len(got)} vs {len(want)}"
    bad = np.flatnonzero(np.abs(got - want) > 1e-4)
    return None if not len(bad) else [round(bad[0] / len(want), 3), round(len(bad) / len(want), 3)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument(
        "--moved-slots",
        type=int,
        default=2,
        help="slots of the engine the detached stream is attached to (its batch bucket)",
    )
    parser.add_argument(
        "--warm-up", action="store_true", help="build every batch bucket's step (CUDA graphs) before the first round"
    )
    parser.add_argument(
        "--frame-codec", action="store_true", help="decode every frame in the tick (the GPU's codec path) on any device"
    )
    parser.add_argument(
        "--one-bucket",
        action="store_true",
        help="step every slot in every tick (one batch bucket): an experiment on batch invariance",
    )
    parser.add_argument(
        "--trace",
        action="store_true",
        help="report each parted stream's first differing sample beside its parks and restores",
    )
    parser.add_argument("--store-only", action="store_true", help="the disk tier alone (see above)")
    parser.add_argument("--store-rounds", type=int, default=5, help="rounds of --store-only")
    parser.add_argument("--io-threads", type=int, help="the parking store's I/O threads (default: min(4, cores))")
    parser.add_argument(
        "--switch-interval", type=float, help="Python's thread switch interval in seconds (sys.setswitchinterval)"
    )
    args = parser.parse_args()
    if args.switch_interval:
        sys.setswitchinterval(args.switch_interval)
    parking = ParkingConfig(park_after_s=0.05, disk_after_s=3600)
    if args.io_threads:
        parking.io_threads = args.io_threads
    greedy = SamplingConfig(temperature=0.0)
    if args.tiny:
        from testkit import tiny_model_and_codec

        model, codec, voices = tiny_model_and_codec()
    else:
        from tts.voices import load_shipped

        model, codec, voices = load_shipped(device=args.device)
    factory = kernels.default_step_factory(args.device) if args.device.startswith("cuda") else None
    frame_codec = True if args.frame_codec else None
    engine = Engine(
        model.to(args.device),
        codec.to(args.device),
        voices,
        max_streams=args.streams,
        device=args.device,
        sampling=greedy,
        parking=parking,
        step_factory=factory,
        frame_codec=frame_codec,
    )
    sentences = [s for s in harvard(64) if len(s.split()) >= 7][: args.streams]
    sentences = (sentences * args.streams)[: args.streams]
    if args.store_only:
        print(json.dumps(store_only(engine, args.store_rounds), indent=2))
        engine.close()
        return
    if args.one_bucket:
        engine.table.bucket = lambda max_streams: max_streams if engine.table.live.any() else 0
    if args.warm_up:
        engine.warm_up()
    events = trace_slots(engine) if args.trace else {}
    where = {"round": "reference"}
    pauses = GcPauses(where)
    batches = trace_batches(engine, where) if args.trace else []
    rounds = []  # each traced round's events: the reference, the host round, the disk round

    def traced_round(played):
        rounds.append(dict(events))
        events.clear()
        return played

    parking.park_after_s = 0  # the reference: never parked
    expected = traced_round(reference_round(engine, sentences))
    again = reference_round(engine, sentences)  # the control: never parked either
    whole = [read_all(speak(engine, sentences[0], 100, None))]  # the moved round's reference
    events.clear()
    parking.park_after_s = 0.05
    restores: dict = {}
    where["round"] = "host"
    host = traced_round(parked_round(engine, sentences, disk=False, restores=restores))
    parking.disk_after_s = 0.05
    where["round"] = "disk"
    disk = traced_round(parked_round(engine, sentences, disk=True, restores=restores))
    where["round"] = "moved"
    other = Engine(
        model,
        codec,
        voices,
        max_streams=args.moved_slots,
        device=args.device,
        sampling=greedy,
        step_factory=factory,
        frame_codec=frame_codec,
    )
    moved = moved_round(engine, other, sentences[0])
    diffs = [max_diff(got, want) for got, want in zip(host + disk + [moved], expected * 2 + whole)]
    parted = [parting(got, want) for got, want in zip(host + disk + [moved], expected * 2 + whole)]
    stats = engine.stats()
    state_bytes = engine.caches.nbytes // engine.max_streams
    print(
        json.dumps(
            {
                "engine": "tiny_random" if args.tiny else "shipped",
                "device": args.device,
                "cpu_cores": os.cpu_count(),
                "load_avg_1m": round(os.getloadavg()[0], 2),
                "streams": args.streams,
                "one_bucket": args.one_bucket,
                "frame_codec": engine.frame_codec,
                "switch_interval_s": sys.getswitchinterval(),
                "parks": stats["parks"],
                "restores": stats["restores"],
                "cache_bytes_per_stream": state_bytes,
                "tiers_ms_per_stream": {
                    kind: stats["parking"][f"{kind}_ms"]
                    for kind in (
                        "park",
                        "restore",
                        "spill",
                        "load",
                        "park_host",
                        "restore_host",
                        "park_wait",
                        "restore_wait",
                        "park_host_cpu",
                        "restore_host_cpu",
                    )
                },
                "row_pool": stats["parking"].get("pool"),
                "restore_ms_per_stream_by_round": restores,
                "disk_tier_ms_per_stream": disk_tier(stats["parking"], restores, engine.store),
                "gc_pauses_ms": pauses.figures(),
                "max_abs_diff": max(diffs),
                "identical_streams": sum(d == 0 for d in diffs),
                "streams_within_1e-4": sum(d <= 1e-4 for d in diffs),
                "step": engine.step_kind,
                "within_1e-4_by_round": {
                    "host": sum(d <= 1e-4 for d in diffs[: len(host)]),
                    "disk": sum(d <= 1e-4 for d in diffs[len(host) : -1]),
                    "moved": int(diffs[-1] <= 1e-4),
                    "moved_slots": args.moved_slots,
                    "unparked_again": sum(max_diff(a, b) <= 1e-4 for a, b in zip(again, expected)),
                },
                "compared_streams": len(diffs),
                "parted": [(i, p) for i, p in enumerate(parted) if p is not None][:12],
                **(
                    {"batches": batch_figures(batches), "trace": traced(rounds, host + disk, expected * 2)}
                    if args.trace
                    else {}
                ),
            },
            indent=2,
        )
    )
    engine.close()


if __name__ == "__main__":
    main()
