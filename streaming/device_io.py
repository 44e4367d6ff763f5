"""Small host tables onto the device without a host sync (through pinned memory on a GPU)."""

from __future__ import annotations

import numpy as np
import torch


class HostToDevice:
    """Uploads of the engine thread's small host lists and arrays to ``device``, whose slot batch is ``batch``."""

    def __init__(self, device: torch.device, batch: int):
        self.device, self.batch = device, batch

    def upload(self, values, dtype=torch.long) -> torch.Tensor:
        """A small host list/array on the device without a host sync (through pinned memory on a GPU)."""
        tensor = torch.as_tensor(np.asarray(values), dtype=dtype)
        if self.device.type == "cuda":
            return tensor.pin_memory().to(self.device, non_blocking=True)
        return tensor

    def columns(self, *columns, dtype=torch.long) -> tuple[torch.Tensor, ...]:
        """Several host columns of one length M on the device in one upload (`upload`): a (k, M) table, then
        its rows (views). Example: ([3, 5], [10, 12]) -> tensor([3, 5]), tensor([10, 12])."""
        return self.upload(np.array(columns), dtype).unbind(0)

    def row_mask(self, rows: list[int]) -> torch.Tensor:
        """(batch,) bool on the device, true at ``rows``: built on the host, one upload."""
        mask = np.zeros(self.batch, dtype=bool)
        mask[rows] = True
        return self.upload(mask, torch.bool)
