"""The journals: a Ray actor that keeps every live session's journal (the client messages its server took) and
its utterances' checkpoints, so that another replica can take a session over (`serving.failover`). Imported
without torch (the actor's process has none)."""

from __future__ import annotations

import time
from dataclasses import dataclass

MAX_JOURNAL_BYTES = 4 << 20  # a session's journal past this is dropped: that session cannot fail over
CHECKPOINTS_KEPT = 2  # per utterance: the latest whose audio the client holds is used (it may lack the newest's)
JOURNALS_ACTOR = "tts-journals"


@dataclass
class Checkpoint:
    """A live utterance's engine state (`Engine.snapshot`) at a place in its session's journal: the state has
    taken in the journal's first ``after`` entries (its context's later ones are not in it), and continues the
    utterance's audio from its byte ``nbytes`` (sample ``samples``) on."""

    context: str | None
    start: int  # the journal index of the utterance's start
    after: int
    samples: int
    nbytes: int
    fingerprint: str  # of the weights it needs (`Engine.fingerprint`)
    state: bytes


# A journal entry: a client message the server took (its text, or its binary data), or, where the server sent an
# utterance's `done`, {"done": context id, "at": [bytes, events]}: the context's count after it (`compact` uses it).
JournalEntry = str | bytes | dict


class Journals:
    """Ray actor: every live session's journal, by journal id (the session's first resume token), and each token
    the session has had -> its journal id. A journal nobody touches for its time-to-live is forgotten (its
    replica is gone, and the window for a resume has passed). One actor: its methods run one at a time, so two
    replicas claiming one token cannot both win."""

    def __init__(self):
        self.entries: dict[str, list[JournalEntry]] = {}
        self.sizes: dict[str, int] = {}
        self.expires: dict[str, float] = {}
        self.tokens: dict[str, str | None] = {}  # token -> journal id; None once claimed (spent)
        self.checkpoints: dict[str, dict[str | None, list[Checkpoint]]] = {}  # journal id -> context -> latest
        self.replays = {"utterances": 0, "from_checkpoints": 0}  # utterances replayed: all, from a checkpoint

    def append(self, batch: list[tuple[str, list[JournalEntry], list[str], float]]) -> None:
        """(journal id, new entries, new tokens, time to live) for each session a replica has news of."""
        now = time.monotonic()
        for jid, entries, tokens, ttl_s in batch:
            if self.sizes.get(jid, 0) < 0:
                continue  # over the bound: it stays dropped
            self.entries.setdefault(jid, []).extend(entries)
            self.sizes[jid] = self.sizes.get(jid, 0) + sum(len(m) if not isinstance(m, dict) else 64 for m in entries)
            if self.sizes[jid] > MAX_JOURNAL_BYTES:
                self.entries[jid], self.sizes[jid] = [], -1
                self.checkpoints.pop(jid, None)
            self.tokens.update({token: jid for token in tokens})
            self.expires[jid] = now + ttl_s
        self._expire(now)

    def checkpoint(self, jid: str, taken: list[Checkpoint]) -> None:
        """Keep a replica's new checkpoints of a session's utterances: the latest CHECKPOINTS_KEPT of each
        context's current utterance (one of a new utterance replaces its context's older ones)."""
        if jid not in self.entries or self.sizes.get(jid, 0) < 0:
            return
        kept = self.checkpoints.setdefault(jid, {})
        for checkpoint in taken:
            same = [c for c in kept.get(checkpoint.context, ()) if c.start == checkpoint.start]
            kept[checkpoint.context] = same[len(same) + 1 - CHECKPOINTS_KEPT :] + [checkpoint]

    def claim(self, token: str) -> tuple[str, list[JournalEntry], list[Checkpoint]] | None:
        """(journal id, its entries, its checkpoints) for a resume with ``token``, which is then spent; None when
        no journal has it."""
        jid = self.tokens.get(token)
        if jid is None or self.sizes.get(jid, 0) < 0 or jid not in self.entries:
            return None
        self.tokens[token] = None
        return jid, list(self.entries[jid]), [c for kept in self.checkpoints.get(jid, {}).values() for c in kept]

    def replayed(self, utterances: int, from_checkpoints: int) -> None:
        """A replica replayed a session: its utterances in progress, and how many went on from a checkpoint."""
        self.replays["utterances"] += utterances
        self.replays["from_checkpoints"] += from_checkpoints

    def stats(self) -> dict:
        """Journals and checkpoints held (their bytes), and the replays so far."""
        held = [c for kept in self.checkpoints.values() for cs in kept.values() for c in cs]
        return {
            "journals": len(self.entries),
            "checkpoints": len(held),
            "checkpoint_bytes": sum(len(c.state) for c in held),
            **self.replays,
        }

    def forget(self, ended: list[tuple[str, str]]) -> None:
        """(journal id, its session's last token) of sessions that ended; one that a resume took elsewhere since
        (its token claimed) lives on there."""
        for jid, token in ended:
            if self.tokens.get(token) == jid:
                self.expires[jid] = 0.0
        self._expire(time.monotonic())

    def claimed(self, tokens: list[str]) -> list[str]:
        """Those of ``tokens`` that a resume has claimed."""
        return [token for token in tokens if token in self.tokens and self.tokens[token] is None]

    def _expire(self, now: float) -> None:
        for jid in [jid for jid, at in self.expires.items() if at <= now]:
            del self.expires[jid]
            self.entries.pop(jid, None)
            self.sizes.pop(jid, None)
            self.checkpoints.pop(jid, None)
        self.tokens = {t: jid for t, jid in self.tokens.items() if jid is None or jid in self.entries}


def journals():
    """The cluster's `Journals` actor, started on first use. Detached: it outlives the replica that started it."""
    import ray

    return (
        ray.remote(Journals)
        .options(
            name=JOURNALS_ACTOR,
            namespace="serve",
            lifetime="detached",
            get_if_exists=True,
            num_cpus=0,
            max_concurrency=1,
        )
        .remote()
    )


def stop_journals() -> None:
    """End the journals actor, if there is one (it is detached: nothing else ends it but the cluster's end)."""
    import ray

    try:
        ray.kill(ray.get_actor(JOURNALS_ACTOR, namespace="serve"))
    except ValueError:
        pass
