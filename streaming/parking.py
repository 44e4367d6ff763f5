"""Parked streams: a stream that waits (its text ran dry, or its reader is behind) gives its slot back, and its
slot state waits here, in tiers, until it can go on.

A parked stream's state is its row of every batched slot tensor (`Slots.rows`), of the KV rings and the voice
prefix (`StepCaches.rows`, the sinks) and of the codec decoder state (`codec_worker.decoder_rows`), packed into
one byte row (`RowLayout`; named (1, ...) views of it in `Parked.rows`), plus the engine's host bookkeeping
(kept by the engine, small). Tiers: when parked the rows are copied to host memory (on a GPU into pinned
memory, asynchronously; on the CPU they are host memory already). After ``disk_after_s`` idle, or at once
while the host tier holds more than ``max_host_bytes``, a few I/O threads write them to one raw file each
(`streaming.parked_file`: the packed row as it is in memory) in a directory of at most ``max_disk_bytes`` and
drop them from memory; restoring a spilled stream reads its file on those threads first (`ParkingStore.want`)
straight into a fresh packed row, so the engine thread never waits for the disk and restores it as it restores
one from host memory. Files are removed on restore, on cancel and when the store closes (the directory with
them). A state that cannot be written (a full disk) stays in memory; one whose file cannot be read back
(truncated, damaged) is reported by `ParkingStore.lost`, and its stream ends with an error.

Worked example, ``disk_after_s`` 10: a stream parked at t = 0 is in host memory; at t = 10 (the spill thread
looks every 1/4 of that) its rows go to ``<dir>/7.park`` and leave memory; text arrives at t = 12:
``want`` starts the load and answers False, the load finishes a few ms later and wakes the engine, whose
next ``want`` answers True; the engine takes the rows (`take`) and the file is gone.

`pack`/`unpack`: one stream's whole state as bytes, to continue it on another engine (`Engine.detach`/`attach`)
with the same weights (`weights_fingerprint`). Copying states in and out of slots: `streaming.slot_mover`.
"""

from __future__ import annotations

import hashlib
import io
import itertools
import os
import shutil
import tempfile
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from streaming.parked_file import FileInfo, read_state, remove_file, write_state
from streaming.parking_rows import RowLayout, RowPool  # noqa: F401  (the store's rows)

# Grace before a stalled stream is parked. A stream waiting for text usually gets it within a tick or two
# (an LLM's next token), and a park + restore costs ~1 ms on 2 cores; half a second parks only real pauses
# (between sentences, a reader seconds behind).
PARK_AFTER_S = 0.5
BLOB_FORMAT = "tts-parked-stream/1"
# A failed spill (a full disk) pauses spilling this long: states stay in memory meanwhile.
SPILL_RETRY_S = 1.0


# Threads moving states between host memory and disk. Two, not more: each load lets the interpreter lock go at
# its read and checksum and must win it back, and more threads contending for it (with the engine's and the
# readers') stretch a 1 ms load's tail. H200, `python -m bench.parking --device cuda --streams 64 / 256`, load p99
# with 4 threads 7.8-14.1 ms over 8 runs (5 over 10; the same on tmpfs: not the file system; the store alone,
# `--store-only`, 2.5-3.2), with 2 threads 4.8-10.6 ms over 8 runs (1 over 10), with 1 thread 6.6-8.0 over 3;
# the wait from asking to loaded p50 27-30 against 18-24 ms for 64 at once, 105-115 against 90-113 for 256.
IO_THREADS = 2


def _io_threads() -> int:
    """IO_THREADS, or fewer on a machine with fewer cores."""
    return max(1, min(IO_THREADS, os.cpu_count() or 1))


@dataclass
class ParkingConfig:
    park_after_s: float = PARK_AFTER_S  # a stream that cannot step this long gives its slot back (0: never)
    disk_after_s: float = 10.0  # a parked stream idle this long moves from host memory to disk
    directory: str | None = None  # where spilled states go: a fresh directory under it (default: the temp dir)
    max_host_bytes: int = 1 << 30  # past this the oldest parked states spill to disk at once
    pinned_bytes: int = 1 << 30  # reserved once for parked states' packed rows (pinned on a GPU): `RowPool`
    max_disk_bytes: int = 4 << 30  # past this nothing more spills (states stay in memory; counts the states'
    # bytes, each file adds a header of a few hundred bytes)
    io_threads: int = field(default_factory=_io_threads)  # threads writing and reading the files


