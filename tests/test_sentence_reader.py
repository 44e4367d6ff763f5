"""`ProcessReader`: sentences read in a child process give exactly the units read here, its errors come back,
and a broken child falls back to reading here; an engine with ``text_process`` speaks as one without."""

import numpy as np
import pytest

from streaming.sentence_reader import ProcessReader, read_sentence
from testkit import tiny_random, wait_until
from tts.normalize import tokenize


def _calls():
    for text in (
        "The birch canoe slid on the smooth planks.",
        "I paid $5 for 3 apples on Jan. 4th",
        "Dr. Smith lives on St. Mark's Road, doesn't he?",
    ):
        tokens = tokenize(text)
        for first in (0, 2):
            for closed in (False, True):
                yield tokens, first, closed


def test_the_child_reads_exactly_what_is_read_here():
    reader = ProcessReader()
    try:
        assert wait_until(reader._ready.is_set, 30)
        assert reader._child is not None
        for call in _calls():
            assert reader(*call) == read_sentence(*call)
    finally:
        reader.close()


def test_a_child_that_died_leaves_reading_here():
    reader = ProcessReader()
    assert wait_until(reader._ready.is_set, 30)
    reader._child.kill()
    reader._child.wait()
    call = next(_calls())
    with pytest.warns(UserWarning, match="not available"):
        assert reader(*call) == read_sentence(*call)
    assert reader._child is None and reader(*call) == read_sentence(*call)
    reader.close()


@pytest.mark.parametrize("frame_codec", [False, True])
def test_an_engine_reading_in_a_process_speaks_the_same(frame_codec):
    audio = []
    for text_process in (False, True):
        engine = tiny_random(max_streams=2, frame_codec=frame_codec, text_process=text_process)
        if text_process:
            assert wait_until(engine.text_reader._ready.is_set, 30) and engine.text_reader._child is not None
        stream = engine.open(seed=7)
        stream.push_text("The birch canoe slid on the smooth planks. Glue the sheet to the dark blue background.")
        stream.end()
        chunks = []
        while (chunk := stream.read(timeout=30)) is not None:
            chunks.append(chunk)
        engine.close()
        audio.append(np.concatenate(chunks))
    assert np.array_equal(audio[0], audio[1])
