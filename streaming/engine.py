"""The serving engine: many streams share one batch of slots and advance together, one AR step per frame
tick, with text arriving incrementally and audio decoded chunk by chunk.

Threads: callers talk to the engine through `Stream` objects (thread-safe), which tell it what happened through
its inbox (`text_arrived`, `cancelled`, `hold_changed`, `flow_changed`). A text thread (`TextWorker`) phonemises
arriving text, so a burst of new text never stalls the tick. The engine thread owns the slots, the model and
the caches; each tick it
  1. schedules: handles the events since the last tick and grants free slots (`streaming.events`, the slot
     table `streaming.slot_table`), parks stalled slots and restores parked ones (`streaming.parking_policy`),
     chooses and encodes new text in one padded text-encoder call (`streaming.prefill`), and applies all of it
     to the device as batched ops (`DeviceUpdates`);
  2. executes: steps every ready slot of the bucket that covers the live ones (`streaming.tick_runner`: one AR
     step, sampling and the slots' bookkeeping as batched tensor ops, `streaming.slots`; on a GPU all of it one
     CUDA graph, `streaming.step_caches.TickGraph`) and launches the codec (`streaming.codec_path`);
  3. updates: collects a launched tick (`Tick`): hands out the chunks that are due, ends finished streams and
     notes each slot's unit.
Host work per tick is proportional to the events, not the slots: no per-slot Python loop in the steady state,
and on a GPU one host sync per tick (waiting for the previous tick's audio while this tick's step runs).

Open streams and slots are counted apart: `open` admits up to ``max_open`` streams, and a stream holds one of
the ``max_streams`` slots only while it can speak; a stream that could not step for ``park_after_s`` is parked
and its slot goes to the next stream waiting for one (`streaming.parking_policy`).
"""

from __future__ import annotations

import atexit
import gc
import os
import sys
import threading
import time
import traceback
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from streaming.codec_path import CpuCodecPath, FrameCodecPath
from streaming.device_io import HostToDevice
from streaming.device_updates import DeviceUpdates, HostFlags
from streaming.errors import BadState, EngineError, ParkedStateLost, ServerFull, UnknownVoice
from streaming.events import Events, step_kind_of
from streaming.live_figures import FIGURES_KEPT, Recent
from streaming.parking import ParkingConfig, ParkingStore
from streaming.parking_policy import ParkingPolicy
from streaming.prefill import Prefill
from streaming.reservations import Full, Reservations
from streaming.sentence_reader import ProcessReader
from streaming.slot_mover import SlotMover
from streaming.slot_table import SlotTable, Utterance
from streaming.slots import PACE_STRETCH, Slots
from streaming.step_caches import TEXT_RING, StepCaches
from streaming.stream import Stream
from streaming.text_worker import TextWorker
from streaming.textstream import StartLatency, engine_lookahead
from streaming.tick_runner import TickRunner
from tts.codec import Codec
from tts.model import TTSModel
from tts.text import MAX_TEXT_CHARS
from tts.voices import blend_preset

__all__ = [
    "BadState",
    "CPU_STREAMS",
    "Engine",
    "EngineError",
    "GPU_STREAMS_CAP",
    "ParkedStateLost",
    "SamplingConfig",
    "TICK_PHASES",
    "ServerFull",
    "UnknownVoice",
    "default_max_streams",
]
StepFactory = Callable[..., Callable]  # factory(model, caches, batch, device) -> step (see COMMON contracts)
# On a GPU the engine thread shares the interpreter lock with every reader and the text thread; when it asks
# for the lock back (after a device wait) the holder keeps it up to the switch interval (Python's default 5 ms):
# 0.5 ms cut late chunks and tick p99 at 1,024 streams on an H200 (docs/decisions.md).
SWITCH_INTERVAL_S = 0.0005
CPU_STREAMS = 8  # default slots on a CPU: a step costs what its active slots cost, so idle slots are free
GPU_STREAMS_CAP = 1024  # default cap on a GPU; memory would allow far more (`default_max_streams`)
TICK_PHASES = ("events", "launch", "wait", "hand_out")  # a tick's parts, the columns of `Engine.tick_phases`
# A seeded stream's step runs with at least this many rows. ONNX Runtime's int8 MatMulNBits (the default CPU step)
# takes another kernel for a one-row product than for two or more: a row's logits at batch 1 differ from the same
# row's at batch 2-8 by up to ~5e-6, while from 2 rows on they are bit-identical whatever the other rows hold
# (measured on the shipped step, batches 1/2/4/8). One idle row costs ~0.45 ms of CPU a step (2-core AMD EPYC),
# paid only while a seeded stream is alone.
EXACT_MIN_ROWS = 2
ROW_SENSITIVE_STEPS = ("onnxruntime-int8",)  # the steps that need it (eager PyTorch: the same at 1 row as at 2)


