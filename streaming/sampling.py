"""Token sampling on the device, without host syncs: top-k + temperature via the Gumbel-max trick."""
from __future__ import annotations

import torch


def sample(logits: torch.Tensor, temperature: float | torch.Tensor, top_k: int,
           generator: torch.Generator | None = None):
    """logits (B, K, N) -> tokens (B, K). ``temperature``: one for all rows (0 means greedy), or a positive
    (B, 1, 1) tensor, one per row (each stream samples at its voice's temperature, in the same batched step)."""
    if not isinstance(temperature, torch.Tensor) and temperature <= 0:
        return logits.argmax(-1)
    values, indices = logits.float().topk(min(top_k, logits.shape[-1]), dim=-1)  # (B, K, top_k)
    uniform = torch.rand(values.shape, device=values.device, generator=generator).clamp_(1e-9, 1 - 1e-9)
    gumbel = -torch.log(-torch.log(uniform))
    choice = (values / temperature + gumbel).argmax(-1, keepdim=True)
    return indices.gather(-1, choice).squeeze(-1)
