"""The decode step compiled by TorchInductor for the CPU.

A one-frame step for a few slots is hundreds of tiny ops (B x 1 token, d256), so eager PyTorch spends most
of it in per-op dispatch. Inductor fuses the elementwise work (RoPE, masks, softmax, ring writes) into
a few C++ loops around the matmuls. Shapes are static, so one compile serves the engine's whole life.
Kill switch: TTS_NO_COMPILE=1. Compiling takes tens of seconds (less with a warm inductor cache), so
long-lived engines (the server, benchmarks) use it and one-shot ones (``tts say``) do not.
"""

from __future__ import annotations

import warnings

import torch

from streaming.step_caches import StepCaches, decode_step
from tts.model import TTSModel


class CompiledStep:
    kind = "compiled"

    def __init__(self, model: TTSModel, caches: StepCaches, batch: int, device: torch.device | str):
        # One graph per batch size: a process that builds several engines (benchmarks, tests) needs more than
        # dynamo's default of 8, past which fullgraph=True fails instead of falling back.
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        self.step = torch.compile(decode_step, dynamic=False, fullgraph=True)
        books = model.cfg.codebooks
        tokens = torch.full((batch, books), model.cfg.codebook_size, dtype=torch.long, device=device)
        frame, phoneme = (torch.zeros(batch, dtype=torch.long, device=device) for _ in range(2))  # distinct, as
        inactive = torch.zeros(batch, dtype=torch.bool, device=device)  # in serving; warm-up writes nothing
        with torch.no_grad():  # the grad mode the engine thread steps in, so that this graph is the one it uses
            self.step(model, caches, tokens, frame, phoneme, inactive)

    def __call__(self, model, caches, tokens, frame, phoneme, active) -> torch.Tensor:
        try:
            return self.step(model, caches, tokens, frame, phoneme, active)
        except Exception as err:  # a recompile that fails mid-serving must not fail the streams
            warnings.warn(f"compiled decode step failed, continuing eagerly: {err}")
            self.step = decode_step
            return decode_step(model, caches, tokens, frame, phoneme, active)
