"""The batch of slots as device tensors: one row per slot, changed only by masked, batched ops.

Next to `StepCaches` (what the model attends to), `Slots` holds what the engine knows of each slot's stream:
its step, tokens and delay-pattern history, how many units are encoded and how many frames they span, each
text-ring entry's frames, the chunk schedule, sampling temperature and seed. A tick reads and updates all of
it in a fixed number of tensor ops, whatever the number of slots; the host sees one small `meta` table per
tick.

**Text ring.** Units are encoded ahead and written into the text ring (capacity R) once, at slot
``unit % R``, with the unit's first frame and its end frame kept beside the entry (``unit_start``,
``unit_end``). A step at unit ``p`` attends to units ``p - behind .. p + ahead`` (the mask), so writing unit
``u`` is safe once no future step reads unit ``u - R``, i.e. while ``u < p + R - behind``
(`encode_limit`). Worked example, R = 32, behind = 3: at unit p = 10 the oldest unit still read is 7, in
ring slot 7; units up to 38 may be written (38 -> slot 6, which held unit 6, no longer read); unit 39 would
overwrite unit 7, so the limit is ``p + R - behind = 39`` (exclusive).

**Aligned unit.** The unit of frame ``f`` is the ring entry with ``unit_start <= f < unit_end``: the
largest unit with a frame at or before ``f`` (zero-frame units own no frame). Past the last scheduled
frame (the delay-pattern tail) it is the last frame's unit. Example: entries units [4, 5, 6] with frames
[10, 13), [13, 13), [13, 15): frame 12 -> unit 4, frame 13 -> unit 6 (unit 5 has no frames), and with
15 frames known, step 17 (tail) -> frame 14 -> unit 6.

**Speculative units.** Units may be encoded before their text encoder's right context (``text_lookahead``
units) has arrived, with zero padding for what is not known yet, and encoded again when more arrives
(`Engine._prefill`). Units ``[0, encoded)`` are in the ring; of these, ``[0, confirmed)`` (a host count) had
their whole right context (or the text was closed) and never change again; the rest are speculative. A
re-encode writes units ``c .. stop - 1`` from the confirmed count ``c``: their keys/values, and their frames,
chained from ``settled`` (the end frame of the confirmed units) instead of ``frames``. A unit whose frames have
started (``unit_start < step``: the AR has produced or is producing its first frame) is *frozen*: its entry,
begin and end stay as they are (its old duration is used to chain the next units' frames), so a step never sees
the frames of its own unit move. Units started form a prefix of the window (begins do not decrease), so frozen
ones do too. The silent-run count (`cap_silence`) is kept at the confirmed boundary, so capping a window again
from ``c`` gives the frozen units their old (capped) durations back. Worked example, lookahead 6: units 0..9
received, so 0..3 are final and 4..9 speculative; all 10 are encoded (``settled`` = end of unit 3, say frame 20;
units 4..9 get frames [20, 23), [23, 25), [25, 30), ...). The AR steps to frame 24 (unit 5; step = 25). Units
10..12 arrive: units 4..6 become final; the re-encode covers units 4..12 from frame 20: units 4 and 5 have
started (begins 20, 23 < 25) and keep [20, 23), [23, 25); unit 6 (begin 25, not started) and the rest are
revised: new keys, durations predicted again, begins chained from 25. ``settled`` becomes the end of unit 6.

**Silent runs.** A unit may be predicted zero frames, but not too many in a row: the aligned unit only moves
on to a unit with frames, and the ring only takes units below ``p + R - behind``, so a run of more than
``R - behind - ahead - 2`` zero-frame units after the aligned unit ``p`` would leave the next unit with frames
(or the ``ahead`` units it needs) unwritable forever: the stream would never step again. The unit that would
make a run one longer gets one frame instead (`cap_silence`). Worked example, R = 32, behind 3, ahead 4 (at
most 23 in a row): p = 11 has frames and units 12..39 are predicted zero frames; unit 35 gets one frame, so
it is encoded while p = 11 (35 + 4 < 11 + 29) and the stream steps on to it.

**Delay pattern.** Codebook k of frame f comes out at step f + k (`tts.delay`), so frame f is complete at
step f + K - 1, and its codes are in the history ring of the last K steps at columns (f + k) % K.
Example, K = 4: at step 9 frame 6 completes; its codebooks 0..3 came out at steps 6, 7, 8, 9, in history
columns 2, 3, 0, 1.

**Elastic pacing.** A jitter buffer stretches audio when its queue runs thin (WebRTC NetEQ's "preemptive
expand"); here the engine owns each unit's duration, so a stream whose text has only just begun is spoken a
little slower until the text is well ahead. Each prefill's rows get a factor from their lead (units received
minus the aligned unit) while their text is open: PACE_STRETCH at a lead of PACE_LEAD units or less, 1 at
PACE_LEAD_FULL or more, linear between, and never more than the slot's factor before (``stretch``, which a
fresh stream starts at PACE_STRETCH and a closed or ended text sets to 1 for good). The durations of the units
encoded are predicted at the voice's rate divided by it; started units keep theirs (Speculative units), and a
speculative unit re-encoded later gets the factor of then. Example, 1.2 from lead 24 to 60: a first prefill
with 10 units received (lead 10) -> 1.2: a unit of 3.0 frames is given round(3.6) = 4; with lead 42 later ->
1.1; with lead 30 after that -> still 1.1 (it never grows back); text ended -> 1.0. Text in one piece so far
(`TextStream.in_pieces`: whole text) is divided by exactly 1.0: the same durations, bit for bit.

**Chunk schedule.** Completed frames wait in ``pending`` until a chunk is due: ``schedule[slot, chunks]``
frames (the last entry repeats), or whatever is left when the utterance is done. A slot's row is chosen once,
at its stream's first prefill: INCREMENTAL_CHUNKS for text in pieces that the start hold let go at once,
CHUNK_SCHEDULE for the rest (`choose_schedules`). Chunk sizes never depend on timing after that (a chunk handed
out early because text ran dry would change the codec's float rounding, and a seeded or parked stream would no
longer repeat bit for bit).
Example, (4, 4, 6, 8, 12, 16, 16):
a stream's chunks hold frames 0-3, 4-7, 8-13, 14-21, 22-33, 34-49, 50-65, ..., and the tail. With ``stagger``
the first 16-frame chunk of slot s is ``16 - s % 8`` frames, so streams that started in the same tick hand out
their 16-frame chunks in 8 different ticks, not all in one: slot 3's chunks hold frames ..., 22-33, 34-46,
47-62, ...

**Flush.** A flush closes the text so far, and its audio must all come out without more text; but frame f is
complete only at step f + K - 1, whose codebook 0 belongs to frame f + K - 1. So the last unit a flush closes
gets K - 1 frames of pause after its predicted ones (`place`), the stream steps through them, and a chunk is
due once the closed text's last frame is complete (``flushed``), whatever its size. Both depend on the text
alone, not on when it came. The schedule goes on (a player that ran dry waiting for the next text restarts
with one whole chunk, not with chunks doubling from 2 frames, which a busy engine's ticks cannot keep ahead
of). Example, K = 8, chunks (4, 4, 6, 8, 12, 16): a flushed sentence's frames are 0-37; its last unit ends at
frame 45 instead of 38, steps run to 44, which completes frame 37, and the chunk of frames 34-37 goes out (4
frames, not 16). The pause's frames 38-44 complete as the next text's first frames step (steps 45-51) and go out in
the next chunk, frames 38-53.
"""

