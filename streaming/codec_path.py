"""The codec's side of a tick, in one of two shapes behind one interface (`CodecPath`): the engine launches a
tick, collects it and hands chunks out through it, and never asks which one it has.

* `CpuCodecPath`: a `CodecWorker` thread decodes due chunks (2, 4, 8, then 16 frames) beside the next AR
  step; a new stream's first chunk goes ahead of the worker's backlog.
* `FrameCodecPath` (a GPU; CPU tests): a `FrameCodec` decodes every completed frame each tick (on a GPU a CUDA
  graph on a CUDA stream of its own, overlapping the next AR step) into an `AudioOutbox`, and due chunks are
  handed out from there on the same schedule.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Protocol, cast

import numpy as np
import torch

from streaming.codec_worker import AudioOutbox, CodecWorker, FrameCodec
from streaming.live_figures import FIGURES_KEPT, Recent
from streaming.slots import COMPLETED, MAX_CHUNK, META, PENDING, Slots
from streaming.stream import Stream
from tts.codec import Codec


class CodecPath(Protocol):
    """What the engine's tick asks of the codec side (`CpuCodecPath`, `FrameCodecPath`)."""

    overlaps: bool  # the tick just launched stays in flight while the host collects the one before
    keeps_codes: bool  # the slots keep each frame's codes for a chunk decode (`Slots.advance`)
    captures_ticks: bool  # a GPU's tick may be one CUDA graph (the step and its bookkeeping)
    snapshots: bool  # `Engine.snapshot` works on it
    codec_ms: Recent  # (ms, frames) per codec call

    def mover_rows(self) -> dict: ...  # the codec state `SlotMover` copies with a slot
    def set_decode_step(self, step: Callable | None) -> None: ...
    def queued(self) -> int: ...
    def warm(self, n: int) -> None: ...
    def start_rows(self, rows: list[int]) -> None: ...
    def restored(self, rows: list[int]) -> None: ...
    def launch(self, tick, meta: torch.Tensor, codes: torch.Tensor, eager: bool) -> None: ...
    def collect(self, tick, meta: np.ndarray, same: np.ndarray, codec_ms) -> None: ...
    def hand_out(self, tick, rows: np.ndarray, frames: np.ndarray, streams: list) -> None: ...
    def end(self, stream: Stream, error: Exception | None) -> None: ...
    def reset_all(self, everything: torch.Tensor) -> None: ...
    def close(self) -> None: ...


class CpuCodecPath:
    """Chunks decoded on the codec worker's thread, in the order the engine thread hands them over."""

    overlaps, keeps_codes, captures_ticks, snapshots = False, True, False, True

    def __init__(self, codec: Codec, batch: int, device: torch.device, slots: Slots):
        self.worker = CodecWorker(codec, batch, device)
        self.codec_ms = self.worker.codec_ms
        self.batch, self.device, self.slots = batch, device, slots

    def mover_rows(self) -> dict:
        return {"codec_worker": self.worker}

    def set_decode_step(self, step: Callable | None) -> None:
        self.worker.set_decode_step(step)

    def queued(self) -> int:
        return self.worker.queued

    def warm(self, n: int) -> None:
        pass

    def start_rows(self, rows: list[int]) -> None:
        self.worker.reset(rows)

    def restored(self, rows: list[int]) -> None:
        pass

    def launch(self, tick, meta: torch.Tensor, codes: torch.Tensor, eager: bool) -> None:
        tick.meta = meta

    def collect(self, tick, meta: np.ndarray, same: np.ndarray, codec_ms) -> None:
        pass  # the worker times its own calls

    def hand_out(self, tick, rows: np.ndarray, frames: np.ndarray, streams: list) -> None:
        """Due chunks to the worker: first chunks in a job of their own, which goes ahead of the others' chunks
        (`CodecWorker`)."""
        keep = [i for i, s in enumerate(streams) if s is not None and not s.cancelled]
        sounded = [tick.utterances[rows[i]].sounded for i in keep]  # one pass: no list scan per row
        firsts = [i for i, was in zip(keep, sounded) if not was]
        for part, first in ((firsts, True), ([i for i, was in zip(keep, sounded) if was], False)):
            if part:
                rows_k = [int(rows[i]) for i in part]
                codes = self.slots.codes[torch.tensor(rows_k, device=self.device)]  # indexing copies
                self.worker.decode(rows_k, [streams[i] for i in part], codes, [int(frames[i]) for i in part], first)
        for i in firsts:
            tick.utterances[rows[i]].sounded = True

    def end(self, stream: Stream, error: Exception | None) -> None:
        """End after the audio already on its way to the stream (the worker keeps the order)."""
        self.worker.finish(stream, error)

    def reset_all(self, everything: torch.Tensor) -> None:
        self.worker.reset(list(range(self.batch)))

    def close(self) -> None:
        self.worker.close()


