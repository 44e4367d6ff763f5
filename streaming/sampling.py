"""Token sampling on the device, without host syncs: top-k + temperature via the Gumbel-max trick.

The noise of each row comes from a counter-based hash of (the stream's seed, the step, the codebook, the
candidate's rank), computed on the device in the batched step. So a stream's draws depend on its own seed
and position only: the same seed gives the same tokens alone or in a busy batch, in any slot.
"""

from __future__ import annotations

import functools

import torch

_LOW32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (Wellons' lowbias32) on int64 tensors holding values in [0, 2**32). The products
    may wrap past 2**63; only their low 32 bits are kept, which wrapping leaves exact."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _LOW32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _LOW32
    return x ^ (x >> 16)


def stream_key(seed: torch.Tensor) -> torch.Tensor:
    """A stream's noise key (32 bits, in int64) from its seed (int64, any leading shape): computed once, when
    the stream starts."""
    return _mix32((seed & _LOW32) ^ _mix32((seed >> 32) & _LOW32))


def counter_uniform(key: torch.Tensor, step: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """Uniform noise in (0, 1), (B, *shape) float32, a pure function of key (B,) (`stream_key`), step (B,)
    and the index within ``shape``. Example: key 7, step 3 gives the same (K, J) block in any batch and row."""
    row = _mix32(key ^ (step & _LOW32))  # (B,)
    bits = _mix32((row[:, None, None] + _spread(shape, key.device)) & _LOW32)  # (B, K, J)
    return ((bits >> 8).float() + 0.5) * 2.0**-24  # 24 bits: exact in float32, never 0 or 1


@functools.lru_cache(maxsize=16)
def _spread(shape: tuple[int, int], device: torch.device) -> torch.Tensor:
    """Each index within ``shape`` times the golden ratio's 32-bit fraction: distinct, well spread offsets."""
    return (torch.arange(shape[0] * shape[1], device=device).view(shape) * 0x9E3779B9) & _LOW32


def sample(
    logits: torch.Tensor,
    temperature: float | torch.Tensor,
    top_k: int,
    generator: torch.Generator | None = None,
    key: torch.Tensor | None = None,
    step: torch.Tensor | None = None,
) -> torch.Tensor:
    """logits (B, K, N) -> tokens (B, K). ``temperature``: one for all rows (0 means greedy), or a positive
    (B, 1, 1) tensor, one per row (each stream samples at its voice's temperature, in the same batched step).
    With ``key`` and ``step`` ((B,) int64 each) the noise is `counter_uniform`'s; else ``generator``'s."""
    if not isinstance(temperature, torch.Tensor) and temperature <= 0:
        return logits.argmax(-1)
    values, indices = logits.float().topk(min(top_k, logits.shape[-1]), dim=-1)  # (B, K, top_k)
    if key is not None:
        uniform = counter_uniform(key, step, tuple(values.shape[1:]))
    else:
        uniform = torch.rand(values.shape, device=values.device, generator=generator).clamp_(1e-9, 1 - 1e-9)
    gumbel = -torch.log(-torch.log(uniform))
    choice = (values / temperature + gumbel).argmax(-1, keepdim=True)
    return indices.gather(-1, choice).squeeze(-1)
