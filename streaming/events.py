"""Events: what streams told the engine since the last tick (starts, attaches, text, cancels, holds, the reader
falling behind or catching up), handled on the engine thread in O(number of events), the slot grants they lead
to, and their device updates, applied once per tick as batched ops (`_apply`). A mixin of `Engine`; the
hand-off between the two halves is `DeviceUpdates`."""

from __future__ import annotations

import threading
import time
import traceback
from typing import cast

import numpy as np
import torch

from streaming.device_updates import DeviceUpdates
from streaming.engine_state import EngineState
from streaming.errors import EngineError
from streaming.parking import Parked
from streaming.slot_table import COUNTS, COUNTS_BEFORE, Utterance
from streaming.stream import MOVING, Stream
from tts.text import TextError

# A burst (hundreds of streams starting in one instant) is spread over ticks, so that no tick stalls the
# streams already speaking for long: at most this many slots granted a tick.
GRANTS_PER_TICK = 64


class Events(EngineState):
    """`Engine`'s event handling (engine thread only)."""

    def _handle_events(self) -> bool:
        with self._lock:
            if self._next_factory is not None:
                (self._factory,), self._next_factory = self._next_factory, None
                self._steps.clear()
                self.step_kind = step_kind_of(self._factory)
                self._graphs = self._tick_graphs()
        handled = False
        while self._inbox:
            kind, stream, payload = self._inbox.popleft()
            handled = True
            try:
                self._handlers[kind](stream, payload)
            except Exception as err:  # this stream's event failed: it alone ends, with a typed error
                traceback.print_exc()
                if stream is not None:
                    self._fail(
                        stream,
                        err
                        if isinstance(err, (TextError, EngineError))
                        else EngineError(f"internal error: {type(err).__name__}: {err}"),
                    )
        if self.store.has_lost:
            self._end_lost()
        if self._parking:
            self._continue_parks()
        if self.parking.park_after_s > 0:
            self._choose_parks()
        if self.table.free and (self.table.starts or self.table.restores):
            self._grant_slots()
        prefill = self._choose_prefill()
        if prefill or handled or self._todo.any():
            todo, self._todo = self._todo, DeviceUpdates()
            self._apply(todo, prefill)
            return True
        return False

    def _on_start(self, stream: Stream, preset: dict) -> None:
        if stream.cancelled:
            self._release()
            return
        u = Utterance(stream, -1, preset, stream.speed * preset["pace"])
        self.table.by_stream[stream] = u
        self._wait_for_slot(u, "start")

    def _on_attach(self, stream: Stream, payload) -> None:
        """A stream detached from another engine (`attach`): parked here with its state, then restored."""
        preset, host, rows = payload
        if stream.cancelled:
            self._release()
            return
        u = Utterance(
            stream,
            -1,
            preset,
            stream.speed * preset["pace"],
            units=list(host["units"]),
            unit_base=host["unit_base"],
            closed_upto=host["closed_upto"],
            text_ended=host["text_ended"],
            spoke=host["spoke"],
            **{name: host.get(name, host[old]) for name, old in zip(COUNTS, COUNTS_BEFORE)},
        )
        self.table.by_stream[stream] = u
        if not rows:  # it never had a slot
            self._wait_for_slot(u, "start")
            return
        u.parked = Parked.of(rows)
        self.store.put(u.parked)
        self._wait_for_slot(u, "restore")

    def _on_warm(self, _, done: threading.Event) -> None:
        try:
            n = 1
            while True:
                n = min(n, self.max_streams)
                if self._graph_for(n) is None:
                    self._step_for(n)
                self.codec_path.warm(n)
                if n == self.max_streams:
                    break
                n *= 2
            self.mover.prepare()  # parking's buffers, row pool and slot views: no park makes them
        finally:
            done.set()

    def _on_cancel(self, stream: Stream, _) -> None:
        u = self.table.by_stream.get(stream)
        if u is not None:
            self._drop(u)

    def _on_flow(self, stream: Stream, _) -> None:
        """The reader fell behind or caught up: pause or resume its slot (see `Stream.deliver`/`read`); a stream
        parked while its reader was behind is restored once the reader is down to ``resume_samples``."""
        u = self.table.by_stream.get(stream)
        if u is None:
            return
        stream.paused = True  # before reading the count: a read after this sees the flag and tells us again
        if stream.queued_samples <= stream.resume_samples:
            stream.paused = False
        if u.slot >= 0 and u not in self._parking:  # (one that parks once the tick in flight is in stays paused)
            self._todo.paused.append((u, stream.paused))
            self.table.stalled_since[u.slot] = np.inf  # not parked in this tick: the event is not applied yet
        elif u.parked is not None and (u.parked_paused or u.news) and not stream.paused:
            self._wait_for_slot(u, "restore")

    def _on_hold(self, stream: Stream, _) -> None:
        """Held (`Stream.hold`): park now, without the grace, and take no slot until released; its text and its
        reader's reads are kept meanwhile. Released: back in a slot (after the reader catches up, if it is behind);
        one that has nothing to do parks again after the grace."""
        u = self.table.by_stream.get(stream)
        if u is None or u.detach is not None:
            return
        if stream.held:
            if u.slot >= 0:
                self._park_soon(u)
            elif u.waiting is not None:
                self.table.waiting(u).remove(u)
                u.waiting = None
        elif u.slot >= 0:  # released before the tick in flight let it park
            if u in self._parking:
                self._parking.remove(u)
            self._todo.paused.append((u, stream.paused))
        elif u.parked is None:
            self._wait_for_slot(u, "start")
        elif stream.paused:
            u.parked_paused = True  # the reader catching up restores it (`_on_flow`)
        else:
            self._wait_for_slot(u, "restore")

    def _on_text(self, stream: Stream, news) -> None:
        u = self.table.by_stream.get(stream)
        if u is None:
            return
        if isinstance(news, Exception):
            raise news
        units, closed, ended, spoke = news
        if units is MOVING:
            self._start_detach(u)
            return
        if units:
            stream.mark("units")
        u.units += units
        if closed:
            u.closed_upto = u.received
        u.text_ended, u.spoke = ended, spoke
        if ended and not u.received:
            self._fail(stream, TextError("text has nothing speakable in it"))
            return
        # A unit's encoding is final once the text encoder's right context (text_lookahead units) is there or
        # nothing more comes before it (closed, ended); speculatively it is encoded at once, and again when final
        # (`_prefill`). Example, lookahead 6, 10 units received, open: 4 final, 10 encodable (4 without speculation)
        complete = ended or u.closed_upto == u.received
        final = u.received if complete else max(0, u.received - self.cfg.text_lookahead)
        encodable = u.received if self.speculative else final
        if u.slot >= 0:
            self.table.encodable[u.slot], self.table.final[u.slot] = encodable, final
            self._todo.flags.append(u)
            self.table.stalled_since[u.slot] = np.inf  # not parked in this tick: the news is not applied yet
            return
        u.encodable, u.final = encodable, final
        if u.parked is not None and (units or closed or ended):
            u.news = True
            if not stream.paused:  # else the reader catching up restores it
                self._wait_for_slot(u, "restore")

    def _fail(self, stream: Stream, error: Exception) -> None:
        u = self.table.by_stream.get(stream)
        if u is not None:
            self._drop(u)
        self._end(stream, error)

    def _end(self, stream: Stream, error: Exception | None) -> None:
        """End a stream after the audio already on its way to it (the codec worker keeps the order)."""
        if stream.detach_request is not None:  # it ended before it could move
            stream.detach_request.fail(EngineError("the stream ended before it could be detached"))
        self.codec_path.end(stream, error)

    def _drop(self, u: Utterance) -> None:
        """The stream leaves the engine: its slot, parked state or place in a queue is freed, and its place in
        admission goes to the next caller waiting in `open`."""
        if self.table.by_stream.get(u.stream) is not u:
            return
        del self.table.by_stream[u.stream]
        if u.slot >= 0:
            self._vacate(u)
        if u.parked is not None:
            self.store.discard(u.parked)
            u.parked = None
        if u.waiting is not None:
            self.table.waiting(u).remove(u)
            u.waiting = None
        self._release()

    def _vacate(self, u: Utterance) -> None:
        """The slot is free for the next tick's starts and restores; its row goes idle on the device."""
        self._todo.frees.append(self.table.vacate(u))

    def _release(self) -> None:
        """A reservation ends: the first caller waiting in `open` gets it (its start comes next tick)."""
        self.admission.release()

    def _wait_for_slot(self, u: Utterance, why: str) -> None:
        """Queue ``u`` for a slot (granted at the end of this tick's events): restores ahead of starts. A held
        stream waits for its release (`_on_hold`)."""
        if u.waiting is not None or u.stream.held:
            return
        u.waiting, u.waiting_since = why, time.perf_counter()
        (self.table.starts if why == "start" else self.table.restores).append(u)
        if why == "restore":
            self.store.want(cast(Parked, u.parked))  # a state on disk starts loading now
        if len(self.table.free) < len(self.table.starts) + len(self.table.restores):
            self.counters["slot_waits"] += 1

    def _grant_slots(self) -> None:
        """Free slots to the waiting streams: parked ones whose state is in memory first, then new ones; at most
        GRANTS_PER_TICK a tick (the rest in the next ticks, in order)."""
        granted = 0
        while self.table.free and (self.table.starts or self.table.restores) and granted < GRANTS_PER_TICK:
            granted += 1
            u = next(
                (r for r in self.table.restores if r.detach is None and self.store.want(cast(Parked, r.parked))), None
            )
            if u is None and not self.table.starts:
                return  # only restores whose state is still loading
            u = u or self.table.starts[0]
            self.table.waiting(u).remove(u)
            self.slot_wait_ms.append((time.perf_counter() - u.waiting_since) * 1000)
            self._occupy(u)

    def _occupy(self, u: Utterance) -> None:
        why, u.waiting = u.waiting, None
        self.table.occupy(u)
        if why == "restore":
            parked = cast(Parked, u.parked)  # a restore has its parked state
            self.store.take(parked)
            self._todo.restores.append((u, parked))
            u.parked = None
            self.counters["restores"] += 1
            u.stream.resume_samples = u.stream.max_queued_samples
        else:
            self._todo.starts.append(u)
            u.stream.mark("slot")
            self._unstepped.append(u)
        self._todo.flags.append(u)  # text that came while it held no slot
        self._todo.paused.append((u, u.stream.paused))

    def _apply(self, todo: DeviceUpdates, prefill: list[tuple[Utterance, int]]) -> None:
        """This tick's event updates on the device, each kind as one batched op: parked rows are copied out
        before freed rows are reset, restored rows written after new rows start."""
        upload, holds = self.io.upload, self.table.holds
        if todo.parks:
            self._park_rows(todo.parks)
        if todo.frees:
            self.slots.reset(self.io.row_mask(todo.frees))
            self._flags.cleared(todo.frees)
        touched = []
        starts = [u for u in todo.starts if holds(u)]  # a slot freed and taken again: the last holder
        if starts:
            rows = [u.slot for u in starts]
            rows_d = upload(rows)
            temperatures = [max(u.voice["temperature"], 1e-4) for u in starts]  # positive: never divides by 0
            self._start_caches(rows_d, starts)
            self.slots.start(rows_d, upload([u.stream.seed for u in starts]), upload(temperatures, torch.float32))
            self._flags.cleared(rows)
            self.codec_path.start_rows(rows)
            touched += rows
        restores = [(u, state) for u, state in todo.restores if holds(u)]
        for state in [state for u, state in todo.restores if not holds(u)]:  # ended since: rows back to the pool
            state.release()
        if restores:
            rows = self._restore_rows(restores)
            self._flags.unknown(rows)  # each row holds its parked flags now
            touched += rows
        if prefill:
            self._prefill(prefill)
            touched += [u.slot for u, _ in prefill]
        flagged = {u.slot: u for u in todo.flags + [u for u, _ in prefill] if holds(u)}
        if flagged:
            rows = list(flagged)
            closed = [self.table.confirmed[s] == flagged[s].closed_upto == flagged[s].received for s in rows]
            ended = [flagged[s].text_ended and self.table.confirmed[s] == flagged[s].received for s in rows]
            self._flags.write("closed", rows, closed, upload)
            self._flags.write("ended", rows, ended, upload)
            touched += rows
        paused = {u.slot: value for u, value in todo.paused if holds(u)}  # the last word counts
        if paused:
            self._flags.write("paused", list(paused), list(paused.values()), upload)
            touched += list(paused)
        if touched:  # these slots' device state changed: they may step again
            self.table.event_at[touched] = time.perf_counter()
            self.table.stalled_since[touched] = np.inf


def step_kind_of(factory) -> str:
    """A step factory's name for `Engine.step_kind` (None: eager)."""
    if factory is None:
        return "eager"
    return getattr(factory, "kind", getattr(factory, "__name__", type(factory).__name__))