from __future__ import annotations

from typing import Any

import torch

from streaming.sampling import stream_key
from tts.alignment import start_frames
from tts.model import ModelConfig

# Frames per codec decode: small first chunks for a fast first sound, then 320 ms. On 2 CPU cores the
# decoder's fixed cost per call (short convolutions, the LSTM's per-call setup) makes 8-frame chunks cost
# about 1.4 times as much per second of audio as 16-frame ones (`python -m bench.codec --quick`). A player that
# starts at the first chunk has the audio of the chunks before chunk k to play while the engine steps to chunk k's
# end: margin_k = 20 ms * E_(k-1) - step * (E_k - E_1) (E_k: the end frame of chunk k), so chunks that double
# lose margin whenever a step takes over 10 ms (half of a frame), and a bigger first chunk adds step * E_1 to each.
# The first is 4 frames, not 2 (the 2nd chunk comes ~56 ms ahead of the player, not ~16 ms, at 6 ms a step; the
# start hold still plans with a 2-frame one: `streaming.textstream.PLANNED_CHUNKS`), and they grow by half, not
# double (at 12 ms a step, loaded 2 cores, (4, 4, 8, 16)'s 4th chunk came 16 ms late; these keep 32 ms in hand).
# Example, 12 ms a step: ends 4, 8, 14, 22, 34, 50 -> margins 80 - 48 = 32, 160 - 120 = 40, 280 - 216 = 64, ...
CHUNK_SCHEDULE = (4, 4, 6, 8, 12, 16)
# Text that comes in pieces faster than the start hold needs (an LLM's words at 10-20 a second: the hold let them
# go as soon as there were enough, `TextStream.released_at_once`) starts with a 6-frame chunk: its first chunks are
# cut while word prefills and the text thread share the 2 cores with the steps and the codec, and the 2nd chunk is
# the one they make late (issue 29: stalls at 20 words/s through `tts serve`). Text the hold waited for (5 words/s,
# 1.2x speech) keeps CHUNK_SCHEDULE's: a bigger first chunk asks it for more text before the first audio, measured
# a few ms later at 5 words/s (docs/decisions.md). Whole text keeps the smaller first chunk (`tts say`, the API).
INCREMENTAL_CHUNKS = (6, 6, 8, 12, 16)
NEVER = 1 << 40
# Elastic pacing at the start (`Slots.pace`): while a stream's text is open and its lead of text over speech is
# thin, units not yet started are spoken up to PACE_STRETCH times slower; the factor eases to 1 as the lead grows
# from PACE_LEAD units to PACE_LEAD_FULL and never grows again. Chosen in the module comment of
# `streaming.textstream` (above PIECE_SPREAD), with the start hold that counts on it.
PACE_STRETCH = 1.2
PACE_LEAD = 24
PACE_LEAD_FULL = 60


