"""A parked stream's state as one raw file: the disk tier of `streaming.parking.ParkingStore`.

The file holds the packed row (`RowLayout`, ``Parked.flat``) as it is in memory, and the few rows outside the
layout (``Parked.loose``: the CPU codec worker's decoder rows, the frame codec's audio outbox) after it, behind
a small header. Writing is one ``os.write`` per buffer straight from the tensors' memory (no per-view copy, no
serialiser); reading is one ``readinto`` straight into a fresh row (pinned on a GPU), so a state back from disk
is restored by the same packed copy as one that never left host memory.

Layout of a file (little endian)::

    b"TTSPARK1"  u32 header length H  header (H bytes of JSON)  flat row  loose tensor 0  loose tensor 1 ...

The header names the format, the layout's fingerprint (`RowLayout.fingerprint`: a state is only read back into
a row of the same layout), the flat row's byte count, each loose tensor's (name, dtype, shape, byte count) and a
CRC-32 of the payload. Worked example: a 2,156,000-byte flat row and one loose (1, 480) float32 outbox, header
H = 230 bytes: the flat row is at bytes 12 + 230 = 242 .. 2,156,242, the outbox at 2,156,242 .. 2,158,162, and
the file is 2,158,162 bytes long; a file of any other length is truncated or foreign (`CorruptParkedFile`).

A file is written under a temporary name and renamed when complete, so a reader never sees half of one. No
fsync: these files live no longer than the process that wrote them (they are removed on restore, cancel and
close), so the page cache is the tier; durability across a crash would cost a disk flush per park.
"""
from __future__ import annotations

import json
import os
import struct
import zlib

import torch

MAGIC = b"TTSPARK1"
FILE_FORMAT = "tts-parked-file/1"
_PREFIX = struct.Struct("<8sI")  # magic, header length


class CorruptParkedFile(ValueError):
    """A parked state's file is truncated, damaged or not one of this layout: the state cannot be read back."""


def write_state(path: str, flat: torch.Tensor | None, loose: dict[str, torch.Tensor], fingerprint: str | None) -> int:
    """Write one parked state (its packed ``flat`` row, may be None, and its ``loose`` rows) to ``path`` via a
    temporary name; returns the file's byte count. On any error (a full disk) the temporary file is removed
    and the error raised: the caller keeps the state in memory."""
    payload = ([] if flat is None else [_bytes(flat)]) + [_bytes(t) for t in loose.values()]
    checksum = 0
    for buffer in payload:
        checksum = zlib.crc32(buffer, checksum)  # releases the GIL for buffers this large
    header = json.dumps({"format": FILE_FORMAT, "layout": fingerprint,
                         "flat": 0 if flat is None else flat.nbytes, "crc32": checksum,
                         "loose": [[name, str(t.dtype).removeprefix("torch."), list(t.shape), t.nbytes]
                                   for name, t in loose.items()]}).encode()
    temporary = path + ".tmp"
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        for buffer in [_PREFIX.pack(MAGIC, len(header)), header] + payload:
            _write_all(fd, memoryview(buffer))
        written = os.fstat(fd).st_size
    except BaseException:
        os.close(fd)
        _remove(temporary)
        raise
    os.close(fd)
    os.replace(temporary, path)
    return written


def read_state(path: str, fingerprint: str | None, pin: bool = False
               ) -> tuple[torch.Tensor | None, dict[str, torch.Tensor]]:
    """(flat row, loose rows) of a file `write_state` wrote for a state of the layout ``fingerprint``; the flat
    row in pinned memory with ``pin``. Raises `CorruptParkedFile` for a truncated, damaged or foreign file
    (OSError if it cannot be read at all)."""
    with open(path, "rb", buffering=0) as file:
        size = os.fstat(file.fileno()).st_size
        header = _header(file, size, fingerprint)
        flat = None
        if header["flat"]:
            flat = torch.empty(header["flat"], dtype=torch.uint8, pin_memory=pin)
            _read_all(file, flat)
        loose = {}
        for name, dtype, shape, nbytes in header["loose"]:
            loose[name] = torch.empty(shape, dtype=getattr(torch, dtype))
            _read_all(file, loose[name])
    checksum = 0
    for tensor in ([] if flat is None else [flat]) + list(loose.values()):
        checksum = zlib.crc32(_bytes(tensor), checksum)
    if checksum != header["crc32"]:
        raise CorruptParkedFile(f"{path}: the payload's checksum differs (the file is damaged)")
    return flat, loose


def _header(file, size: int, fingerprint: str | None) -> dict:
    """The header of an open file of ``size`` bytes, checked: magic, format, layout and the exact length."""
    prefix = file.read(_PREFIX.size)
    if len(prefix) < _PREFIX.size:
        raise CorruptParkedFile(f"{file.name}: shorter than a header ({size} bytes)")
    magic, length = _PREFIX.unpack(prefix)
    if magic != MAGIC:
        raise CorruptParkedFile(f"{file.name}: not a parked state file")
    try:
        header = json.loads(file.read(length))
        expected = _PREFIX.size + length + header["flat"] + sum(entry[3] for entry in header["loose"])
    except (ValueError, KeyError, TypeError, IndexError) as err:
        raise CorruptParkedFile(f"{file.name}: unreadable header ({type(err).__name__}: {err})") from None
    if header.get("format") != FILE_FORMAT or header.get("layout") != fingerprint:
        raise CorruptParkedFile(f"{file.name}: another format or another row layout")
    if size != expected:
        raise CorruptParkedFile(f"{file.name}: {size} bytes, its header says {expected} (truncated or extended)")
    return header


def _bytes(tensor: torch.Tensor) -> memoryview:
    """A contiguous host tensor's memory as bytes, without a copy (any dtype, bfloat16 too)."""
    return memoryview(tensor.contiguous().view(-1).view(torch.uint8).numpy())


def _write_all(fd: int, view: memoryview) -> None:
    while view:
        written = os.write(fd, view)
        if written <= 0:
            raise OSError("a write to the parked state's file wrote nothing (disk full?)")
        view = view[written:]


def _read_all(file, tensor: torch.Tensor) -> None:
    view = _bytes(tensor)
    while view:
        read = file.readinto(view)
        if not read:
            raise CorruptParkedFile(f"{file.name}: ended early")
        view = view[read:]


def _remove(path: str | None) -> None:
    if path is not None:
        try:
            os.remove(path)
        except FileNotFoundError:
            pass
