"""Ring-buffered KV cache: fixed memory per stream, keys stored after rotary embedding.

Entry with position ``p`` lives in slot ``p % capacity``; the ring is never reordered or grown. Positions
are kept beside the keys (-1 = empty) and the attention masks are derived from them.

Worked example, capacity 4: positions 0..5 written one by one leave slots holding [4, 5, 2, 3]; writing
position 6 overwrites slot 2 -> [4, 5, 6, 3]. A window-4 query at position 6 sees 3, 4, 5, 6.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class RingKVCache:
    keys: torch.Tensor  # (B, H, C, D)
    values: torch.Tensor  # (B, H, C, D)
    positions: torch.Tensor  # (B, C) long, -1 = empty

    @classmethod
    def empty(cls, batch: int, heads: int, capacity: int, head_dim: int, device=None, dtype=torch.float32):
        zeros = torch.zeros(batch, heads, capacity, head_dim, device=device, dtype=dtype)
        return cls(zeros, zeros.clone(), torch.full((batch, capacity), -1, dtype=torch.long, device=device))

    @property
    def capacity(self) -> int:
        return self.positions.shape[1]

    def update(self, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor):
        """Write k, v (B, H, T, D) at ``positions`` (B, T) (distinct modulo capacity; -1 = write nothing).
        Returns the whole ring: (keys, values, positions)."""
        slots = positions.clamp(min=0) % self.capacity  # (B, T)
        keep = positions >= 0
        batch = torch.arange(slots.shape[0], device=slots.device)[:, None].expand_as(slots)
        # Indexed writes, not gather/scatter: inductor (torch 2.13) miscompiled the scatter form inside the step.
        self.keys[batch, :, slots] = torch.where(keep[..., None, None], k.transpose(1, 2), self.keys[batch, :, slots])
        self.values[batch, :, slots] = torch.where(keep[..., None, None], v.transpose(1, 2), self.values[batch, :, slots])
        self.positions[batch, slots] = torch.where(keep, positions, self.positions[batch, slots])
        return self.keys, self.values, self.positions

    def reset(self, mask: torch.Tensor) -> None:
        """Empty the rings of the batch slots where ``mask`` (B,) is true; other slots are untouched."""
        self.positions.masked_fill_(mask[:, None], -1)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.keys, self.values, self.positions))