class Parked:
    """One parked stream's slot state in host memory (or a file): a packed row of a `RowLayout` (``flat``),
    and named (1, ...) tensors beside it; `rows` names them all."""

    _ids = itertools.count()

    def __init__(self):
        self.id = next(Parked._ids)
        self.loose: dict[str, torch.Tensor] = {}  # rows outside the layout (the CPU codec worker's, the outbox)
        self.flat: torch.Tensor | None = None  # (row_bytes,) uint8, pinned on a GPU
        self.layout: RowLayout | None = None
        self.pool: RowPool | None = None  # where ``flat`` is a row of (`release` gives it back)
        self.pool_row: int | None = None
        self.captured = threading.Event()  # every row is in `rows` (the CPU codec worker adds the decoder's later)
        self.copied = None  # a CUDA event: the device -> pinned host copies are done
        self.path: str | None = None  # its file, while it is on disk
        self.file: FileInfo | None = None  # what reads that file back
        self.parked_at = time.monotonic()
        self.wanted = False  # a restore waits for it: keep it in memory, or bring it back
        self.wanted_at = 0.0  # when its load was asked for (`ParkingStore.want`)
        self.loading = False  # an I/O thread is writing or reading its file
        self.pinned = False  # its packed row was in pinned memory: read it back into pinned memory
        self.error: Exception | None = None  # its file could not be read back: its state is gone
        self.nbytes = 0

    @property
    def rows(self) -> dict[str, torch.Tensor]:
        packed = {} if self.flat is None else self.layout.views(self.flat)
        return packed | self.loose

    @property
    def tier(self) -> str:
        """ "host" (its rows in memory), "disk" (only in its file) or "lost" (its file could not be read back)."""
        if self.error is not None:
            return "lost"
        return "disk" if self.path is not None and self.flat is None and not self.loose else "host"

    @classmethod
    def of(cls, rows: dict[str, torch.Tensor]) -> Parked:
        """A state whose rows are all there already (one attached from another engine)."""
        parked = cls()
        parked.add(rows)
        parked.captured.set()
        return parked

    def settled(self, timeout: float) -> bool:
        """Wait until every row is in `rows`: the CPU codec worker's decoder rows added, a GPU's copies to
        pinned memory done. False if the codec worker did not add them within ``timeout`` seconds."""
        if not self.captured.wait(timeout):
            return False
        if self.copied is not None:
            self.copied.synchronize()
        return True

    def add(self, rows: dict[str, torch.Tensor]) -> None:
        self.loose.update(rows)
        self._count()

    def add_packed(
        self, flat: torch.Tensor, layout: RowLayout, pool: RowPool | None = None, row: int | None = None
    ) -> None:
        """Its packed row ``flat``: row ``row`` of ``pool``'s slab, or (None) a tensor of its own."""
        self.flat, self.layout = flat, layout
        self.pool, self.pool_row = (pool, row) if row is not None else (None, None)
        self._count()

    def release(self, after=None) -> None:
        """Drop the packed row (restored, spilled, moved or discarded); a pool row goes back to its pool (free
        at once for the device: `RowPool`), with ``after`` (a restore's CUDA event after its copy out of the
        row; default: the park's copy into it) for a host writer to wait for. Twice is once."""
        if self.pool_row is not None:
            self.pool.give(self.pool_row, after if after is not None else self.copied)
        self.flat, self.pool, self.pool_row = None, None, None

    def __del__(self):
        """A state dropped without `release` (an error path: a detach given up, an engine fault) still gives its
        pool row back; safe at any time for the device (`RowPool`: one CUDA stream), and nothing reads it."""
        if getattr(self, "pool_row", None) is not None:
            self.pool.give(self.pool_row, getattr(self, "copied", None))

    def _count(self) -> None:
        self.nbytes = sum(t.nbytes for t in self.loose.values()) + (0 if self.flat is None else self.flat.nbytes)


