"""Selective attention masks, derived from positions only.

An audio query at frame ``t`` whose aligned phoneme is ``p`` may look at
  * every voice/sink prefix slot (always; those are scored without rotary phase),
  * text slots holding phoneme ``j`` with ``p - behind <= j <= p + ahead``,
  * audio slots holding frame ``s`` with ``t - window < s <= t``.
Empty slots hold position -1 and are never visible.

Worked example (behind=1, ahead=2, window=3): query t=10, p=4. Text slots holding phonemes
[2, 3, 4, 5, 6, 7] -> [F, T, T, T, T, F]. Audio slots holding frames [7, 8, 9, 10, -1] -> [F, T, T, T, F].
"""

from __future__ import annotations

import torch


def text_mask(query_phoneme: torch.Tensor, key_phoneme: torch.Tensor, behind: int, ahead: int) -> torch.Tensor:
    """(B, Tq) x (B, Tk) -> (B, Tq, Tk) bool."""
    offset = key_phoneme[:, None, :] - query_phoneme[:, :, None]
    return (key_phoneme[:, None, :] >= 0) & (offset >= -behind) & (offset <= ahead)


def audio_mask(query_frame: torch.Tensor, key_frame: torch.Tensor, window: int) -> torch.Tensor:
    """(B, Tq) x (B, Tk) -> (B, Tq, Tk) bool: causal, at most ``window`` frames back (self included)."""
    age = query_frame[:, :, None] - key_frame[:, None, :]
    return (key_frame[:, None, :] >= 0) & (age >= 0) & (age < window)
