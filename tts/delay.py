"""Delay pattern: codebook k of frame f is produced at step f + k, so one step yields one token of
every codebook and the finer codebooks see the coarser ones of the same frame.

Worked example, K=3 codebooks, T=2 frames a, b (``_`` = nothing):

    frame codes      step:  0   1   2   3
    k=0: a0 b0               a0  b0  _   _
    k=1: a1 b1       ->      _   a1  b1  _
    k=2: a2 b2               _   _   a2  b2

There are T + K - 1 steps. Step s takes the tokens of step s - 1 as input (all ``_`` at step 0), where
``_`` is the token id ``codebook_size``.
"""

from __future__ import annotations

import torch


def delay(codes: torch.Tensor, empty: int) -> torch.Tensor:
    """(B, K, T) frame codes -> (B, K, T + K - 1) step tokens, ``empty`` where a codebook has nothing."""
    batch, books, frames = codes.shape
    out = codes.new_full((batch, books, frames + books - 1), empty)
    for k in range(books):
        out[:, k, k : k + frames] = codes[:, k]
    return out


def undelay(steps: torch.Tensor) -> torch.Tensor:
    """(B, K, S) step tokens -> (B, K, S - K + 1) frame codes: the inverse of `delay`."""
    books = steps.shape[1]
    frames = steps.shape[2] - books + 1
    return torch.stack([steps[:, k, k : k + frames] for k in range(books)], dim=1)
