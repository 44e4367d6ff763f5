"""Replaying a journal on the replica that takes a session over: which of its messages go to the server again
(`compact`, with the checkpoints that let an utterance continue), and which of the server's output the client
lacks (`Replay.filter`); `Shift` translates the client's counts into the new server's."""

from __future__ import annotations

import base64
import json
from collections import deque
from dataclasses import dataclass, field

from tts.rates import SAMPLE_RATE


@dataclass
class Shift:
    """A session replayed here without its finished utterances (`compact`): per context, where the server's count
    of bytes and events starts in the session's; and how many client messages were left out. Acks, resumes and
    `resumed.received` are translated by it."""

    offsets: dict = field(default_factory=dict)  # context id -> [bytes, events]
    dropped: int = 0


class Replay:
    """A session coming back from its journal on this replica: the journal's messages go to the server first
    (those of utterances the client has whole left out, and where a checkpoint continues an utterance, those it
    has taken in: `compact`), and of the server's output only what the client lacks goes out.

    Example: the client holds 9600 audio bytes and 1 event (ready) of the default context; the replay's output
    is ready, 4800 B, timing, 9600 B, ...: ready is dropped (event 0 < 1), the 4800 B too (bytes 0..4800 < 9600),
    the timing event goes (event 1 >= 1), of the 9600 B chunk (bytes 4800..14400) the last 4800 B go."""

    def __init__(self, entries: list, have: dict, checkpoints=(), fingerprint: str | None = None, expect=None):
        """``checkpoints`` (`Checkpoint`) made with weights of ``fingerprint``; ``expect(state) -> seed``
        (`Checkpointing.expect`) registers the one chosen for an utterance."""
        self.received = sum(not isinstance(entry, dict) for entry in entries)
        feed, self.shift, chosen = compact(entries, have, checkpoints, fingerprint)
        self.standins = {}  # context id -> (the seed standing in for its checkpoint, the checkpoint's sample)
        for context_id, (at, checkpoint) in chosen.items():
            seed = expect(checkpoint.state)
            feed[at] = json.dumps({**parsed_message({"text": feed[at]}), "seed": seed})
            self.standins[context_id] = (seed, checkpoint.samples)
        self.starts = sum(parsed_message({"text": m}).get("type") == "start" for m in feed if isinstance(m, str))
        self.unspoken = {context_id: samples for context_id, (_, samples) in self.standins.items()}  # for `done`
        self.feed, self.have = deque(feed), have

    def next_message(self) -> dict | None:
        """The next journal message for the server; None when the journal is all in."""
        if not self.feed:
            return None
        message = self.feed.popleft()
        if isinstance(message, bytes):
            return {"type": "websocket.receive", "bytes": message}
        return {"type": "websocket.receive", "text": message}

    def filter(self, message: dict, event: dict | None, position: list[int], nbytes: int, context_id) -> dict | None:
        """The part of an output message the client lacks (None: it has it all). ``position``: the context's
        (bytes, events) before it, in the session's count."""
        have_bytes, have_events = self.have.get(context_id, (0, 0))
        if event is None or event.get("type") == "audio":
            return _tail(message, event, max(0, have_bytes - position[0])) if nbytes else message
        if event.get("type") == "queued":
            return message if position[0] >= have_bytes and position[1] >= have_events else None
        if position[1] < have_events:
            return None
        if event.get("type") == "done" and context_id in self.unspoken:  # the server spoke from the checkpoint on
            spoken = event.get("audio_seconds", 0) + self.unspoken.pop(context_id) / SAMPLE_RATE
            return {**message, "text": json.dumps({**event, "audio_seconds": round(spoken, 3)})}
        return message


