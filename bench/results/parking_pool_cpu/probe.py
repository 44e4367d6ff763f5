"""CPU probe (issue 27, park tail): the engine thread's time per park with the old SlotMover (main 29df7bd: a
fresh row allocated per parked stream, slot views made at a slot's first park, one store put and wake-up per
stream) against this branch's (rows from a RowPool reserved once, slot views made at prepare, one put per call).
The shipped model's slot state (2,163,712-byte rows with the frame codec's), 64 slots, the frame codec's path
on the CPU, 4 idle I/O threads, switch interval 0.5 ms as on a GPU. The CPU has no pinned memory: what a fresh
row costs here is malloc + page faults, not cudaHostAlloc; the copies themselves are memcpy.

    python bench/results/parking_pool_cpu/probe.py [--rounds 6]

Per park call size k: the first call (slots never parked before) and the later calls' p50 and max, each as
[wall ms, engine thread CPU ms] per stream.
"""
import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.getcwd())
from streaming.codec_worker import AudioOutbox, FrameCodec  # noqa: E402
from streaming.decode import TEXT_RING, StepCaches  # noqa: E402
from streaming.parking import Parked, ParkingConfig, ParkingStore, RowLayout  # noqa: E402
from streaming.slot_state import SlotMover  # noqa: E402
from streaming.slots import CHUNK_SCHEDULE, Slots  # noqa: E402
from tts.voices import load_shipped  # noqa: E402


def old_slot_state():
    """streaming/slot_state.py as of main 29df7bd, imported beside this branch's."""
    source = subprocess.run(["git", "show", "29df7bd:streaming/slot_state.py"], capture_output=True, text=True,
                            check=True).stdout
    path = "/tmp/old_slot_state_29df7bd.py"
    with open(path, "w") as f:
        f.write(source)
    spec = importlib.util.spec_from_file_location("old_slot_state", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def mover(cls, model, codec, batch):
    cpu = torch.device("cpu")
    store = ParkingStore(ParkingConfig(disk_after_s=3600, io_threads=4), on_loaded=lambda: None)
    parts = {"frame_decoder": FrameCodec(codec, batch, cpu),
             "outbox": AudioOutbox(batch, max(CHUNK_SCHEDULE), codec.cfg.hop)}
    return cls(store, StepCaches.empty(model.cfg, batch, cpu), Slots(model.cfg, batch, TEXT_RING, cpu, stagger=True),
               cpu, batch, **parts), store


def rounds(m, store, sizes, count, prepare):
    """Per call size k: ``count`` rounds of parking slots 0..k-1 in one call, then restoring them; the engine
    thread's ms per stream of each park call (its round 0 separately: first use)."""
    if prepare:
        m.prepare()
    out = {}
    for k in sizes:
        first, later = None, []
        for r in range(count):
            parked = [Parked() for _ in range(k)]
            t0, c0 = time.perf_counter(), time.thread_time()
            m.park([(p, slot) for p, slot in zip(parked, range(k))])
            ms = ((time.perf_counter() - t0) * 1000 / k, (time.thread_time() - c0) * 1000 / k)
            if r == 0:
                first = ms
            else:
                later.append(ms)
            for p in parked:
                store.take(p)
            m.restore(list(range(k)), parked)
        later = np.array(later)  # (rounds - 1, [wall, cpu])
        out[k] = {"first_call_ms_per_stream": [round(v, 3) for v in first],
                  "later_p50": [round(float(v), 3) for v in np.percentile(later, 50, axis=0)],
                  "later_max": [round(float(v), 3) for v in later.max(axis=0)]}
    return out


def puts(row_bytes, k=64, repeats=20):
    """The engine thread's ms to put k parked states in a store whose 4 I/O threads wait (disk_after_s 3600):
    one `put` (lock, wake-up) per state, as main did, against one `put` for all; 0.2 ms of Python between puts
    (the rest of a park), as in a park call of k streams."""
    out = {}
    for mode in ("per_state", "one_call", "per_state"):
        store = ParkingStore(ParkingConfig(disk_after_s=3600, io_threads=4), on_loaded=lambda: None)
        store.start()
        times = []
        for _ in range(repeats):
            states = []
            for _ in range(k):
                p = Parked()
                p.add({"row": torch.zeros(1, 8)})
                states.append(p)
            t0 = time.perf_counter()
            for p in states:
                work = time.perf_counter() + 0.0002
                while time.perf_counter() < work:  # pure Python: holds the GIL
                    pass
                if mode == "per_state":
                    store.put(p)
            if mode == "one_call":
                store.put(*states)
            times.append((time.perf_counter() - t0) * 1000)
            for p in states:
                store.take(p)
        store.close()
        out.setdefault(mode, []).append({"p50": round(float(np.percentile(times, 50)), 3),
                                         "max": round(max(times), 3), "ideal": round(k * 0.2, 3)})
    return out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    sys.setswitchinterval(0.0005)
    torch.set_num_threads(1)
    model, codec, _ = load_shipped(device="cpu")
    batch = 64
    old_cls = old_slot_state().SlotMover
    result = {"load_before": os.getloadavg(), "rounds": args.rounds}
    m, store = mover(SlotMover, model, codec, batch)
    tensors = m.row_tensors()
    layout = RowLayout(tensors)
    result["row_bytes"], result["row_tensors"] = layout.row_bytes, len(tensors)
    t0, c0 = time.perf_counter(), time.thread_time()
    for slot in range(batch):
        layout.slot(tensors, slot)
    result["slot_views_ms_per_slot"] = [round((time.perf_counter() - t0) * 1000 / batch, 3),
                                        round((time.thread_time() - c0) * 1000 / batch, 3)]
    result["puts_engine_thread_ms"] = puts(layout.row_bytes)
    sizes = [1, 4, 16, 64]
    result["old"] = rounds(*mover(old_cls, model, codec, batch), sizes, args.rounds, prepare=False)
    result["new"] = rounds(m, store, sizes, args.rounds, prepare=True)
    result["old_again"] = rounds(*mover(old_cls, model, codec, batch), sizes, args.rounds, prepare=False)
    result["load_after"] = os.getloadavg()
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