@dataclass
class SamplingConfig:
    temperature: float = 0.7
    top_k: int = 40


class Engine(Events, Prefill, ParkingPolicy, TickRunner):
    """Many streams on one batch of slots (module docstring). Its parts: `Events`, `Prefill`, `ParkingPolicy`,
    `TickRunner` (one job each, on the engine thread), `SlotTable`, and the codec path (`CpuCodecPath` or
    `FrameCodecPath`)."""

    _cores_split = False

    def __init__(
        self,
        model: TTSModel,
        codec: Codec,
        voices: dict[str, dict],
        max_streams: int | None = None,
        device: str = "cpu",
        sampling: SamplingConfig | None = None,
        max_chars: int = MAX_TEXT_CHARS,
        max_queued_seconds: float = 4.0,
        seed: int = 0,
        step_factory: StepFactory | None = None,
        max_waiting: int | None = None,
        frame_codec: bool | None = None,
        max_open: int | None = None,
        parking: ParkingConfig | None = None,
        speculative: bool = True,
        text_process: bool | None = None,
    ):
        self.model, self.codec, self.device = model.eval(), codec.eval(), torch.device(device)
        self.cfg, self.voices = model.cfg, voices
        self.default_voice = next((n for n, v in voices.items() if v.get("default")), next(iter(voices)))
        self.sample_rate = codec.cfg.sample_rate
        self.frame_seconds = 1 / codec.cfg.frame_rate
        self.max_streams = default_max_streams(model, codec, self.device, max_streams)
        self.max_open = max(self.max_streams, max_open or self.max_streams)  # streams open at once, slot or not
        self.parking = parking or ParkingConfig()
        self.store = ParkingStore(self.parking, on_loaded=self.wake)
        self._fingerprint: str | None = None
        self.max_chars, self.max_queued = max_chars, max_queued_seconds
        self.speculative = speculative  # encode units before their right context is there (`_on_text`)
        self.sampling = sampling or SamplingConfig()
        self.seeds = torch.Generator().manual_seed(seed)  # draws the seed of every unseeded stream
        self.start_latency = StartLatency()  # release -> first audio of word-by-word starts (the start hold's)
        if self.device.type == "cpu" and not Engine._cores_split:  # the AR step and the codec worker run side
            torch.set_num_threads(max(1, torch.get_num_threads() // 2))  # by side: split the cores, once a process
            Engine._cores_split = True
        self.frame_codec = self.device.type == "cuda" if frame_codec is None else frame_codec
        if self.device.type == "cuda":
            sys.setswitchinterval(min(sys.getswitchinterval(), SWITCH_INTERVAL_S))
        self._build_device_state(self.max_streams)
        # Live figures of the last FIGURES_KEPT ticks, in fixed memory (`Recent`: ~3 MB for all of them), so a
        # server's memory stays flat (in deques a tick's entries took ~250 B: a server grew ~10 MB in 13 minutes)
        self.step_ms = Recent(FIGURES_KEPT)  # AR step + sampling, per tick
        self.tick_ms = Recent(FIGURES_KEPT)  # a whole tick: events, prefill, step, codec, hand-out
        # its parts (s): events and prefill, launch, waiting for the device, handing out the previous tick's audio
        self.tick_phases = Recent(FIGURES_KEPT, width=4)
        self._waited = 0.0
        self._factory, self._next_factory = step_factory, None
        self._steps: dict[int, Callable] = {}
        self._views: dict[int, StepCaches] = {}
        self.step_kind = step_kind_of(step_factory)
        self._graphs = self._tick_graphs()
        self.mover = SlotMover(
            self.store,
            self.caches,
            self.slots,
            self.device,
            self.max_streams,
            max_open=self.max_open,
            **self.codec_path.mover_rows(),
        )
        if self.device.type == "cuda":  # pinned rows for parking now (each cudaHostAlloc costs ms), not in a park:
            self.mover.prepare()  # a server need not call warm_up
        self._build_host_tables(self.max_streams)
        # thread hand-offs
        self._lock = threading.Lock()  # guards the factory switch
        self._wake = threading.Event()
        self._inbox: deque = deque()  # (kind, stream, payload) from other threads
        self.admission = Reservations(self.max_open, self.max_open if max_waiting is None else max_waiting)
        self.text_worker = TextWorker(self._text_taken)
        # Sentences read in a process of its own (`ProcessReader`: the reading holds the interpreter lock the
        # engine thread needs between torch calls); default: TTS_TEXT_PROCESS=1 in the environment
        if text_process is None:
            text_process = os.environ.get("TTS_TEXT_PROCESS", "") not in ("", "0")
        self.text_reader = ProcessReader() if text_process else None
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="tts-engine", daemon=True)
        self._thread.start()
        atexit.register(self.close)  # stop between ticks: a thread inside torch at exit can abort the process

    def _build_device_state(self, batch: int) -> None:
        """Caches, slot state, voice prefixes and the codec side, for ``batch`` slots."""
        self.caches = StepCaches.empty(self.cfg, batch, self.device)
        self.slots = Slots(self.cfg, batch, TEXT_RING, self.device, stagger=self.frame_codec)
        with torch.no_grad():  # prefix caching: every voice's prefix keys/values (L, V, H, S, D), computed once
            self.prefixes = self.model.voice_prefix(torch.arange(self.cfg.voices, device=self.device))
        self._blend_prefixes: OrderedDict[tuple, tuple] = OrderedDict()  # blends' prefixes (`_voice_prefix`)
        # units confirmed after their frames had started: spoken as encoded before all their right context came
        self._spoken_speculative = torch.zeros((), dtype=torch.long, device=self.device)
        self.io = HostToDevice(self.device, batch)
        if self.frame_codec:  # the one place the codec path is chosen
            self.codec_path = FrameCodecPath(self.codec, batch, self.device, self.io.row_mask)
        else:
            self.codec_path = CpuCodecPath(self.codec, batch, self.device, self.slots)
        self.codec_ms = self.codec_path.codec_ms

    def _build_host_tables(self, batch: int) -> None:
        """What the engine thread alone keeps per slot: O(1) per event to update, numpy where a tick scans."""
        self.table = SlotTable(batch)
        self._parking: list[Utterance] = []  # holds and detaches waiting for the tick in flight (frame codec)
        self.counters = {
            "parks": 0,
            "restores": 0,
            "slot_waits": 0,
            "revised_units": 0,
            "confirmed_units": 0,
        }  # revised: encoded again; confirmed: with all their right context
        self.slot_wait_ms = Recent(FIGURES_KEPT)
        self._todo = DeviceUpdates()  # event updates for the device, applied at the next tick
        self._flags = HostFlags(self.slots, ("closed", "ended", "paused"))  # what the device's flags hold
        self._schedules: list = []  # prefills of the coming tick, for the streams' timings
        self._any_ready = False  # whether the last collected tick had a slot ready to step
        self._ticks = 0
        self._inflight: deque = deque()
        self._unstepped: list[Utterance] = []  # started, not yet stepped: their first step is marked (`_collect`)
        self._handlers = {
            "start": self._on_start,
            "cancel": self._on_cancel,
            "text": self._on_text,
            "flow": self._on_flow,
            "warm": self._on_warm,
            "attach": self._on_attach,
            "hold": self._on_hold,
        }

    # ---- public API -------------------------------------------------------------------------
    def open(
        self,
        voice: str | None = None,
        speed: float = 1.0,
        *,
        seed: int | None = None,
        lookahead_words: int | None = None,
        wait_s: float = 0.0,
    ) -> Stream:
        """A new stream. ``voice``: a shipped voice's name or a blend of them (``"joe:0.6+kumo:0.4"``, see
        `voice_preset`). ``seed`` fixes its sampling noise and so its audio, bit for bit, whatever else runs; unseeded
        streams draw one from the engine's generator. When ``max_open`` streams are open, wait up to ``wait_s``
        seconds in a first-come-first-served queue (at most ``max_waiting`` callers) for one to end, then raise
        ServerFull. An open stream that finds every slot busy waits for one inside the engine (counted in
        `stats` as ``slot_waits``)."""
        preset = self.voice_preset(self.default_voice if voice is None else voice)
        if isinstance(speed, bool) or not isinstance(speed, (int, float)) or not 0.25 <= speed <= 4.0:
            raise ValueError(f"speed must be a number from 0.25 to 4.0, not {speed!r}")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise ValueError(f"seed must be an integer, not {seed!r}")
        seeded = seed is not None
        with self._lock:
            if seed is None:
                seed = int(torch.randint(0, 2**62, (), generator=self.seeds))
        stream = Stream(self, preset["name"], float(speed), self.max_chars, seed % 2**63, lookahead_words)
        if self.text_reader is not None:
            stream.text.reader = self.text_reader
        stream.decode_alone = seeded  # bit-identical audio whatever else runs (see CodecWorker.decode)
        stream.gain_db = preset.get("gain_db", 0.0)  # every voice at the same loudness (`tts.loudness.level`)
        stream.text.start_latency_s = self.start_latency.estimate()
        if not self.speculative or self.slots.stretch_max != PACE_STRETCH:  # the start hold counts as the engine
            stream.text.set_engine_lookahead(*engine_lookahead(self.cfg, self.speculative), self.slots.stretch_max)
        try:
            self.admission.admit(stream, wait_s, lambda s: self._inbox.append(("start", s, preset)))
        except Full as err:
            raise ServerFull(str(err)) from None
        self.wake()
        return stream

    def voice_preset(self, voice: str) -> dict:
        """The preset ``voice`` speaks with (`tts.voices.blend_preset`): pace, temperature, ``mix`` (row ->
        weight) and ``weights``, the mix as a (V,) list for the text encoder. Raises UnknownVoice."""
        try:
            preset = blend_preset(voice, self.voices, self.sampling.temperature)
        except ValueError as err:
            raise UnknownVoice(str(err)) from None
        weights = [0.0] * self.cfg.voices
        for row, weight in preset["mix"].items():
            weights[row] = weight
        return preset | {"weights": weights}

    def warm_up(self) -> None:
        """Build the step (and on a GPU the codec's graph) of every slot bucket now, rather than when streams
        first reach it (a CUDA graph capture stalls every stream for a moment). Blocks until done."""
        done = threading.Event()
        self._inbox.append(("warm", None, done))
        self.wake()
        done.wait()
        gc.collect()
        gc.freeze()  # what exists now (model, tables, graphs) lives on: later full collections skip it

    def set_step_factory(self, factory: StepFactory | None) -> None:
        """Run the AR step built by ``factory`` (None: eager) from the next tick on; callable from any thread
        while streams are live (the caches stay, so no stream is dropped or changes beyond float rounding)."""
        with self._lock:
            self._next_factory = (factory,)
        self.wake()

    def set_codec_step(self, step: Callable | None) -> None:
        """Decode CPU chunks with ``step(codes (M, K, T), state) -> (M, T*hop) audio`` (None: the torch decoder,
        `Codec.decode_step`) from the next codec job on; callable from any thread. A GPU's frame codec keeps its own."""
        self.codec_path.set_decode_step(step)

    def stats(self) -> dict:
        """Live figures for a health endpoint: streams, the queue, and recent tick/step/codec times (ms)."""

        def recent(figure: Recent, column: int | None = None):
            values = figure.values(last=2000)
            values = values if column is None else values[:, column]
            if not len(values):
                return {"p50": None, "p99": None}
            p50, p99 = np.nanpercentile(values, [50, 99])
            return {"p50": round(float(p50), 3), "p99": round(float(p99), 3)}

        return {
            "active_streams": self.admission.held,
            "queued": self.admission.queued,
            "max_streams": self.max_streams,
            "max_open": self.max_open,
            "slots_used": int(self.table.live.sum()),
            "waiting_for_slot": len(self.table.starts) + len(self.table.restores),
            **self.counters,
            "slot_wait_ms": recent(self.slot_wait_ms),
            "parking": self.store.stats(),
            "step_kind": self.step_kind,
            "tick_ms": recent(self.tick_ms),
            "step_ms": recent(self.step_ms),
            "codec_ms": recent(self.codec_ms, 0),
            "slowest_ticks_ms": self._slowest_ticks(),
            "start_latency_ms": round(self.start_latency.estimate() * 1000, 1),
            "units_spoken_speculative": int(self._spoken_speculative),
            "codec_queued": self.codec_path.queued(),
        }

    def _slowest_ticks(self, last: int = 2000) -> dict:
        """What the slowest 1 % of the last ``last`` ticks spent their time on, mean ms per part: events and
        prefill, launch (step and sampling; on the CPU the frame codec too), waiting for the device, handing out
        (on the CPU: waiting for room in the codec worker's queue). Example: {"events": 1.0, "launch": 9.0,
        "wait": 0.0, "hand_out": 30.0} says the codec held those ticks up."""
        ticks, parts = self.tick_ms.values(last=last), self.tick_phases.values(last=last)
        if not len(ticks) or len(ticks) != len(parts):
            return {}
        slow = parts[ticks >= np.percentile(ticks, 99)] * 1000
        return {name: round(float(value), 1) for name, value in zip(TICK_PHASES, slow.mean(0))}

    @property
    def active_streams(self) -> int:
        return self.admission.held

    def wake(self) -> None:
        self._wake.set()

    def close(self) -> None:
        """Stop the engine's threads (at the end of a tick); streams still open are left unfinished."""
        self._closing = True
        self.wake()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=2)
        self.text_worker.close()
        if self.text_reader is not None:
            self.text_reader.close()
        self.codec_path.close()
        self.store.close()

    # ---- the inbox: what streams tell the engine (any thread) ----------------------------------
    def text_arrived(self, stream: Stream) -> None:
        """New text, a flush or the end: the text thread takes it (phonemises) and passes the units on."""
        self.text_worker.arrived(stream)

    def cancelled(self, stream: Stream) -> None:
        self._inbox.append(("cancel", stream, None))
        self.wake()

    def hold_changed(self, stream: Stream) -> None:
        """`Stream.hold` or `release`: park the stream at once and keep it parked, or let it go on."""
        self._inbox.append(("hold", stream, None))
        self.wake()

    def flow_changed(self, stream: Stream) -> None:
        """The reader fell behind (queued audio over the limit) or caught up: pause or resume the stream."""
        self._inbox.append(("flow", stream, None))
        self.wake()

    def _text_taken(self, stream: Stream, news) -> None:
        self._inbox.append(("text", stream, news))
        self.wake()

    # ---- engine thread ----------------------------------------------------------------------------
    def _run(self) -> None:
        torch.set_grad_enabled(False)
        while not self._closing:
            self._wake.wait(timeout=0.05)
            self._wake.clear()
            try:
                while self._tick() and not self._closing:
                    pass
            except Exception as err:  # a fault of the batch: fail the streams in it, reset, keep serving
                traceback.print_exc()
                self._recover(err)

    def _tick(self) -> bool:
        """Handle events, step the ready slots, hand out audio. Returns whether to tick again at once.
        With the frame codec (a GPU) the tick just launched stays in flight while the host handles the previous
        one's results."""
        started = time.perf_counter()
        events = self._handle_events()
        n = self.table.bucket(self.max_streams, EXACT_MIN_ROWS if self.step_kind in ROW_SENSITIVE_STEPS else 1)
        launched = n > 0 and (events or self._any_ready)
        handled = time.perf_counter()
        if launched:
            self._launch(n)
            self._ticks += 1
        collecting = time.perf_counter()
        keep = 1 if launched and self.codec_path.overlaps else 0
        self._waited = 0.0
        while len(self._inflight) > keep:
            self._collect(self._inflight.popleft())
        if launched:
            ended = time.perf_counter()
            self.tick_ms.append((ended - started) * 1000)
            self.tick_phases.append(
                (handled - started, collecting - handled, self._waited, ended - collecting - self._waited)
            )
        return launched or bool(self._inflight)


def default_max_streams(model: TTSModel, codec: Codec, device: torch.device, cap: int | None = None) -> int:
    """Slots for an engine: ``cap`` (a flag: `tts serve --max-streams`) or CPU_STREAMS on a CPU; on a GPU,
    as many as half its free memory holds (caches, slot and codec state, and working memory per slot), at
    most ``cap`` (default GPU_STREAMS_CAP)."""
    if device.type != "cuda":
        return cap or CPU_STREAMS
    cfg = model.cfg
    meta = torch.device("meta")
    state = StepCaches.empty(cfg, 1, meta).nbytes
    state += sum(b.nbytes for b in codec.decoder.init_state(1, meta).buffers)
    working = 4 * 2**20  # logits, sampling and codec activations of one slot, over every bucket's graph
    free, _ = torch.cuda.mem_get_info(device)
    return max(1, min(cap or GPU_STREAMS_CAP, int(free * 0.5) // (state + working)))
