"""Reading one Wyoming event from a client within the server's limits (streaming/wyoming.py).

The `wyoming` package's own reader trusts what a client declares: a header with ``"payload_length": 10**12``
makes it buffer whatever follows until that much has come (a client sent 300 MiB and the server held it all),
and a header that is JSON but not an event (``[1,2,3]``, no ``type``, ``data`` a list, ``data_length`` a string)
raises out of the connection's task. Here every declared length is checked before anything is read, and every
malformed header is a `BadEvent` with a code the server sends back as an ``error`` event.

An event on the wire: one JSON header line ``{"type": ..., "data": {...}, "data_length": N, "payload_length": M}``,
then N bytes of JSON (more data, merged into ``data``), then M bytes of payload. Example, limit 65,536: a header
of 80 bytes declaring data_length 100 and payload_length 65,400 totals 65,580 bytes: refused (fatal: the bytes
cannot be skipped without reading them).
"""

from __future__ import annotations

import asyncio
import json

from wyoming.event import Event


class BadEvent(Exception):
    """An event the server refuses: ``code`` for the error event; ``fatal`` when the connection cannot go on (the
    stream's framing is lost or the client declared more than the limit)."""

    def __init__(self, message: str, code: str = "bad_event", fatal: bool = False):
        super().__init__(message)
        self.code, self.fatal = code, fatal


async def read_event(reader: asyncio.StreamReader, max_bytes: int, timeout_s: float) -> Event | None:
    """The next event, None at the end of the stream. The header line must come within ``timeout_s``
    (TimeoutError, nothing consumed), its data and payload within ``timeout_s`` more (else a fatal BadEvent)."""
    async with asyncio.timeout(timeout_s):
        try:
            line = await reader.readline()
        except ValueError:  # the line passed the reader's buffer limit (64 KiB): no newline in sight
            raise BadEvent("event header line over the size limit", "event_too_large", fatal=True) from None
    if not line:
        return None
    header = _header(line, max_bytes)
    try:
        async with asyncio.timeout(timeout_s):
            data = await reader.readexactly(header["data_length"]) if header["data_length"] else b""
            payload = await reader.readexactly(header["payload_length"]) if header["payload_length"] else None
    except (TimeoutError, asyncio.IncompleteReadError):
        raise BadEvent("the event's data or payload did not come in time", fatal=True) from None
    fields = dict(header["data"])
    if data:
        try:
            more = json.loads(data)
        except ValueError:
            raise BadEvent("the event's data is not JSON") from None
        if not isinstance(more, dict):
            raise BadEvent(f"the event's data must be a JSON object, not {type(more).__name__}")
        fields.update(more)
    return Event(type=header["type"], data=fields, payload=payload)


def _header(line: bytes, max_bytes: int) -> dict:
    """The header line's fields, checked; lengths defaulted to 0 and data to {}."""
    try:
        header = json.loads(line)
    except ValueError:
        raise BadEvent("the event header is not JSON") from None
    if not isinstance(header, dict):
        raise BadEvent(f"the event header must be a JSON object, not {type(header).__name__}")
    if not isinstance(header.get("type"), str) or not header["type"]:
        raise BadEvent("the event has no type (a non-empty string)")
    data = header.get("data")
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise BadEvent(f"the event's data must be a JSON object, not {type(data).__name__}")
    lengths = {}
    for name in ("data_length", "payload_length"):
        value = header.get(name) or 0
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            fatal = header.get(name) is not None  # its bytes may follow, and cannot be told from the next event
            raise BadEvent(f"{name} must be a non-negative integer, not {header.get(name)!r}", fatal=fatal)
        lengths[name] = value
    if (total := len(line) + lengths["data_length"] + lengths["payload_length"]) > max_bytes:
        raise BadEvent(
            f"the event is {total} bytes (header, data and payload); the limit is {max_bytes}",
            "event_too_large",
            fatal=True,
        )
    return {"type": header["type"], "data": data, **lengths}