class ParkingStore:
    """The parked states of one engine, bounded (`ParkingConfig`); the engine thread puts, wants and takes,
    ``io_threads`` I/O threads move states between host memory and disk (loads before spills)."""

    KINDS = (
        "park",
        "restore",
        "spill",
        "load",
        "load_wait",
        "load_row_wait",
        "load_read",
        "spill_cpu",
        "load_cpu",
        "park_host",
        "restore_host",
        "park_wait",
        "restore_wait",
        "park_host_cpu",
        "restore_host_cpu",
    )

    def __init__(self, config: ParkingConfig, on_loaded: Callable[[], None]):
        self.config, self.on_loaded = config, on_loaded
        self._entries: OrderedDict[Parked, int] = OrderedDict()  # oldest first -> bytes counted in host memory
        self._cond = threading.Condition()
        self._loads: deque[Parked] = deque()
        self._lost: list[Parked] = []  # loads that failed, for the engine (`lost`)
        self._dir: str | None = None
        self._closing = False
        self._spill_after = 0.0  # monotonic time before which nothing spills (after a failed spill)
        self._spilling: dict[Parked, int] = {}  # states being written now -> their bytes: leaving host memory
        self.host_bytes = self.disk_bytes = 0
        self.failures = {"spill": 0, "load": 0}
        # ms per stream; "load_wait": from the `want` that asked for a load until the state is in memory (the
        # load itself and its wait behind other files); "load" (an I/O thread's wall time for one) is
        # "load_row_wait" (taking a pool row: the pool's lock, and any wait for a device copy out of the row,
        # `RowPool.take_settled`) and then "load_read" (`read_state`: open, read, checksum), one of each per load
        # at the same index; "spill_cpu"/"load_cpu": the I/O thread's CPU time for a spill/load (what it costs
        # on an idle core; the wall time beside it adds the waits for a core and the GIL);
        # "park_wait"/"restore_wait": on a GPU, the device's wait for the last tick's decode (the codec's CUDA
        # stream) before a park/restore could start, per stream: the dependency, kept apart from the copies
        self.times: dict[str, deque] = {kind: deque(maxlen=100_000) for kind in self.KINDS}
        self._threads: list[threading.Thread] = []
        self._device_times: deque = deque()
        self.pool: RowPool | None = None  # the packed rows parks take (`SlotMover.prepare`), for `stats`

    # ---- engine thread ---------------------------------------------------------------------------
    def put(self, *parked: Parked) -> None:
        """Keep parked states: a tick's parks at once, under one lock and with one wake-up of an I/O thread
        (one per state made as many threads want the GIL while the engine thread was parking the rest), or
        as many as there are states to spill at once while the host tier is over ``max_host_bytes``."""
        with self._cond:
            for state in parked:
                self._entries[state] = state.nbytes
                self.host_bytes += state.nbytes
            self._start_threads()
            over = self.host_bytes > self.config.max_host_bytes
            self._cond.notify(min(len(parked), self.config.io_threads) if over else 1)

    def start(self) -> None:
        """Start the I/O threads now (`SlotMover.prepare`, at warm-up) rather than in the first park."""
        with self._cond:
            self._start_threads()

    def want(self, parked: Parked) -> bool:
        """A restore waits for ``parked``: whether its rows are in memory now (if not, its file is being loaded
        and `on_loaded` is called when it is, or when it failed: `lost`)."""
        with self._cond:
            parked.wanted = True
            if parked.tier == "host":
                return True
            if not parked.loading and parked.error is None:
                parked.loading, parked.wanted_at = True, time.perf_counter()
                self._loads.append(parked)
                self._cond.notify()
            return False

    def take(self, parked: Parked) -> dict[str, torch.Tensor]:
        """Remove ``parked`` from the store and return its rows (in memory: `want` answered True)."""
        with self._cond:
            assert parked.tier == "host", "take what `want` said is in memory"
            self._forget(parked)
            return parked.rows

    def discard(self, parked: Parked) -> None:
        """The stream ended while parked: forget its state, remove its file, give its row back (only if the
        store still held it: a state taken for a restore or a detach is its taker's to release)."""
        with self._cond:
            if self._forget(parked):
                parked.release()

    @property
    def has_lost(self) -> bool:
        """Whether `lost` has states to report (a lock-free look, for the engine's tick)."""
        return bool(self._lost)

    def lost(self) -> list[Parked]:
        """The states whose files could not be read back since the last call (each with its ``error``): their
        streams cannot continue. Still in the store until discarded."""
        with self._cond:
            lost, self._lost = self._lost, []
            return lost

    def note(self, kind: str, ms: float, count: int = 1) -> None:
        """Time of a park or restore of ``count`` streams, counted per stream."""
        self.times[kind].extend([ms / count] * count)

    def note_device(self, kind: str, start, end, count: int) -> None:
        """A park or restore on a GPU: its CUDA events, read once the device has passed them (`stats`)."""
        self._device_times.append((kind, start, end, count))

    # ---- figures, end ------------------------------------------------------------------------------
    def tiers(self) -> dict[str, int]:
        """Parked states per tier, {"host": n, "disk": m} ("lost" only while a stream has one): a cheap look,
        without `stats`' percentiles."""
        with self._cond:
            tiers = {"host": 0, "disk": 0}
            for parked in self._entries:
                tiers[parked.tier] = tiers.get(parked.tier, 0) + 1
            return tiers

    def stats(self) -> dict:
        while self._device_times and self._device_times[0][2].query():
            kind, start, end, count = self._device_times.popleft()
            self.note(kind, start.elapsed_time(end), count)
        with self._cond:
            figures = {
                "parked": self.tiers(),
                "host_bytes": self.host_bytes,
                "disk_bytes": self.disk_bytes,
                "io_threads": self.config.io_threads,
                "failures": dict(self.failures),
            }
        if self.pool is not None:
            figures["pool"] = {"rows": self.pool.rows, "in_use": self.pool.in_use, "misses": self.pool.misses}
        for kind, values in self.times.items():
            values = list(values)[-5000:]
            figures[f"{kind}_ms"] = {
                "count": len(self.times[kind]),
                "p50": _percentile(values, 50),
                "p99": _percentile(values, 99),
            }
        return figures

    def close(self) -> None:
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        for thread in self._threads:
            thread.join(timeout=5)
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)

    # ---- I/O threads ---------------------------------------------------------------------------------
    def _start_threads(self) -> None:
        if not self._threads and self.config.disk_after_s is not None:
            for i in range(max(1, self.config.io_threads)):
                thread = threading.Thread(target=self._run, name=f"tts-parking-{i}", daemon=True)
                thread.start()
                self._threads.append(thread)

    def _run(self) -> None:
        while True:
            with self._cond:
                job = self._next_job()
                while job is None and not self._closing:
                    self._cond.wait(timeout=max(0.05, self.config.disk_after_s / 4))
                    job = self._next_job()
                if self._closing:
                    return
            try:
                job[0](job[1])  # each handles its own I/O errors
            except Exception as err:  # anything else: the state stays where it was
                with self._cond:
                    job[1].loading = False
                    self._spilling.pop(job[1], None)
                print(f"parking: {job[0].__name__} failed: {type(err).__name__}: {err}")

    def _next_job(self):
        if self._loads:
            return self._load, self._loads.popleft()
        now = time.monotonic()
        if now < self._spill_after:
            return None
        cutoff = now - self.config.disk_after_s
        on_their_way = sum(self._spilling.values())  # being written by other threads: count them on disk already
        over = self.host_bytes - on_their_way > self.config.max_host_bytes
        for parked in self._entries:  # oldest first
            if (
                parked.tier == "host"
                and not parked.wanted
                and not parked.loading
                and parked.captured.is_set()
                and (over or parked.parked_at <= cutoff)
                and self.disk_bytes + on_their_way + parked.nbytes <= self.config.max_disk_bytes
            ):
                parked.loading = True  # busy: not spilled twice
                self._spilling[parked] = self._entries[parked]
                return self._spill, parked
        return None

    def _spill(self, parked: Parked) -> None:
        """Write ``parked`` to its file and drop it from memory, unless it was restored or wanted meanwhile.
        If the write fails (a full disk) it stays in memory and spilling pauses for SPILL_RETRY_S."""
        started, cpu = time.perf_counter(), time.thread_time()
        if parked.copied is not None:
            parked.copied.synchronize()
        path = os.path.join(self._directory(), f"{parked.id}.park")
        try:
            info = write_state(path, parked.flat, parked.loose, parked.layout and parked.layout.fingerprint)
        except Exception as err:
            with self._cond:
                parked.loading = False
                del self._spilling[parked]
                self.failures["spill"] += 1
                self._spill_after = time.monotonic() + SPILL_RETRY_S
            print(f"parking: a state could not be written to disk, it stays in memory: {err}")
            return
        with self._cond:
            parked.loading = False
            del self._spilling[parked]
            if parked not in self._entries or parked.wanted:  # restored or wanted meanwhile: keep it in memory
                remove_file(path)
                return
            parked.pinned = parked.flat is not None and parked.flat.is_pinned()
            parked.path, parked.file, parked.loose = path, info, {}
            parked.release()  # its packed row is in the file: a pool row goes back to the pool
            self.host_bytes -= self._entries[parked]
            self.disk_bytes += parked.nbytes
            self._entries[parked] = 0
        self.times["spill"].append((time.perf_counter() - started) * 1000)
        self.times["spill_cpu"].append((time.thread_time() - cpu) * 1000)

    def _load(self, parked: Parked) -> None:
        """Read ``parked``'s file back into memory (its packed row into a free pool row no device copy is pending
        on, `RowPool.take_settled`, else a fresh row, pinned if it was) and wake the engine; a file that cannot be
        read leaves the state lost (`lost`)."""
        started, cpu = time.perf_counter(), time.thread_time()
        row = self.pool.take_settled() if self.pool is not None and parked.file.flat_bytes else None
        got_row = time.perf_counter()
        try:
            into = None if row is None else self.pool.row(row)
            flat, loose = read_state(parked.path, parked.file, pin=parked.pinned, into=into)
            if into is None or flat is not into:  # not read into the pool row (another size): give it back
                row = self._give_back(row)
        except Exception as err:  # truncated or damaged (CorruptParkedFile), or unreadable
            flat, loose, row = None, err, self._give_back(row)
        ended, cpu = time.perf_counter(), time.thread_time() - cpu
        with self._cond:
            parked.loading = False
            remove_file(parked.path)
            if parked not in self._entries:
                self._give_back(row)
                return  # discarded meanwhile
            self.disk_bytes -= parked.nbytes
            if isinstance(loose, Exception):
                parked.error, parked.path = loose, None
                self.failures["load"] += 1
                self._lost.append(parked)
            else:
                parked.flat, parked.loose, parked.path = flat, loose, None  # the file's byte count: `nbytes`
                parked.pool, parked.pool_row = (self.pool, row) if row is not None else (None, None)
                parked.file = None
                self.host_bytes += parked.nbytes
                self._entries[parked] = parked.nbytes
                self.times["load"].append((ended - started) * 1000)
                self.times["load_row_wait"].append((got_row - started) * 1000)
                self.times["load_read"].append((ended - got_row) * 1000)
                self.times["load_wait"].append((ended - parked.wanted_at) * 1000)
                self.times["load_cpu"].append(cpu * 1000)
        if parked.error is not None:
            print(f"parking: a parked state could not be read back, its stream ends: {parked.error}")
        self.on_loaded()

    def _give_back(self, row: int | None) -> None:
        """A pool row `_load` took but did not keep, back to the pool; None, for the caller's row."""
        if row is not None:
            self.pool.give(row)

    def _directory(self) -> str:
        with self._cond:
            if self._dir is None:
                self._dir = tempfile.mkdtemp(prefix="tts-parked-", dir=self.config.directory)
            return self._dir

    def _forget(self, parked: Parked) -> bool:
        """Remove ``parked`` from the store (and its file); whether it was there."""
        if parked not in self._entries:
            return False
        self.host_bytes -= self._entries.pop(parked)
        if parked.tier == "disk":
            self.disk_bytes -= parked.nbytes
            if not parked.loading:  # a file being loaded is removed by the loader
                remove_file(parked.path)
        return True


