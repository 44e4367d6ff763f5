"""The serving engine: many streams share one batch of slots and advance together, one AR step per
frame tick, with text arriving incrementally and audio decoded chunk by chunk.

One background thread owns the model, the caches and the codec state. Callers talk to it through
`Stream` objects (thread-safe): push text, flush, end, cancel, read audio chunks.
"""
from __future__ import annotations

import threading
from collections import deque
import time
import traceback
import warnings
from dataclasses import dataclass, field

import torch

from streaming.codec_worker import CodecWorker
from streaming.decode import StepCaches, decode_step
from streaming.sampling import sample
from streaming.stream import Stream
from tts.codec import Codec
from tts.model import TTSModel
from tts.text import MAX_TEXT_CHARS, SYMBOLS, TextError

ENCODE_CHUNK = 48  # units encoded per text-encoder call
# Frames per codec decode: small first chunks for a fast first sound, then 320 ms. On 2 CPU cores the
# decoder's fixed cost per call (short convolutions, the LSTM's per-call setup) makes 8-frame chunks cost
# about 1.4 times as much per second of audio as 16-frame ones (`python -m bench.codec --quick`).
CHUNK_SCHEDULE = (2, 4, 8, 16)
NEVER = 1 << 40


class EngineError(RuntimeError):
    code = "engine_error"


class ServerFull(EngineError):
    code = "server_full"


class UnknownVoice(EngineError, ValueError):
    code = "unknown_voice"


@dataclass
class SamplingConfig:
    temperature: float = 0.7
    top_k: int = 40


@dataclass
class Slot:
    """Host-side bookkeeping of one batch slot. Unit indices are absolute within the utterance."""
    stream: Stream
    voice_id: int
    rate: float  # frames-per-phoneme divisor: the stream's speed times the voice's pace
    temperature: float  # the voice's sampling temperature
    units: list[int] = field(default_factory=list)  # unit ids from absolute index unit_base on
    unit_base: int = 0
    encoded: int = 0  # units whose states, durations and text keys exist
    frame_unit: list[int] = field(default_factory=list)  # aligned unit of each frame from frame_base on
    frame_base: int = 0
    text_kv: list = field(default_factory=list)  # per encoded-but-unwritten unit: per layer (k, v)
    written: int = 0
    closed_upto: int = -1  # units up to here were closed by a flush: speak them without more lookahead
    step: int = 0
    pending: int = 0  # finished frames not yet decoded
    chunks: int = 0

    @property
    def unit_count(self) -> int:
        return self.unit_base + len(self.units)

    @property
    def frames_known(self) -> int:
        return self.frame_base + len(self.frame_unit)

    def unit_at(self, frame: int) -> int:
        """Aligned unit of ``frame``; past the last known frame, the last unit (the delay-pattern tail)."""
        return self.frame_unit[min(frame, self.frames_known - 1) - self.frame_base]

    def trim(self, lookahead: int) -> None:
        """Forget frames and units no step can touch again, so host memory stays flat on long speech.
        Example: step 5000, frame_base 0 -> frames 0..4998 are dropped and frame_base becomes 4999.
        The last known frame is always kept, as the delay-pattern tail steps past it still read its unit:
        2046 frames known, step 2050 -> frames 0..2044 are dropped (not 0..2048), frame 2045 stays."""
        old_frames = min(self.step - 1, self.frames_known - 1) - self.frame_base
        if old_frames > 1024:
            del self.frame_unit[:old_frames]
            self.frame_base += old_frames
        old_units = self.encoded - lookahead - 1 - self.unit_base
        if old_units > 1024:
            del self.units[:old_units]
            self.unit_base += old_units


