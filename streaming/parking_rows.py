"""Where parked slots' rows live in memory: `RowLayout` (each tensor's place in one flat row) and `RowPool` (a
pool of such rows, pinned on a GPU, so that parking allocates nothing)."""

from __future__ import annotations

import hashlib
import heapq
import threading

import torch


class RowLayout:
    """One slot's rows of many batched tensors packed into one contiguous byte row, so that parking a stream
    is one batched gather into a staging buffer and one device -> host copy, and restoring it one host ->
    device copy and one batched scatter, instead of a gather, an allocation and a copy per tensor (~70).

    Each named (B, ...) tensor's row takes ``row.nbytes`` bytes at an offset aligned to 16 bytes. Worked
    example, {"keys": (B, 2, 3) float32, "step": (B,) int64, "live": (B,) bool}: keys at bytes 0..23, step at
    32..39, live at 48; a row is 64 bytes, and slot s's state is row s of each tensor, copied to bytes
    [0, 24), [32, 40), [48, 49) of its packed row. The copies go through `torch._foreach_copy_`, one call per
    dtype: a few kernel launches for any number of tensors and streams on a GPU, and little Python (the views
    of a slot's rows and of a staging row are built once)."""

    ALIGN = 16

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.entries = []  # (name, offset, nbytes, dtype, row shape)
        offset = 0
        for name, tensor in tensors.items():
            row = tensor[0]
            nbytes = row.numel() * row.element_size()
            self.entries.append((name, offset, nbytes, tensor.dtype, tuple(row.shape)))
            offset += -(-nbytes // self.ALIGN) * self.ALIGN
        self.row_bytes = offset
        self.fingerprint = hashlib.blake2b(repr((self.entries, offset)).encode(), digest_size=8).hexdigest()
        self._slots: dict[tuple[int, int], dict] = {}

    def views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """The named rows inside ``flat`` (row_bytes,) uint8, as (1, ...) views."""
        return {
            name: flat[offset : offset + nbytes].view(dtype).view((1,) + shape)
            for name, offset, nbytes, dtype, shape in self.entries
        }

    def packed(self, flat: torch.Tensor) -> dict[torch.dtype, list[torch.Tensor]]:
        """The rows inside ``flat`` as views without the batch dimension, grouped by dtype in entry order: one
        side of `copy` (build once for a buffer that is used again, such as a staging row)."""
        groups: dict[torch.dtype, list] = {}
        for _name, offset, nbytes, dtype, shape in self.entries:
            groups.setdefault(dtype, []).append(flat[offset : offset + nbytes].view(dtype).view(shape))
        return groups

    def slot(self, tensors: dict[str, torch.Tensor], slot: int) -> dict[torch.dtype, list[torch.Tensor]]:
        """Row ``slot`` of every tensor, grouped as in `packed` (kept: a slot's rows are views that never change)."""
        key = (id(tensors), slot)
        if key not in self._slots:
            groups: dict[torch.dtype, list] = {}
            for name, _, _, dtype, _ in self.entries:
                groups.setdefault(dtype, []).append(tensors[name].select(0, slot))
            self._slots[key] = groups
        return self._slots[key]

    def flatten(self, rows: dict[str, torch.Tensor], pin: bool = False) -> torch.Tensor:
        """Named (1, ...) rows (a parked state from disk or another engine) packed into one (row_bytes,) row
        (in pinned memory with ``pin``: its copy to the GPU is then asynchronous)."""
        flat = torch.zeros(self.row_bytes, dtype=torch.uint8, pin_memory=pin)
        for name, view in self.views(flat).items():
            view.copy_(rows[name])
        return flat

    @staticmethod
    def copy(targets: list[dict], sources: list[dict]) -> None:
        """Copy grouped rows (`packed`, `slot`) ``sources[i]`` into ``targets[i]``: one `torch._foreach_copy_`
        per dtype for all of them."""
        pairs: dict[torch.dtype, tuple[list, list]] = {}
        for target, source in zip(targets, sources):
            for dtype, views in target.items():
                dst, src = pairs.setdefault(dtype, ([], []))
                dst += views
                src += source[dtype]
        for dst, src in pairs.values():
            torch._foreach_copy_(dst, src)


class RowPool:
    """Packed rows (`RowLayout`) for parked states, reserved once: one (rows, row_bytes) uint8 slab, pinned on a
    GPU, and a free list, so that a park takes rows and allocates nothing. A fresh pinned block is a
    cudaHostAlloc (PyTorch's caching allocator rounds a shipped state's 2,202,224-byte row up to a 4 MiB block,
    and pinning it costs milliseconds); allocated per park, every park beyond the blocks warmed at start paid
    it on the engine thread, inside the park's timing.

    Bound: ``rows`` = min(max_open, min(pinned_bytes, max_host_bytes) // row_bytes): never more rows than
    streams that can be parked at once (every open stream), nor more bytes than the host tier may hold or the
    pinned reservation allows. Worked example, the shipped model's row with the frame codec (2,202,224 bytes,
    87 tensors) and the defaults (1 GiB each): 1,024 open streams get 1,073,741,824 // 2,202,224 = 487 rows
    (1,072,483,088 bytes); 64 open streams get 64 rows (141 MB). PyTorch's pinned allocator rounds the slab up
    to a power of two (64 rows: a 256 MiB block, 256 rows: 564 MB in a 1 GiB block), as it rounded every
    per-park row (2.2 MB in a 4 MiB block). A park that finds no free row still works: its row comes from
    PyTorch's allocator as before (counted in ``misses``), and a spill to disk gives a pool row back.

    A row given back is free at once for the device: every device access to the slab (a park's copy into a row,
    a restore's copy out of it) is queued on the engine's one CUDA stream, in order, so a later park's copy into
    a row runs after an earlier restore's copy out of it; the host reads a row only once its park's copy is done
    (`Parked.settled`, the spill's wait). The host writes one (a load from disk) only once the device's last
    copy out of or into it is done (a restore's or a park's: the CUDA event the row was given back with), so
    the two kinds of taker pick differently (`take`, `take_settled`), from one free list kept in the order the
    rows came back. Worked example, 4 rows, free [0, 1, 2, 3] at start (never used, nothing to wait for):
    a park of 2 takes 0, 1 (the lowest: consecutive rows, one copy); a restore gives 1 back with its event e1,
    still queued on the device: free [2, 3, 1]; a load takes 2, the first whose event is done, without waiting
    (lowest-first, it took 1 and waited for e1, behind the tick in flight, inside the load's timing: the suspect
    for the H200's load p99 of 10-15 ms, `ParkingStore` times the wait as ``load_row_wait``); a park of 2 then
    takes 1, 3 (its copy queues after e1). Only if every free row's event is pending does a load wait, for the
    oldest given back (the device runs its copies in order: the first done). On the CPU every copy is done when
    it returns (no events)."""

    def __init__(self, rows: int, row_bytes: int, pin: bool):
        self.slab = torch.empty(max(rows, 0), row_bytes, dtype=torch.uint8, pin_memory=pin)  # (rows, row_bytes)
        self._views = list(self.slab.unbind(0))  # row r as a (row_bytes,) view, made once
        # free row -> the CUDA event it was given back with (None: nothing to wait for), oldest given back first
        self._free: dict[int, object] = dict.fromkeys(range(len(self.slab)))
        # the engine thread takes and gives back, an I/O thread takes (load) and gives back (spill); re-entrant:
        # a state's `Parked.__del__` may give its row back from a garbage collection that runs inside `take`
        self._lock = threading.RLock()
        self.misses = 0  # rows asked for while none was free

    @property
    def rows(self) -> int:
        return len(self.slab)

    @property
    def in_use(self) -> int:
        return self.rows - len(self._free)

    def row(self, row: int) -> torch.Tensor:
        """Slab row ``row``, (row_bytes,) uint8."""
        return self._views[row]

    def take(self, n: int) -> list[int | None]:
        """``n`` rows for the device to write (a park: its copies queue after any given-back row's), ascending,
        the lowest free first (a batch's rows run: `runs`); None for each that none is left for (``misses``)."""
        with self._lock:
            got = heapq.nsmallest(n, self._free)  # a copy first: a give from a collection may come meanwhile
            for row in got:
                del self._free[row]
            self.misses += n - len(got)
        return got + [None] * (n - len(got))

    def take_settled(self) -> int | None:
        """One row for the host to write (a load from disk): the first free row, oldest given back first, whose
        device copy is done (its event's query, no wait); else the oldest given back, once its copy is done
        (a wait); None if none is free (``misses``). Example: free [2, 3, 1] with 1's event pending -> 2."""
        with self._lock:
            if not self._free:
                self.misses += 1
                return None
            order = list(self._free)  # oldest given back first (a copy: a give may come meanwhile)
            row = next((r for r in order if self._free[r] is None or self._free[r].query()), None)
            pending = None if row is not None else self._free[order[0]]  # none is done: wait for the oldest
            row = order[0] if row is None else row
            del self._free[row]
        if pending is not None:  # outside the lock (the engine thread takes and gives meanwhile); a wait lets the
            pending.synchronize()  # GIL go, and may wait to get it back behind the engine thread: never if done
        return row

    def give(self, row: int, after=None) -> None:
        """Row ``row`` back, last in the order (`take_settled`); ``after``: a CUDA event recorded after the last
        device copy out of or into it."""
        with self._lock:
            self._free[row] = after

    @staticmethod
    def runs(rows: list[int | None]) -> list[tuple[int, int, int]]:
        """(position, first row, count) of each run of consecutive slab rows at consecutive positions of
        ``rows`` (None: not a pool row, left out), so that copying a batch between its staging rows (position
        i <-> staging row i) and the slab is one copy per run. Example: [4, 5, 6, None, 9, 10, 2] -> (0, 4, 3),
        (4, 9, 2), (6, 2, 1): staging rows 0..2 <-> slab rows 4..6, 4..5 <-> 9..10, 6 <-> 2."""
        out: list[tuple[int, int, int]] = []
        for i, row in enumerate(rows):
            if row is None:
                continue
            if out and out[-1][0] + out[-1][2] == i and out[-1][1] + out[-1][2] == row:
                out[-1] = (out[-1][0], out[-1][1], out[-1][2] + 1)
            else:
                out.append((i, row, 1))
        return out
