"""A parked stream's state as one raw file: the disk tier of `streaming.parking.ParkingStore`.

The file holds the packed row (`RowLayout`, ``Parked.flat``) as it is in memory and, after it, the few rows
outside the layout (``Parked.loose``: the CPU codec worker's decoder rows, the frame codec's audio outbox) packed
the same way, behind a small header. Writing is one ``os.writev`` straight from the rows' memory (no per-view
copy, no serialiser); reading is one ``os.readv`` of the whole file, the packed row straight into a free row
of the parking pool (`RowPool`, pinned on a GPU) and the rest into a small buffer (into one fresh buffer when no
pool row is free), so a state back from disk is restored by the same packed copy as one that never left host
memory. Few calls matter more than few bytes here: each call that releases
the GIL may wait for it behind the engine thread, so a load is one allocation, open, fstat, one read, close and
two numpy reductions, whatever the number of rows (whose views are numpy's, `unpack_loose`).

Layout of a file (little endian; every part starts at a multiple of 16 bytes)::

    b"TTSPARK1"  u32 header length H  header (JSON, space-padded)  flat row  loose rows (packed, `pack_loose`)

The header names the format, the layout's fingerprint (`RowLayout.fingerprint`), the byte counts, each loose
row's (name, dtype, shape, offset, byte count) and a checksum of the payload (the sum and the xor of its 64-bit
words: ~0.1 ms for 2 MB, where CRC-32 took 1.2 ms on 2 cores). The writer keeps the header (`FileInfo`), and the
reader takes the file only if its header is that very one and its length is the one the header gives. Worked
example: a 2,156,000-byte flat row, one loose (1, 480) float32 outbox (1,920 bytes) and a header of
H = 228 bytes (padded so that 12 + H = 240 is a multiple of 16): the flat row is at bytes 240 .. 2,156,240, the
outbox at 2,156,240 .. 2,158,160, and the file is 2,158,160 bytes long; a file of any other length, or with
another header, is truncated or foreign, and a payload whose checksum differs is damaged (`CorruptParkedFile`).

A file is written under a temporary name and renamed when complete, so a reader never sees half of one. No
fsync: these files live no longer than the process that wrote them (they are removed on restore, cancel and
close), so the page cache is the tier; durability across a crash would cost a disk flush per park.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

MAGIC = b"TTSPARK1"
FILE_FORMAT = "tts-parked-file/2"
ALIGN = 16  # every part of a file starts at a multiple of this (a row's views need their dtype's alignment)
_PREFIX = struct.Struct("<8sI")  # magic, header length


class CorruptParkedFile(ValueError):
    """A parked state's file is truncated, damaged or not the one written: the state cannot be read back."""


@dataclass(frozen=True)
class FileInfo:
    """What the writer of a parked state's file keeps in memory to read it back: the file's first bytes
    (prefix and header), its length, and where its rows are in it."""

    head: bytes
    size: int
    flat_bytes: int
    loose: tuple  # (name, dtype name, shape, offset in the loose part, byte count)
    checksum: tuple[int, int]


def write_state(
    path: str, flat: torch.Tensor | None, loose: dict[str, torch.Tensor], fingerprint: str | None
) -> FileInfo:
    """Write one parked state (its packed ``flat`` row, may be None, and its ``loose`` rows) to ``path`` via a
    temporary name. On any error (a full disk) the temporary file is removed and the error raised: the caller
    keeps the state in memory."""
    flat = torch.empty(0, dtype=torch.uint8) if flat is None else flat
    packed, entries = pack_loose(loose)
    payload = [_words(flat), _words(packed)]
    checksum = _checksum(payload)
    header = json.dumps(
        {
            "format": FILE_FORMAT,
            "layout": fingerprint,
            "flat": flat.nbytes,
            "loose": entries,
            "checksum": list(checksum),
        }
    ).encode()
    header += b" " * (-(_PREFIX.size + len(header)) % ALIGN)
    head = _PREFIX.pack(MAGIC, len(header)) + header
    info = FileInfo(head, len(head) + flat.nbytes + packed.nbytes, flat.nbytes, tuple(map(tuple, entries)), checksum)
    temporary = path + ".tmp"
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        _transfer(os.writev, fd, [memoryview(head)] + [memoryview(words).cast("B") for words in payload])
    except BaseException:
        os.close(fd)
        remove_file(temporary)
        raise
    os.close(fd)
    os.replace(temporary, path)
    return info


