"""The slot table: the engine thread's one home of who holds which slot, the per-slot counts (numpy, where a
tick scans them), the free slots and the streams waiting for one. A stream's counts live in its slot's row
while it holds one and in its `Utterance` while it does not; `occupy` and `save_counts` move them."""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from streaming.parking import Parked
from streaming.slot_mover import DetachRequest
from streaming.stream import Stream

# A stream's unit counts (`Utterance`), in the host state a detach or snapshot carries; a state from before
# speculative encoding lacks the last two: its counts then are the encoded and encodable ones (all final)
COUNTS = ("encoded", "encodable", "unit", "confirmed", "final")
COUNTS_BEFORE = ("encoded", "encodable", "unit", "encoded", "encodable")


@dataclass
class Utterance:
    """Host side of one open stream, in a slot or not (parked, or waiting for a slot); only the engine thread
    touches it. Unit indices are absolute."""

    stream: Stream
    slot: int  # -1: holds no slot
    voice: dict  # the stream's preset (`Engine.voice_preset`): a shipped voice or a blend
    rate: float  # frames-per-unit divisor: the stream's speed times the voice's pace
    units: list[int] = field(default_factory=list)  # unit ids from absolute index unit_base on
    unit_base: int = 0
    closed_upto: int = -1  # units up to here were closed by a flush: speak them without more lookahead
    text_ended: bool = False
    spoke: bool = False
    sounded: bool = False  # a chunk of it has been handed out (the next is not its first)
    done: bool = False  # its last chunk is handed out
    encoded: int = 0  # units encoded, encodable and its aligned unit, kept here while it holds no slot (`SlotTable`)
    encodable: int = 0
    unit: int = 0
    confirmed: int = 0  # of those encoded, units encoded with their whole right context (final), and units
    final: int = 0  # whose right context is there (`Engine._on_text`): kept here while it holds no slot
    parked: Parked | None = None  # its slot state while parked
    parked_paused: bool = False  # parked while its reader was behind: the reader catching up restores it
    news: bool = False  # text came while parked (and its reader was behind): the reader catching up restores it
    waiting: str | None = None  # "start" or "restore": queued for a slot
    waiting_since: float = 0.0
    detach: DetachRequest | None = None
    park_after: int = 0  # parking with a tick in flight: once every tick launched before this one is collected

    @property
    def received(self) -> int:
        return self.unit_base + len(self.units)


class SlotTable:
    """Per slot: its utterance and counts; per engine: every open stream, the free slots (a heap: the lowest
    first) and the queues of streams waiting for one (restores ahead of starts). O(1) per event to update."""

    def __init__(self, batch: int):
        self.batch = batch
        self.utterances: list[Utterance | None] = [None] * batch
        self.by_stream: dict[Stream, Utterance] = {}  # every open stream: in a slot, parked or waiting for one
        self.free = list(range(batch))  # a heap: the lowest free slot first
        self.encoded = np.zeros(batch, dtype=np.int64)  # units encoded, per slot
        self.encodable = np.zeros(batch, dtype=np.int64)  # units that may be encoded now, per slot
        self.final = np.zeros(batch, dtype=np.int64)  # units whose encoding is final (right context there)
        self.confirmed = np.zeros(batch, dtype=np.int64)  # units encoded with their final encoding
        self.unit = np.zeros(batch, dtype=np.int64)  # each slot's aligned unit at the last collected tick
        self.live = np.zeros(batch, dtype=bool)
        self.generation = np.zeros(batch, dtype=np.int64)  # counts the streams each slot has held
        # Parking: a slot is stalled from the launch of the first tick after its last event in which it could not
        # step (events are what change a stalled slot's device state, so it stays stalled until the next one).
        self.stalled_since = np.full(batch, np.inf)
        self.event_at = np.zeros(batch)  # when an event last changed the slot's device state
        self.restores: deque[Utterance] = deque()  # parked streams with work to do, waiting for a slot: first
        self.starts: deque[Utterance] = deque()  # new streams waiting for a slot

    def count_tables(self) -> list[np.ndarray]:
        """The per-slot host counts named in COUNTS, in that order."""
        return [self.encoded, self.encodable, self.unit, self.confirmed, self.final]

    def counts_of(self, u: Utterance) -> dict[str, int]:
        """``u``'s counts by name: from its slot's row while it holds one, else its own."""
        if u.slot >= 0:
            return {name: int(table[u.slot]) for name, table in zip(COUNTS, self.count_tables())}
        return {name: getattr(u, name) for name in COUNTS}

    def save_counts(self, u: Utterance) -> None:
        """Copy ``u``'s slot counts into ``u`` (it is about to leave its slot)."""
        for name, table in zip(COUNTS, self.count_tables()):
            setattr(u, name, int(table[u.slot]))

    def holds(self, u: Utterance) -> bool:
        return u.slot >= 0 and self.utterances[u.slot] is u

    def waiting(self, u: Utterance) -> deque:
        """The queue ``u`` waits in (``u.waiting``: "start" or "restore")."""
        return self.starts if u.waiting == "start" else self.restores

    def occupy(self, u: Utterance) -> int:
        """``u`` takes the lowest free slot with its counts; returns the slot."""
        slot = heapq.heappop(self.free)
        u.slot = slot
        self.utterances[slot] = u
        self.live[slot] = True
        self.generation[slot] += 1
        for name, table in zip(COUNTS, self.count_tables()):
            table[slot] = getattr(u, name)
        return slot

    def vacate(self, u: Utterance) -> int:
        """``u`` leaves its slot, which goes back to the free heap with its counts cleared (its aligned unit stays
        till the next start). Returns the slot."""
        slot = u.slot
        self.utterances[slot], u.slot = None, -1
        self.live[slot] = False
        for table in self.count_tables()[:2] + self.count_tables()[3:]:
            table[slot] = 0
        self.stalled_since[slot] = np.inf
        heapq.heappush(self.free, slot)
        return slot

    def bucket(self, max_streams: int) -> int:
        """Slots to step: the power of two covering the highest live slot, at most max_streams (0: none live).
        Example: live slots {0, 2, 5} of 16 -> 8; {0} -> 1; {9} -> 16; {9} of 12 -> 12."""
        live = np.flatnonzero(self.live)
        if not len(live):
            return 0
        return min(max_streams, 1 << int(live[-1]).bit_length())
