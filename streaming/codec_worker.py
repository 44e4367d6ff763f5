"""Codec decoding beside the AR step, in one of two shapes.

`CodecWorker` (the CPU): chunks on a thread of their own, so that the next AR step runs while the last
frames become audio. On 2 CPU cores the AR step and the codec decoder each get one, and a frame tick costs
the longer of the two instead of their sum. The engine thread hands over one job per tick through a
bounded queue (when the codec is the slower, a full queue makes the engine wait); a slot's reset, its chunks
and its end are handled in the order they were made, even when a new stream reuses the slot straight away,
and a new stream's first chunk goes ahead of the others' chunks (`CodecWorker`).

`FrameCodec` (a GPU): every tick, one decoder call of one frame for every slot (idle rows masked: their
state is left as it was), with static shapes, so that it is captured once as a CUDA graph per slot bucket
and replayed on a CUDA stream of its own, where it overlaps the next AR step. A stream decoded frame by
frame equals its offline decode (`Codec.decode`), as the chunked decode does.
"""

from __future__ import annotations

import copy
import os
import threading
import time
import traceback
import warnings
from collections.abc import Callable

import numpy as np
import torch

from streaming.live_figures import FIGURES_KEPT, Recent
from streaming.masks import slot_mask
from streaming.stream import Stream
from tts.codec import Codec, DecoderState


def fast_path_enabled(name: str) -> bool:
    """Kill switches of the fast paths: TTS_NO_GRAPH=1 (no CUDA graphs), TTS_NO_COMPILE=1 (no compiled step)."""
    return os.environ.get(f"TTS_NO_{name.upper()}", "0") in ("", "0")


