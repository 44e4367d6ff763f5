"""The hand-off from events to the device: what this tick's events changed (`DeviceUpdates`), applied once per tick
as batched ops (`Events._apply`), and the host's copy of the per-slot flags it last wrote (`HostFlags`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from streaming.parking import Parked
from streaming.slot_table import Utterance
from streaming.slots import Slots


@dataclass
class DeviceUpdates:
    """Event updates waiting for the next tick: slots freed, streams started, flags to set."""

    frees: list[int] = field(default_factory=list)
    starts: list[Utterance] = field(default_factory=list)
    flags: list[Utterance] = field(default_factory=list)  # closed/ended to recompute
    paused: list[tuple[Utterance, bool]] = field(default_factory=list)
    parks: list[tuple[Utterance, int]] = field(default_factory=list)  # (stream, the slot it leaves)
    restores: list[tuple[Utterance, Parked]] = field(default_factory=list)  # (stream in its new slot, its state)

    def any(self) -> bool:
        return bool(self.frees or self.starts or self.flags or self.paused or self.parks or self.restores)


class HostFlags:
    """What the host last wrote into some of `Slots`' per-slot flags, so that an event that leaves a flag as it
    was costs no device write (each write is two uploads and an indexed store, and every torch call lets go of
    the interpreter lock, which a busy server's other threads then hold a while). Most text events are words
    inside a sentence: they change neither ``closed`` nor ``ended``. Per flag and slot: 0 or 1, or -1 not known
    (a restored row holds its parked value). Example: slot 3 gets a word (closed False, as written before: no
    write), then a flush that the prefill confirms (closed True: one write of row 3), then parks and is freed
    (reset on the device: 0 here too), then a stream is restored into it (-1: the next event's value is written,
    whatever it is)."""

    def __init__(self, slots: Slots, names: tuple[str, ...]):
        self.flags = {name: getattr(slots, name) for name in names}  # (B,) bool device tensors
        self.known = {name: np.zeros(slots.batch, dtype=np.int8) for name in names}  # fresh slots: all False

    def cleared(self, rows) -> None:
        """``rows`` were reset on the device (`Slots.reset`, `Slots.start`): every flag False."""
        for known in self.known.values():
            known[rows] = 0

    def unknown(self, rows) -> None:
        """``rows`` hold values the host did not write (restored parked state)."""
        for known in self.known.values():
            known[rows] = -1

    def write(self, name: str, rows, values, upload) -> None:
        """Set flag ``name`` of ``rows`` (distinct) to ``values`` on the device, writing only those that differ."""
        rows, values = np.asarray(rows, dtype=np.int64), np.asarray(values, dtype=bool)
        known = self.known[name]
        changed = known[rows] != values
        if changed.any():
            rows, values = rows[changed], values[changed]
            self.flags[name][upload(rows)] = upload(values, torch.bool)
            known[rows] = values
