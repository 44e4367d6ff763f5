"""Test helpers: a tiny random-weight engine for fast tests of everything around the model."""
from __future__ import annotations

import threading
import time

import torch

from streaming.engine import Engine
from tts.codec import CODEC_PRESETS, Codec
from tts.model import MODEL_PRESETS, TTSModel

VOICE_NAMES = ["joe", "slt", "rms", "kal", "awb"]


def tiny_model_and_codec() -> tuple[TTSModel, Codec, dict[str, dict]]:
    """A tiny random model and codec (the same weights on every call) and five voices for them."""
    torch.manual_seed(0)
    codec = Codec(CODEC_PRESETS["tiny"])
    codec.quantizer.codebooks.normal_()
    model = TTSModel(MODEL_PRESETS["tiny"])
    torch.nn.init.constant_(model.text.duration[-1].bias, 1.4)  # about 3 frames a unit, like speech
    voices = {n: {"name": n, "index": i, "description": "tiny random test voice", "teacher": "none",
                  "sample_rate": codec.cfg.sample_rate, "default": i == 0} for i, n in enumerate(VOICE_NAMES)}
    return model, codec, voices


def tiny_random(max_streams: int = 4, **kwargs) -> Engine:
    """An engine on the tiny random model and codec: real scheduling, streaming and audio shapes, noise for
    sound."""
    model, codec, voices = tiny_model_and_codec()
    return Engine(model, codec, voices, max_streams=max_streams, **kwargs)


def wait_until(condition, seconds: float = 10.0) -> bool:
    """Poll ``condition`` until it holds (True) or ``seconds`` pass (False)."""
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


def held_codec_worker(codec: Codec, slots: int):
    """A CPU `CodecWorker` whose first decode waits until the test sets the returned gate (so the test can queue
    jobs behind it): (worker, gate, lengths of the decodes run so far)."""
    from streaming.codec_worker import CodecWorker
    gate, lengths = threading.Event(), []

    def held(codes, state):
        lengths.append(codes.shape[-1])
        if len(lengths) == 1:
            gate.wait(30)
        return codec.decode_step(codes, state)

    worker = CodecWorker(codec, slots, "cpu")
    worker.set_decode_step(held)
    return worker, gate, lengths
