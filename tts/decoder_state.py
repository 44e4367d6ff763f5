"""The carried state of a streaming codec decoder, for a batch of streams (either decoder kind)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class DecoderState:
    """Carried decoder state for a batch of streams: conv histories, transposed-conv tails, LSTM (h, c).
    ``start``: the state of one stream (batch 1) that `reset` restores; None restores zeros."""

    buffers: list[torch.Tensor] = field(default_factory=list)
    lstm: tuple[torch.Tensor, torch.Tensor] | None = None
    start: DecoderState | None = None

    def reset(self, mask: torch.Tensor) -> None:
        """Return the streams where ``mask`` (B,) is true to the starting state (a masked write: no host sync)."""
        for i, buffer in enumerate(self.buffers):  # (B, C, N); the start's (1, C, N) broadcasts
            start = 0.0 if self.start is None else self.start.buffers[i]
            buffer.copy_(torch.where(mask[:, None, None], start, buffer))
        if self.lstm is not None:
            for i, part in enumerate(self.lstm):  # (1, B, H); the start's (1, 1, H) broadcasts
                start = 0.0 if self.start is None else self.start.lstm[i]
                part.copy_(torch.where(mask[None, :, None], start, part))

    def repeat(self, batch: int) -> DecoderState:
        """``batch`` streams, each in this one-stream state, which `reset` restores."""
        return DecoderState(
            [b.repeat(batch, 1, 1) for b in self.buffers],
            None if self.lstm is None else tuple(part.repeat(1, batch, 1) for part in self.lstm),
            self,
        )

    def select(self, index: torch.Tensor) -> DecoderState:
        """A copy holding the streams at ``index`` (M,), in that order, for a decode of those streams only."""
        return DecoderState(
            [b[index] for b in self.buffers], None if self.lstm is None else tuple(part[:, index] for part in self.lstm)
        )

    def write(self, index: torch.Tensor, sub: DecoderState) -> None:
        """Store ``sub`` (from `select` of the same ``index``, then stepped) back into those streams."""
        for buffer, new in zip(self.buffers, sub.buffers):
            buffer[index] = new
        if self.lstm is not None:
            for part, new in zip(self.lstm, sub.lstm):
                part[:, index] = new