def weights_fingerprint(*modules: torch.nn.Module) -> str:
    """A digest of the modules' weights and configs (``cfg``): a moved stream needs an engine with the same."""
    digest = hashlib.blake2b(digest_size=16)
    for module in modules:
        digest.update(repr(module.cfg).encode())
        for name, tensor in module.state_dict().items():
            digest.update(name.encode())
            digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def pack(host: dict, rows: dict[str, torch.Tensor], unread: list[np.ndarray], fingerprint: str) -> bytes:
    """One stream's state as bytes: ``host`` (plain data), its slot ``rows`` (empty if it never had a slot),
    its ``unread`` audio, and the ``fingerprint`` of the weights it needs."""
    buffer = io.BytesIO()
    torch.save(
        {
            "format": BLOB_FORMAT,
            "fingerprint": fingerprint,
            "host": host,
            "rows": {name: t.cpu().clone() for name, t in rows.items()},  # views of a packed row: copies
            "unread": [torch.from_numpy(np.ascontiguousarray(c)) for c in unread],
        },
        buffer,
    )
    return buffer.getvalue()


def unpack(blob: bytes, fingerprint: str) -> tuple[dict, dict[str, torch.Tensor], list[np.ndarray]]:
    """(host, rows, unread audio) from `pack`. Raises ValueError for anything else, or for a state made with
    other weights. Only plain data and tensors are read (``weights_only``): a blob runs no code."""
    if not isinstance(blob, (bytes, bytearray, memoryview)):
        raise ValueError(f"a stream state is bytes, not {type(blob).__name__}")
    try:
        state = torch.load(io.BytesIO(bytes(blob)), weights_only=True)
    except Exception as err:
        raise ValueError(f"not a stream state: {type(err).__name__}: {err}") from None
    if not isinstance(state, dict) or state.get("format") != BLOB_FORMAT:
        raise ValueError("not a stream state of this version")
    if state["fingerprint"] != fingerprint:
        raise ValueError(
            "this stream was made with other weights; it can only continue on an engine with the same model and codec"
        )
    return state["host"], state["rows"], [t.numpy() for t in state["unread"]]


def _percentile(values: list[float], q: float) -> float | None:
    return round(float(np.percentile(values, q)), 3) if values else None
