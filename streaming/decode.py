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
    """Everything a batch of B streams attends to: per layer the voice prefix (B, H, S, D) keys/values,
    a text ring and an audio ring. Memory is fixed at construction, whatever the speech length.
    ``text_stack``: every layer's text-ring keys and values as one (L, B, H, C, D) tensor each, whose layer l
    is ``text[l].keys``/``.values`` (`empty` allocates them so), so that `write_text` writes all layers in one
    indexed store; None (caches put together otherwise) writes layer by layer."""
    sinks: list[tuple[torch.Tensor, torch.Tensor]]
    text: list[RingKVCache]
    audio: list[RingKVCache]
    text_stack: tuple[torch.Tensor, torch.Tensor] | None = None
    sink_stack: tuple[torch.Tensor, torch.Tensor] | None = None  # the same for the prefix: (L, B, H, S, D) each

    @classmethod
    def empty(cls, cfg: ModelConfig, batch: int, device=None, dtype=torch.float32,
              text_capacity: int = TEXT_RING) -> "StepCaches":
        def rings(capacity) -> tuple[list[RingKVCache], tuple[torch.Tensor, torch.Tensor]]:
            # every layer's ring holds the same positions: one tensor; its keys/values: layer l of one stack each
            keys = torch.zeros(cfg.layers, batch, cfg.heads, capacity, cfg.head_dim, device=device, dtype=dtype)
            values = torch.zeros_like(keys)
            positions = torch.full((batch, capacity), -1, dtype=torch.long, device=device)
            return [RingKVCache(keys[layer], values[layer], positions) for layer in range(cfg.layers)], (keys, values)
        if text_capacity <= cfg.behind + cfg.ahead:
            raise ValueError(f"a text ring of {text_capacity} cannot hold the {cfg.behind + cfg.ahead + 1} units "
                             "a step attends to")
        sink_keys = torch.zeros(cfg.layers, batch, cfg.heads, cfg.sinks, cfg.head_dim, device=device, dtype=dtype)
        sink_values = torch.zeros_like(sink_keys)
        text, stack = rings(text_capacity)
        return cls([(sink_keys[layer], sink_values[layer]) for layer in range(cfg.layers)], text, rings(cfg.window)[0],
                   stack, (sink_keys, sink_values))

    @property
    def batch(self) -> int:
        return self.text[0].positions.shape[0]

    def view(self, n: int) -> "StepCaches":
        """The first ``n`` slots, sharing storage: a step over the view reads and writes these slots' caches.
        Layers keep sharing one positions tensor per ring kind, as in the full caches."""
        def rings(full):
            positions = full[0].positions[:n]
            return [RingKVCache(r.keys[:n], r.values[:n], positions) for r in full]
        stack = None if self.text_stack is None else tuple(t[:, :n] for t in self.text_stack)
        sinks = None if self.sink_stack is None else tuple(t[:, :n] for t in self.sink_stack)
        return StepCaches([(k[:n], v[:n]) for k, v in self.sinks], rings(self.text), rings(self.audio), stack, sinks)

    def start(self, slots: int | torch.Tensor, prefix: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Give ``slots`` (one index, or a (M,) tensor of them) fresh streams with the voice prefix ``prefix``
        (per layer (1 or M, H, S, D) keys/values): empty rings, prefix copied in. No host sync."""
        mask = slot_mask(self.batch, slots, self.text[0].positions.device)
        for (keys, values), (pk, pv) in zip(self.sinks, prefix):
            keys[slots], values[slots] = (pk[0], pv[0]) if isinstance(slots, int) else (pk, pv)
        self.text[0].reset(mask)  # one positions tensor per ring kind
        self.audio[0].reset(mask)

    def start_stacked(self, slots: torch.Tensor, prefix: tuple[torch.Tensor, torch.Tensor]) -> None:
        """`start` of ``slots`` (M,) with the prefix of all layers stacked, (L, M, H, S, D) keys and values: one
        store each with ``sink_stack`` (caches put together otherwise: layer by layer, the same values)."""
        if self.sink_stack is None:
            return self.start(slots, [(keys, values) for keys, values in zip(*prefix)])
        for sinks, new in zip(self.sink_stack, prefix):
            sinks[:, slots] = new
        mask = slot_mask(self.batch, slots, self.text[0].positions.device)
        self.text[0].reset(mask)  # one positions tensor per ring kind
        self.audio[0].reset(mask)

    def rows(self) -> dict[str, torch.Tensor]:
        """The rings' per-slot tensors by name, batch first ("text.3.keys": layer 3's text-ring keys (B, H, R, D),
        "text.positions": (B, R), ...). The sinks are left out: they are the voice's prefix, rebuilt by `start`."""
        tensors = {}
        for kind, rings in (("text", self.text), ("audio", self.audio)):
            tensors[f"{kind}.positions"] = rings[0].positions
            for layer, ring in enumerate(rings):
                tensors[f"{kind}.{layer}.keys"], tensors[f"{kind}.{layer}.values"] = ring.keys, ring.values
        return tensors

    def write_text(self, text_kv: list[tuple[torch.Tensor, torch.Tensor]], positions: torch.Tensor,
                   keep: torch.Tensor | None = None, rows: torch.Tensor | None = None) -> None:
        """text_kv: per layer (M, H, T, D) keys/values of units at ``positions`` (M, T); ``keep`` and ``rows``
        as in `RingKVCache.update` (without ``keep``, -1 = nothing). With ``text_stack``, all layers in one
        store (the same values land in the same places: a fixed number of torch calls whatever the layers)."""
        if self.text_stack is None:
            for ring, (k, v) in zip(self.text, text_kv):
                ring.update(k, v, positions, keep, rows)
            return
        self.write_text_stacked(tuple(torch.stack([kv[i] for kv in text_kv]) for i in (0, 1)), positions, keep, rows)

    def write_text_stacked(self, text_kv: tuple[torch.Tensor, torch.Tensor], positions: torch.Tensor,
                           keep: torch.Tensor | None = None, rows: torch.Tensor | None = None) -> None:
        """`write_text` of keys, values stacked (L, M, H, T, D) (`TTSModel.text_keys_values_stacked`)."""
        if self.text_stack is None:
            return self.write_text(list(zip(*text_kv)), positions, keep, rows)
        RingKVCache.update_layers(self.text_stack, text_kv, self.text[0].positions, positions, keep, rows)

    @property
    def nbytes(self) -> int:
        sinks = sum(k.numel() * k.element_size() * 2 for k, _ in self.sinks)
        rings = sum(r.keys.nbytes + r.values.nbytes for r in self.text + self.audio)
        return sinks + rings + self.text[0].positions.nbytes + self.audio[0].positions.nbytes