def read_state(
    path: str, info: FileInfo, pin: bool = False, into: torch.Tensor | None = None
) -> tuple[torch.Tensor | None, dict[str, torch.Tensor]]:
    """(flat row, loose rows) of the file `write_state` wrote with ``info``: views of one buffer, pinned with
    ``pin``; or, given ``into`` (a (flat_bytes,) uint8 row: a parking pool's, `RowPool`), the packed row is read
    straight into it and only the header and loose rows get a buffer of their own. Why: a fresh pinned block for
    a 2.2 MB row is a cudaHostAlloc of milliseconds on a GPU host, and with parks taking pool rows no freed
    per-park block is left cached for it (H200, 64 loads at once: p50 1.3-1.8 -> 8.1-8.8 ms without ``into``).
    Example, a 512-byte head, 2,202,224-byte row, 96 loose bytes: one readv into [buffer[0:512], into,
    buffer[512:608]]. Raises `CorruptParkedFile` for a truncated, damaged or foreign file (OSError if it cannot
    be read)."""
    if into is not None and into.numel() != info.flat_bytes:
        into = None  # another layout's row size: a buffer of its own
    start = len(info.head)
    # with ``into`` the rest is the header and the loose rows, which the host reads (the frame codec's outbox, the
    # CPU codec worker's rows): pageable, as a fresh pinned block of any size is a cudaHostAlloc
    buffer = torch.empty(
        info.size - (0 if into is None else info.flat_bytes), dtype=torch.uint8, pin_memory=pin and into is None
    )
    parts = [buffer] if into is None else [buffer[:start], into, buffer[start:]]
    with open(path, "rb", buffering=0) as file:
        size = os.fstat(file.fileno()).st_size
        if size != info.size:
            raise CorruptParkedFile(f"{path}: {size} bytes, not the {info.size} written (truncated or extended)")
        read = _transfer(os.readv, file.fileno(), [memoryview(part.numpy()) for part in parts])
    if read != info.size or bytes(buffer[:start].numpy()) != info.head:
        raise CorruptParkedFile(f"{path}: not the header written (another file, or damaged)")
    payload = [buffer[start:]] if into is None else [into, buffer[start:]]
    if _checksum([_words(part) for part in payload]) != info.checksum:  # sum and xor: any split of the words
        raise CorruptParkedFile(f"{path}: the payload's checksum differs (the file is damaged)")
    flat = buffer[start : start + info.flat_bytes] if into is None else into
    loose = buffer[start + info.flat_bytes :] if into is None else buffer[start:]
    return (flat if info.flat_bytes else None), unpack_loose(loose, info.loose)


def pack_loose(loose: dict[str, torch.Tensor]) -> tuple[torch.Tensor, list]:
    """Named rows packed into one uint8 tensor, each at a multiple of ALIGN bytes, and their entries (name,
    dtype, shape, offset, byte count). Example: {"a": (1, 3) float32, "b": (1,) int64}: a at 0..11, b at 16..23,
    24 bytes padded to 32."""
    entries, offset = [], 0
    for name, tensor in loose.items():
        entries.append([name, str(tensor.dtype).removeprefix("torch."), list(tensor.shape), offset, tensor.nbytes])
        offset += -(-tensor.nbytes // ALIGN) * ALIGN
    packed = np.zeros(offset, dtype=np.uint8)  # numpy: a plain memcpy each (torch's copies woke its thread pool)
    for (_name, _, _, at, nbytes), tensor in zip(entries, loose.values()):
        packed[at : at + nbytes] = tensor.contiguous().view(-1).view(torch.uint8).numpy()
    return torch.from_numpy(packed), entries


def unpack_loose(packed: torch.Tensor, entries) -> dict[str, torch.Tensor]:
    """The named rows of `pack_loose`'s ``packed`` (views of it), made through numpy: a torch view is an op that
    lets the GIL go and waits to get it back behind the engine thread, twice per row; numpy's views do not
    (a dtype numpy lacks, bfloat16, takes torch's way)."""
    raw, rows = packed.numpy(), {}
    for name, dtype, shape, at, nbytes in entries:
        if dtype in _NUMPY:
            rows[name] = torch.from_numpy(raw[at : at + nbytes].view(_NUMPY[dtype]).reshape(shape))
        else:
            rows[name] = packed[at : at + nbytes].view(getattr(torch, dtype)).view(shape)
    return rows


_NUMPY = {
    "float32": np.float32,
    "float64": np.float64,
    "float16": np.float16,
    "int64": np.int64,
    "int32": np.int32,
    "int16": np.int16,
    "int8": np.int8,
    "uint8": np.uint8,
    "bool": np.bool_,
}


def _words(tensor: torch.Tensor) -> np.ndarray:
    """A uint8 tensor of a multiple of 8 bytes as 64-bit words (no copy)."""
    return tensor.numpy().view(np.uint64)


def _checksum(parts: list[np.ndarray]) -> tuple[int, int]:
    """The sum (mod 2**64) and the xor of all the 64-bit words: any damaged word changes both."""
    total = xor = 0
    for words in parts:
        total = (total + int(np.add.reduce(words, dtype=np.uint64))) % (1 << 64)
        xor ^= int(np.bitwise_xor.reduce(words)) if len(words) else 0
    return total, xor


def _transfer(call: Callable[[int, list], int], fd: int, views: list[memoryview]) -> int:
    """``call`` (os.writev or os.readv) over ``views`` in order, again only where the kernel moved less; the
    bytes moved. A write that moves nothing raises OSError (a full disk); a read that moves nothing is the file's
    end. Example, views of 512 / 2,202,224 / 96 bytes and a first readv of 1,000,000: the second starts 999,488
    bytes into the 2nd view."""
    total = 0
    while views:
        moved = call(fd, views)
        if moved <= 0:
            if call is os.readv:
                return total
            raise OSError("a write to the parked state's file wrote nothing (disk full?)")
        total += moved
        while views and moved >= len(views[0]):
            moved -= len(views[0])
            views.pop(0)
        if views:
            views[0] = views[0][moved:]
    return total


def remove_file(path: str | None) -> None:
    """Remove ``path`` if there is one and it exists (a parked state's file, once restored or discarded)."""
    if path is not None:
        try:
            os.remove(path)
        except FileNotFoundError:
            pass