def pace_factor(lead, most: float = PACE_STRETCH):
    """Elastic pacing's factor at a lead of ``lead`` units (a tensor or a float): ``most`` at PACE_LEAD or
    less, 1 at PACE_LEAD_FULL or more, linear between. Example, 1.2 from 24 to 60: lead 42 -> 1.1."""
    if isinstance(lead, torch.Tensor):
        ease = ((lead - PACE_LEAD) / (PACE_LEAD_FULL - PACE_LEAD)).clamp(0, 1)
    else:
        ease = min(1.0, max(0.0, (lead - PACE_LEAD) / (PACE_LEAD_FULL - PACE_LEAD)))
    return most - (most - 1) * ease


# Rows of the per-slot tables `Slots.flags` and `Slots.counts`, in order.
FLAG_ROWS = ("live", "paused", "closed", "ended")
COUNT_ROWS = ("step", "frames", "encoded", "pending", "chunks", "silent", "settled", "flushed")

# Columns of the per-tick table the host reads (`Slots.advance`).
META = ("unit", "ready", "completed", "pending", "due", "done")
UNIT, READY, COMPLETED, PENDING, DUE, DONE = range(len(META))  # its columns' indices


MAX_CHUNK = max(*CHUNK_SCHEDULE, *INCREMENTAL_CHUNKS)


def schedule_table(
    sizes: tuple[int, ...], batch: int, stagger: bool, device=None, width: int | None = None
) -> torch.Tensor:
    """(B, S) chunk sizes per slot: ``sizes``, then its last size to ``width`` columns (default: once more; the
    last column repeats). With ``stagger`` the first chunk of the last size is ``size - slot % 8`` frames (module
    docstring, Chunk schedule). Example, (6, 6, 8, 12, 16), 3 slots, stagger -> [6, 6, 8, 12, 16, 16],
    [6, 6, 8, 12, 15, 16], [6, 6, 8, 12, 14, 16]."""
    width = len(sizes) + 1 if width is None else width
    table = torch.tensor([*sizes] + [sizes[-1]] * (width - len(sizes)), device=device).repeat(batch, 1)
    if stagger:
        table[:, sizes.index(sizes[-1])] -= torch.arange(batch, device=device) % 8
    return table


