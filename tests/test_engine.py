"""The serving engine on a tiny random model: scheduling, slots, incremental text, limits."""
import threading

import numpy as np
import pytest

from streaming.engine import Engine, SamplingConfig, ServerFull, Slot, UnknownVoice
from tts.api import synthesize, synthesize_stream
from tts.text import TextError

GREEDY = SamplingConfig(temperature=0.0)
TEXT = "Hello there. How are you today? The ring never grows."


@pytest.fixture(scope="module")
def engine():
    return Engine.tiny_random(max_streams=3, sampling=GREEDY)


def test_speaks_whole_frames_and_stops(engine):
    audio = synthesize(TEXT, engine=engine)
    assert audio.dtype == np.float32 and len(audio) > 0
    assert len(audio) % engine.codec.cfg.hop == 0
    assert np.isfinite(audio).all()


def test_first_chunk_is_small_and_comes_before_the_rest(engine):
    chunks = list(synthesize_stream(TEXT, engine=engine))
    assert len(chunks) > 3
    assert len(chunks[0]) == 2 * engine.codec.cfg.hop


def test_incremental_text_equals_whole_text(engine):
    whole = synthesize(TEXT, engine=engine)
    pieces = ["Hello there. ", "How are you", " today? ", "The ring never grows."]
    np.testing.assert_allclose(synthesize(iter(pieces), engine=engine), whole, atol=1e-5)


def test_other_streams_do_not_change_a_stream(engine):
    alone = synthesize(TEXT, voice="slt", engine=engine)
    results = {}

    def run(name, text, voice):
        results[name] = synthesize(text, voice=voice, engine=engine)

    threads = [threading.Thread(target=run, args=("a", TEXT, "slt")),
               threading.Thread(target=run, args=("b", "Something else entirely, said by another voice.", "joe"))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    # the AR tokens are identical; audio may differ by float rounding when the codec decodes two streams at once
    np.testing.assert_allclose(results["a"], alone, atol=1e-5)


def test_voice_and_speed_change_the_audio(engine):
    slow = synthesize("Speed test sentence.", speed=0.5, engine=engine)
    fast = synthesize("Speed test sentence.", speed=2.0, engine=engine)
    assert len(slow) > 1.5 * len(fast)


def test_voice_pace_multiplies_speed(engine):
    """A preset's pace scales every phoneme's frames like speed does: pace 0.5 at speed 2 is speed 1."""
    voice = engine.default_voice
    plain = synthesize("Pace test sentence.", voice=voice, engine=engine)
    engine.voices[voice]["pace"] = 0.5
    try:
        paced = synthesize("Pace test sentence.", voice=voice, speed=2.0, engine=engine)
        slower = synthesize("Pace test sentence.", voice=voice, engine=engine)
    finally:
        del engine.voices[voice]["pace"]
    assert np.array_equal(paced, plain)
    assert len(slower) > 1.5 * len(plain)


def test_errors_are_typed(engine):
    with pytest.raises(UnknownVoice):
        engine.open("nobody")
    with pytest.raises(ValueError):
        engine.open(speed=9)
    with pytest.raises(TextError):
        synthesize("", engine=engine)
    with pytest.raises(TextError):
        synthesize("?!.,", engine=engine)
    with pytest.raises(TextError):
        synthesize("a" * (engine.max_chars + 1), engine=engine)


def test_server_full_then_free_again(engine):
    streams = [engine.open() for _ in range(engine.max_streams)]
    with pytest.raises(ServerFull):
        engine.open()
    for s in streams:
        s.cancel()
    for s in streams:
        assert s.read(timeout=5) is None
    deadline = threading.Event()
    for _ in range(100):
        if engine.active_streams == 0:
            break
        deadline.wait(0.05)
    engine.open().cancel()


def test_cancel_stops_at_once(engine):
    stream = engine.open()
    stream.push_text(TEXT * 5)
    stream.end()
    assert stream.read(timeout=30) is not None
    stream.cancel()
    assert stream.read(timeout=5) is None


def test_backpressure_bounds_queued_audio():
    engine = Engine.tiny_random(max_streams=1, sampling=GREEDY, max_queued_seconds=0.5)
    stream = engine.open()
    stream.push_text(TEXT * 8)
    stream.end()
    first = stream.read(timeout=30)
    threading.Event().wait(1.0)  # a reader that stalls
    limit = 0.5 * engine.sample_rate + 8 * engine.codec.cfg.hop
    assert stream.queued_samples <= limit
    total = len(first)
    while (chunk := stream.read(timeout=30)) is not None:
        total += len(chunk)
    assert total > 2 * limit  # it resumed after the reader caught up


def test_cache_memory_is_fixed(engine):
    before = engine.caches.nbytes
    synthesize(TEXT * 3, engine=engine)
    assert engine.caches.nbytes == before


def test_phoneme_timings_tile_the_audio(engine):
    stream = engine.open()
    stream.push_text("Timing test.")
    stream.end()
    samples = 0
    while (chunk := stream.read(timeout=30)) is not None:
        samples += len(chunk)
    timings = stream.take_timings()
    assert timings and timings[0][1] == 0.0
    assert all(a[2] <= b[1] + 1e-9 for a, b in zip(timings, timings[1:]))
    assert abs(timings[-1][2] - samples / engine.sample_rate) < 0.2


def test_trim_keeps_the_unit_the_delay_tail_reads():
    """A 2046-frame utterance trimmed at step 2050, in its delay-pattern tail: the last frame's unit stays."""
    slot = Slot(stream=None, voice_id=0, rate=1.0, temperature=0.7, frame_unit=[i // 10 for i in range(2046)])
    slot.step = 2050
    slot.trim(lookahead=4)
    assert (slot.frame_base, slot.frames_known) == (2045, 2046)
    assert slot.unit_at(2050) == 204
    slot.frame_unit += [205] * 2000  # more text arrived: frames before the step are dropped again
    slot.step = 3500
    slot.trim(lookahead=4)
    assert slot.frame_base == 3499 and slot.unit_at(3500) == 205


def test_per_row_temperature_in_one_batched_sample():
    import torch

    from streaming.sampling import sample
    logits = torch.zeros(2, 3, 50)
    logits[..., 7] = 5.0  # token 7 is the clear favourite of every row and codebook
    draws = torch.stack([sample(logits, torch.tensor([1e-6, 1e3])[:, None, None], 40) for _ in range(50)])  # (50, B, K)
    assert (draws[:, 0] == 7).all()  # near zero: greedy
    assert (draws[:, 1] != 7).any()  # very hot: anything in the top 40


def test_a_stream_samples_at_its_voices_temperature():
    engine = Engine.tiny_random(max_streams=2)
    engine.voices["slt"] = {**engine.voices["slt"], "temperature": 0.3}
    synthesize("Hello there.", voice="slt", engine=engine)
    assert engine.temperature.flatten().tolist() == pytest.approx([0.3, engine.sampling.temperature])
