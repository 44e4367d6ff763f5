"""The serving engine: many streams share one batch of slots and advance together, one AR step per
frame tick, with text arriving incrementally and audio decoded chunk by chunk.

Threads: callers talk to the engine through `Stream` objects (thread-safe). A text thread phonemises
arriving text (`Stream.take_text`), so a burst of new text never stalls the tick. The engine thread owns
the slots, the model and the caches; each tick it
  1. handles what happened since the last tick (events: starts, cancels, text, readers catching up) and
     encodes new text of every stream that needs it in one padded text-encoder call (`_prefill`),
  2. steps every ready slot of the bucket that covers the live ones (`_launch`: one AR step, sampling and
     the slots' bookkeeping as batched tensor ops, `streaming.slots`; on a GPU all of it one CUDA graph,
     `streaming.decode.TickGraph`),
  3. decodes the completed frames (one codec call per tick) and hands out chunks that are due (`_collect`).
Host work per tick is proportional to the events, not the slots: no per-slot Python loop in the steady
state, and on a GPU one host sync per tick (waiting for the previous tick's audio while this tick's step
runs).

Codec: on the CPU a `CodecWorker` thread decodes due chunks (2, 4, 8, then 16 frames); on a GPU a
`FrameCodec` decodes every completed frame each tick on its own CUDA stream (a CUDA graph), overlapping the
next AR step, and the host hands out chunks on the same schedule.
A new stream's first chunk goes ahead of the CPU codec worker's backlog (`CodecWorker`).

Open streams and slots are counted apart: `open` admits up to ``max_open`` streams, and a stream holds one of
the ``max_streams`` slots only while it can speak. A stream that could not step for ``park_after_s`` (its
text ran dry, or its reader is behind) is parked: its slot state is copied out (`streaming.slot_state`, into
the `streaming.parking` store) and the slot goes to the next stream waiting for one; when its text or its reader
comes back it waits for a slot (restores ahead of new starts) and continues exactly where it stopped.
`detach`/`attach` move a stream's whole state to another engine with the same weights. The engine decides when
a slot's state moves; `SlotMover` copies it.
"""
from __future__ import annotations

import atexit
import contextlib
import gc
import heapq
import os
import sys
import threading
import time
import traceback
import warnings
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from streaming.admission import Admission, Full
from streaming.codec_worker import AudioOutbox, CodecWorker, FrameCodec, exact_convolutions, fast_path_enabled
from streaming.decode import TEXT_RING, StepCaches, TickGraph, decode_step
from streaming.figures import Recent, Timer
from streaming.parking import Parked, ParkingConfig, ParkingStore, pack, unpack, weights_fingerprint
from streaming.sampling import sample
from streaming.sentence_reader import ProcessReader
from streaming.slot_state import DetachRequest, SlotMover, Snapshot, host_state
from streaming.slots import MAX_CHUNK, META, PACE_STRETCH, Slots
from streaming.stream import MOVING, Stream
from streaming.text_worker import TextWorker
from streaming.textstream import StartLatency, engine_lookahead
from tts.alignment import predicted_frames
from tts.codec import Codec
from tts.model import TTSModel
from tts.text import MAX_TEXT_CHARS, TextError
from tts.voices import blend_preset

StepFactory = Callable[..., Callable]  # factory(model, caches, batch, device) -> step (see COMMON contracts)
UNIT, READY, COMPLETED, PENDING, DUE, DONE = range(len(META))
# A stream's unit counts (`Utterance`), in the host state a detach or snapshot carries; a state from before
# speculative encoding lacks the last two: its counts then are the encoded and encodable ones (all final)
COUNTS = ("encoded", "encodable", "unit", "confirmed", "final")
COUNTS_BEFORE = ("encoded", "encodable", "unit", "encoded", "encodable")
URGENT_LEAD = 8  # units encoded ahead of a slot's aligned unit below which its next units are encoded at once
FIGURES_KEPT = 40_000  # ticks of live figures kept (13 min of one stream's 50 ticks a second; benches clear them per load)
ROUTINE_TICKS = 8  # otherwise top-ups wait for every 8th tick, so one text-encoder call serves many slots
# A burst (hundreds of streams starting in one instant) is spread over ticks, so that no tick stalls the
# streams already speaking for long: at most this many slots granted, and rows prefilled, per tick.
GRANTS_PER_TICK = 64
PREFILL_ROWS = 128
# On a GPU the engine thread shares the interpreter lock with every reader and the text thread; when it asks
# for the lock back (after a device wait) the holder keeps it up to the switch interval (Python's default 5 ms).
# 0.5 ms: H200, 1,024 streams at once, late chunks 3,606 -> 806, tick p99 61 -> 46 ms; 512: p99 33 -> 28 ms.
SWITCH_INTERVAL_S = 0.0005
CPU_STREAMS = 8  # default slots on a CPU: a step costs what its active slots cost, so idle slots are free
GPU_STREAMS_CAP = 1024  # default cap on a GPU; memory would allow far more (`default_max_streams`)
BLEND_PREFIXES = 64  # blends whose prefix keys/values stay cached (64 KB each for the shipped model)


class EngineError(RuntimeError):
    code = "engine_error"


class ServerFull(EngineError):
    code = "server_full"


class UnknownVoice(EngineError, ValueError):
    code = "unknown_voice"


class ParkedStateLost(EngineError):
    """A parked stream's state could not be read back from disk (its file truncated or damaged): it cannot
    continue, and ends with this error (code ``engine_error``); the other streams go on."""


class BadState(EngineError, ValueError):
    """`Engine.attach` was given bytes that are not a stream state of an engine with the same weights."""
    code = "bad_state"


@dataclass
class SamplingConfig:
    temperature: float = 0.7
    top_k: int = 40


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
    encoded: int = 0  # units encoded, encodable and its aligned unit, kept here while it holds no slot
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


