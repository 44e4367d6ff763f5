"""Per-slot decoding state on the device and the one batched AR step over it."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from streaming.kv_cache import RingKVCache
from streaming.masks import slot_mask
from tts.model import ModelConfig, TTSModel


@dataclass
class StepCaches:
    """Everything a batch of B streams attends to: per layer the voice prefix (B, H, S, D) keys/values,
    a text ring and an audio ring. Memory is fixed at construction, whatever the speech length."""
    sinks: list[tuple[torch.Tensor, torch.Tensor]]
    text: list[RingKVCache]
    audio: list[RingKVCache]

    @classmethod
    def empty(cls, cfg: ModelConfig, batch: int, device=None, dtype=torch.float32) -> "StepCaches":
        def rings(capacity):  # every layer's ring holds the same positions: share one tensor
            first = RingKVCache.empty(batch, cfg.heads, capacity, cfg.head_dim, device, dtype)
            rest = [RingKVCache(torch.zeros_like(first.keys), torch.zeros_like(first.values), first.positions)
                    for _ in range(cfg.layers - 1)]
            return [first, *rest]
        sink = torch.zeros(batch, cfg.heads, cfg.sinks, cfg.head_dim, device=device, dtype=dtype)
        return cls([(sink.clone(), sink.clone()) for _ in range(cfg.layers)], rings(cfg.text_slots),
                   rings(cfg.window))

    def start(self, slot: int, prefix: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Give ``slot`` a fresh stream with the voice prefix ``prefix`` (per layer (1, H, S, D) keys/values)."""
        mask = slot_mask(self.text[0].positions.shape[0], slot, self.text[0].positions.device)
        for (keys, values), (pk, pv), text, audio in zip(self.sinks, prefix, self.text, self.audio):
            keys[slot], values[slot] = pk[0], pv[0]
            text.reset(mask)
            audio.reset(mask)

    def write_text(self, text_kv: list[tuple[torch.Tensor, torch.Tensor]], positions: torch.Tensor) -> None:
        """text_kv: per layer (B, H, R, D) keys/values of units at ``positions`` (B, R), -1 = nothing."""
        for ring, (k, v) in zip(self.text, text_kv):
            ring.update(k, v, positions)

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