class CodecWorker:
    """The CPU codec thread. Jobs run in the order given, with one exception: a new stream's first chunk (and
    its reset) goes ahead of every job queued before it that it does not depend on, so that a stream's first
    audio does not wait for the 16-frame chunks of the streams already speaking (on the loaded 2-core machine
    a backlog of those held first chunks back by up to 2 s, `python -m bench.soak --timeline`).

    Decoder rows: each slot has two rows of decoder state, and a stream starting in a slot takes the one its
    slot's previous stream did not use, so its reset and first chunk touch no row that the chunks still
    queued for the previous stream touch. Example, 4 slots: slot 1 decodes in row 1; its stream ends with two
    chunks queued; the next stream in slot 1 decodes in row 5 (1 + 4): its reset and first chunk can run
    before those two chunks. The mapping is the engine thread's (every call below comes from it).

    Dependencies (`_runnable`): a job touches its decoder rows and its streams; a first chunk may run before
    an earlier job only if they share neither. Example: queue [decode rows {1, 2}, finish stream A, reset row 5
    (first), decode row 5 (first)]: the reset runs next, then the first chunk, then the rest in order."""

    def __init__(self, codec: Codec, max_streams: int, device, depth: int = 64):
        self.codec = codec
        self.slots = max_streams
        self.state = codec.init_state(2 * max_streams, device)  # two decoder rows per slot
        self.device = device
        self.depth = depth
        self._row = list(range(max_streams))  # each slot's decoder row now
        self._jobs: list[tuple] = []  # (kind, rows, streams, first, *payload), in the order given
        self._firsts = 0  # first-chunk jobs among them
        self._cond = threading.Condition()
        self.codec_ms = Recent(FIGURES_KEPT, width=2)  # (ms, frames) per decode call
        self.decode_step = codec.decode_step  # (M, K, T) codes, state -> (M, T*hop) audio; see set_decode_step
        self._thread = threading.Thread(target=self._run, name="tts-codec", daemon=True)
        self._thread.start()

    def reset(self, slots: list[int]) -> None:
        """New streams start in ``slots``: each takes its slot's other decoder row, whose state returns to the
        silent lead-in's (ahead of earlier jobs, as its first chunk)."""
        for slot in slots:
            self._row[slot] = slot + self.slots if self._row[slot] == slot else slot
        self._put("reset", self._rows(slots), (), True)

    def decode(
        self, rows: list[int], streams: list[Stream], codes: torch.Tensor, lengths: list[int], first: bool = False
    ) -> None:
        """Decode the first ``lengths[i]`` frames of ``codes`` (M, K, T) for slot ``rows[i]``, each continuing its
        own state, and deliver the audio to ``streams[i]``. Rows of one length share a decoder call, except a
        stream with ``decode_alone`` (a seeded one): on the CPU a row's float result depends on the batch it
        is computed in (a 1-row matmul takes another kernel than a 4-row one, differing by ~1e-7), so such a
        stream gets a call of its own and its audio is the same bit for bit whoever else is speaking.
        Example: lengths [4, 4, 4] with row 1 seeded -> calls {rows 0, 2} and {row 1}. ``first``: these are the
        streams' first chunks (they go ahead of earlier jobs they do not depend on)."""
        self._put("decode", self._rows(rows), streams, first, codes, lengths)

    def set_decode_step(self, step) -> None:
        """Decode with ``step`` (None: the codec's own `decode_step`) from the next decode job on."""
        self.decode_step = step or self.codec.decode_step

    def finish(self, stream: Stream, error: Exception | None) -> None:
        """End ``stream`` once everything queued before for it has been delivered."""
        self._put("finish", (), (stream,), False, error)

    def capture(self, rows: list[int], done: Callable[[list[dict]], None]) -> None:
        """Copy the decoder state of slots ``rows`` once the decodes queued before are done, and pass it, one
        dict of (1, ...) tensors per row (`decoder_rows`), to ``done`` (called on the codec thread). Parking uses
        this: a parked stream's state includes every chunk decoded up to the moment it was parked."""
        self._put("capture", self._rows(rows), (), False, done)

    def restore(self, rows: list[int], states: Callable[[], list[dict]]) -> None:
        """Put captured decoder states (`capture`) into slots ``rows``, before any later decode of those rows.
        ``states`` is called when the job runs: a stream parked and restored at once has its decoder rows
        captured by a job queued before this one, which has not run when the engine asks for the restore."""
        self._put("restore", self._rows(rows), (), False, states)

    def close(self) -> None:
        """Stop after the jobs queued so far."""
        self._put("stop", (), (), False)
        self._thread.join(timeout=2)

    @property
    def queued(self) -> int:
        return len(self._jobs)

    def _rows(self, slots: list[int]) -> tuple[int, ...]:
        return tuple(self._row[slot] for slot in slots)

    def _put(self, kind: str, rows: tuple, streams, first: bool, *payload) -> None:
        """Queue a job; while ``depth`` jobs wait, the engine thread waits (the codec is the slower), except
        for a first chunk or a reset (one or two per new stream): those never wait for the others' backlog."""
        with self._cond:
            self._cond.wait_for(lambda: first or len(self._jobs) < self.depth)
            self._jobs.append((kind, rows, tuple(streams), first, *payload))
            self._firsts += first
            self._cond.notify_all()

    def _take(self) -> tuple:
        """The next job to run: the first first-chunk job that depends on no job before it, else the oldest."""
        with self._cond:
            self._cond.wait_for(lambda: self._jobs)
            at = self._runnable() if self._firsts else 0
            job = self._jobs.pop(at)
            self._firsts -= job[3]
            self._cond.notify_all()
            return job

    def _runnable(self) -> int:
        """Index of the first first-chunk job sharing no decoder row and no stream with a job before it (0 if
        none). Example: [decode rows (1,), decode rows (5,) first] -> 1; [reset (5,) first, decode (5,) first] -> 0."""
        rows, streams = set(), set()
        for at, (_, job_rows, job_streams, first, *_) in enumerate(self._jobs):
            if first and rows.isdisjoint(job_rows) and streams.isdisjoint(job_streams):
                return at
            rows.update(job_rows)
            streams.update(job_streams)
        return 0

    def _run(self) -> None:
        torch.set_grad_enabled(False)
        while True:
            job = self._take()
            kind, rows, streams = job[:3]
            if kind == "stop":
                return
            try:
                if kind == "reset":
                    self.state.reset(slot_mask(self.state.buffers[0].shape[0], torch.tensor(rows), self.device))
                elif kind == "decode":
                    self._decode(list(rows), list(streams), *job[4:])
                elif kind == "capture":
                    captured = decoder_rows(self.state, torch.tensor(rows, device=self.device))
                    job[4]([{name: t[i : i + 1] for name, t in captured.items()} for i in range(len(rows))])
                elif kind == "restore":
                    states = job[4]()
                    put_decoder_rows(
                        self.state,
                        torch.tensor(rows, device=self.device),
                        {
                            name: torch.cat([state[name] for state in states])
                            for name in states[0]
                            if name.startswith("codec.")
                        },
                    )
                else:
                    streams[0].finish(job[4])
            except Exception as err:  # a bug must not leave readers hanging
                traceback.print_exc()
                from streaming.errors import EngineError

                for stream in streams:  # (a decode's or a finish's; other jobs have none)
                    stream.finish(EngineError(f"internal error: {err}"))

    def _decode(self, rows: list[int], streams: list[Stream], codes: torch.Tensor, lengths: list[int]) -> None:
        step = self.decode_step  # one step for the whole job, even if another is set meanwhile
        begun = time.perf_counter()
        for stream in streams:
            stream.mark("codec", begun)
        groups: dict[tuple[int, int], list[int]] = {}
        for i, length in enumerate(lengths):
            groups.setdefault((length, i if streams[i].decode_alone else -1), []).append(i)
        # short chunks first: a new stream's first audio does not wait for others' 16-frame chunks of this job
        for (length, _), members in sorted(groups.items()):
            started = time.perf_counter()
            select = torch.tensor([rows[i] for i in members], device=self.device)
            sub = self.state.select(select)
            frames = codes[members, :, :length]
            audio = step(frames, sub).float().cpu().numpy()
            self.state.write(select, sub)
            self.codec_ms.append(((time.perf_counter() - started) * 1000, len(members) * length))
            for row, i in enumerate(members):
                if not streams[i].cancelled:
                    streams[i].deliver(audio[row])