class Engine:
    _cores_split = False

    def __init__(self, model: TTSModel, codec: Codec, voices: dict[str, dict], max_streams: int | None = None,
                 device: str = "cpu", sampling: SamplingConfig | None = None, max_chars: int = MAX_TEXT_CHARS,
                 max_queued_seconds: float = 4.0, seed: int = 0, step_factory: StepFactory | None = None,
                 max_waiting: int | None = None, frame_codec: bool | None = None, max_open: int | None = None,
                 parking: ParkingConfig | None = None, speculative: bool = True, text_process: bool | None = None):
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
        self.step_kind = _kind(step_factory)
        self._graphs = self._tick_graphs()
        codec = ({"frame_decoder": self.frame_decoder, "outbox": self.outbox, "codec_stream": self.codec_stream}
                 if self.frame_codec else {"codec_worker": self.codec_worker})
        self.mover = SlotMover(self.store, self.caches, self.slots, self.device, self.max_streams,
                               max_open=self.max_open, **codec)
        if self.device.type == "cuda":  # pinned rows for parking now (each cudaHostAlloc costs ms), not in a park:
            self.mover.prepare()  # a server need not call warm_up
        self._build_host_tables(self.max_streams)
        # thread hand-offs
        self._lock = threading.Lock()  # guards the factory switch
        self._wake = threading.Event()
        self._inbox: deque = deque()  # (kind, stream, payload) from other threads
        self.admission = Admission(self.max_open, self.max_open if max_waiting is None else max_waiting)
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
        if self.frame_codec:
            self.frame_decoder = FrameCodec(self.codec, batch, self.device)
            self.outbox = AudioOutbox(batch, MAX_CHUNK, self.codec.cfg.hop)
            self.codec_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
            if self.device.type == "cuda":  # where each tick's table and audio reach the host, in turn
                self._pinned = [(torch.zeros(batch, len(META), dtype=torch.long, pin_memory=True),
                                 torch.zeros(batch, self.codec.cfg.hop, pin_memory=True)) for _ in range(4)]
            self.codec_ms = Recent(FIGURES_KEPT, width=2)  # (ms, frames) per codec call
        else:
            self.codec_worker = CodecWorker(self.codec, batch, self.device)
            self.codec_ms = self.codec_worker.codec_ms

    def _build_host_tables(self, batch: int) -> None:
        """What the engine thread alone keeps per slot: O(1) per event to update, numpy where a tick scans."""
        self.utterances: list[Utterance | None] = [None] * batch
        self._by_stream: dict[Stream, Utterance] = {}  # every open stream: in a slot, parked or waiting for one
        self._free = list(range(batch))  # a heap: the lowest free slot first
        self._encoded = np.zeros(batch, dtype=np.int64)  # units encoded, per slot
        self._encodable = np.zeros(batch, dtype=np.int64)  # units that may be encoded now, per slot
        self._final = np.zeros(batch, dtype=np.int64)  # units whose encoding is final (right context there)
        self._confirmed = np.zeros(batch, dtype=np.int64)  # units encoded with their final encoding
        self._unit = np.zeros(batch, dtype=np.int64)  # each slot's aligned unit at the last collected tick
        self._live = np.zeros(batch, dtype=bool)
        self._generation = np.zeros(batch, dtype=np.int64)  # counts the streams each slot has held
        # Parking: a slot is stalled from the launch of the first tick after its last event in which it could not
        # step (events are what change a stalled slot's device state, so it stays stalled until the next one).
        self._stalled_since = np.full(batch, np.inf)
        self._event_at = np.zeros(batch)  # when an event last changed the slot's device state
        self._restores: deque[Utterance] = deque()  # parked streams with work to do, waiting for a slot: first
        self._starts: deque[Utterance] = deque()  # new streams waiting for a slot
        self._parking: list[Utterance] = []  # holds and detaches waiting for the tick in flight (frame codec)
        self.counters = {"parks": 0, "restores": 0, "slot_waits": 0, "revised_units": 0,
                         "confirmed_units": 0}  # revised: encoded again; confirmed: with all their right context
        self.slot_wait_ms = Recent(FIGURES_KEPT)
        self._todo = _DeviceUpdates()  # event updates for the device, applied at the next tick
        self._flags = _HostFlags(self.slots, ("closed", "ended", "paused"))  # what the device's flags hold
        self._codec_resets: list[int] = []  # slots whose frame decoder state restarts at the next tick
        self._schedules: list = []  # prefills of the coming tick, for the streams' timings
        self._any_ready = False  # whether the last collected tick had a slot ready to step
        self._ticks = 0
        self._inflight: deque = deque()
        self._unstepped: list[Utterance] = []  # started, not yet stepped: their first step is marked (`_collect`)
        self._handlers = {"start": self._on_start, "cancel": self._on_cancel, "text": self._on_text,
                          "flow": self._on_flow, "warm": self._on_warm, "attach": self._on_attach,
                          "hold": self._on_hold}

    # ---- public API -------------------------------------------------------------------------
    def open(self, voice: str | None = None, speed: float = 1.0, *, seed: int | None = None,
             lookahead_words: int | None = None, wait_s: float = 0.0) -> Stream:
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
        if not self.frame_codec:
            self.codec_worker.set_decode_step(step)

    def stats(self) -> dict:
        """Live figures for a health endpoint: streams, the queue, and recent tick/step/codec times (ms)."""
        def recent(figure: Recent, column: int | None = None):
            values = figure.values(last=2000)
            values = values if column is None else values[:, column]
            if not len(values):
                return {"p50": None, "p99": None}
            p50, p99 = np.nanpercentile(values, [50, 99])
            return {"p50": round(float(p50), 3), "p99": round(float(p99), 3)}
        return {"active_streams": self.admission.held, "queued": self.admission.queued, "max_streams": self.max_streams,
                "max_open": self.max_open, "slots_used": int(self._live.sum()), "waiting_for_slot":
                len(self._starts) + len(self._restores), **self.counters, "slot_wait_ms": recent(self.slot_wait_ms),
                "parking": self.store.stats(), "step_kind": self.step_kind, "tick_ms": recent(self.tick_ms),
                "step_ms": recent(self.step_ms), "codec_ms": recent(self.codec_ms, 0),
                "slowest_ticks_ms": self._slowest_ticks(),
                "start_latency_ms": round(self.start_latency.estimate() * 1000, 1),
                "units_spoken_speculative": int(self._spoken_speculative),
                "codec_queued": 0 if self.frame_codec else self.codec_worker.queued}

    def _slowest_ticks(self, last: int = 2000) -> dict:
        """What the slowest 1 % of the last ``last`` ticks spent their time on, mean ms per part: events and
        prefill, launch (step and sampling; on the CPU the frame codec too), waiting for the device, handing out
        (on the CPU: waiting for room in the codec worker's queue). Example: {"events": 1.0, "launch": 9.0,
        "wait": 0.0, "hand_out": 30.0} says the codec held those ticks up."""
        ticks, parts = self.tick_ms.values(last=last), self.tick_phases.values(last=last)
        if not len(ticks) or len(ticks) != len(parts):
            return {}
        slow = parts[ticks >= np.percentile(ticks, 99)] * 1000
        return {name: round(float(value), 1) for name, value in zip(("events", "launch", "wait", "hand_out"),
                                                                      slow.mean(0))}

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
        if not self.frame_codec:
            self.codec_worker.close()
        self.store.close()

    # ---- moving a stream between engines ------------------------------------------------------------
    def detach(self, stream: Stream, timeout: float = 30.0) -> bytes:
        """Park ``stream`` at once and remove it from this engine; its reader here gets no more audio
        (``stream.moved``, `Stream.read` returns None). Returns its whole state (slot state, text front end,
        unread audio, voice, speed, seed, counters) for `attach` on an engine with the same weights, where it
        continues sample-exactly. Raises EngineError if the stream is not open here (or ends meanwhile)."""
        if stream.engine is not self or stream.finished or stream.cancelled or stream.moved:
            raise EngineError("only a stream open on this engine can be detached")
        request = DetachRequest()
        stream.detach_request = request
        stream.detaching = True  # the text thread takes no more text: what it took reaches the engine first
        self.text_arrived(stream)  # and then tells the engine (`_on_text`), in order
        if not request.done.wait(timeout):
            raise EngineError(f"the stream could not be detached within {timeout:g} s")
        if request.error is not None:
            raise request.error
        u = request.utterance
        try:
            if u.parked is not None and not u.parked.settled(timeout):  # the CPU codec worker adds the decoder's rows
                raise EngineError("the stream's decoder state was not captured in time")
            rows = {} if u.parked is None else u.parked.rows
            return pack(self._host_state(u), rows, stream.take_unread(), self.fingerprint)
        finally:
            if u.parked is not None:
                u.parked.release()  # packed (copied), or given up: its pool row goes back

    def attach(self, state: bytes, wait_s: float = 0.0) -> Stream:
        """Continue a stream detached from another engine with the same weights (`detach`): a new Stream that
        first yields the audio its old reader had not read, then goes on where it stopped. Admission as in
        `open`. Raises BadState for bytes that are not such a state, UnknownVoice, ServerFull."""
        try:
            host, rows, unread = unpack(state, self.fingerprint)
        except ValueError as err:
            raise BadState(str(err)) from None
        if rows and host["frame_codec"] != self.frame_codec:
            raise BadState("the stream was detached from an engine with the other codec path (frame codec on/off)")
        if rows and not set(self.mover.row_tensors()) <= set(rows):
            raise BadState("the stream's state lacks rows this engine needs (an engine of another version?)")
        stream = Stream.from_state(self, host["stream"], unread)
        if self.text_reader is not None:
            stream.text.reader = self.text_reader
        preset = self.voice_preset(stream.voice)
        try:
            self.admission.admit(stream, wait_s, lambda s: self._inbox.append(("attach", s, (preset, host, rows))))
        except Full as err:
            raise ServerFull(str(err)) from None
        self.wake()
        self.text_arrived(stream)  # text it had not yet taken
        return stream

    @property
    def fingerprint(self) -> str:
        """A digest of the model's and the codec's weights and configs: a moved stream needs the same."""
        if self._fingerprint is None:
            self._fingerprint = weights_fingerprint(self.model, self.codec)
        return self._fingerprint

    def _host_state(self, u: Utterance) -> dict:
        """``u``'s host state for `detach` and `snapshot` (`slot_state.host_state`); its counts from the slot's
        tables while it holds one."""
        counts = [int(a[u.slot]) for a in self._count_tables()] if u.slot >= 0 else [getattr(u, n) for n in COUNTS]
        return host_state(u, dict(zip(COUNTS, counts)), self.frame_codec)

    # ---- what streams tell the engine (any thread) --------------------------------------------
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
        n = self._bucket()
        launched = n > 0 and (events or self._any_ready)
        handled = time.perf_counter()
        if launched:
            self._launch(n)
            self._ticks += 1
        collecting = time.perf_counter()
        keep = 1 if launched and self.frame_codec else 0
        self._waited = 0.0
        while len(self._inflight) > keep:
            self._collect(self._inflight.popleft())
        if launched:
            ended = time.perf_counter()
            self.tick_ms.append((ended - started) * 1000)
            self.tick_phases.append((handled - started, collecting - handled, self._waited,
                                     ended - collecting - self._waited))
        return launched or bool(self._inflight)

    def _bucket(self) -> int:
        """Slots to step: the power of two covering the highest live slot, at most max_streams (0: none live).
        Example: live slots {0, 2, 5} of 16 -> 8; {0} -> 1; {9} -> 16; {9} of 12 -> 12."""
        live = np.flatnonzero(self._live)
        if not len(live):
            return 0
        return min(self.max_streams, 1 << int(live[-1]).bit_length())

    # -- events: O(number of events) host work, device updates batched per tick --
    def _handle_events(self) -> bool:
        with self._lock:
            if self._next_factory is not None:
                (self._factory,), self._next_factory = self._next_factory, None
                self._steps.clear()
                self.step_kind = _kind(self._factory)
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
                    self._fail(stream, err if isinstance(err, (TextError, EngineError)) else
                               EngineError(f"internal error: {type(err).__name__}: {err}"))
        if self.store.has_lost:
            self._end_lost()
        if self._parking:
            self._continue_parks()
        if self.parking.park_after_s > 0:
            self._choose_parks()
        if self._free and (self._starts or self._restores):
            self._grant_slots()
        prefill = self._choose_prefill()
        if prefill or handled or self._todo.any():
            todo, self._todo = self._todo, _DeviceUpdates()
            self._apply(todo, prefill)
            return True
        return False

    def _on_start(self, stream: Stream, preset: dict) -> None:
        if stream.cancelled:
            self._release()
            return
        u = Utterance(stream, -1, preset, stream.speed * preset["pace"])
        self._by_stream[stream] = u
        self._wait_for_slot(u, "start")

    def _on_attach(self, stream: Stream, payload) -> None:
        """A stream detached from another engine (`attach`): parked here with its state, then restored."""
        preset, host, rows = payload
        if stream.cancelled:
            self._release()
            return
        u = Utterance(stream, -1, preset, stream.speed * preset["pace"], units=list(host["units"]),
                      unit_base=host["unit_base"], closed_upto=host["closed_upto"], text_ended=host["text_ended"],
                      spoke=host["spoke"], **{name: host.get(name, host[old]) for name, old in zip(COUNTS, COUNTS_BEFORE)})
        self._by_stream[stream] = u
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
                if self.frame_codec:
                    with torch.cuda.stream(self.codec_stream) if self.codec_stream else contextlib.nullcontext():
                        self.frame_decoder.prepare(n)
                if n == self.max_streams:
                    break
                n *= 2
            self.mover.prepare()  # parking's buffers, row pool and slot views: no park makes them
        finally:
            done.set()

    def _on_cancel(self, stream: Stream, _) -> None:
        u = self._by_stream.get(stream)
        if u is not None:
            self._drop(u)

    def _on_flow(self, stream: Stream, _) -> None:
        """The reader fell behind or caught up: pause or resume its slot (see `Stream.deliver`/`read`); a stream
        parked while its reader was behind is restored once the reader is down to ``resume_samples``."""
        u = self._by_stream.get(stream)
        if u is None:
            return
        stream.paused = True  # before reading the count: a read after this sees the flag and tells us again
        if stream.queued_samples <= stream.resume_samples:
            stream.paused = False
        if u.slot >= 0 and u not in self._parking:  # (one that parks once the tick in flight is in stays paused)
            self._todo.paused.append((u, stream.paused))
            self._stalled_since[u.slot] = np.inf  # not parked in this tick: the event is not applied yet
        elif u.parked is not None and (u.parked_paused or u.news) and not stream.paused:
            self._wait_for_slot(u, "restore")

    def _on_hold(self, stream: Stream, _) -> None:
        """Held (`Stream.hold`): park now, without the grace, and take no slot until released; its text and its
        reader's reads are kept meanwhile. Released: back in a slot (after the reader catches up, if it is behind);
        one that has nothing to do parks again after the grace."""
        u = self._by_stream.get(stream)
        if u is None or u.detach is not None:
            return
        if stream.held:
            if u.slot >= 0:
                self._park_soon(u)
            elif u.waiting is not None:
                (self._starts if u.waiting == "start" else self._restores).remove(u)
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
        u = self._by_stream.get(stream)
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
            self._encodable[u.slot], self._final[u.slot] = encodable, final
            self._todo.flags.append(u)
            self._stalled_since[u.slot] = np.inf  # not parked in this tick: the news is not applied yet
            return
        u.encodable, u.final = encodable, final
        if u.parked is not None and (units or closed or ended):
            u.news = True
            if not stream.paused:  # else the reader catching up restores it
                self._wait_for_slot(u, "restore")

    def _fail(self, stream: Stream, error: Exception) -> None:
        u = self._by_stream.get(stream)
        if u is not None:
            self._drop(u)
        self._end(stream, error)

    def _end(self, stream: Stream, error: Exception | None) -> None:
        """End a stream after the audio already on its way to it (the codec worker keeps the order)."""
        if stream.detach_request is not None:  # it ended before it could move
            stream.detach_request.fail(EngineError("the stream ended before it could be detached"))
        if self.frame_codec:
            stream.finish(error)
        else:
            self.codec_worker.finish(stream, error)

    def _drop(self, u: Utterance) -> None:
        """The stream leaves the engine: its slot, parked state or place in a queue is freed, and its place in
        admission goes to the next caller waiting in `open`."""
        if self._by_stream.get(u.stream) is not u:
            return
        del self._by_stream[u.stream]
        if u.slot >= 0:
            self._vacate(u)
        if u.parked is not None:
            self.store.discard(u.parked)
            u.parked = None
        if u.waiting is not None:
            (self._starts if u.waiting == "start" else self._restores).remove(u)
            u.waiting = None
        self._release()

    def _vacate(self, u: Utterance) -> None:
        """The slot is free for the next tick's starts and restores; its row goes idle on the device."""
        slot = u.slot
        self.utterances[slot], u.slot = None, -1
        self._live[slot] = False
        for table in self._count_tables()[:2] + self._count_tables()[3:]:  # (its aligned unit stays till a start)
            table[slot] = 0
        self._stalled_since[slot] = np.inf
        heapq.heappush(self._free, slot)
        self._todo.frees.append(slot)

    def _count_tables(self) -> list[np.ndarray]:
        """The per-slot host counts named in COUNTS, in that order."""
        return [self._encoded, self._encodable, self._unit, self._confirmed, self._final]

    def _release(self) -> None:
        """A reservation ends: the first caller waiting in `open` gets it (its start comes next tick)."""
        self.admission.release()

    # -- slots: who gets one, parking and restoring --
    def _wait_for_slot(self, u: Utterance, why: str) -> None:
        """Queue ``u`` for a slot (granted at the end of this tick's events): restores ahead of starts. A held
        stream waits for its release (`_on_hold`)."""
        if u.waiting is not None or u.stream.held:
            return
        u.waiting, u.waiting_since = why, time.perf_counter()
        (self._starts if why == "start" else self._restores).append(u)
        if why == "restore":
            self.store.want(u.parked)  # a state on disk starts loading now
        if len(self._free) < len(self._starts) + len(self._restores):
            self.counters["slot_waits"] += 1

    def _grant_slots(self) -> None:
        """Free slots to the waiting streams: parked ones whose state is in memory first, then new ones; at most
        GRANTS_PER_TICK a tick (the rest in the next ticks, in order)."""
        granted = 0
        while self._free and (self._starts or self._restores) and granted < GRANTS_PER_TICK:
            granted += 1
            u = next((r for r in self._restores if r.detach is None and self.store.want(r.parked)), None)
            if u is None and not self._starts:
                return  # only restores whose state is still loading
            u = u or self._starts[0]
            (self._starts if u.waiting == "start" else self._restores).remove(u)
            self.slot_wait_ms.append((time.perf_counter() - u.waiting_since) * 1000)
            self._occupy(u)

    def _occupy(self, u: Utterance) -> None:
        slot = heapq.heappop(self._free)
        why, u.waiting, u.slot = u.waiting, None, slot
        self.utterances[slot] = u
        self._live[slot] = True
        self._generation[slot] += 1
        for name, table in zip(COUNTS, self._count_tables()):
            table[slot] = getattr(u, name)
        if why == "restore":
            self.store.take(u.parked)
            self._todo.restores.append((u, u.parked))
            u.parked = None
            self.counters["restores"] += 1
            u.stream.resume_samples = u.stream.max_queued_samples
        else:
            self._todo.starts.append(u)
            u.stream.mark("slot")
            self._unstepped.append(u)
        self._todo.flags.append(u)  # text that came while it held no slot
        self._todo.paused.append((u, u.stream.paused))

    def _choose_parks(self) -> None:
        """Park the slots stalled for ``park_after_s``. Such a slot did nothing in the tick in flight either
        (`_stalled_since`), so its state is complete on the device when this tick's updates copy it out.
        Example, park_after_s 0.5: slot 3's text runs dry; the first tick launched after its last event in which
        it cannot step was launched at t = 10.00 s, so its stalled_since is 10.00 (later such ticks keep the
        minimum); the first tick handled after 10.50 parks it. Had text come at 10.30, that event would have
        reset it to infinity, and the next tick launched after 10.30 in which it cannot step would set it anew."""
        cutoff = time.perf_counter() - self.parking.park_after_s
        stalled = np.flatnonzero(self._live & (self._stalled_since <= cutoff))
        for slot in stalled:
            self._park(self.utterances[slot])

    def _park(self, u: Utterance) -> None:
        for name, table in zip(COUNTS, self._count_tables()):
            setattr(u, name, int(table[u.slot]))
        u.parked, u.parked_paused, u.news = Parked(), u.stream.paused, False
        if u.parked_paused:  # restore once the reader has half the queue to play, not at the first read
            u.stream.resume_samples = u.stream.max_queued_samples // 2
        self._todo.parks.append((u, u.slot))
        self._vacate(u)
        self.counters["parks"] += 1

    def _park_rows(self, parks: list[tuple[Utterance, int]]) -> None:
        """Copy the parked slots' state out (`SlotMover.park`); hand the detached ones over."""
        self.mover.park([(u.parked, slot) for u, slot in parks])
        for u, _ in parks:
            if u.detach is not None:
                self._finish_detach(u)

    def _restore_rows(self, restores: list[tuple[Utterance, Parked]]) -> list[int]:
        """Put parked states into their new slots (`SlotMover.restore`); returns the slots."""
        rows = [u.slot for u, _ in restores]
        self.mover.restore(rows, [p for _, p in restores])
        if self.frame_codec:  # the restored decoder state stands: no reset pending from the slot's last holder
            restored = set(rows)
            self._codec_resets = [r for r in self._codec_resets if r not in restored]
        return rows

    def _end_lost(self) -> None:
        """End the streams whose parked state could not be read back from disk (`ParkingStore.lost`)."""
        for parked in self.store.lost():
            u = next((u for u in self._by_stream.values() if u.parked is parked), None)
            if u is not None:
                self._fail(u.stream, ParkedStateLost(f"the stream's parked state could not be read back from "
                                                     f"disk: {parked.error}"))

    # -- parking at once (hold, detach) --
    def _park_soon(self, u: Utterance) -> None:
        """Park ``u``'s slot in this tick's updates; if the tick in flight may be stepping it (the frame codec),
        pause it now and park it once that tick is collected (`_continue_parks`)."""
        if not (self.frame_codec and self._inflight):
            self._park(u)
        elif u not in self._parking:
            self._todo.paused.append((u, True))
            u.park_after = self._ticks
            self._parking.append(u)

    def _continue_parks(self) -> None:
        waiting, self._parking = self._parking, []
        for u in waiting:
            if self._by_stream.get(u.stream) is not u:  # ended meanwhile
                if u.detach is not None:
                    u.detach.fail(EngineError("the stream ended before it could be detached"))
                continue
            if u.slot >= 0 and any(tick.serial < u.park_after for tick in self._inflight):
                self._parking.append(u)
            elif u.slot >= 0:
                self._park(u)
            elif u.detach is None:
                continue  # a hold, parked
            elif self.store.want(u.parked):
                self._finish_detach(u)
            else:
                self._parking.append(u)

    # -- detach: park at once, then hand the state to the caller --
    def _start_detach(self, u: Utterance) -> None:
        u.detach = u.stream.detach_request
        if u.slot >= 0:
            self._park_soon(u)  # finished in that tick's `_park_rows`
        elif u.parked is not None and not self.store.want(u.parked):
            self._parking.append(u)  # its state is on its way back from disk
        else:
            self._finish_detach(u)

    def _finish_detach(self, u: Utterance) -> None:
        """Hand the detached stream to `detach` (which reads its parked rows) and forget it here."""
        request, u.detach = u.detach, None
        parked = u.parked
        if parked is not None:
            self.store.take(parked)
        self._drop(u)
        u.parked = parked  # the CPU codec worker may still be adding the decoder's rows: `detach` waits for them
        request.utterance = u
        request.done.set()

    def _choose_prefill(self) -> list[tuple[Utterance, int]]:
        """Slots whose encoded lead over their aligned unit ran low and that have units to encode: encode up
        to the ring's limit (`Slots.encode_limit`). Urgent ones (a first prefill, or a lead of at most
        URGENT_LEAD units) go now; routine top-ups (a lead of at most half the ring) every ROUTINE_TICKS ticks,
        many slots in one call; at most PREFILL_ROWS slots a tick, the lowest leads first. A slot that could not
        step goes now whatever its lead: units without frames count in the lead but give it nothing to speak.
        Example, ring 32, behind 3: at unit 20 with 33 encoded (lead 13) and 80 received, a routine top-up encodes
        units 33..48 (up to 20 + 32 - 3 = 49, exclusive); at unit 11 with 29 encoded (lead 18) of which 12..28
        have no frames, the slot cannot step, and units 29..39 are encoded at once."""
        unit = np.maximum(self._unit, 0)
        lead = self._encoded - unit
        low = self.slots.encode_limit(0) // 2 if self._ticks % ROUTINE_TICKS == 0 else URGENT_LEAD
        stalled = self._stalled_since < np.inf
        room = self._encoded < self.slots.encode_limit(unit)
        # speculative units whose right context grew: revised as soon as the AR may come near them
        revise = (self._final > self._confirmed) & (self._confirmed < self._encoded) & (self._confirmed - unit <= low)
        need = np.flatnonzero(((self._encodable > self._encoded) & room
                               & ((lead <= low) | (self._encoded == 0) | stalled)) | revise)
        if len(need) > PREFILL_ROWS:  # the lowest leads now, the rest next tick
            need = np.sort(need[np.argsort(lead[need], kind="stable")[:PREFILL_ROWS]])
        chosen = []
        for slot in need:
            stop = min(int(self._encodable[slot]), self.slots.encode_limit(int(unit[slot])),
                       int(self._encoded[slot]) + self.slots.encode_limit(0))
            stop = max(stop, int(self._encoded[slot]))  # a revision alone re-encodes what is there
            chosen.append((self.utterances[slot], stop))
        return chosen

    def _apply(self, todo: "_DeviceUpdates", prefill: list[tuple[Utterance, int]]) -> None:
        """This tick's event updates on the device, each kind as one batched op: parked rows are copied out
        before freed rows are reset, restored rows written after new rows start."""
        upload, holds = self._upload, self._holds
        if todo.parks:
            self._park_rows(todo.parks)
        if todo.frees:
            self.slots.reset(self._row_mask(todo.frees))
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
            if self.frame_codec:
                self._codec_resets += rows
            else:
                self.codec_worker.reset(rows)
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
            closed = [self._confirmed[s] == flagged[s].closed_upto == flagged[s].received for s in rows]
            ended = [flagged[s].text_ended and self._confirmed[s] == flagged[s].received for s in rows]
            self._flags.write("closed", rows, closed, upload)
            self._flags.write("ended", rows, ended, upload)
            touched += rows
        paused = {u.slot: value for u, value in todo.paused if holds(u)}  # the last word counts
        if paused:
            self._flags.write("paused", list(paused), list(paused.values()), upload)
            touched += list(paused)
        if touched:  # these slots' device state changed: they may step again
            self._event_at[touched] = time.perf_counter()
            self._stalled_since[touched] = np.inf

    def _holds(self, u: Utterance) -> bool:
        return u.slot >= 0 and self.utterances[u.slot] is u

    def _start_caches(self, rows: torch.Tensor, utterances: list[Utterance]) -> None:
        """Fresh caches in ``rows`` with each stream's voice prefix ((L, M, H, S, D) keys/values: all layers
        in one store, `StepCaches.start`)."""
        prefixes = [self._voice_prefix(u.voice) for u in utterances]  # per stream (L, 1, H, S, D) keys, values
        stacked = prefixes[0] if len(prefixes) == 1 else tuple(torch.cat([p[i] for p in prefixes], 1) for i in (0, 1))
        self.caches.start(rows, stacked)

    def _voice_prefix(self, preset: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """(L, 1, H, S, D) prefix keys/values of a voice: a shipped voice's row of ``prefixes``; a
        blend's computed once and kept, keyed by its mix (the normalised spec), the least recently used of
        more than BLEND_PREFIXES dropped (a stream holds its own copy in the caches)."""
        if len(preset["mix"]) == 1:
            row = next(iter(preset["mix"]))
            return tuple(t[:, row:row + 1] for t in self.prefixes)
        key = tuple(preset["mix"].items())
        if key in self._blend_prefixes:
            self._blend_prefixes.move_to_end(key)
        else:
            with torch.no_grad():
                weights = self._upload([preset["weights"]], torch.float32)  # (1, V)
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
        m, upload = len(w.rows), self._upload
        # (M,) columns, a few uploads in all (each is a torch call, three on a GPU)
        rows_d, counts_d, first_d, leads_d, offsets_d, settles_d = self._upload_columns(
            w.rows, w.counts, w.firsts, w.leads, w.offsets, w.settles)
        opens_d, pieces_d, flushes_d = self._upload_columns(w.opens, w.pieces, w.flushes, dtype=torch.bool)
        if any(w.fresh):  # a slot's first prefill: its chunk sizes, by whether its text outran the start hold
            self.slots.choose_schedules(rows_d, *self._upload_columns(w.fresh, w.at_once, dtype=torch.bool))
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

    def _prefill_windows(self, chosen: list[tuple[Utterance, int]]) -> "_PrefillRows":
        """Host side of a prefill: each row's unit window (padded into one (M, L) array) and what to take from it,
        from the slot's confirmed count to ``stop``, and how many of those it confirms; the slots' encoded and
        confirmed counts move on, and units no later prefill reads are forgotten."""
        look = self.cfg.text_lookahead
        w, windows = _PrefillRows(), []
        for u, stop in chosen:
            slot = u.slot
            start = max(int(self._confirmed[slot]), stop - self.slots.ring)  # older ones are no longer read
            lo, hi = max(0, start - look), min(u.received, stop + look)
            w.rows.append(slot)
            u.stream.mark("prefill")
            windows.append(u.units[lo - u.unit_base:hi - u.unit_base])
            w.offsets.append(start - lo)
            w.counts.append(stop - start)
            w.firsts.append(start)
            confirmed = min(int(self._final[slot]), stop)
            w.settles.append(max(0, confirmed - start))
            w.voices.append(u.voice["weights"])  # (V,): one-hot for a shipped voice
            w.rates.append(u.rate)
            w.leads.append(u.received - max(int(self._unit[slot]), 0))
            w.opens.append(not u.text_ended and u.closed_upto != u.received)
            w.pieces.append(u.stream.text.in_pieces)
            w.fresh.append(int(self._encoded[slot]) == 0)
            w.at_once.append(u.stream.text.released_at_once)
            self.counters["revised_units"] += max(0, int(self._encoded[slot]) - start)
            self._encoded[slot], self._confirmed[slot] = stop, max(start, confirmed)
            # this prefill confirms the last unit of text a flush closed (not the end): a pause goes after it
            w.flushes.append(not u.text_ended and u.closed_upto == u.received == stop == self._confirmed[slot])
            old = int(self._confirmed[slot]) - look - 1 - u.unit_base  # host memory stays flat on long speech
            if old > 1024:
                del u.units[:old]
                u.unit_base += old
        w.units = np.zeros((len(w.rows), max(map(len, windows))), dtype=np.int64)  # (M, L), 0 = padding
        for i, window in enumerate(windows):
            w.units[i, :len(window)] = window
        return w

    # -- the batched tick --
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
        tick = _Tick(n, list(self.utterances[:n]), self._generation[:n].copy(), self._schedules, timer,
                     self._ticks, launched_at)
        self._schedules = []
        if not self.frame_codec:
            tick.meta = meta
        elif cuda:
            self._decode_frames_cuda(tick, meta, codes)
        else:
            reset = self._take_codec_resets()
            timer.mark()
            tick.audio = self.frame_decoder.run(n, codes, meta[:, COMPLETED].bool(), reset).numpy().copy()
            timer.mark()
            tick.meta = meta
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
        return slots.advance(sampled, ready, unit, keep_codes=not self.frame_codec)

    def _decode_frames_cuda(self, tick: "_Tick", meta: torch.Tensor, codes: torch.Tensor) -> None:
        """The codec on its own CUDA stream, overlapping the next tick's step: it first copies what it reads of
        this tick's outputs (which the next tick's graph rewrites; the main stream waits for that copy only),
        then decodes and copies the audio to a pinned buffer of a small ring (no allocation per tick)."""
        n, timer = tick.n, tick.timer
        reset = self._take_codec_resets()
        main = torch.cuda.current_stream(self.device)
        self.codec_stream.wait_stream(main)
        with torch.cuda.stream(self.codec_stream):
            if reset is not None:
                reset.record_stream(self.codec_stream)
            if self._graphs is None:  # eager outputs: fresh tensors, kept alive for the codec stream
                for t in (meta, codes):
                    t.record_stream(self.codec_stream)
            self.frame_decoder.take(n, codes, meta[:, COMPLETED].bool(), reset)
            host_meta, host_audio = self._pinned[self._ticks % len(self._pinned)]
            host_meta[:n].copy_(meta, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record()
            timer.mark()
            audio = self.frame_decoder.decode(n)
            timer.mark()
            host_audio[:n].copy_(audio, non_blocking=True)
            tick.ready = torch.cuda.Event()
            tick.ready.record()
        main.wait_event(copied)
        tick.meta, tick.audio = host_meta[:n], host_audio[:n]

    def _tick_graphs(self) -> dict | None:
        """Captured ticks by bucket when they can serve: a GPU with the frame codec, graphs not switched off
        (TTS_NO_GRAPH=1), and a step factory (None asks for the eager step). They step with `decode_step`
        itself, captured inside the tick, in place of the factory's step (on a GPU that is the same step)."""
        wanted = (self.device.type == "cuda" and self.frame_codec and self._factory is not None
                  and fast_path_enabled("graph"))
        return {} if wanted else None

    def _take_codec_resets(self) -> torch.Tensor | None:
        resets, self._codec_resets = self._codec_resets, []
        return self._row_mask(resets) if resets else None

    def _graph_for(self, n: int) -> "TickGraph | None":
        """The captured tick of bucket ``n`` (built on first use), or None: no CUDA graphs here (the CPU, no
        step factory, TTS_NO_GRAPH=1) or the capture failed (then the eager tick serves, with a warning)."""
        if self._graphs is None:
            return None
        graph = self._graphs.get(n)
        if graph is None:
            try:
                graph = TickGraph(self.model, self._view(n), self.slots, n, self.sampling.temperature,
                                  self.sampling.top_k)
            except Exception as err:
                warnings.warn(f"tick CUDA graph for {n} slots unavailable, stepping eagerly: {err}")
                self._graphs = None
                self.step_kind = "eager"
                return None
            self._graphs[n] = graph
            self.step_kind = TickGraph.kind
        return graph

    def _collect(self, tick: "_Tick") -> None:
        """Results of a launched tick: hand out due chunks, end finished streams, note each slot's unit."""
        if tick.ready is not None:
            waiting = time.perf_counter()
            tick.ready.synchronize()  # the one host sync of a GPU tick
            self._waited += time.perf_counter() - waiting
        meta = tick.meta.numpy() if isinstance(tick.meta, torch.Tensor) else tick.meta
        n = tick.n
        same = tick.generation == self._generation[:n]  # rows still held by the stream that was stepped
        self._unit[:n] = np.where(same, meta[:, UNIT], self._unit[:n])
        ready = meta[:, READY].astype(bool)
        self._any_ready = bool(ready.any())
        fresh = self._live[:n] & (tick.launched_at > self._event_at[:n])  # launched after the slot's last event
        stalled = self._stalled_since[:n]
        self._stalled_since[:n] = np.where(ready, np.inf, np.where(fresh, np.minimum(stalled, tick.launched_at),
                                                                   stalled))
        step_ms, codec_ms = tick.timer.elapsed()
        self.step_ms.append(step_ms)
        if self._unstepped:
            self._mark_first_steps(tick, ready)
        self._schedule_units(tick.schedules)
        if self.frame_codec:
            completed = np.flatnonzero(meta[:, COMPLETED] & same)  # not a row restored since: it holds audio
            audio = tick.audio.numpy() if isinstance(tick.audio, torch.Tensor) else tick.audio
            self.outbox.add(completed, meta[completed, PENDING] - 1, audio[completed])
            self.codec_ms.append((codec_ms, len(completed)))
        due = np.flatnonzero(meta[:, DUE])
        if len(due):
            self._hand_out(tick, due, meta[due, PENDING])
        for row in np.flatnonzero(meta[:, DONE]):
            u = tick.utterances[row]
            if u is not None and not u.done and self.utterances[row] is u:
                u.done = True
                self._end(u.stream, None if u.spoke else TextError("text has nothing speakable in it"))
                self._drop(u)  # the row goes idle with the next tick's updates

    def _mark_first_steps(self, tick: "_Tick", ready: np.ndarray) -> None:
        """Mark the streams of ``tick`` that it stepped for the first time (`Stream.mark` "stepped": when that tick
        was launched); forget those that left meanwhile. Only just-started streams are looked at."""
        waiting = []
        for u in self._unstepped:
            if self._by_stream.get(u.stream) is not u:
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
            begin, durations = (schedule.numpy() if isinstance(schedule, torch.Tensor) else schedule)
            for i, (u, first, count) in enumerate(zip(utterances, firsts, counts)):
                if count and self._holds(u):
                    u.stream.schedule(first, begin[i, :count].tolist(), durations[i, :count].tolist())

    def _hand_out(self, tick: "_Tick", rows: np.ndarray, frames: np.ndarray) -> None:
        streams = [tick.utterances[r].stream if tick.utterances[r] is not None else None for r in rows]
        for stream in streams:
            if stream is not None and "due" not in stream.marks:
                stream.mark("due")
                stream.ticks["due"] = tick.serial
        if self.frame_codec:
            for row, count, stream in zip(rows, frames, streams):
                if stream is not None and not stream.cancelled:
                    stream.deliver(self.outbox.chunk(row, count))
            return
        keep = [i for i, s in enumerate(streams) if s is not None and not s.cancelled]
        sounded = [tick.utterances[rows[i]].sounded for i in keep]  # one pass: no list scan per row
        firsts = [i for i, was in zip(keep, sounded) if not was]
        for part, first in ((firsts, True), ([i for i, was in zip(keep, sounded) if was], False)):
            if part:  # first chunks in a job of their own: it goes ahead of the others' chunks (`CodecWorker`)
                rows_k = [int(rows[i]) for i in part]
                codes = self.slots.codes[torch.tensor(rows_k, device=self.device)]  # indexing copies
                self.codec_worker.decode(rows_k, [streams[i] for i in part], codes, [int(frames[i]) for i in part],
                                         first)
        for i in firsts:
            tick.utterances[rows[i]].sounded = True

    # -- helpers --
    def _step_for(self, n: int) -> Callable:
        """The step for bucket ``n``, built by the step factory on first use (eager if it cannot be built)."""
        step = self._steps.get(n)
        if step is None:
            step, kind = decode_step, "eager"
            if self._factory is not None:
                try:
                    step = self._factory(self.model, self._view(n), n, self.device)
                    kind = getattr(step, "kind", _kind(self._factory))  # what was built, not what was hoped for
                except Exception as err:  # no compiler, say: serve eagerly rather than not at all
                    warnings.warn(f"{self.step_kind} step for {n} slots unavailable, running eagerly: {err}")
            self.step_kind = kind
            self._steps[n] = step
        return step

    def _view(self, n: int) -> StepCaches:
        if n not in self._views:
            self._views[n] = self.caches.view(n)
        return self._views[n]

    def _upload(self, values, dtype=torch.long) -> torch.Tensor:
        """A small host list/array on the device without a host sync (through pinned memory on a GPU)."""
        tensor = torch.as_tensor(np.asarray(values), dtype=dtype)
        if self.device.type == "cuda":
            return tensor.pin_memory().to(self.device, non_blocking=True)
        return tensor

    def _upload_columns(self, *columns, dtype=torch.long) -> tuple[torch.Tensor, ...]:
        """Several host columns of one length M on the device in one upload (`_upload`): a (k, M) table, then
        its rows (views). Example: ([3, 5], [10, 12]) -> tensor([3, 5]), tensor([10, 12])."""
        return self._upload(np.array(columns), dtype).unbind(0)

    def _row_mask(self, rows: list[int]) -> torch.Tensor:
        """(max_streams,) bool on the device, true at ``rows``: built on the host, one upload."""
        mask = np.zeros(self.max_streams, dtype=bool)
        mask[rows] = True
        return self._upload(mask, torch.bool)

    def _recover(self, err: Exception) -> None:
        """After a fault of the batched tick: every live stream fails with EngineError, every slot and the
        decoder state return to empty, and the engine serves new streams as before."""
        for u in [u for u in self.utterances if u is not None] + [u for u, _ in self._todo.parks]:
            self._drop(u)
            u.stream.finish(EngineError(f"internal error: {err}"))
        self._inflight.clear()
        for _, state in self._todo.restores:
            state.release()
        self._todo, self._codec_resets, self._schedules = _DeviceUpdates(), [], []
        self._any_ready = False
        everything = torch.ones(self.max_streams, dtype=torch.bool, device=self.device)
        self.slots.reset(everything)
        self._flags.cleared(slice(None))
        self.caches.text_stack.reset(everything)
        self.caches.audio_stack.reset(everything)
        if self.frame_codec:
            self.frame_decoder.state.reset(everything)
        else:
            self.codec_worker.reset(list(range(self.max_streams)))

    def snapshot(self, stream: Stream, timeout: float = 10.0) -> tuple[bytes, int]:
        """A copy of ``stream``'s whole state, as `detach` returns it, while the stream goes on here; and how many
        samples of its audio come before that state. `attach` on an engine with the same weights continues the
        stream sample-exactly from that sample on (the audio before it is not in the copy). For checkpoints of
        live streams (streaming/failover.py). The copy is consistent: the text thread stops at the stream's place
        in its queue (every unit it took before has reached the engine, none is taken after) while the engine
        thread, between two ticks, copies the host state and the slot's rows; the codec thread adds the decoder's
        rows after the chunks already due (their samples are the count). The caller pushes no text meanwhile.
        The CPU codec path only. Raises EngineError for a stream not open here, or parked or moving now (the
        caller may try again later), or on a frame codec."""
        if self.frame_codec:
            raise EngineError("a snapshot needs the CPU codec path (no frame codec)")
        if stream.engine is not self or stream.finished or stream.cancelled or stream.moved or stream.detaching:
            raise EngineError("only a stream open on this engine can be snapshotted")
        taking = Snapshot(stream)

        def pause() -> None:  # on the text thread, in the stream's place: it waits there for the copy
            self._inbox.append(("snapshot", stream, taking))
            self.wake()
            taking.copied.wait(timeout)

        self._handlers.setdefault("snapshot", self._on_snapshot)
        self.text_worker.run_in_turn(pause)
        if not taking.done.wait(timeout):
            raise EngineError(f"no snapshot of the stream within {timeout:g} s")
        if taking.error is not None:
            raise taking.error
        return pack(taking.host, taking.rows, [], self.fingerprint), taking.samples

    def _on_snapshot(self, stream: Stream, taking: Snapshot) -> None:
        """`snapshot`'s copy, on the engine thread at its next events (never raises: it would fail the stream)."""
        try:
            u = self._by_stream.get(stream)
            if u is None or u.parked is not None or u.detach is not None:
                raise EngineError("the stream is parked, moving or gone: no snapshot now")
            taking.host = self._host_state(u)
            if u.slot < 0:  # waiting for its first slot: nothing spoken, no rows
                taking.samples = stream.samples
                taking.done.set()
            else:
                self.mover.copy_row(u.slot, taking.finish)
        except Exception as err:
            taking.fail(err)
        finally:
            taking.copied.set()


@dataclass
class _PrefillRows:
    """One prefill's host side (`Engine._prefill_windows`): the padded unit windows (M, L) and, per row, its
    slot, what to take from its window, what it confirms, its voice and rate, and what elastic pacing
    (`Slots.pace`) and a flush's pause (`Slots.place`) need."""
    units: np.ndarray | None = None  # (M, L), 0 = padding
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


@dataclass
class _DeviceUpdates:
    """Event updates waiting for the next tick: slots freed, streams started, flags to set."""
    frees: list[int] = field(default_factory=list)
    starts: list[Utterance] = field(default_factory=list)
    flags: list[Utterance] = field(default_factory=list)  # closed/ended to recompute
    paused: list[tuple[Utterance, bool]] = field(default_factory=list)
    parks: list[tuple[Utterance, int]] = field(default_factory=list)  # (stream, the slot it leaves)
    restores: list[tuple[Utterance, Parked]] = field(default_factory=list)  # (stream in its new slot, its state)

    def any(self) -> bool:
        return bool(self.frees or self.starts or self.flags or self.paused or self.parks or self.restores)


class _HostFlags:
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

    def write(self, name: str, rows: list[int], values: list[bool], upload) -> None:
        """Set flag ``name`` of ``rows`` (distinct) to ``values`` on the device, writing only those that differ."""
        rows, values = np.asarray(rows, dtype=np.int64), np.asarray(values, dtype=bool)
        known = self.known[name]
        changed = known[rows] != values
        if changed.any():
            rows, values = rows[changed], values[changed]
            self.flags[name][upload(rows)] = upload(values, torch.bool)
            known[rows] = values


@dataclass
class _Tick:
    n: int
    utterances: list  # who held each of the first n slots when the tick was launched
    generation: np.ndarray
    schedules: list
    timer: Timer
    serial: int  # ticks launched before it
    launched_at: float
    meta: object = None  # (n, len(META)): a tensor, or a pinned host tensor on a GPU
    audio: object = None  # frame audio (n, hop) with a frame codec
    ready: object = None  # CUDA event: the tick's results are on the host


def _to_host(tensor: torch.Tensor) -> torch.Tensor:
    """A pinned host copy, filled asynchronously on the current CUDA stream (read after its event)."""
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    return host


def _kind(factory) -> str:
    if factory is None:
        return "eager"
    return getattr(factory, "kind", getattr(factory, "__name__", type(factory).__name__))


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