def decode_step(model: TTSModel, caches: StepCaches, tokens: torch.Tensor, frame: torch.Tensor,
                phoneme: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
    """One frame step for every slot: tokens (B, K) of the previous step, frame (B,) step index,
    phoneme (B,) aligned unit, active (B,) bool (inactive slots write nothing). -> logits (B, K, N)."""
    write_pos = torch.where(active, frame, -1)[:, None]

    def audio_kv(layer, k, v, _):
        return caches.audio[layer].update(k, v, write_pos)

    text_kv = [(ring.keys, ring.values) for ring in caches.text]
    logits = model(tokens[:, :, None], frame[:, None], phoneme[:, None], caches.sinks, text_kv,
                   caches.text[0].positions, audio_kv)
    return logits[:, :, 0]


def tick_step(model: TTSModel, caches: StepCaches, slots, n: int, temperature: float, top_k: int,
              step=decode_step, dry: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """One frame tick of the first ``n`` slots on the device: plan (aligned units, who is ready), the AR step,
    sampling and the slots' bookkeeping (`streaming.slots.Slots`). Returns (meta (n, len(META)), codes (n, K)).
    ``temperature`` 0 samples greedily, else each slot samples at its own (``slots.temperature``). ``dry``
    runs plan, step and sampling with every slot inactive and changes nothing (a warm-up before a capture)."""
    unit, ready = slots.plan(n, caches.text[0].positions[:n])
    if dry:
        ready = torch.zeros_like(ready)
    logits = step(model, caches, slots.tokens[:n], slots.step[:n], unit.clamp(min=0), ready)
    sampled = sample(logits, slots.temperature[:n] if temperature > 0 else 0.0, top_k, key=slots.key[:n],
                     step=slots.step[:n])
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
