"""Codec decoding on its own thread, so that the next AR step runs while the last frames become audio.

On 2 CPU cores the AR step and the codec decoder each get one, and a frame tick costs the longer of the
two instead of their sum. The engine thread hands jobs over in order through a bounded queue (when the
codec is the slower, a full queue makes the engine wait), so a slot's reset, its chunks and its end are
handled in the order they were made, even when a new stream reuses the slot straight away.
"""
from __future__ import annotations

import queue
import threading
import time
import traceback
from collections import deque

import torch

from streaming.masks import slot_mask
from streaming.stream import Stream
from tts.codec import Codec


class CodecWorker:
    def __init__(self, codec: Codec, max_streams: int, device, depth: int = 64):
        self.codec = codec
        self.state = codec.init_state(max_streams, device)
        self.device = device
        self.jobs: queue.Queue = queue.Queue(maxsize=depth)
        self.codec_ms: deque[tuple[float, int]] = deque(maxlen=200_000)  # (ms, frames) per decode call
        threading.Thread(target=self._run, name="tts-codec", daemon=True).start()

    def reset(self, index: int) -> None:
        """A new stream starts in slot ``index``: its decoder state returns to the silent lead-in's."""
        self.jobs.put(("reset", index))

    def decode(self, slots: list[int], streams: list[Stream], frames: torch.Tensor) -> None:
        """Decode ``frames`` (M, K, T) codes of M slots (each continuing its own state) and deliver the audio."""
        self.jobs.put(("decode", slots, streams, frames))

    def finish(self, stream: Stream, error: Exception | None) -> None:
        """End ``stream`` once everything queued before has been delivered."""
        self.jobs.put(("finish", stream, error))

    def _run(self) -> None:
        torch.set_grad_enabled(False)
        while True:
            job = self.jobs.get()
            try:
                if job[0] == "reset":
                    self.state.reset(slot_mask(self.state.buffers[0].shape[0], job[1], self.device))
                elif job[0] == "decode":
                    self._decode(*job[1:])
                else:
                    job[1]._finish(job[2])
            except Exception as err:  # a bug must not leave readers hanging
                traceback.print_exc()
                from streaming.engine import EngineError
                streams = job[2] if job[0] == "decode" else [job[1]] if job[0] == "finish" else []  # reset: none
                for stream in streams:
                    stream._finish(EngineError(f"internal error: {err}"))

    def _decode(self, slots: list[int], streams: list[Stream], frames: torch.Tensor) -> None:
        started = time.perf_counter()
        select = torch.tensor(slots, device=self.device)
        sub = self.state.select(select)
        audio = self.codec.decoder.step(self.codec.quantizer.decode(frames), sub)[:, 0].float().cpu().numpy()
        self.state.write(select, sub)
        self.codec_ms.append(((time.perf_counter() - started) * 1000, frames.shape[0] * frames.shape[2]))
        for row, stream in enumerate(streams):
            if not stream.cancelled:
                stream._deliver(audio[row])
