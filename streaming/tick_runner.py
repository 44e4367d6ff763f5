"""The batched tick's execute and update halves: launch (one AR step of the ready slots, sampling and the slots'
bookkeeping as batched tensor ops; on a GPU one `TickGraph`), then collect (hand out due chunks through the
codec path, end finished streams, note each slot's unit). `Tick` is what a launch hands its collect. A mixin of
`Engine` (engine thread only)."""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from streaming.codec_worker import fast_path_enabled
from streaming.device_updates import DeviceUpdates
from streaming.engine_state import EngineState
from streaming.errors import EngineError
from streaming.events import step_kind_of
from streaming.live_figures import Timer
from streaming.sampling import sample
from streaming.slot_table import Utterance
from streaming.slots import DONE, DUE, PENDING, READY, UNIT
from streaming.step_caches import StepCaches, TickGraph, decode_step
from tts.text import TextError


class TickRunner(EngineState):
    """`Engine`'s launch and collect."""

    def _launch(self, n: int) -> None:
        """Step the ready slots among the first ``n``; decode completed frames; queue the results for the host.
        On a GPU with graphs the step is one `TickGraph` launch and the codec one more on its own stream."""
        launched_at = time.perf_counter()
        cuda = self.device.type == "cuda"
        timer = Timer(cuda)
        graph = self._graph_for(n)
        if graph is not None:
            meta, codes = graph()
            timer.mark()
        else:
            meta, codes = self._eager_tick(n, timer)
        tick = Tick(
            n,
            list(self.table.utterances[:n]),
            self.table.generation[:n].copy(),
            self._schedules,
            timer,
            self._ticks,
            launched_at,
        )
        self._schedules = []
        self.codec_path.launch(tick, meta, codes, eager=self._graphs is None)
        self._inflight.append(tick)

    def _eager_tick(self, n: int, timer: Timer) -> tuple[torch.Tensor, torch.Tensor]:
        """`tick_step` op by op, with the step factory's step (the CPU path, and a GPU without graphs)."""
        slots = self.slots
        step = self._step_for(n)
        unit, ready = slots.plan(n, self.caches.text_stack.positions[:n])
        logits = step(self.model, self._view(n), slots.tokens[:n], slots.step[:n], unit.clamp(min=0), ready)
        temperature = slots.temperature[:n] if self.sampling.temperature > 0 else 0.0  # 0: greedy, for tests
        sampled = sample(logits, temperature, self.sampling.top_k, key=slots.key[:n], step=slots.step[:n])
        timer.mark()  # the step's time: AR step and sampling
        return slots.advance(sampled, ready, unit, keep_codes=self.codec_path.keeps_codes)

    def _tick_graphs(self) -> dict | None:
        """Captured ticks by bucket when they can serve: a GPU with the frame codec, graphs not switched off
        (TTS_NO_GRAPH=1), and a step factory (None asks for the eager step). They step with `decode_step`
        itself, captured inside the tick, in place of the factory's step (on a GPU that is the same step)."""
        wanted = (
            self.device.type == "cuda"
            and self.codec_path.captures_ticks
            and self._factory is not None
            and fast_path_enabled("graph")
        )
        return {} if wanted else None

    def _graph_for(self, n: int) -> TickGraph | None:
        """The captured tick of bucket ``n`` (built on first use), or None: no CUDA graphs here (the CPU, no
        step factory, TTS_NO_GRAPH=1) or the capture failed (then the eager tick serves, with a warning)."""
        if self._graphs is None:
            return None
        graph = self._graphs.get(n)
        if graph is None:
            try:
                graph = TickGraph(
                    self.model, self._view(n), self.slots, n, self.sampling.temperature, self.sampling.top_k
                )
            except Exception as err:
                warnings.warn(f"tick CUDA graph for {n} slots unavailable, stepping eagerly: {err}")
                self._graphs = None
                self.step_kind = "eager"
                return None
            self._graphs[n] = graph
            self.step_kind = TickGraph.kind
        return graph

    def _collect(self, tick: Tick) -> None:
        """Results of a launched tick: hand out due chunks, end finished streams, note each slot's unit."""
        if tick.ready is not None:
            waiting = time.perf_counter()
            tick.ready.synchronize()  # the one host sync of a GPU tick
            self._waited += time.perf_counter() - waiting
        meta = tick.meta.numpy() if isinstance(tick.meta, torch.Tensor) else tick.meta
        n = tick.n
        same = tick.generation == self.table.generation[:n]  # rows still held by the stream that was stepped
        self.table.unit[:n] = np.where(same, meta[:, UNIT], self.table.unit[:n])
        ready = meta[:, READY].astype(bool)
        self._any_ready = bool(ready.any())
        fresh = self.table.live[:n] & (
            tick.launched_at > self.table.event_at[:n]
        )  # launched after the slot's last event
        stalled = self.table.stalled_since[:n]
        self.table.stalled_since[:n] = np.where(
            ready, np.inf, np.where(fresh, np.minimum(stalled, tick.launched_at), stalled)
        )
        step_ms, codec_ms = tick.timer.elapsed()
        self.step_ms.append(step_ms)
        if self._unstepped:
            self._mark_first_steps(tick, ready)
        self._schedule_units(tick.schedules)
        self.codec_path.collect(tick, meta, same, codec_ms)
        due = np.flatnonzero(meta[:, DUE])
        if len(due):
            self._hand_out(tick, due, meta[due, PENDING])
        for row in np.flatnonzero(meta[:, DONE]):
            u: Utterance | None = tick.utterances[row]
            if u is not None and not u.done and self.table.utterances[row] is u:
                u.done = True
                self._end(u.stream, None if u.spoke else TextError("text has nothing speakable in it"))
                self._drop(u)  # the row goes idle with the next tick's updates

    def _mark_first_steps(self, tick: Tick, ready: np.ndarray) -> None:
        """Mark the streams of ``tick`` that it stepped for the first time (`Stream.mark` "stepped": when that tick
        was launched); forget those that left meanwhile. Only just-started streams are looked at."""
        waiting = []
        for u in self._unstepped:
            if self.table.by_stream.get(u.stream) is not u:
                continue
            row = u.slot
            if 0 <= row < tick.n and tick.utterances[row] is u and ready[row]:
                u.stream.mark("stepped", tick.launched_at)
                u.stream.ticks["stepped"] = tick.serial
            else:
                waiting.append(u)
        self._unstepped = waiting

    def _schedule_units(self, schedules: list) -> None:
        """Tell each prefilled stream when its new units are spoken (its phoneme and word timings)."""
        for utterances, firsts, counts, schedule in schedules:
            begin, durations = schedule.numpy() if isinstance(schedule, torch.Tensor) else schedule
            for i, (u, first, count) in enumerate(zip(utterances, firsts, counts)):
                if count and self.table.holds(u):
                    u.stream.schedule(first, begin[i, :count].tolist(), durations[i, :count].tolist())

    def _hand_out(self, tick: Tick, rows: np.ndarray, frames: np.ndarray) -> None:
        streams = [tick.utterances[r].stream if tick.utterances[r] is not None else None for r in rows]
        for stream in streams:
            if stream is not None and "due" not in stream.marks:
                stream.mark("due")
                stream.ticks["due"] = tick.serial
        self.codec_path.hand_out(tick, rows, frames, streams)

    def _step_for(self, n: int) -> Callable:
        """The step for bucket ``n``, built by the step factory on first use (eager if it cannot be built)."""
        step = self._steps.get(n)
        if step is None:
            step, kind = decode_step, "eager"
            if self._factory is not None:
                try:
                    step = self._factory(self.model, self._view(n), n, self.device)
                    kind = getattr(step, "kind", step_kind_of(self._factory))  # what was built, not what was hoped for
                except Exception as err:  # no compiler, say: serve eagerly rather than not at all
                    warnings.warn(f"{self.step_kind} step for {n} slots unavailable, running eagerly: {err}")
            self.step_kind = kind
            self._steps[n] = step
        return step

    def _view(self, n: int) -> StepCaches:
        if n not in self._views:
            self._views[n] = self.caches.view(n)
        return self._views[n]

    def _recover(self, err: Exception) -> None:
        """After a fault of the batched tick: every live stream fails with EngineError, every slot and the
        decoder state return to empty, and the engine serves new streams as before."""
        for u in [u for u in self.table.utterances if u is not None] + [u for u, _ in self._todo.parks]:
            self._drop(u)
            u.stream.finish(EngineError(f"internal error: {err}"))
        self._inflight.clear()
        for _, state in self._todo.restores:
            state.release()
        self._todo, self._schedules = DeviceUpdates(), []
        self._any_ready = False
        everything = torch.ones(self.max_streams, dtype=torch.bool, device=self.device)
        self.slots.reset(everything)
        self._flags.cleared(slice(None))
        self.caches.text_stack.reset(everything)
        self.caches.audio_stack.reset(everything)
        self.codec_path.reset_all(everything)


@dataclass
class Tick:
    n: int
    utterances: list[Any]  # who held each of the first n slots when the tick was launched (Utterance or None)
    generation: np.ndarray
    schedules: list
    timer: Timer
    serial: int  # ticks launched before it
    launched_at: float
    meta: Any = None  # (n, len(META)): a tensor, or a pinned host tensor on a GPU
    audio: Any = None  # frame audio (n, hop) with a frame codec
    ready: Any = None  # CUDA event: the tick's results are on the host
