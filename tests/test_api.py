"""The Python API: chunk objects with words, plain arrays still working, and the default engine's step."""

import json
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from kernels import ort
from streaming.engine import ServerFull
from tts.api import Chunk, synthesize, synthesize_stream

TEXT = "Hello there, Dr. Smith. It costs $5 today!"


@pytest.fixture
def engine(tiny_engine):  # conftest: the tiny random-weight engine
    return tiny_engine


def test_chunks_are_float32_arrays_with_rate_start_and_words(engine):
    chunks = list(synthesize_stream(TEXT, engine=engine))
    assert chunks and all(isinstance(c, Chunk) and isinstance(c, np.ndarray) for c in chunks)
    assert all(c.dtype == np.float32 and c.ndim == 1 and c.sample_rate == engine.sample_rate for c in chunks)
    ends = np.cumsum([len(c) for c in chunks]) / engine.sample_rate
    assert np.allclose([c.start for c in chunks], np.concatenate([[0.0], ends[:-1]]))  # back to back
    words = [w for c in chunks for w in c.words]
    assert [w["word"] for w in words] == TEXT.split()  # each word once, as written, in order
    for chunk in chunks:  # a word goes with the chunk it starts in (or, scheduled late, a later one)
        assert all(w["start"] < chunk.end + 1e-6 for w in chunk.words)
    starts = [w["start"] for w in words]
    assert starts == sorted(starts) and all(w["end"] >= w["start"] for w in words)
    assert starts[0] < chunks[0].end + 1e-6


def test_a_seed_repeats_the_speech_and_busy_slots_make_callers_wait(engine):
    first = synthesize("The same words again.", engine=engine, seed=7)
    assert np.array_equal(first, synthesize("The same words again.", engine=engine, seed=7))
    release = threading.Event()

    def held_open(i):  # a text source that has not ended: the caller's slot stays taken until release
        yield f"Caller {i} talks for a while here."
        release.wait(60)

    busy = [synthesize_stream(held_open(i), engine=engine) for i in range(engine.max_streams)]
    for chunks in busy:
        next(chunks)  # every slot speaking
    with pytest.raises(ServerFull):
        next(synthesize_stream("No room.", engine=engine, wait_s=0))
    spoken = {}
    waiter = threading.Thread(target=lambda: spoken.update(audio=synthesize("Room soon.", engine=engine, wait_s=30)))
    waiter.start()
    time.sleep(0.5)
    assert waiter.is_alive()  # queued for a slot, not refused
    release.set()
    for chunks in busy:
        chunks.close()  # the callers stop: their slots free, and the waiting call gets one
    waiter.join(timeout=60)
    assert len(spoken["audio"]) > 0


def test_plain_arrays_stay_available(engine):
    chunks = list(synthesize_stream("Plain arrays still work.", engine=engine))
    whole = np.concatenate(chunks)
    assert type(whole) is np.ndarray and whole.dtype == np.float32
    assert type(chunks[0] * 0.5) is np.ndarray and isinstance(chunks[0].max(), np.floating)
    part = chunks[0][:10]
    assert isinstance(part, Chunk) and part.sample_rate == chunks[0].sample_rate  # views keep the attributes
    audio = synthesize("Plain arrays still work.", engine=engine)
    assert type(audio) is np.ndarray and audio.dtype == np.float32 and len(audio) > 0


def test_default_engine_speaks_with_a_fast_step_from_the_first_sentence(tmp_path):
    """A fresh process on the shipped voices with an empty cache: the first sentence already runs the int8
    ONNX Runtime step (from the shipped weightless graph: nothing built, nothing written to the cache), and
    the engine has slots for several callers."""
    code = (
        "import json; from tts.api import get_engine, synthesize; synthesize('Hello there.'); "
        "e = get_engine(); print(json.dumps([e.step_kind, e.max_streams]))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "TTS_CACHE_DIR": str(tmp_path)},
    )
    assert done.returncode == 0, done.stderr
    kind, slots = json.loads(done.stdout.strip().splitlines()[-1])
    assert kind == ("onnxruntime-int8" if ort.available() else "lean") and slots >= 4
    assert not (tmp_path / "kernels").exists() or not ort.available()
