"""`Engine.snapshot` (the checkpoints of serving/failover.py) on the tiny random engine: a snapshot copies a
live stream without changing it, and the copy continues it elsewhere sample-exactly."""

from __future__ import annotations

import numpy as np

from testkit import tiny_random

SENTENCE = "The quick brown fox jumps over the lazy dog. "
WORDS = SENTENCE.split()


def rest(stream, chunks: list, timeout: float = 30) -> np.ndarray:
    """The stream's audio to its end, after ``chunks`` already read."""
    while (chunk := stream.read(timeout=timeout)) is not None:
        chunks.append(chunk)
    return np.concatenate(chunks)


def speak(engine, seed: int = 41, snapshot_after: int | None = None) -> tuple[np.ndarray, list]:
    """A seeded stream fed word by word: (its audio, [(snapshot, its sample, words pushed)] if one was taken)."""
    stream, chunks, taken = engine.open(seed=seed), [], []
    for i, word in enumerate(WORDS):
        stream.push_text(word + " ")
        if i + 1 == snapshot_after:
            chunks.append(stream.read(timeout=30))  # it is speaking
            taken.append((*engine.snapshot(stream), i + 1))
    stream.end()
    return rest(stream, chunks), taken


def test_a_snapshot_leaves_the_stream_as_it_was_and_continues_elsewhere_from_its_sample():
    """`Engine.snapshot` mid-utterance, text still arriving: the stream goes on here exactly as a stream never
    snapshotted; the snapshot attached on another engine, given the text that came after it, speaks exactly
    that stream's audio from the snapshot's sample on. Twice: in a slot, speaking; and waiting for text."""
    here, there = tiny_random(max_streams=2), tiny_random(max_streams=2)
    for engine in (here, there):  # as failover's engines (serving/ray_serve.py): audio from the text alone, not
        engine.slots.stretch_max = 1.0  # from how far it was ahead (elastic pacing, `Slots.pace`)
    try:
        reference, _ = speak(here)
        for after in (4, len(WORDS)):
            audio, [(state, samples, pushed)] = speak(here, snapshot_after=after)
            assert np.array_equal(audio, reference) and 0 < samples < len(reference)
            moved = there.attach(state)
            for word in WORDS[pushed:]:
                moved.push_text(word + " ")
            moved.end()
            assert np.array_equal(rest(moved, []), reference[samples:])
    finally:
        here.close()
        there.close()


def test_the_text_thread_goes_on_after_snapshots():
    """A snapshot's pause in the text thread's queue ends as it began: the thread goes on taking every
    stream's text. Snapshots of two live streams, then a stream opened after them: all three end (each read
    waits at most 10 s), with the audio of the same seeded streams on an engine never snapshotted. (A pause
    that lacked an attribute the text thread reads of a stream ended that thread at the first snapshot: every
    later read waited for ever with the engine idle, the Ray tests' hang after the hold and soak merges.)"""

    def three(engine, snapshots: bool) -> list[np.ndarray]:
        streams = [engine.open(seed=seed) for seed in (1, 2)]
        chunks = []
        for stream in streams:
            stream.push_text(SENTENCE)
            chunks.append([stream.read(timeout=10)])  # it is speaking
            if snapshots:
                engine.snapshot(stream)
        for stream in streams:
            stream.end()
        return [rest(stream, read, timeout=10) for stream, read in zip(streams, chunks)] + [speak(engine, 3)[0]]

    engine, fresh = tiny_random(max_streams=2), tiny_random(max_streams=2)
    try:
        for got, reference in zip(three(engine, True), three(fresh, False)):
            assert np.array_equal(got, reference)
    finally:
        engine.close()
        fresh.close()
