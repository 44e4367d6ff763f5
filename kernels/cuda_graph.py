"""The decode step captured as a CUDA graph per slot bucket and replayed every frame tick.

All shapes are static (B slots, rings of fixed capacity), and the step only writes into the caches in
place, so one capture serves the whole life of the engine. Inputs are copied into static buffers.
"""

from __future__ import annotations

import torch

from streaming.step_caches import StepCaches, decode_step
from tts.model import TTSModel


class GraphedStep:
    kind = "cuda_graph"

    def __init__(self, model: TTSModel, caches: StepCaches, batch: int, device: torch.device | str):
        books = model.cfg.codebooks
        self.tokens = torch.full((batch, books), model.cfg.codebook_size, dtype=torch.long, device=device)
        self.frame = torch.zeros(batch, dtype=torch.long, device=device)
        self.phoneme = torch.zeros(batch, dtype=torch.long, device=device)
        self.active = torch.zeros(batch, dtype=torch.bool, device=device)  # all inactive: warm-up writes nothing
        args = (model, caches, self.tokens, self.frame, self.phoneme, self.active)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), torch.inference_mode():
            for _ in range(3):
                decode_step(*args)
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph), torch.inference_mode():
            self.logits = decode_step(*args)

    def __call__(self, model, caches, tokens, frame, phoneme, active) -> torch.Tensor:
        self.tokens.copy_(tokens)
        self.frame.copy_(frame)
        self.phoneme.copy_(phoneme)
        self.active.copy_(active)
        self.graph.replay()
        return self.logits


class CudaGraphSteps:
    """Step factory: a `GraphedStep` for each bucket of slots the engine asks for."""

    kind = "cuda_graph"

    def __call__(self, model: TTSModel, caches: StepCaches, batch: int, device) -> GraphedStep:
        return GraphedStep(model, caches, batch, device)
