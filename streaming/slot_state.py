"""A slot's state in and out of the engine's batch: parking copies it out of its slot, restoring copies it into
any free slot, `Engine.detach`/`attach` and `Engine.snapshot` carry it to another engine.

The engine decides when (its tick loop: which slots stall, when a tick in flight lets a slot go, who gets a
free slot); `SlotMover` does the copying, on the device the engine runs on. A slot's state is its row of every
batched tensor (`SlotMover.row_tensors`: the KV rings and the voice prefix, the slot table (`Slots.rows`), and
with the frame codec its decoder state), packed into one byte row (`streaming.parking.RowLayout`). On a GPU a
park is one batched gather into a staging buffer and one copy per stream to pinned host memory, a restore one
copy per stream into the staging buffer and one batched scatter, ordered after the codec's CUDA stream; on the
CPU one batched copy each way. The CPU codec worker's decoder rows are captured and restored on its own thread,
in order with its decodes.

Worked example, 16 slots, a GPU, staging 16 rows: streams in slots 3 and 9 park in one tick: slot rows 3 and 9
are gathered into staging rows 0 and 1, which are copied to two fresh pinned rows; later the stream from slot 9
is restored into slot 0: its pinned row goes to staging row 0, which is scattered into slot row 0.

This module sits below the engine (the engine imports it, never the other way): it knows the engine's
streams only as objects with the `Utterance` fields it reads.
"""
from __future__ import annotations

import functools
import threading
import time
from typing import Callable

import torch

from streaming.codec_worker import AudioOutbox, CodecWorker, FrameCodec, decoder_row_tensors
from streaming.decode import StepCaches
from streaming.figures import Timer
from streaming.parking import Parked, ParkingStore, RowLayout
from streaming.slots import Slots

STAGING_ROWS = 64  # a GPU parks and restores up to this many streams per batched copy