def compact(entries: list, have: dict, checkpoints=(), fingerprint: str | None = None) -> tuple[list, Shift, dict]:
    """The journal's messages to replay for a client holding ``have`` (context id -> (bytes, events)), the
    shift, and the checkpoints chosen. Per context, the messages before the last `done` the client holds are
    left out, and the server's count for it starts where that done left the session's. A context whose first
    message left in is the start of an utterance with a checkpoint (`Checkpoint`) of weights ``fingerprint``
    whose audio the client holds continues from the latest such: its messages that the checkpoint has taken
    in are left out too, and the server's count starts that many bytes further (its first event, `ready`,
    is the client's already). Chosen: context id -> (the index of its start in the feed, its checkpoint).

    Example: journal [start, text, end, done-mark(None at 96000 B, 3 events), start, text] and a client holding
    (120000 B, 4 events) of the default context: it has the first utterance's done, so the replay is [start,
    text]; the shift is offsets {None: [96000, 3]}, 3 messages dropped; the server's 0 B is the session's 96000 B.
    With a checkpoint of the second utterance (start 4) after 6 entries at 20000 B: the replay is [start], the
    offsets {None: [116000, 3]}, 4 messages dropped."""
    cuts = {}
    for i, entry in enumerate(entries):
        if isinstance(entry, dict):
            held_bytes, held_events = have.get(entry["done"], (0, 0))
            if entry["at"][0] <= held_bytes and entry["at"][1] <= held_events:
                cuts[entry["done"]] = (i, entry["at"])
    shift = Shift({context_id: list(at) for context_id, (_, at) in cuts.items()})
    chosen = _checkpoints(entries, have, cuts, checkpoints, fingerprint)
    feed: list = []
    starts: dict = {}
    for i, entry in enumerate(entries):
        if isinstance(entry, dict):
            continue
        context_id = _context(entry)
        cut, checkpoint = cuts.get(context_id), chosen.get(context_id)
        if cut is not None and i < cut[0] or checkpoint is not None and checkpoint.start < i < checkpoint.after:
            shift.dropped += 1
            continue
        if checkpoint is not None and i == checkpoint.start:
            starts[context_id] = (len(feed), checkpoint)
            offsets = shift.offsets.setdefault(context_id, [0, 0])
            offsets[0] += checkpoint.nbytes
        feed.append(entry)
    return feed, shift, starts


def _checkpoints(entries: list, have: dict, cuts: dict, checkpoints, fingerprint: str | None) -> dict:
    """Per context, the checkpoint a replay continues from (`compact`): of its first utterance left in, made
    with these weights, the latest whose audio bytes the client holds, with that utterance's `ready`."""
    first = {}  # context id -> the index of its first message left in
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict) and (context_id := _context(entry)) not in first:
            if context_id not in cuts or i > cuts[context_id][0]:
                first[context_id] = i
    chosen = {}
    for checkpoint in sorted(checkpoints, key=lambda c: c.samples):
        context_id = checkpoint.context
        base = cuts[context_id][1] if context_id in cuts else (0, 0)
        held_bytes, held_events = have.get(context_id, (0, 0))
        if (
            first.get(context_id) == checkpoint.start
            and checkpoint.after <= len(entries)
            and checkpoint.fingerprint == fingerprint
            and held_bytes >= base[0] + checkpoint.nbytes
            and held_events > base[1]
        ):
            chosen[context_id] = checkpoint
    return chosen


def _context(message) -> str | None:
    """The context a client message belongs to (the default one, None, for binary data and unreadable text)."""
    return parsed_message({"text": message}).get("context_id") if isinstance(message, str) else None


def shifted_message(message: dict, parsed: dict, shift: Shift) -> dict:
    """An ack or resume with its positions in the server's count (`Shift`)."""
    if not shift.offsets:
        return message

    def moved(position: dict) -> dict:
        bytes_at, events_at = shift.offsets.get(position.get("context_id"), (0, 0))
        return {
            **position,
            "bytes": max(0, position.get("bytes", 0) - bytes_at),
            "events": max(0, position.get("events", 0) - events_at),
        }

    if parsed.get("type") == "ack":
        parsed = moved(parsed)
    else:
        parsed = {**parsed, "contexts": [moved(p) for p in parsed.get("contexts") or () if isinstance(p, dict)]}
    return {**message, "text": json.dumps(parsed)}


def parsed_message(message: dict) -> dict:
    """A client message's JSON object ({} for binary data or anything else)."""
    try:
        parsed = json.loads(message.get("text") or "null")
    except ValueError:
        return {}
    return parsed if isinstance(parsed, dict) else {}


def outgoing(message: dict) -> tuple[str | None, int, dict | None]:
    """(context id, audio bytes, the event or None) of a message the server sends: binary audio is the default
    context's; a named context's audio is an `audio` event with base64 data."""
    if message.get("bytes") is not None:
        return None, len(message["bytes"]), None
    event = json.loads(message["text"])
    nbytes = 0
    if event.get("type") == "audio":  # base64: 4 characters per 3 bytes, "=" padding the last group
        data = event["audio"]
        nbytes = len(data) * 3 // 4 - data[-2:].count("=")
    return event.get("context_id"), nbytes, event


def _tail(message: dict, event: dict | None, skip: int) -> dict | None:
    """An audio message without its first ``skip`` bytes (None when nothing is left)."""
    if skip == 0:
        return message
    if event is None:
        rest = message["bytes"][skip:]
        return {**message, "bytes": rest} if rest else None
    rest = base64.b64decode(event["audio"])[skip:]
    return {**message, "text": json.dumps({**event, "audio": base64.b64encode(rest).decode("ascii")})} if rest else None