class FrameCodecPath:
    """Every completed frame decoded in the tick that made it; chunks handed out from the outbox."""

    overlaps, keeps_codes, captures_ticks, snapshots = True, False, True, False

    def __init__(self, codec: Codec, batch: int, device: torch.device, row_mask: Callable[[list[int]], torch.Tensor]):
        self.decoder = FrameCodec(codec, batch, device)
        self.outbox = AudioOutbox(batch, MAX_CHUNK, codec.cfg.hop)
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.device, self._row_mask = device, row_mask
        if device.type == "cuda":  # where each tick's table and audio reach the host, in turn
            self._pinned = [
                (
                    torch.zeros(batch, len(META), dtype=torch.long, pin_memory=True),
                    torch.zeros(batch, codec.cfg.hop, pin_memory=True),
                )
                for _ in range(4)
            ]
        self.codec_ms = Recent(FIGURES_KEPT, width=2)  # (ms, frames) per codec call
        self._resets: list[int] = []  # slots whose frame decoder state restarts at the next tick

    def mover_rows(self) -> dict:
        return {"frame_decoder": self.decoder, "outbox": self.outbox, "codec_stream": self.stream}

    def set_decode_step(self, step: Callable | None) -> None:
        pass  # the frame codec keeps its own

    def queued(self) -> int:
        return 0

    def warm(self, n: int) -> None:
        with torch.cuda.stream(self.stream) if self.stream else contextlib.nullcontext():
            self.decoder.prepare(n)

    def start_rows(self, rows: list[int]) -> None:
        self._resets += rows

    def restored(self, rows: list[int]) -> None:
        """The restored decoder state stands: no reset pending from the slot's last holder."""
        restored = set(rows)
        self._resets = [r for r in self._resets if r not in restored]

    def launch(self, tick, meta: torch.Tensor, codes: torch.Tensor, eager: bool) -> None:
        if self.device.type == "cuda":
            self._decode_cuda(tick, meta, codes, eager)
            return
        reset = self._take_resets()
        tick.timer.mark()
        tick.audio = self.decoder.run(tick.n, codes, meta[:, COMPLETED].bool(), reset).numpy().copy()
        tick.timer.mark()
        tick.meta = meta

    def _decode_cuda(self, tick, meta: torch.Tensor, codes: torch.Tensor, eager: bool) -> None:
        """The codec on its own CUDA stream, overlapping the next tick's step: it first copies what it reads of
        this tick's outputs (which the next tick's graph rewrites; the main stream waits for that copy only),
        then decodes and copies the audio to a pinned buffer of a small ring (no allocation per tick)."""
        n, timer, side = tick.n, tick.timer, cast(torch.cuda.Stream, self.stream)  # (a GPU has one)
        reset = self._take_resets()
        main = torch.cuda.current_stream(self.device)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            if reset is not None:
                reset.record_stream(side)
            if eager:  # eager outputs: fresh tensors, kept alive for the codec stream
                for t in (meta, codes):
                    t.record_stream(side)
            self.decoder.take(n, codes, meta[:, COMPLETED].bool(), reset)
            host_meta, host_audio = self._pinned[tick.serial % len(self._pinned)]
            host_meta[:n].copy_(meta, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record()
            timer.mark()
            audio = self.decoder.decode(n)
            timer.mark()
            host_audio[:n].copy_(audio, non_blocking=True)
            tick.ready = torch.cuda.Event()
            tick.ready.record()
        main.wait_event(copied)
        tick.meta, tick.audio = host_meta[:n], host_audio[:n]

    def collect(self, tick, meta: np.ndarray, same: np.ndarray, codec_ms) -> None:
        """The tick's frames into the outbox, but not those of a row restored since (it holds other audio)."""
        completed = np.flatnonzero(meta[:, COMPLETED] & same)
        audio = tick.audio.numpy() if isinstance(tick.audio, torch.Tensor) else tick.audio
        self.outbox.add(completed, meta[completed, PENDING] - 1, audio[completed])
        self.codec_ms.append((codec_ms, len(completed)))

    def hand_out(self, tick, rows: np.ndarray, frames: np.ndarray, streams: list) -> None:
        for row, count, stream in zip(rows, frames, streams):
            if stream is not None and not stream.cancelled:
                stream.deliver(self.outbox.chunk(row, count))

    def end(self, stream: Stream, error: Exception | None) -> None:
        stream.finish(error)

    def reset_all(self, everything: torch.Tensor) -> None:
        self._resets = []
        self.decoder.state.reset(everything)

    def close(self) -> None:
        pass

    def _take_resets(self) -> torch.Tensor | None:
        resets, self._resets = self._resets, []
        return self._row_mask(resets) if resets else None
