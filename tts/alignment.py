"""Phoneme durations -> which unit each frame belongs to, and the teacher-forcing layout of a batch."""

from __future__ import annotations

import torch

from tts.delay import delay


def frame_phonemes(durations: torch.Tensor) -> torch.Tensor:
    """Unit index of every frame. Example: durations [2, 0, 3] -> [0, 0, 2, 2, 2] (unit 1 has no frames)."""
    return torch.repeat_interleave(torch.arange(len(durations), device=durations.device), durations)


def start_frames(durations: torch.Tensor) -> torch.Tensor:
    """First frame of every unit, along the last axis (any leading axes: a batch of rows).
    Example: [2, 0, 3] -> [0, 2, 2]; [[1, 1], [0, 4]] -> [[0, 1], [0, 0]]."""
    return torch.cumsum(durations, -1) - durations


def unrounded_frames(log_durations: torch.Tensor, rate: float | torch.Tensor = 1.0) -> torch.Tensor:
    """Frames of each unit from the text encoder's log(1 + frames) (the inverse of the training target
    ``log1p(durations)``), divided by ``rate`` (speed times the voice's pace; a tensor broadcasts per row).
    Example: log1p([3, 0, 5.6]) at rate 2 -> [1.5, 0, 2.8]."""
    return torch.expm1(log_durations.float()).clamp(min=0) / rate


def predicted_frames(log_durations: torch.Tensor, rate: float | torch.Tensor = 1.0) -> torch.Tensor:
    """`unrounded_frames`, rounded. Example: log1p([3, 0, 5.6]) at rate 2 -> [2, 0, 3] (1.5 rounds to even)."""
    return torch.round(unrounded_frames(log_durations, rate)).long()


def teacher_forcing_batch(items: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], codebook_size: int):
    """items: (units (N,), durations (N,), codes (K, T)) with durations.sum() == T.

    Returns padded tensors: units (B, N), starts (B, N), text_phoneme (B, N) (-1 = pad),
    inputs (B, K, S), targets (B, K, S) (-100 = no loss), frame_pos (B, S), step_phoneme (B, S),
    where S = T + K - 1 steps (see `tts.delay`)."""
    books = items[0][2].shape[0]
    n_max = max(len(u) for u, _, _ in items)
    s_max = max(c.shape[1] for _, _, c in items) + books - 1
    batch = len(items)
    units = torch.zeros(batch, n_max, dtype=torch.long)
    starts = torch.zeros(batch, n_max, dtype=torch.long)
    text_phoneme = torch.full((batch, n_max), -1, dtype=torch.long)
    inputs = torch.full((batch, books, s_max), codebook_size, dtype=torch.long)
    targets = torch.full((batch, books, s_max), -100, dtype=torch.long)
    step_phoneme = torch.zeros(batch, s_max, dtype=torch.long)
    for b, (u, d, codes) in enumerate(items):
        n, frames = len(u), codes.shape[1]
        units[b, :n], starts[b, :n], text_phoneme[b, :n] = u, start_frames(d), torch.arange(n)
        steps = delay(codes[None].long(), codebook_size)[0]  # (K, S)
        inputs[b, :, 1 : steps.shape[1]] = steps[:, :-1]
        valid = steps != codebook_size
        targets[b, :, : steps.shape[1]] = torch.where(valid, steps, torch.full_like(steps, -100))
        per_frame = frame_phonemes(d)
        step_phoneme[b, : steps.shape[1]] = per_frame[torch.arange(steps.shape[1]).clamp(max=frames - 1)]
        step_phoneme[b, steps.shape[1] :] = per_frame[-1]
    frame_pos = torch.arange(s_max).expand(batch, s_max).contiguous()
    return units, starts, text_phoneme, inputs, targets, frame_pos, step_phoneme
