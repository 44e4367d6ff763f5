"""A slot's state in and out of the engine's batch: parking copies it out of its slot, restoring copies it into
any free slot, `Engine.detach`/`attach` and `Engine.snapshot` carry it to another engine.

The engine decides when (its tick loop: which slots stall, when a tick in flight lets a slot go, who gets a
free slot); `SlotMover` does the copying, on the device the engine runs on. A slot's state is its row of every
batched tensor (`SlotMover.row_tensors`: the KV rings and the voice prefix, the slot table (`Slots.rows`), and
with the frame codec its decoder state), packed into one byte row (`streaming.parking.RowLayout`) of a pool
reserved once (`streaming.parking.RowPool`, pinned on a GPU: a park allocates nothing). On a GPU a park is one
batched gather into a staging buffer and one copy to pinned host memory per run of consecutive pool rows, a
restore one copy per run into the staging buffer and one batched scatter, ordered after the codec's CUDA
stream; on the CPU one batched copy each way. The CPU codec worker's decoder rows are captured and restored on
its own thread, in order with its decodes.

Worked example, 16 slots, a GPU, staging 16 rows, pool rows 0..4 free: streams in slots 3 and 9 park in one
tick: slot rows 3 and 9 are gathered into staging rows 0 and 1, which go to pool rows 0 and 1 in one copy;
later the stream from slot 9 is restored into slot 0: pool row 1 goes to staging row 0, which is scattered
into slot row 0, and pool row 1 is free again.

This module sits below the engine (the engine imports it, never the other way): it knows the engine's
streams only as objects with the `Utterance` fields it reads.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable

import torch

from streaming.codec_worker import AudioOutbox, CodecWorker, FrameCodec, decoder_row_tensors
from streaming.live_figures import Timer
from streaming.parking import Parked, ParkingStore, RowLayout, RowPool
from streaming.slots import Slots
from streaming.step_caches import StepCaches

STAGING_ROWS = 64  # a GPU parks and restores up to this many streams per batched copy


class SlotMover:
    """Copies slots' state between the engine's batch and `Parked` states in its `ParkingStore`. Engine thread
    only. With the frame codec (``frame_decoder``) the decoder state and the audio outbox travel too; without it
    the CPU ``codec_worker`` captures and restores its decoder rows. A parked state's packed row is a row of
    one `RowPool` (at most min(max_open, min(pinned_bytes, max_host_bytes) // row_bytes) rows, reserved once)."""

    def __init__(
        self,
        store: ParkingStore,
        caches: StepCaches,
        slots: Slots,
        device: torch.device,
        max_streams: int,
        *,
        max_open: int | None = None,
        frame_decoder: FrameCodec | None = None,
        outbox: AudioOutbox | None = None,
        codec_stream=None,
        codec_worker: CodecWorker | None = None,
    ):
        self.store, self.caches, self.slots = store, caches, slots
        self.device, self.max_streams = device, max_streams
        self.max_open = max(max_streams, max_open or max_streams)  # streams that can be parked at once
        self.frame_codec = frame_decoder is not None
        self.frame_decoder, self.outbox, self.codec_stream = frame_decoder, outbox, codec_stream
        self.codec_worker = codec_worker
        self._layout: tuple[RowLayout, dict] | None = None  # `layout`
        self._staging: torch.Tensor | None = None
        self._staging_rows: list[dict] = []
        self.pool: RowPool | None = None  # `prepare`
        self._pool_packed: dict[int, dict] = {}  # on the CPU, a pool row's views (`RowLayout.packed`), kept

    def row_tensors(self) -> dict[str, torch.Tensor]:
        """Every (B, ...) tensor of a slot's state by name: caches (the voice prefix too, so that a restore
        needs no `Engine._start_caches`), slots and, with the frame codec, its decoder state."""
        tensors = self.caches.rows() | {
            f"sinks.{layer}.{part}": pair[i]
            for layer, pair in enumerate(self.caches.sinks)
            for i, part in enumerate(("keys", "values"))
        }
        tensors |= self.slots.rows()
        if self.frame_codec:
            tensors |= decoder_row_tensors(self.frame_decoder.state)
        return tensors

    def layout(self) -> tuple[RowLayout, dict[str, torch.Tensor]]:
        """The packed layout of a slot's state and the (B, ...) tensors it covers: caches, slots and, with the
        frame codec, its decoder state (the CPU codec worker's is captured on its own thread)."""
        if self._layout is None:
            tensors = self.row_tensors()
            self._layout = (RowLayout(tensors), tensors)
        return self._layout

    def prepare(self) -> tuple[RowLayout, dict[str, torch.Tensor]]:
        """Everything a park or a restore uses, made once: on a GPU when the engine is built, on the CPU at
        warm-up (`Engine.warm_up`; else by the first park or restore, inside its timing): the layout; on a GPU
        a staging buffer for the packed rows of up to STAGING_ROWS streams at a time; the row pool (`RowPool`:
        pinned on a GPU); every slot's row views (`RowLayout.slot`, ~87 per slot with the frame codec, so that
        no park makes them); the store's I/O threads."""
        layout, tensors = self.layout()
        if self.pool is None:
            cuda = self.device.type == "cuda"
            if cuda:
                staging = min(STAGING_ROWS, self.max_streams)
                self._staging = torch.empty(staging, layout.row_bytes, dtype=torch.uint8, device=self.device)
                self._staging_rows = [layout.packed(row) for row in self._staging]
            config = self.store.config
            rows = min(self.max_open, min(config.pinned_bytes, config.max_host_bytes) // layout.row_bytes)
            self.pool = self.store.pool = RowPool(rows, layout.row_bytes, pin=cuda)
            for slot in range(self.max_streams):
                layout.slot(tensors, slot)
            self.store.start()
        return layout, tensors

    def park(self, parks: list[tuple[Parked, int]]) -> None:
        """Copy the slots' rows out into their (fresh) `Parked` states and put those in the store, packed
        (`RowLayout`) into rows of the pool: on a GPU one batched gather into the staging buffer, then one copy
        to pinned host memory per run of consecutive pool rows (`RowPool.runs`); on the CPU one gather into
        the pool's rows. Called before the slots are reset or taken again."""
        started, cpu, cuda = time.perf_counter(), time.thread_time(), self.device.type == "cuda"
        layout, tensors = self.prepare()
        rows = [slot for _, slot in parks]
        timer = self._wait_for_codec()
        pool_rows = self.pool.take(len(rows))
        flats = [
            self.pool.row(r)
            if r is not None
            # a miss: a row of its own, as before the pool
            else torch.empty(layout.row_bytes, dtype=torch.uint8, pin_memory=cuda)
            for r in pool_rows
        ]
        if cuda:
            for at in range(0, len(rows), len(self._staging)):
                part = rows[at : at + len(self._staging)]
                layout.copy(self._staging_rows[: len(part)], [layout.slot(tensors, r) for r in part])
                self._staging_copy(pool_rows[at : at + len(part)], flats[at : at + len(part)], to_host=True)
            timer.mark()
        else:
            layout.copy(self._packed(pool_rows, flats), [layout.slot(tensors, r) for r in rows])
        for i, (parked, _) in enumerate(parks):
            parked.add_packed(flats[i], layout, self.pool, pool_rows[i])
            parked.copied = timer.marks[-1] if cuda else None  # the host reads the row after this event
            if self.frame_codec:
                parked.add({"outbox": torch.from_numpy(self.outbox.audio[rows[i] : rows[i] + 1].copy())})
                parked.captured.set()
        self.store.put(*[parked for parked, _ in parks])
        if not self.frame_codec:
            self.codec_worker.capture(rows, functools.partial(_captured, [parked for parked, _ in parks]))
        self._note("park", started, cpu, timer, len(parks))

    def restore(self, rows: list[int], parked: list[Parked]) -> None:
        """Put parked states into slots ``rows``, every row (the voice prefix too) in packed form: on a GPU one
        copy per run of consecutive pool rows into the staging buffer, then one batched scatter. Their rows go
        back to the pool (free at once for the device, after the copy for the host: `RowPool`)."""
        started, cpu, cuda = time.perf_counter(), time.thread_time(), self.device.type == "cuda"
        layout, tensors = self.prepare()  # the voice prefix (sinks) included: no `Engine._start_caches`
        pool_rows = [p.pool_row if p.pool is self.pool else None for p in parked]
        flats = [
            p.flat if p.flat is not None and p.layout is layout else layout.flatten(p.rows, pin=cuda) for p in parked
        ]
        timer = self._wait_for_codec()  # the last tick's decode writes every decoder row (masked): after it
        if cuda:
            for at in range(0, len(rows), len(self._staging)):
                n = min(len(self._staging), len(rows) - at)
                self._staging_copy(pool_rows[at : at + n], flats[at : at + n], to_host=False)
                layout.copy([layout.slot(tensors, r) for r in rows[at : at + n]], self._staging_rows[:n])
        else:
            layout.copy([layout.slot(tensors, r) for r in rows], self._packed(pool_rows, flats))
        if self.frame_codec:
            self.outbox.audio[rows] = torch.cat([p.loose["outbox"] for p in parked]).numpy()
        else:  # the decoder rows are loose rows (captured on the codec thread, or attached)
            self.codec_worker.restore(rows, lambda: [p.loose for p in parked])
        if cuda:
            timer.mark()
        for p in parked:
            p.release(timer.marks[-1] if cuda else None)  # a load from disk may write the row once this is done
        self._note("restore", started, cpu, timer, len(parked))

    def copy_row(self, slot: int, done: Callable[[dict[str, torch.Tensor]], None]) -> None:
        """A copy of slot ``slot``'s state while it stays there (CPU codec path: `Engine.snapshot`): its packed
        rows now, and the codec worker's decoder rows after the decodes queued before; ``done(rows)`` is called
        with all of them, as named (1, ...) tensors, on the codec thread."""
        layout, tensors = self.layout()
        flat = torch.empty(layout.row_bytes, dtype=torch.uint8)
        layout.copy([layout.packed(flat)], [layout.slot(tensors, slot)])
        rows = layout.views(flat)
        self.codec_worker.capture([slot], lambda states: done(rows | states[0]))

    def _packed(self, pool_rows: list[int | None], flats: list[torch.Tensor]) -> list[dict]:
        """The CPU's side of `RowLayout.copy` for these states: a pool row's views, made at its first use and
        kept (~3 view ops per row tensor, each letting the GIL go: made per park, they were a third of a CPU
        park's time), else made now (a miss, or a state loaded from disk or attached)."""
        layout = self._layout[0]
        for row in pool_rows:
            if row is not None and row not in self._pool_packed:
                self._pool_packed[row] = layout.packed(self.pool.row(row))
        return [
            self._pool_packed[row] if row is not None else layout.packed(flat) for row, flat in zip(pool_rows, flats)
        ]

    def _wait_for_codec(self) -> Timer:
        """On a GPU with the frame codec, order what follows after the codec's CUDA stream (the last tick's
        decode writes the decoder rows). The timer's first two marks are before and after that wait: the
        park's or restore's own device time starts at the second (`_note`)."""
        timer = Timer(self.device.type == "cuda")
        if timer.cuda and self.frame_codec:
            torch.cuda.current_stream(self.device).wait_stream(self.codec_stream)
        timer.mark()
        return timer

    def _staging_copy(self, pool_rows: list[int | None], flats: list[torch.Tensor], to_host: bool) -> None:
        """Staging rows 0..n-1 to (``to_host``) or from the states' packed rows: one copy per run of consecutive
        pool rows (`RowPool.runs`), one per row outside the pool (``pool_rows`` None: a miss, or a state loaded
        from disk or attached). Example: pool rows [4, 5, None]: staging 0..1 <-> slab rows 4..5 in one copy,
        staging 2 <-> its own row."""
        slab, staging = self.pool.slab, self._staging
        for i, row, n in RowPool.runs(pool_rows):
            if to_host:
                slab[row : row + n].copy_(staging[i : i + n], non_blocking=True)
            else:
                staging[i : i + n].copy_(slab[row : row + n], non_blocking=True)
        for i, (row, flat) in enumerate(zip(pool_rows, flats)):
            if row is None:
                if to_host:
                    flat.copy_(staging[i], non_blocking=True)
                else:
                    staging[i].copy_(flat, non_blocking=flat.is_pinned())

    def _note(self, kind: str, started: float, cpu: float, timer: Timer, count: int) -> None:
        """Park/restore time per stream: on a GPU the device's, from the end of the wait for the codec stream
        to the copies' end (CUDA events, read later; the wait itself as ``park_wait``/``restore_wait``), else
        the clock's; and the engine thread's time for all of it (``park_host``, ``restore_host``) either way,
        beside its CPU time (``park_host_cpu``, ``restore_host_cpu``: host time well above it is time spent
        waiting, for the GIL or in a blocking call, rather than working)."""
        host_ms = (time.perf_counter() - started) * 1000
        if timer.cuda:
            self.store.note_device(f"{kind}_wait", timer.marks[0], timer.marks[1], count)
            self.store.note_device(kind, timer.marks[1], timer.marks[-1], count)
        else:
            self.store.note(kind, host_ms, count)
        self.store.note(f"{kind}_host_cpu", (time.thread_time() - cpu) * 1000, count)
        self.store.note(f"{kind}_host", host_ms, count)


def _captured(parked: list[Parked], states: list[dict]) -> None:
    """The CPU codec worker's decoder rows of streams just parked (on its thread)."""
    for p, state in zip(parked, states):
        p.add(state)
        p.captured.set()


def host_state(u, counts: dict[str, int], frame_codec: bool) -> dict:
    """What a moved stream carries besides its slot's rows, as plain data: its `Stream.export_state`, its units
    and text flags, its unit ``counts`` (`Engine` COUNTS) and which codec path made its decoder rows."""
    return {
        "stream": u.stream.export_state(),
        "units": list(u.units),
        "unit_base": u.unit_base,
        "closed_upto": u.closed_upto,
        "text_ended": u.text_ended,
        "spoke": u.spoke,
        **counts,
        "frame_codec": frame_codec,
    }


class DetachRequest:
    """A `Engine.detach` in progress (`Stream.detach_request`): the engine thread parks the stream, then hands
    it over here."""

    def __init__(self):
        self.done = threading.Event()
        self.error: Exception | None = None
        self.utterance = None  # the engine's host side of the stream, once handed over

    def fail(self, error: Exception) -> None:
        self.error = error
        self.done.set()


class Snapshot:
    """A `Engine.snapshot` in progress: the engine thread copies the host state and the slot's rows (``copied``
    once it has, or found it cannot), the codec thread adds the decoder's rows (`finish`: ``done``)."""

    def __init__(self, stream):
        self.stream = stream
        self.copied, self.done = threading.Event(), threading.Event()
        self.host: dict = {}
        self.rows: dict[str, torch.Tensor] = {}
        self.samples = 0  # samples of the stream's audio before the copied state
        self.error: Exception | None = None

    def finish(self, rows: dict[str, torch.Tensor]) -> None:
        """The slot's rows, the decoder's included (on the codec thread, after the chunks already due)."""
        self.rows = rows
        self.samples = self.host["stream"]["samples"] = self.stream.samples
        self.done.set()

    def fail(self, error: Exception) -> None:
        self.error = error
        self.done.set()
