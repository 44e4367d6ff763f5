"""Prefill: which slots' text is encoded this tick, and encoding it, many slots in one padded text-encoder call
(durations -> frames on the device, keys/values into the text ring), with the voice prefixes new streams start
from. A mixin of `Engine` (engine thread only); `_PrefillRows` is the host side a prefill hands the device."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np
import torch

from streaming.codec_worker import exact_convolutions
from streaming.engine_state import EngineState
from streaming.slot_table import Utterance
from tts.alignment import predicted_frames

URGENT_LEAD = 8  # units encoded ahead of a slot's aligned unit below which its next units are encoded at once
ROUTINE_TICKS = 8  # otherwise top-ups wait for every 8th tick, so one text-encoder call serves many slots
PREFILL_ROWS = 128  # rows prefilled per tick at most: a burst of starts is spread over ticks
BLEND_PREFIXES = 64  # blends whose prefix keys/values stay cached (64 KB each for the shipped model)


class Prefill(EngineState):
    """`Engine`'s prefill (its state: ``table``, ``slots``, ``caches``, ``model``, ``prefixes``, ``io``)."""

    def _choose_prefill(self) -> list[tuple[Utterance, int]]:
        """Slots whose encoded lead over their aligned unit ran low and that have units to encode: encode up
        to the ring's limit (`Slots.encode_limit`). Urgent ones (a first prefill, or a lead of at most
        URGENT_LEAD units) go now; routine top-ups (a lead of at most half the ring) every ROUTINE_TICKS ticks,
        many slots in one call; at most PREFILL_ROWS slots a tick, the lowest leads first. A slot that could not
        step goes now whatever its lead: units without frames count in the lead but give it nothing to speak.
        Example, ring 32, behind 3: at unit 20 with 33 encoded (lead 13) and 80 received, a routine top-up encodes
        units 33..48 (up to 20 + 32 - 3 = 49, exclusive); at unit 11 with 29 encoded (lead 18) of which 12..28
        have no frames, the slot cannot step, and units 29..39 are encoded at once."""
        unit = np.maximum(self.table.unit, 0)
        lead = self.table.encoded - unit
        low = self.slots.encode_limit(0) // 2 if self._ticks % ROUTINE_TICKS == 0 else URGENT_LEAD
        stalled = self.table.stalled_since < np.inf
        room = self.table.encoded < self.slots.encode_limit(unit)
        # speculative units whose right context grew: revised as soon as the AR may come near them
        revise = (
            (self.table.final > self.table.confirmed)
            & (self.table.confirmed < self.table.encoded)
            & (self.table.confirmed - unit <= low)
        )
        need = np.flatnonzero(
            ((self.table.encodable > self.table.encoded) & room & ((lead <= low) | (self.table.encoded == 0) | stalled))
            | revise
        )
        if len(need) > PREFILL_ROWS:  # the lowest leads now, the rest next tick
            need = np.sort(need[np.argsort(lead[need], kind="stable")[:PREFILL_ROWS]])
        chosen: list[tuple[Utterance, int]] = []
        for slot in need:
            stop = min(
                int(self.table.encodable[slot]),
                self.slots.encode_limit(int(unit[slot])),
                int(self.table.encoded[slot]) + self.slots.encode_limit(0),
            )
            stop = max(stop, int(self.table.encoded[slot]))  # a revision alone re-encodes what is there
            chosen.append((cast(Utterance, self.table.utterances[slot]), stop))
        return chosen

    def _start_caches(self, rows: torch.Tensor, utterances: list[Utterance]) -> None:
        """Fresh caches in ``rows`` with each stream's voice prefix ((L, M, H, S, D) keys/values: all layers
        in one store, `StepCaches.start`)."""
        prefixes = [self._voice_prefix(u.voice) for u in utterances]  # per stream (L, 1, H, S, D) keys, values
        stacked = (
            prefixes[0]
            if len(prefixes) == 1
            else (torch.cat([p[0] for p in prefixes], 1), torch.cat([p[1] for p in prefixes], 1))
        )
        self.caches.start(rows, stacked)

    def _voice_prefix(self, preset: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """(L, 1, H, S, D) prefix keys/values of a voice: a shipped voice's row of ``prefixes``; a
        blend's computed once and kept, keyed by its mix (the normalised spec), the least recently used of
        more than BLEND_PREFIXES dropped (a stream holds its own copy in the caches)."""
        if len(preset["mix"]) == 1:
            row = next(iter(preset["mix"]))
            keys, values = self.prefixes
            return keys[:, row : row + 1], values[:, row : row + 1]
        key = tuple(preset["mix"].items())
        if key in self._blend_prefixes:
            self._blend_prefixes.move_to_end(key)
        else:
            with torch.no_grad():
                weights = self.io.upload([preset["weights"]], torch.float32)  # (1, V)
                self._blend_prefixes[key] = self.model.voice_prefix(weights)
            if len(self._blend_prefixes) > BLEND_PREFIXES:
                self._blend_prefixes.popitem(last=False)
        return self._blend_prefixes[key]

    def _prefill(self, chosen: list[tuple[Utterance, int]]) -> None:
        """Encode the chosen slots' units from their confirmed count up to ``stop`` in one padded text-encoder call:
        durations -> frames on the device, keys/values written into the text ring. Each row reads
        ``text_lookahead`` units of context on either side, which is exactly what the encoder's convolutions see,
        so a unit's state does not depend on where a prefill starts. Units whose right context has not all arrived
        are encoded speculatively (zero padding past the last unit received) and again by the next prefill; those
        whose frames have started meanwhile are kept as they are (`Slots.place`). Example (lookahead 6): units
        33..48 of 80 are encoded from units 27..54, so row i's units (M, L) hold 27..54 (L >= 28, zero-padded),
        offset 6 and count 16 pick 33..48, all confirmed. Speculative: 41 units received, 33 confirmed, 39 encoded:
        units 33..40 are encoded from units 27..40 (padded after 40), offset 6, count 8, of which 33 and 34 (final:
        35 = 41 - 6) are confirmed and reported to the stream's timings; 35..40 stay speculative."""
        w = self._prefill_windows(chosen)
        m, upload = len(w.rows), self.io.upload
        # (M,) columns, a few uploads in all (each is a torch call, three on a GPU)
        rows_d, counts_d, first_d, leads_d, offsets_d, settles_d = self.io.columns(
            w.rows, w.counts, w.firsts, w.leads, w.offsets, w.settles
        )
        opens_d, pieces_d, flushes_d = self.io.columns(w.opens, w.pieces, w.flushes, dtype=torch.bool)
        if any(w.fresh):  # a slot's first prefill: its chunk sizes, by whether its text outran the start hold
            self.slots.choose_schedules(rows_d, *self.io.columns(w.fresh, w.at_once, dtype=torch.bool))
        floats = upload(np.concatenate([np.ravel(w.voices), w.rates]), torch.float32)  # (M * V + M,)
        voices_d, rates_d = floats[:-m].view(m, -1), floats[-m:]  # (M, V): one-hot for a shipped voice; (M,)
        paced = self.slots.pace(rows_d, leads_d, opens_d, pieces_d)
        rates_d = rates_d / paced  # (M,) elastic pacing: slower while the text's lead is thin
        with exact_convolutions(benchmark=False):  # (M, L, C), (M, L)
            states, log_dur = self.model.text(upload(w.units), voices_d)
        at = torch.arange(max(w.counts), device=self.device)  # (E,)
        keep = at < counts_d[:, None]  # (M, E)
        columns = (offsets_d[:, None] + at).clamp(max=w.units.shape[1] - 1)
        durations = predicted_frames(log_dur.gather(1, columns), rates_d[:, None]) * keep
        durations[:, 0] += (first_d == 0) & (durations.sum(1) == 0)  # an utterance has at least one frame
        positions = first_d[:, None] + at
        # frames chained from the confirmed units' end; started units kept; never stuck behind silent units
        begin, durations, write = self.slots.place(rows_d, positions, keep, durations, settles_d, flushes_d)
        self._spoken_speculative += (keep & ~write & (at < settles_d[:, None])).sum()  # frozen, now confirmed
        self.counters["confirmed_units"] += sum(w.settles)
        states = states.gather(1, columns[:, :, None].expand(-1, -1, self.cfg.dim))
        self.caches.write_text(self.model.text_keys_values(states, begin), positions, write, rows_d)
        self.slots.add_units(rows_d, positions, keep, begin, begin + durations, write)
        if any(w.settles):  # the confirmed units' final frames, for the streams' timings (read at collect)
            schedule = torch.stack([begin, durations])  # (2, M, E)
            if self.device.type == "cuda":
                schedule = _to_host(schedule)
            self._schedules.append(([u for u, _ in chosen], w.firsts, w.settles, schedule))

    def _prefill_windows(self, chosen: list[tuple[Utterance, int]]) -> _PrefillRows:
        """Host side of a prefill: each row's unit window (padded into one (M, L) array) and what to take from it,
        from the slot's confirmed count to ``stop``, and how many of those it confirms; the slots' encoded and
        confirmed counts move on, and units no later prefill reads are forgotten."""
        look = self.cfg.text_lookahead
        w, windows = _PrefillRows(), []
        for u, stop in chosen:
            slot = u.slot
            start = max(int(self.table.confirmed[slot]), stop - self.slots.ring)  # older ones are no longer read
            lo, hi = max(0, start - look), min(u.received, stop + look)
            w.rows.append(slot)
            u.stream.mark("prefill")
            windows.append(u.units[lo - u.unit_base : hi - u.unit_base])
            w.offsets.append(start - lo)
            w.counts.append(stop - start)
            w.firsts.append(start)
            confirmed = min(int(self.table.final[slot]), stop)
            w.settles.append(max(0, confirmed - start))
            w.voices.append(u.voice["weights"])  # (V,): one-hot for a shipped voice
            w.rates.append(u.rate)
            w.leads.append(u.received - max(int(self.table.unit[slot]), 0))
            w.opens.append(not u.text_ended and u.closed_upto != u.received)
            w.pieces.append(u.stream.text.in_pieces)
            w.fresh.append(int(self.table.encoded[slot]) == 0)
            w.at_once.append(u.stream.text.released_at_once)
            self.counters["revised_units"] += max(0, int(self.table.encoded[slot]) - start)
            self.table.encoded[slot], self.table.confirmed[slot] = stop, max(start, confirmed)
            # this prefill confirms the last unit of text a flush closed (not the end): a pause goes after it
            w.flushes.append(not u.text_ended and u.closed_upto == u.received == stop == self.table.confirmed[slot])
            old = int(self.table.confirmed[slot]) - look - 1 - u.unit_base  # host memory stays flat on long speech
            if old > 1024:
                del u.units[:old]
                u.unit_base += old
        w.units = np.zeros((len(w.rows), max(map(len, windows))), dtype=np.int64)  # (M, L), 0 = padding
        for i, window in enumerate(windows):
            w.units[i, : len(window)] = window
        return w


@dataclass
class _PrefillRows:
    """One prefill's host side (`Engine._prefill_windows`): the padded unit windows (M, L) and, per row, its
    slot, what to take from its window, what it confirms, its voice and rate, and what elastic pacing
    (`Slots.pace`) and a flush's pause (`Slots.place`) need."""

    units: Any = None  # (M, L) int64, 0 = padding
    rows: list[int] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)
    counts: list[int] = field(default_factory=list)
    firsts: list[int] = field(default_factory=list)
    settles: list[int] = field(default_factory=list)
    voices: list[list[float]] = field(default_factory=list)
    rates: list[float] = field(default_factory=list)
    leads: list[int] = field(default_factory=list)  # units received minus the aligned unit
    opens: list[bool] = field(default_factory=list)  # the text is not closed or ended
    pieces: list[bool] = field(default_factory=list)  # the text came in more than one piece
    flushes: list[bool] = field(default_factory=list)  # it confirms the end of a flushed text
    fresh: list[bool] = field(default_factory=list)  # the slot's first prefill: its chunk schedule is chosen
    at_once: list[bool] = field(default_factory=list)  # its text in pieces outran the start hold


def _to_host(tensor: torch.Tensor) -> torch.Tensor:
    """A pinned host copy, filled asynchronously on the current CUDA stream (read after its event)."""
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    return host