def decoder_rows(state: DecoderState, index: torch.Tensor) -> dict[str, torch.Tensor]:
    """Copies of the decoder state of the streams at ``index`` (M,), batch first: "codec.i" (M, C, N) per
    buffer, "codec.h"/"codec.c" (M, 1, H) for the LSTM (whose state is (1, B, H): batch second)."""
    sub = state.select(index)
    rows = {f"codec.{i}": buffer for i, buffer in enumerate(sub.buffers)}
    if sub.lstm is not None:
        rows["codec.h"], rows["codec.c"] = (part.transpose(0, 1).contiguous() for part in sub.lstm)
    return rows


def decoder_row_tensors(state: DecoderState) -> dict[str, torch.Tensor]:
    """The decoder state's tensors by the names of `decoder_rows`, batch first, as views (writes land in the
    state): "codec.i" (B, C, N) per buffer, "codec.h"/"codec.c" (B, 1, H) for the LSTM's (1, B, H) (whose
    row views then have a contiguous row's strides)."""
    tensors = {f"codec.{i}": buffer for i, buffer in enumerate(state.buffers)}
    if state.lstm is not None:
        tensors["codec.h"], tensors["codec.c"] = (part[0].unsqueeze(1) for part in state.lstm)
    return tensors


def put_decoder_rows(state: DecoderState, index: torch.Tensor, rows: dict[str, torch.Tensor]) -> None:
    """Write rows from `decoder_rows` (possibly of another engine) into the streams at ``index``."""
    lstm = None if state.lstm is None else (rows["codec.h"].transpose(0, 1), rows["codec.c"].transpose(0, 1))
    state.write(index, DecoderState([rows[f"codec.{i}"] for i in range(len(state.buffers))], lstm))


