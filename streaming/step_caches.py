"""Per-slot decoding state on the device and the one batched AR step over it."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from streaming.kv_cache import RingKVCache
from streaming.masks import slot_mask
from streaming.sampling import sample
from tts.model import ModelConfig, TTSModel

# Text ring entries per slot. The step sees units p-behind..p+ahead of its aligned unit p (the mask); the rest
# of the ring holds units encoded ahead, written once when the text is encoded (see `streaming.slots`).
TEXT_RING = 32


@dataclass
class StepCaches:
    """Everything a batch of B streams attends to, all L layers stacked: the voice prefix ``sink_stack``,
    (L, B, H, S, D) keys and values, a text ring and an audio ring (`RingKVCache`s of (L, B, H, C, D) keys
    and values, their layers sharing one (B, C) positions tensor). Memory is fixed at construction, whatever
    the speech length. The stacks are the storage, so that a start or a text write stores all layers at
    once; ``sinks`` (per layer (keys, values) (B, H, S, D)), ``text`` and ``audio`` (per layer rings) are
    views of them, layer l of the stack, made once: what the step, the ONNX binding and parking read."""

    sink_stack: tuple[torch.Tensor, torch.Tensor]
    text_stack: RingKVCache
    audio_stack: RingKVCache

    def __post_init__(self):
        keys, values = self.sink_stack
        self.sinks = [(keys[layer], values[layer]) for layer in range(keys.shape[0])]
        self.text, self.audio = self.text_stack.layers(), self.audio_stack.layers()

    @classmethod
    def empty(
        cls, cfg: ModelConfig, batch: int, device=None, dtype=torch.float32, text_capacity: int = TEXT_RING
    ) -> StepCaches:
        if text_capacity <= cfg.behind + cfg.ahead:
            raise ValueError(
                f"a text ring of {text_capacity} cannot hold the {cfg.behind + cfg.ahead + 1} units a step attends to"
            )

        def rings(capacity: int) -> RingKVCache:
            return RingKVCache.empty(cfg.layers, batch, cfg.heads, capacity, cfg.head_dim, device=device, dtype=dtype)

        sinks = torch.zeros(cfg.layers, batch, cfg.heads, cfg.sinks, cfg.head_dim, device=device, dtype=dtype)
        return cls((sinks, sinks.clone()), rings(text_capacity), rings(cfg.window))

    @property
    def batch(self) -> int:
        return self.text_stack.positions.shape[0]

    def view(self, n: int) -> StepCaches:
        """The first ``n`` slots, sharing storage: a step over the view reads and writes these slots' caches."""
        return StepCaches(tuple(t[:, :n] for t in self.sink_stack), self.text_stack.view(n), self.audio_stack.view(n))

    def start(self, slots: torch.Tensor, prefix: tuple[torch.Tensor, torch.Tensor]) -> None:
        """Give ``slots`` (M,) fresh streams with the voice prefix ``prefix``, (L, M or 1, H, S, D) keys and
        values of all layers (`TTSModel.voice_prefix`): empty rings, the prefix copied in, one store each.
        No host sync."""
        for sinks, new in zip(self.sink_stack, prefix):
            sinks[:, slots] = new
        mask = slot_mask(self.batch, slots, self.text_stack.positions.device)
        self.text_stack.reset(mask)
        self.audio_stack.reset(mask)

    def rows(self) -> dict[str, torch.Tensor]:
        """The rings' per-slot tensors by name, batch first ("text.3.keys": layer 3's text-ring keys (B, H, R, D),
        "text.positions": (B, R), ...). The sinks are left out: they are the voice's prefix, rebuilt by `start`."""
        tensors = {}
        for kind, rings in (("text", self.text), ("audio", self.audio)):
            tensors[f"{kind}.positions"] = rings[0].positions
            for layer, ring in enumerate(rings):
                tensors[f"{kind}.{layer}.keys"], tensors[f"{kind}.{layer}.values"] = ring.keys, ring.values
        return tensors

    def write_text(
        self,
        text_kv: tuple[torch.Tensor, torch.Tensor],
        positions: torch.Tensor,
        keep: torch.Tensor | None = None,
        rows: torch.Tensor | None = None,
    ) -> None:
        """text_kv: keys, values (L, M, H, T, D) of units at ``positions`` (M, T) (`TTSModel.text_keys_values`);
        ``keep`` and ``rows`` as in `RingKVCache.update` (without ``keep``, -1 = nothing): all layers in one
        store each, a fixed number of torch calls whatever the depth."""
        self.text_stack.update(*text_kv, positions, keep, rows)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.sink_stack) + self.text_stack.nbytes + self.audio_stack.nbytes


def decode_step(
    model: TTSModel,
    caches: StepCaches,
    tokens: torch.Tensor,
    frame: torch.Tensor,
    phoneme: torch.Tensor,
    active: torch.Tensor,
) -> torch.Tensor:
    """One frame step for every slot: tokens (B, K) of the previous step, frame (B,) step index,
    phoneme (B,) aligned unit, active (B,) bool (inactive slots write nothing). -> logits (B, K, N)."""
    write_pos = torch.where(active, frame, -1)[:, None]

    def audio_kv(layer, k, v, _):
        return caches.audio[layer].update(k, v, write_pos)

    text = caches.text  # the per-layer views: the step indexes no stack
    logits = model(
        tokens[:, :, None],
        frame[:, None],
        phoneme[:, None],
        tuple(zip(*caches.sinks)),
        ([ring.keys for ring in text], [ring.values for ring in text]),
        text[0].positions,
        audio_kv,
    )
    return logits[:, :, 0]


def tick_step(
    model: TTSModel,
    caches: StepCaches,
    slots,
    n: int,
    temperature: float,
    top_k: int,
    step=decode_step,
    dry: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One frame tick of the first ``n`` slots on the device: plan (aligned units, who is ready), the AR step,
    sampling and the slots' bookkeeping (`streaming.slots.Slots`). Returns (meta (n, len(META)), codes (n, K)).
    ``temperature`` 0 samples greedily, else each slot samples at its own (``slots.temperature``). ``dry``
    runs plan, step and sampling with every slot inactive and changes nothing (a warm-up before a capture)."""
    unit, ready = slots.plan(n, caches.text_stack.positions[:n])
    if dry:
        ready = torch.zeros_like(ready)
    logits = step(model, caches, slots.tokens[:n], slots.step[:n], unit.clamp(min=0), ready)
    sampled = sample(
        logits, slots.temperature[:n] if temperature > 0 else 0.0, top_k, key=slots.key[:n], step=slots.step[:n]
    )
    if dry:
        return None, None
    return slots.advance(sampled, ready, unit, keep_codes=False)


class TickGraph:
    """`tick_step` of ``n`` slots captured as one CUDA graph: a steady-state tick is one launch, whatever
    the number of slots (the ~70 small kernels of plan, sampling and bookkeeping included). Every input is
    state the engine keeps in fixed device tensors (`Slots`, `StepCaches`), so the graph reads it where it
    lies; ``meta`` and ``codes`` are the graph's outputs, rewritten by each replay."""

    kind = "cuda_graph_tick"

    def __init__(self, model: TTSModel, caches: StepCaches, slots, n: int, temperature: float, top_k: int):
        args = (model, caches, slots, n, temperature, top_k)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            tick_step(*args, dry=True)  # lazy initialisation (cuBLAS, the noise table) outside the capture
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, capture_error_mode="thread_local"):
            self.meta, self.codes = tick_step(*args)

    def __call__(self) -> tuple[torch.Tensor, torch.Tensor]:
        self.graph.replay()
        return self.meta, self.codes