class Slots:
    def __init__(self, cfg: ModelConfig, batch: int, ring: int, device=None, stagger: bool = False):
        def zeros(*shape, dtype=torch.long):
            return torch.zeros(*shape, dtype=dtype, device=device)

        books = cfg.codebooks
        self.batch, self.ring, self.books, self.empty = batch, ring, books, cfg.codebook_size
        self.behind, self.ahead = cfg.behind, cfg.ahead
        self.codebook = torch.arange(books, device=device)  # (K,)
        # (2, B, S): each slot's chunk sizes, CHUNK_SCHEDULE's (row 0) and INCREMENTAL_CHUNKS' (row 1); `schedule`
        # is the one each slot's stream uses (`start`, `choose_schedules`)
        tables = (CHUNK_SCHEDULE, INCREMENTAL_CHUNKS)
        width = max(map(len, tables)) + 1
        self.schedules = torch.stack([schedule_table(sizes, batch, stagger, device, width) for sizes in tables])
        self.schedule = self.schedules[0].clone()  # (B, S)
        # The per-slot flags and counts are the rows of two tables (each name a view of its row), so that a reset
        # is one store per table and `place` reads a slot's counts in one gather: every torch call lets go of
        # the interpreter lock, which a busy server's other threads then hold a while (`streaming.engine`).
        self.flags = zeros(len(FLAG_ROWS), batch, dtype=torch.bool)  # (4, B)
        self.live, self.paused, self.closed, self.ended = self.flags.unbind(0)
        self.counts = zeros(len(COUNT_ROWS), batch)  # (8, B); step first: the step reads step[:n] at offset 0
        self.step, self.frames, self.encoded, self.pending, self.chunks, self.silent, self.settled, self.flushed = (
            self.counts.unbind(0)
        )
        # silent: zero-frame units in a row at the end of those confirmed (`cap_silence`); settled: end frame of the
        # confirmed units (a re-encode chains its frames from here); flushed: end frame of the text the last flush
        # closed (0: none; a chunk ends there)
        self.stretch = torch.ones(batch, device=device)  # (B,) elastic pacing's factor now (`pace`)
        self.stretch_max = PACE_STRETCH  # a fresh stream's factor (1: no elastic pacing)
        self.key = zeros(batch)  # each stream's sampling-noise key (`streaming.sampling.stream_key` of its seed)
        self.temperature = torch.ones(batch, 1, 1, device=device)  # (B, 1, 1)
        self.tokens = torch.full((batch, books), self.empty, dtype=torch.long, device=device)  # (B, K) last step's
        self.history = zeros(batch, books, books)  # (B, K, K): codebook k of the last K steps, column step % K
        self.unit_frames = zeros(2, batch, ring)  # (2, B, R): first frame and end frame of each entry
        self.unit_start, self.unit_end = self.unit_frames.unbind(0)
        self.codes = zeros(batch, books, MAX_CHUNK)  # (B, K, C) completed frames awaiting the codec

    def reset(self, mask: torch.Tensor) -> None:
        """Rows where ``mask`` (B,) is true return to an empty, idle slot (not live)."""
        self.flags.masked_fill_(mask, False)  # (B,) broadcast over the table's rows
        self.counts.masked_fill_(mask, 0)
        self.tokens.masked_fill_(mask[:, None], self.empty)
        self.history.masked_fill_(mask[:, None, None], 0)

    def rows(self) -> dict[str, torch.Tensor]:
        """Every per-slot tensor by name, batch first: a slot's state is row ``s`` of each (what parking copies
        out and back, `streaming.parking`). The chunk schedule is included: a stream moved to another slot keeps
        its staggered chunk sizes."""
        names = (
            "live",
            "paused",
            "closed",
            "ended",
            "step",
            "frames",
            "encoded",
            "pending",
            "chunks",
            "silent",
            "settled",
            "flushed",
            "key",
            "stretch",
            "temperature",
            "tokens",
            "history",
            "unit_start",
            "unit_end",
            "codes",
            "schedule",
        )
        return {name: getattr(self, name) for name in names}

    def start(self, rows: torch.Tensor, seeds: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
        """Fresh streams in ``rows`` (M,) with their seeds (M,) and temperatures (M,). Returns the (B,) mask."""
        mask = torch.zeros(self.batch, dtype=torch.bool, device=rows.device)
        mask[rows] = True
        self.reset(mask)
        self.live[rows] = True
        self.key[rows] = stream_key(seeds)
        self.stretch[rows] = self.stretch_max
        self.temperature[rows, 0, 0] = temperatures
        self.schedule[rows] = self.schedules[0, rows]
        return mask

    def choose_schedules(self, rows: torch.Tensor, fresh: torch.Tensor, at_once: torch.Tensor) -> None:
        """At a slot's first prefill (``fresh`` (M,) bool, of the slots ``rows`` (M,)): its stream's chunk sizes,
        INCREMENTAL_CHUNKS if its text came in pieces and the start hold let it go at once (``at_once`` (M,) bool,
        `TextStream.released_at_once`), else CHUNK_SCHEDULE's (set by `start`). Chosen once, before the first
        frame: the sizes never change under a stream's chunks. Example, rows [2, 5], fresh [True, False], at once
        [True, True] -> slot 2 hands out 6, 6, 8, ... frames; slot 5 keeps what it had."""
        pick = (fresh & at_once)[:, None]  # (M, 1)
        self.schedule[rows] = torch.where(pick, self.schedules[1, rows], self.schedule[rows])

    def pace(
        self, rows: torch.Tensor, lead: torch.Tensor, open_text: torch.Tensor, in_pieces: torch.Tensor
    ) -> torch.Tensor:
        """Elastic pacing's factor (M,) for the units the slots ``rows`` (M,) encode now, given their ``lead``
        (M,) (units received minus the aligned unit), whether their text is open (M,) bool and came in more than
        one piece so far (M,) bool (module docstring, Elastic pacing): the durations are predicted at the rate
        divided by it. Example (1.2 from lead 24 to 60), leads [10, 42, 70, 5] of open texts, factors 1.2 before,
        the 4th text in one piece so far -> [1.2, 1.1, 1.0, 1.0] (the 4th slot's factor stays 1.2); a closed text
        -> 1.0, and its slot's factor becomes 1."""
        stretch = self.stretch[rows]
        paced = torch.minimum(stretch, pace_factor(lead, self.stretch_max))
        self.stretch[rows] = torch.where(open_text, torch.where(in_pieces, paced, stretch), 1.0)
        return torch.where(open_text & in_pieces, paced, 1.0)

    def encode_limit(self, unit: Any) -> Any:  # a tensor, an array or an int: the same back
        """Units below this may be written into the ring while the slot is at ``unit`` (module docstring)."""
        return unit + self.ring - self.behind

    def cap_silence(
        self, rows: torch.Tensor, durations: torch.Tensor, keep: torch.Tensor, settle: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``durations`` (M, E) of the next units of the slots ``rows`` (M,) (``keep``: which are real), with
        one frame given to each unit that would make a run of zero-frame units longer than the most the ring
        lets a stream step past (module docstring, Silent runs); the slots' runs carry over to their next units.
        The run kept is the one after the first ``settle`` (M,) units (default: all real ones; 0 keeps the slot's
        run): those confirmed, where the next re-encode starts (Speculative units).
        Example, at most 2 in a row, a run of 1 before: durations [0, 0, 3, 0, 0, 0] -> [0, 1, 3, 0, 0, 1]
        (runs 2, 3 -> forced, 0, 1, 2, 3 -> forced), leaving a run of 0 (with ``settle`` 5, a run of 2)."""
        settle = keep.sum(1) if settle is None else settle  # (M,)
        durations, self.silent[rows] = self._cap(durations, keep, settle, self.silent[rows])
        return durations

    def _cap(
        self, durations: torch.Tensor, keep: torch.Tensor, settle: torch.Tensor, silent: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`cap_silence` on given runs ``silent`` (M,) before the units: (capped durations (M, E), the runs
        after the first ``settle`` units (M,)), nothing stored."""
        cycle = self.ring - self.behind - self.ahead - 1  # the most in a row, plus one
        at = torch.arange(durations.shape[1], device=durations.device)  # (E,)
        quiet = (durations == 0) & keep  # (M, E)
        last_sound = torch.where(quiet, -1, at).cummax(1).values  # (M, E) the last unit with frames so far
        run = (at - last_sound + torch.where(last_sound < 0, silent[:, None], 0)) % cycle  # 0 where it has frames
        forced = quiet & (run == 0)
        last = (settle - 1).clamp(min=0)[:, None]  # (M, 1) each row's last unit counted
        after = torch.where(forced | ~quiet, 0, run).gather(1, last)[:, 0]
        return durations + forced, torch.where(settle > 0, after, silent)

    def place(
        self,
        rows: torch.Tensor,
        positions: torch.Tensor,
        keep: torch.Tensor,
        durations: torch.Tensor,
        settle: torch.Tensor,
        flush: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Frames of the units at ``positions`` (M, E) (from each slot's confirmed count on, ``keep``: which are
        real) encoded now with predicted ``durations`` (M, E), of which the first ``settle`` (M,) are confirmed by
        this encode (module docstring, Speculative units): units already in the ring whose frames started keep
        their frames (and their ring entries: not in ``write``), the others are capped (`cap_silence`) and chained
        from ``settled``, which moves to the end of the confirmed ones. Returns begin (M, E), durations (M, E) and
        ``write`` (M, E): the units to write. With nothing speculative (no units in the ring at ``positions``, all
        confirmed) it is the plain encode: begin = frames + start_frames(durations). ``flush`` (M,) bool: rows
        whose confirmed units end the text a flush closed; their last one gets a pause after it (module
        docstring, Flush)."""
        at = positions % self.ring
        batch = rows[:, None].expand_as(at)
        begun, ends = self.unit_frames[:, batch, at].unbind(0)  # (M, E) each: the entries' frames so far
        step, _, encoded, _, _, silent, settled, flushed = self.counts[:, rows].unbind(0)  # (M,) each
        frozen = keep & (positions < encoded[:, None]) & (begun < step[:, None])  # in the ring, started: kept
        old = ends - begun  # (M, E)
        capped, self.silent[rows] = self._cap(torch.where(frozen, old, durations), keep, settle, silent)
        durations = torch.where(frozen, old, capped)
        last = (settle - 1).clamp(min=0)[:, None]  # (M, 1)
        settling = settle > 0
        pause = (
            torch.zeros_like(settle)
            if flush is None  # (M,) frames after the closed text
            else torch.where(flush & settling, self.books - 1, 0)
        )
        durations = durations.scatter_add(1, last, pause[:, None])
        begin = settled[:, None] + start_frames(durations)  # (M, E)
        settled = torch.where(settling, (begin + durations).gather(1, last)[:, 0], settled)
        self.settled[rows] = settled
        self.flushed[rows] = torch.where(pause > 0, settled - pause, flushed)
        return begin, durations, keep & ~frozen

    def add_units(
        self,
        rows: torch.Tensor,
        positions: torch.Tensor,
        keep: torch.Tensor,
        start: torch.Tensor,
        end: torch.Tensor,
        write: torch.Tensor | None = None,
    ) -> None:
        """Record encoded units: ``positions`` (M, E) unit indices (distinct modulo R) of the slots ``rows`` (M,),
        ``keep`` (M, E) which are real, ``start``/``end`` (M, E) their frames, ``write`` (M, E) the entries to
        write (default ``keep``; not the frozen ones of a re-encode, `place`). The units' keys and values go
        into the text ring by `StepCaches.write_text` at the same ring slots."""
        at = positions % self.ring
        batch = rows[:, None].expand_as(at)
        write = keep if write is None else write
        self.unit_frames[:, batch, at] = torch.where(write, torch.stack([start, end]), self.unit_frames[:, batch, at])
        self.encoded[rows] = torch.where(keep, positions + 1, 0).amax(1)
        self.frames[rows] = torch.where(keep, end, 0).amax(1)

    def plan(self, n: int, ring_units: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The first ``n`` slots' aligned units (n,) (-1: no frame yet) and which may step now (n,) bool.
        ``ring_units`` (n, R): the unit index in each text-ring entry (-1 empty), i.e. the text ring's positions.
        A slot steps when live, not paused, not finished, its frame is scheduled (or the text has ended) and
        the units it attends to are encoded (or nothing more will come before them: closed or ended)."""
        s = slice(0, n)
        step, frames, ended = self.step[s], self.frames[s], self.ended[s]
        frame = torch.minimum(step, (frames - 1).clamp(min=0))[:, None]  # (n, 1)
        owns = (ring_units >= 0) & (self.unit_start[s] <= frame) & (self.unit_end[s] > self.unit_start[s])
        unit = torch.where(owns, ring_units, -1).amax(1)  # (n,)
        total = self.total_steps(s)
        text_ready = ended | self.closed[s] | (unit + self.ahead < self.encoded[s])
        ready = self.live[s] & ~self.paused[s] & (step < total) & (ended | (step < frames)) & text_ready & (unit >= 0)
        return unit, ready

    def total_steps(self, s: slice) -> torch.Tensor:
        """Steps of each utterance once its text has ended (frames + K - 1; 0 for none), else NEVER."""
        frames = self.frames[s]
        return torch.where(self.ended[s], torch.where(frames > 0, frames + self.books - 1, 0), NEVER)

    def advance(
        self, sampled: torch.Tensor, ready: torch.Tensor, unit: torch.Tensor, keep_codes: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """After a step of the first n slots: take the ``sampled`` tokens (n, K) of the ``ready`` (n,) rows,
        update the delay-pattern history, collect each completed frame's codes (into ``codes`` at
        ``pending`` if ``keep_codes``) and run the chunk schedule. Returns the host's table (n, len(META))
        long, taken before due chunks are cleared, and the codes (n, K) of the frame each row completed."""
        n, books = ready.shape[0], self.books
        s = slice(0, n)
        step, frames, ended = self.step[s], self.frames[s], self.ended[s]
        frame_of = step[:, None] - self.codebook  # (n, K): codebook k of this step belongs to frame step - k
        limit = torch.where(ended, frames, NEVER)[:, None]
        tokens = torch.where((frame_of >= 0) & (frame_of < limit), sampled, self.empty)
        self.tokens[s] = torch.where(ready[:, None], tokens, self.tokens[s])
        history = self.history[s]
        column = (step % books)[:, None, None].expand(-1, books, 1)  # (n, K, 1)
        history.scatter_(2, column, torch.where(ready[:, None, None], tokens[:, :, None], history.gather(2, column)))
        done_frame = step - (books - 1)
        completed = ready & (done_frame >= 0) & (done_frame < frames)
        columns = ((done_frame[:, None] + self.codebook) % books)[:, :, None]  # (n, K, 1)
        codes = history.gather(2, columns)[:, :, 0]  # (n, K)
        step += ready
        pending = self.pending[s]
        if keep_codes:
            at = pending.clamp(max=self.codes.shape[2] - 1)[:, None, None].expand(-1, books, 1)
            held = self.codes[s]
            held.scatter_(2, at, torch.where(completed[:, None, None], codes[:, :, None], held.gather(2, at)))
        pending += completed
        done = self.live[s] & ended & (step >= self.total_steps(s))
        chunks = self.chunks[s]
        size = self.schedule[s].gather(1, chunks.clamp(max=self.schedule.shape[1] - 1)[:, None])[:, 0]
        flushed = completed & (done_frame == self.flushed[s] - 1)  # the flushed text's last frame: all of it out
        due = (pending >= size) | (done & (pending > 0)) | flushed
        meta = torch.stack([unit, ready.long(), completed.long(), pending, due.long(), done.long()], 1)
        pending.masked_fill_(due, 0)
        chunks += due
        return meta, codes