class SlotMover:
    """Copies slots' state between the engine's batch and `Parked` states in its `ParkingStore`. Engine thread
    only. With the frame codec (``frame_decoder``) the decoder state and the audio outbox travel too; without it
    the CPU ``codec_worker`` captures and restores its decoder rows."""

    def __init__(self, store: ParkingStore, caches: StepCaches, slots: Slots, device: torch.device,
                 max_streams: int, *, frame_decoder: FrameCodec | None = None, outbox: AudioOutbox | None = None,
                 codec_stream=None, codec_worker: CodecWorker | None = None):
        self.store, self.caches, self.slots = store, caches, slots
        self.device, self.max_streams = device, max_streams
        self.frame_codec = frame_decoder is not None
        self.frame_decoder, self.outbox, self.codec_stream = frame_decoder, outbox, codec_stream
        self.codec_worker = codec_worker
        self._layout: tuple[RowLayout, dict] | None = None  # `layout`
        self._staging: torch.Tensor | None = None
        self._staging_rows: list[dict] = []

    def row_tensors(self) -> dict[str, torch.Tensor]:
        """Every (B, ...) tensor of a slot's state by name: caches (the voice prefix too, so that a restore
        needs no `Engine._start_caches`), slots and, with the frame codec, its decoder state."""
        tensors = self.caches.rows() | {f"sinks.{layer}.{part}": pair[i] for layer, pair in enumerate(self.caches.sinks)
                                        for i, part in enumerate(("keys", "values"))}
        tensors |= self.slots.rows()
        if self.frame_codec:
            tensors |= decoder_row_tensors(self.frame_decoder.state)
        return tensors

    def layout(self) -> tuple[RowLayout, dict[str, torch.Tensor]]:
        """The packed layout of a slot's state and the (B, ...) tensors it covers: caches, slots and, with the
        frame codec, its decoder state (the CPU codec worker's is captured on its own thread). On a GPU also a
        staging buffer for the packed rows of up to STAGING_ROWS streams at a time, and pinned host memory for
        as many parked rows made ready (the first cudaHostAlloc of each costs milliseconds)."""
        if self._layout is None:
            tensors = self.row_tensors()
            layout = RowLayout(tensors)
            self._layout = (layout, tensors)
            if self.device.type == "cuda":
                staging = min(STAGING_ROWS, self.max_streams)
                self._staging = torch.empty(staging, layout.row_bytes, dtype=torch.uint8, device=self.device)
                self._staging_rows = [layout.packed(row) for row in self._staging]
                warm = [torch.empty(layout.row_bytes, dtype=torch.uint8, pin_memory=True) for _ in range(staging)]
                del warm  # back to PyTorch's pinned-memory cache, for the first parks to take
        return self._layout

    def park(self, parks: list[tuple[Parked, int]]) -> None:
        """Copy the slots' rows out into their (fresh) `Parked` states and put those in the store, packed
        (`RowLayout`): on a GPU one batched gather into a staging buffer, then one copy per stream to pinned host
        memory; on the CPU one gather into host rows. Called before the slots are reset or taken again."""
        started, timer = time.perf_counter(), Timer(self.device.type == "cuda")
        rows = [slot for _, slot in parks]
        cuda = self.device.type == "cuda"
        if cuda and self.frame_codec:
            torch.cuda.current_stream(self.device).wait_stream(self.codec_stream)
        layout, tensors = self.layout()
        flats = [torch.empty(layout.row_bytes, dtype=torch.uint8, pin_memory=cuda) for _ in rows]
        if cuda:
            for at in range(0, len(rows), len(self._staging)):
                part = rows[at:at + len(self._staging)]
                layout.copy(self._staging_rows[:len(part)], [layout.slot(tensors, r) for r in part])
                for i in range(len(part)):
                    flats[at + i].copy_(self._staging[i], non_blocking=True)
            timer.mark()
        else:
            layout.copy([layout.packed(flat) for flat in flats], [layout.slot(tensors, r) for r in rows])
        for i, (parked, _) in enumerate(parks):
            parked.add_packed(flats[i], layout)
            if self.frame_codec:
                parked.add({"outbox": torch.from_numpy(self.outbox.audio[rows[i]:rows[i] + 1].copy())})
                parked.copied = timer.marks[-1] if cuda else None
                parked.captured.set()
            self.store.put(parked)
        if not self.frame_codec:
            self.codec_worker.capture(rows, functools.partial(_captured, [parked for parked, _ in parks]))
        self._note("park", started, timer, len(parks))

    def restore(self, rows: list[int], parked: list[Parked]) -> None:
        """Put parked states into slots ``rows``, every row (the voice prefix too) in packed form: on a GPU one
        copy each into the staging buffer, then one batched scatter."""
        started, timer = time.perf_counter(), Timer(self.device.type == "cuda")
        cuda = self.device.type == "cuda"
        layout, tensors = self.layout()  # the voice prefix (sinks) included: no `Engine._start_caches`
        flats = [p.flat if p.flat is not None and p.layout is layout else layout.flatten(p.rows, pin=cuda)
                 for p in parked]
        if cuda and self.frame_codec:  # the last tick's decode writes every decoder row (masked) on its stream:
            torch.cuda.current_stream(self.device).wait_stream(self.codec_stream)  # after it, not under it
        if cuda:
            for at in range(0, len(rows), len(self._staging)):
                part = flats[at:at + len(self._staging)]
                for i, flat in enumerate(part):
                    self._staging[i].copy_(flat, non_blocking=flat.is_pinned())
                layout.copy([layout.slot(tensors, r) for r in rows[at:at + len(part)]],
                            self._staging_rows[:len(part)])
        else:
            layout.copy([layout.slot(tensors, r) for r in rows], [layout.packed(flat) for flat in flats])
        if self.frame_codec:
            self.outbox.audio[rows] = torch.cat([p.loose["outbox"] for p in parked]).numpy()
        else:
            self.codec_worker.restore(rows, lambda: [p.rows for p in parked])
        if cuda:
            timer.mark()
        self._note("restore", started, timer, len(parked))

    def copy_row(self, slot: int, done: Callable[[dict[str, torch.Tensor]], None]) -> None:
        """A copy of slot ``slot``'s state while it stays there (CPU codec path: `Engine.snapshot`): its packed
        rows now, and the codec worker's decoder rows after the decodes queued before; ``done(rows)`` is called
        with all of them, as named (1, ...) tensors, on the codec thread."""
        layout, tensors = self.layout()
        flat = torch.empty(layout.row_bytes, dtype=torch.uint8)
        layout.copy([layout.packed(flat)], [layout.slot(tensors, slot)])
        rows = layout.views(flat)
        self.codec_worker.capture([slot], lambda states: done(rows | states[0]))

    def _note(self, kind: str, started: float, timer: Timer, count: int) -> None:
        """Park/restore time per stream: on a GPU the device's (CUDA events, read later), else the clock's;
        and the engine thread's time (``park_host``, ``restore_host``) either way."""
        host_ms = (time.perf_counter() - started) * 1000
        if timer.cuda:
            self.store.note_device(kind, timer.marks[0], timer.marks[-1], count)
        else:
            self.store.note(kind, host_ms, count)
        self.store.note(f"{kind}_host", host_ms, count)


def _captured(parked: list[Parked], states: list[dict]) -> None:
    """The CPU codec worker's decoder rows of streams just parked (on its thread)."""
    for p, state in zip(parked, states):
        p.add(state)
        p.captured.set()


def host_state(u, counts: dict[str, int], frame_codec: bool) -> dict:
    """What a moved stream carries besides its slot's rows, as plain data: its `Stream.export_state`, its units
    and text flags, its unit ``counts`` (`Engine` COUNTS) and which codec path made its decoder rows."""
    return {"stream": u.stream.export_state(), "units": list(u.units), "unit_base": u.unit_base,
            "closed_upto": u.closed_upto, "text_ended": u.text_ended, "spoke": u.spoke, **counts,
            "frame_codec": frame_codec}


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