class Engine:
    _cores_split = False

    def __init__(self, model: TTSModel, codec: Codec, voices: dict[str, dict], max_streams: int = 8,
                 device: str = "cpu", sampling: SamplingConfig | None = None, max_chars: int = MAX_TEXT_CHARS,
                 max_queued_seconds: float = 4.0, seed: int = 0, compile: bool = False):
        self.model, self.codec, self.device = model.eval(), codec.eval(), device
        self.cfg, self.voices = model.cfg, voices
        self.default_voice = next((n for n, v in voices.items() if v.get("default")), next(iter(voices)))
        self.sample_rate = codec.cfg.sample_rate
        self.max_streams, self.max_chars, self.max_queued = max_streams, max_chars, max_queued_seconds
        self.sampling = sampling or SamplingConfig()
        self.generator = torch.Generator(device).manual_seed(seed)
        if str(device) == "cpu" and not Engine._cores_split:  # the AR step and the codec worker run side by
            torch.set_num_threads(max(1, torch.get_num_threads() // 2))  # side: split the cores, once a process
            Engine._cores_split = True
        self.caches = StepCaches.empty(self.cfg, max_streams, device)
        self.codec_worker = CodecWorker(codec, max_streams, device)
        self.codec_ms = self.codec_worker.codec_ms  # (ms, frames) per codec call
        self.slots: list[Slot | None] = [None] * max_streams
        books = self.cfg.codebooks
        self.tokens = torch.full((max_streams, books), self.cfg.codebook_size, dtype=torch.long, device=device)
        self.books = torch.arange(books, device=device)  # codebook indices, reused every tick
        self.history = torch.zeros(max_streams, books, books, dtype=torch.long, device=device)  # last K steps
        self.temperature = torch.full((max_streams, 1, 1), max(self.sampling.temperature, 1e-4), device=device)  # (B, 1, 1)
        self.frames = torch.zeros(max_streams, books, max(CHUNK_SCHEDULE), dtype=torch.long, device=device)
        self._prefix: dict[int, list] = {}
        self._new: list[int] = []
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self.step_ms: deque[float] = deque(maxlen=200_000)  # AR step + sampling, per tick
        self.sync_timing = False  # benchmarks on a GPU set this to time the step exactly
        self._decode_step = self._fast_step(compile)
        self._thread = threading.Thread(target=self._run, name="tts-engine", daemon=True)
        self._thread.start()

    # ---- public API -------------------------------------------------------------------------
    def open(self, voice: str | None = None, speed: float = 1.0) -> Stream:
        voice = voice or self.default_voice
        if voice not in self.voices:
            raise UnknownVoice(f"unknown voice {voice!r}; choose one of {sorted(self.voices)}")
        if not isinstance(speed, (int, float)) or not 0.25 <= speed <= 4.0:
            raise ValueError(f"speed must be a number from 0.25 to 4.0, not {speed!r}")
        stream = Stream(self, voice, float(speed), self.max_chars)
        with self._lock:
            free = [i for i, s in enumerate(self.slots) if s is None]
            if not free:
                raise ServerFull(f"all {self.max_streams} streams are busy; try again shortly")
            preset = self.voices[voice]
            self.slots[free[0]] = Slot(stream, preset["index"], float(speed) * preset.get("pace", 1.0),
                                       preset.get("temperature", self.sampling.temperature))
            self._new.append(free[0])
        self.wake()
        return stream

    @classmethod
    def tiny_random(cls, max_streams: int = 4, **kwargs) -> "Engine":
        """An engine on a tiny random-weight model and codec: real scheduling, streaming and audio shapes,
        noise for sound. For fast tests of everything around the model."""
        from tts.codec import CODEC_PRESETS
        from tts.model import MODEL_PRESETS
        torch.manual_seed(0)
        codec = Codec(CODEC_PRESETS["tiny"])
        codec.quantizer.codebooks.normal_()
        model = TTSModel(MODEL_PRESETS["tiny"])
        torch.nn.init.constant_(model.text.duration[-1].bias, 1.4)  # about 3 frames a unit, like speech
        names = ["joe", "slt", "rms", "kal", "awb"]
        voices = {n: {"name": n, "index": i, "description": "tiny random test voice", "teacher": "none",
                      "sample_rate": codec.cfg.sample_rate, "default": i == 0} for i, n in enumerate(names)}
        return cls(model, codec, voices, max_streams=max_streams, **kwargs)

    def wake(self) -> None:
        self._wake.set()

    @property
    def active_streams(self) -> int:
        return sum(s is not None for s in self.slots)

    def _fast_step(self, compile: bool):
        """The best available step: a CUDA graph on a GPU; an inductor-compiled step if ``compile`` (long-lived
        engines: compiling takes seconds); else the eager step. Kill switches: TTS_NO_GRAPH, TTS_NO_COMPILE."""
        import kernels
        if str(self.device).startswith("cuda") and kernels.enabled("graph"):
            from kernels.cuda_graph import GraphedStep
            self.step_kind = "cuda_graph"
            return GraphedStep(self.model, self.caches, self.max_streams, self.device)
        if compile and kernels.enabled("compile"):
            try:
                from kernels.compiled import CompiledStep
                step = CompiledStep(self.model, self.caches, self.max_streams, self.device)
                self.step_kind = "compiled"
                return step
            except Exception as err:  # no C++ compiler, say: serve eagerly rather than not at all
                warnings.warn(f"compiled decode step unavailable, running eagerly: {err}")
        self.step_kind = "eager"
        return decode_step

    # ---- engine thread ----------------------------------------------------------------------
    def _run(self) -> None:
        torch.set_grad_enabled(False)
        while True:
            self._wake.wait(timeout=0.05)
            self._wake.clear()
            try:
                while self._tick():
                    pass
            except Exception as err:  # a bug must not leave callers hanging: fail the streams, keep serving
                traceback.print_exc()
                for index, slot in enumerate(self.slots):
                    if slot is not None:
                        slot.stream._finish(EngineError(f"internal error: {err}"))
                        self.slots[index] = None

    def _tick(self) -> bool:
        """Advance every ready stream by one frame. Returns whether any work was done."""
        with self._lock:
            new, self._new = self._new, []
        for index in new:
            self._start(index)
        ready = []
        for index, slot in enumerate(self.slots):
            if slot is None:
                continue
            if slot.stream.cancelled:
                self.slots[index] = None
                continue
            self._advance_text(slot)
            slot.trim(self.cfg.text_lookahead)
            if self._can_step(slot):
                ready.append(index)
            elif self._is_done(slot):
                self._decode([index])
                spoke = slot.stream.text.spoken_any
                self.codec_worker.finish(slot.stream, None if spoke else TextError("text has nothing speakable in it"))
                self.slots[index] = None
        if not ready:
            return False
        self._step(ready)
        due = [i for i in ready if self.slots[i].pending >= self._chunk_size(self.slots[i])]
        if due:
            self._decode(due)
        return True

    def _start(self, index: int) -> None:
        slot = self.slots[index]
        if slot.voice_id not in self._prefix:  # prefix caching: a voice's prefix is computed once
            self._prefix[slot.voice_id] = self.model.voice_prefix(torch.tensor([slot.voice_id], device=self.device))
        self.caches.start(index, self._prefix[slot.voice_id])
        self.codec_worker.reset(index)
        self.tokens[index] = self.cfg.codebook_size
        self.history[index] = 0
        self.temperature[index] = max(slot.temperature, 1e-4)  # positive: a voice samples, never divides by 0

    def _advance_text(self, slot: Slot) -> None:
        """Phonemise newly arrived text and encode units as far as the text encoder's lookahead allows,
        but only about one encode chunk beyond what the next frames need (memory stays bounded)."""
        units, closed = slot.stream.text.take()
        slot.units += units
        if closed:
            slot.closed_upto = slot.unit_count
        complete = slot.stream.text.ended or slot.closed_upto == slot.unit_count
        current = slot.unit_at(slot.step) if slot.step < slot.frames_known else slot.encoded
        while slot.encoded < slot.unit_count and slot.encoded <= current + self.cfg.ahead + ENCODE_CHUNK:
            start = slot.encoded
            stop = min(start + ENCODE_CHUNK, slot.unit_count if complete else slot.unit_count - self.cfg.text_lookahead)
            if stop <= start:
                return
            self._encode(slot, start, stop)

    def _encode(self, slot: Slot, start: int, stop: int) -> None:
        look = self.cfg.text_lookahead
        lo, hi = max(0, start - look), min(slot.unit_count, stop + look)
        units = torch.tensor([slot.units[lo - slot.unit_base:hi - slot.unit_base]], device=self.device)
        voice = torch.tensor([slot.voice_id], device=self.device)
        states, log_dur = self.model.text(units, voice)
        states, log_dur = states[:, start - lo:stop - lo], log_dur[0, start - lo:stop - lo]
        durations = torch.round(torch.expm1(log_dur.float()).clamp(min=0) / slot.rate).long().tolist()
        if start == 0 and sum(durations) == 0:
            durations[0] = 1
        first = slot.frames_known
        starts = torch.tensor([first + sum(durations[:i]) for i in range(len(durations))], device=self.device)
        kv = self.model.text_keys_values(states, starts[None])
        frame_s = 1 / self.codec.cfg.frame_rate
        slot.stream._schedule([(SYMBOLS[u], round(int(f) * frame_s, 3), round((int(f) + d) * frame_s, 3))
                               for u, f, d in zip(slot.units[start - slot.unit_base:stop - slot.unit_base],
                                                  starts.tolist(), durations) if d > 0])
        for i, duration in enumerate(durations):
            slot.frame_unit += [start + i] * duration
            slot.text_kv.append([(k[:, :, i:i + 1], v[:, :, i:i + 1]) for k, v in kv])
        slot.encoded = stop

    def _total_steps(self, slot: Slot) -> int:
        """Steps of the utterance once all its text is known (frames + codebooks - 1), else NEVER."""
        if slot.stream.text.ended and slot.encoded == slot.unit_count:
            return slot.frames_known + self.cfg.codebooks - 1 if slot.frames_known else 0
        return NEVER

    def _can_step(self, slot: Slot) -> bool:
        if slot.stream.queued_samples > self.max_queued * self.sample_rate:
            return False  # backpressure: the reader is behind
        total = self._total_steps(slot)
        if total != NEVER:
            return slot.step < total
        if slot.step >= slot.frames_known:
            return False
        closed = slot.encoded == slot.closed_upto == slot.unit_count
        return closed or slot.unit_at(slot.step) + self.cfg.ahead < slot.encoded

    def _is_done(self, slot: Slot) -> bool:
        return slot.stream.text.ended and slot.step >= self._total_steps(slot)

    def _write_text(self, ready: list[int]) -> None:
        """Put every unit within the window ahead of each stream's current unit into its text ring."""
        per_slot = []
        for index in ready:
            slot = self.slots[index]
            unit = slot.unit_at(slot.step)
            upto = min(unit + self.cfg.ahead + 1, slot.encoded)
            per_slot.append((index, slot, list(range(slot.written, upto))))
        while any(todo for _, _, todo in per_slot):
            positions = torch.full((self.max_streams, 1), -1, dtype=torch.long)
            layers = [[torch.zeros(self.max_streams, self.cfg.heads, 1, self.cfg.head_dim, device=self.device),
                       torch.zeros(self.max_streams, self.cfg.heads, 1, self.cfg.head_dim, device=self.device)]
                      for _ in range(self.cfg.layers)]
            for index, slot, todo in per_slot:
                if not todo:
                    continue
                unit = todo.pop(0)
                positions[index, 0] = unit
                for layer, (k, v) in zip(layers, slot.text_kv.pop(0)):
                    layer[0][index], layer[1][index] = k[0], v[0]
                slot.written += 1
            self.caches.write_text([tuple(kv) for kv in layers], positions.to(self.device))

    def _step(self, ready: list[int]) -> None:
        self._write_text(ready)
        active = torch.zeros(self.max_streams, dtype=torch.bool)
        frame = torch.zeros(self.max_streams, dtype=torch.long)
        unit = torch.zeros(self.max_streams, dtype=torch.long)
        total = torch.full((self.max_streams,), NEVER, dtype=torch.long)
        for index in ready:
            slot = self.slots[index]
            active[index], frame[index] = True, slot.step
            unit[index] = slot.unit_at(slot.step)
            steps = self._total_steps(slot)
            total[index] = steps - self.cfg.codebooks + 1 if steps != NEVER else NEVER
        active, frame, unit, total = (t.to(self.device) for t in (active, frame, unit, total))
        started = time.perf_counter()
        logits = self._decode_step(self.model, self.caches, self.tokens, frame, unit, active)
        temperature = self.temperature if self.sampling.temperature > 0 else 0.0  # 0: greedy, for tests
        tokens = sample(logits, temperature, self.sampling.top_k, self.generator)
        if self.sync_timing:
            torch.cuda.synchronize()
        self.step_ms.append((time.perf_counter() - started) * 1000)
        frame_of_token = frame[:, None] - self.books  # codebook k of this step belongs to frame step - k
        valid = (frame_of_token >= 0) & (frame_of_token < total[:, None])
        tokens = torch.where(valid, tokens, self.cfg.codebook_size)
        self.tokens = torch.where(active[:, None], tokens, self.tokens)
        column = (frame % self.cfg.codebooks)[:, None, None].expand(-1, self.cfg.codebooks, 1)
        old = self.history.gather(2, column)
        self.history.scatter_(2, column, torch.where(active[:, None, None], tokens[:, :, None], old))
        self._collect_frames(ready, frame)

    def _collect_frames(self, ready: list[int], frame: torch.Tensor) -> None:
        """A frame is complete once its last codebook is out: frame f at step f + K - 1.
        Example, K=3: at step 5 frame 3 is complete, its codebooks k come from steps 3, 4, 5."""
        books = self.cfg.codebooks
        for index in ready:
            slot = self.slots[index]
            done_frame = slot.step - (books - 1)
            slot.step += 1
            if done_frame < 0 or done_frame >= slot.frames_known:
                continue
            steps = (done_frame + self.books) % books
            self.frames[index, :, slot.pending] = self.history[index, self.books, steps]
            slot.pending += 1

    def _chunk_size(self, slot: Slot) -> int:
        return CHUNK_SCHEDULE[min(slot.chunks, len(CHUNK_SCHEDULE) - 1)]

    def _decode(self, indices: list[int]) -> None:
        """Hand the pending frames of the given slots to the codec worker, batched by frame count."""
        groups: dict[int, list[int]] = {}
        for index in indices:
            if self.slots[index].pending:
                groups.setdefault(self.slots[index].pending, []).append(index)
        for count, members in groups.items():
            select = torch.tensor(members, device=self.device)
            streams = [self.slots[i].stream for i in members]
            self.codec_worker.decode(members, streams, self.frames[select, :, :count])  # indexing copies
            for index in members:
                slot = self.slots[index]
                slot.pending, slot.chunks = 0, slot.chunks + 1
