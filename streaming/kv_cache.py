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
    """One ring, keys/values (B, H, C, D); or the rings of L layers that hold the same positions, stacked
    (L, B, H, C, D): `update` then writes every layer in one indexed store each, and `layers` are the
    per-layer rings, views of the stack. ``positions`` (B, C) long, -1 = empty, is shared by all layers."""

    keys: torch.Tensor  # (..., B, H, C, D)
    values: torch.Tensor  # (..., B, H, C, D)
    positions: torch.Tensor  # (B, C) long, -1 = empty

    @classmethod
    def empty(cls, *shape: int, device=None, dtype=torch.float32) -> RingKVCache:
        """Empty rings of keys/values ``shape`` (..., B, H, C, D)."""
        zeros = torch.zeros(shape, device=device, dtype=dtype)
        return cls(zeros, zeros.clone(), torch.full((shape[-4], shape[-2]), -1, dtype=torch.long, device=device))

    @property
    def capacity(self) -> int:
        return self.positions.shape[1]

    def layers(self) -> list[RingKVCache]:
        """The rings of a stack, layer l a view of ``keys[l]``/``values[l]``, all sharing ``positions``. Views
        by indexing, not unbind: unbind's views may not be written in place under autograd."""
        return [
            RingKVCache(self.keys[layer], self.values[layer], self.positions) for layer in range(self.keys.shape[0])
        ]

    def update(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        positions: torch.Tensor,
        keep: torch.Tensor | None = None,
        rows: torch.Tensor | None = None,
    ):
        """Write k, v (..., M, H, T, D) (the ring's leading layer dims, if any) at ``positions`` (M, T), which
        must be distinct modulo the capacity within a row. ``keep`` (M, T) bool says which entries to write
        (the others write nothing); without it, -1 positions write nothing. ``rows`` (M,) are the batch rows
        written (default: all, M = B). Returns the whole ring: (keys, values, positions).

        Example, capacity 4, one row: positions [5, 6, 7] with keep [T, T, F] write ring slots 1 and 2;
        slot 3 keeps what it held. Positions [5, -1, -1] without ``keep`` would send both -1 entries to
        slot 0: that is why a multi-entry write with holes passes ``keep`` and distinct positions.
        Stacked, L = 8: one indexed store for keys, one for values and one for positions, not 8 of each."""
        if keep is None:
            keep, positions = positions >= 0, positions.clamp(min=0)
        slots = positions % self.capacity  # (M, T)
        batch = (torch.arange(slots.shape[0], device=slots.device) if rows is None else rows)[:, None]  # (M, 1)
        written = keep[(..., *[None] * (k.dim() - 2))]  # (M, T, 1, ..., 1)
        # Indexed writes, not gather/scatter: inductor (torch 2.13) miscompiled the scatter form inside the step.
        # batch and slots broadcast to (M, T): ring[..., batch, :, slots, :] is (M, T, ..., H, D)
        for ring, new in ((self.keys, k), (self.values, v)):
            ring[..., batch, :, slots, :] = torch.where(
                written, new.movedim((-4, -2), (0, 1)), ring[..., batch, :, slots, :]
            )
        self.positions[batch, slots] = torch.where(keep, positions, self.positions[batch, slots])
        return self.keys, self.values, self.positions

    def view(self, n: int) -> RingKVCache:
        """The first ``n`` batch rows, sharing storage (writes through the view land in this ring)."""
        return RingKVCache(self.keys[..., :n, :, :, :], self.values[..., :n, :, :, :], self.positions[:n])

    def reset(self, mask: torch.Tensor) -> None:
        """Empty the rings of the batch slots where ``mask`` (B,) is true; other slots are untouched."""
        self.positions.masked_fill_(mask[:, None], -1)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.keys, self.values, self.positions))
