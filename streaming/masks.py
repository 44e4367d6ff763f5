"""Masks of the streaming side. The attention masks are defined in `tts.masks` (the model needs them and
`tts` imports nothing from `streaming`); they are re-exported here for the streaming code."""

from __future__ import annotations

import torch

from tts.masks import audio_mask, text_mask

__all__ = ["audio_mask", "text_mask", "slot_mask"]


def slot_mask(batch: int, slots: int | torch.Tensor, device=None) -> torch.Tensor:
    """(batch,) bool, true at ``slots`` (one index or a (M,) tensor of them): what the per-slot states'
    ``reset(mask)`` take, so starting streams empties their own slots and leaves the others untouched.
    Example: batch 4, slots [0, 2] -> [T, F, T, F]."""
    mask = torch.zeros(batch, dtype=torch.bool, device=device)
    mask[slots] = True
    return mask