def exact_convolutions(benchmark: bool = True):
    """cuDNN without TF32 for the decoder's convolutions, choosing each shape's algorithm by timing them. With
    TF32 (PyTorch's default for convolutions) a stream's samples depend on the slot bucket it is decoded in
    (each batch size gets its own algorithm), by up to ~6e-4: a stream restored into another slot, or moved,
    would not continue exactly; in float32 they agree to ~1e-6. cuDNN's heuristic picks FFT and other slow
    float32 algorithms for these small convolutions (H200: 7.6 ms a call at 256 slots, against 1.4 with TF32),
    so the choice is benchmarked (once per shape, before a graph capture). The text encoder, whose shapes vary
    from call to call, passes ``benchmark=False``: float32 too, so a unit's duration (a rounded float) does not
    depend on the batch it was encoded in."""
    return torch.backends.cudnn.flags(
        enabled=torch.backends.cudnn.enabled, benchmark=benchmark, deterministic=False, allow_tf32=False
    )


class FrameUpsample(torch.nn.Module):
    """A decoder block's transposed convolution (`tts.codec.CausalConvTranspose1d`) stepped one frame at a
    time as one matrix product: for a single input sample it is x (B, Cin) @ W (Cin, Cout * kernel). cuDNN
    runs it as a float32 "dgrad" convolution that took 1.1 ms of a 4.4 ms codec call at 512 slots on an H200;
    the product gives the same samples (to float rounding) for a fraction of that. Longer inputs go to the
    convolution itself."""

    def __init__(self, up):
        super().__init__()
        self.up, self.tail = up, up.tail

    def step(self, x: torch.Tensor, tail: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if x.shape[-1] != 1:
            return self.up.step(x, tail)
        weight, bias = self.up.weight, self.up.bias  # (Cin, Cout, kernel), (Cout,)
        y = (x[:, :, 0] @ weight.flatten(1)).view(x.shape[0], *weight.shape[1:]) + bias[:, None]  # (B, Cout, k)
        y = torch.cat([y[..., : self.tail] + tail, y[..., self.tail :]], dim=-1)
        cut = y.shape[-1] - self.tail
        return y[..., :cut], y[..., cut:] - bias[:, None]


def frame_decoder(decoder):
    """``decoder`` with its blocks' transposed convolutions stepped as `FrameUpsample` (weights shared)."""
    frames = copy.copy(decoder)
    frames._modules = dict(decoder._modules)
    frames.blocks = torch.nn.ModuleList(
        torch.nn.ModuleList([FrameUpsample(up), res1, res3]) for up, res1, res3 in decoder.blocks
    )
    return frames


class FrameCodec:
    """One frame per slot per call: ``run(n, codes, completed, reset)`` decodes the frame ``codes`` (n, K) of the
    rows where ``completed`` (n,) is true, after returning the rows in ``reset`` (B,) bool (or None) to the
    lead-in state, and leaves (n, hop) samples in ``audio[:n]``. On a GPU the call is a CUDA graph per ``n``
    (built on first use, unless TTS_NO_GRAPH=1)."""

    def __init__(self, codec: Codec, max_streams: int, device):
        self.codec, self.device = codec, torch.device(device)
        self.decoder = frame_decoder(codec.decoder)
        self.state = codec.init_state(max_streams, device)
        self.codes = torch.zeros(max_streams, codec.cfg.codebooks, dtype=torch.long, device=device)  # (B, K)
        self.mask = torch.zeros(max_streams, dtype=torch.bool, device=device)  # (B,)
        self.audio = torch.zeros(max_streams, codec.cfg.hop, device=device)  # (B, hop)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.use_graphs = self.device.type == "cuda" and fast_path_enabled("graph")
        # One memory pool for every bucket's graph: they run one at a time and copy their output out.
        self.pool = torch.cuda.graph_pool_handle() if self.use_graphs else None
        # Captured on a stream of their own: PyTorch keys the cuBLAS workspace a captured matmul uses by the
        # capture stream, and graphs captured without one (the engine's tick graphs) share one stream and so one
        # workspace (pytorch/pytorch#193402). The engine replays this graph on its codec stream while the next
        # tick's graph runs: sharing, greedy never-parked rounds on an H200 (64 slots stepped together) parted
        # from their first run, every live stream from one tick on, in 6 of 12 rounds; apart, in 0 of 16.
        self.capture_stream = torch.cuda.Stream(self.device) if self.use_graphs else None

    def run(self, n: int, codes: torch.Tensor, completed: torch.Tensor, reset: torch.Tensor | None) -> torch.Tensor:
        self.take(n, codes, completed, reset)
        return self.decode(n)

    def take(self, n: int, codes: torch.Tensor, completed: torch.Tensor, reset: torch.Tensor | None) -> None:
        """The first half of `run`: reset rows, copy this tick's frame codes and mask into the static inputs."""
        if reset is not None:
            self.state.reset(reset)
        self.codes[:n].copy_(torch.where(completed[:, None], codes, 0))  # idle rows: any valid code
        self.mask[:n].copy_(completed)

    def decode(self, n: int) -> torch.Tensor:
        """The second half of `run`: decode the taken frames; (n, hop) samples."""
        if self.use_graphs and n not in self.graphs:
            try:
                self.graphs[n] = self._capture(n)
            except Exception as err:  # serve eagerly rather than not at all
                warnings.warn(f"codec CUDA graph unavailable, decoding eagerly: {err}")
                self.use_graphs = False
        if self.use_graphs:
            self.graphs[n].replay()
        else:
            self._step(n)
        return self.audio[:n]

    def prepare(self, n: int) -> None:
        """Capture the graph for the first ``n`` rows now (call on the stream that will replay it)."""
        if self.use_graphs and n not in self.graphs:
            self.graphs[n] = self._capture(n)

    def _step(self, n: int) -> None:
        """The decoder step over the first n rows of the static buffers; idle rows keep their state."""
        rows = DecoderState(
            [b[:n] for b in self.state.buffers],
            None if self.state.lstm is None else tuple(p[:, :n] for p in self.state.lstm),
        )
        stepped = DecoderState(list(rows.buffers), rows.lstm)
        z = self.codec.quantizer.decode(self.codes[:n, :, None])  # (n, D, 1)
        with exact_convolutions():
            audio = self.decoder.step(z, stepped)  # (n, 1, hop)
        keep = self.mask[:n]
        for old, new in zip(rows.buffers, stepped.buffers):
            old.copy_(torch.where(keep[:, None, None], new, old))
        if rows.lstm is not None:
            for old, new in zip(rows.lstm, stepped.lstm):
                old.copy_(torch.where(keep[None, :, None], new, old))
        self.audio[:n].copy_(audio[:, 0])

    def _capture(self, n: int) -> torch.cuda.CUDAGraph:
        saved = [b[:n].clone() for b in self.state.buffers], [p[:, :n].clone() for p in self.state.lstm or ()]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):  # warm-up: cuDNN picks its kernels outside the capture
                self._step(n)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, stream=self.capture_stream):
            self._step(n)
        for old, kept in zip(self.state.buffers, saved[0]):  # the warm-up stepped live rows: undo it
            old[:n].copy_(kept)
        for old, kept in zip(self.state.lstm or (), saved[1]):
            old[:, :n].copy_(kept)
        return graph


class AudioOutbox:
    """Host-side assembly of chunks from per-tick frames (`FrameCodec`): frame audio lands at each row's
    pending position, and a due row's chunk is handed over whole. Example, hop 480: a row whose chunk of 4
    frames is due after this tick receives samples [0, 1920) of its row, written over the last 4 ticks."""

    def __init__(self, max_streams: int, frames: int, hop: int):
        self.hop = hop
        self.audio = np.zeros((max_streams, frames, hop), dtype=np.float32)  # (B, C, hop)

    def add(self, rows: np.ndarray, positions: np.ndarray, audio: np.ndarray) -> None:
        """Frame audio (M, hop) of ``rows`` (M,) at their pending ``positions`` (M,)."""
        self.audio[rows, positions] = audio

    def chunk(self, row: int, frames: int) -> np.ndarray:
        return self.audio[row, :frames].reshape(-1).copy()
