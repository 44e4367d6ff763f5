"""Speculative text encoding (`Engine._prefill`, `Slots.place`): units are encoded before their right context has
arrived and revised when it comes, never once their frames have started; whole text takes no speculative path.
Elastic pacing (`Slots.pace`): a start whose text is thin is spoken slower; whole text is not."""

import time

import numpy as np
import pytest
import torch

from streaming.engine import SamplingConfig
from streaming.parking import ParkingConfig
from streaming.step_caches import decode_step
from testkit import tiny_random, wait_until
from tts.api import synthesize
from tts.text import text_sentences

GREEDY = SamplingConfig(temperature=0.0)
TEXT = "Hello there, how are you today? The ring never grows, and the birch canoe slid on the smooth planks."
NO_PARKING = ParkingConfig(park_after_s=0)


def _speak(engine, pieces, pause_s=0.0):
    """Audio and word timings of ``pieces`` pushed one by one (``pause_s`` apart), then the end."""
    stream = engine.open(seed=3, lookahead_words=1)  # lookahead 1: word by word gives the whole text's units
    for k, piece in enumerate(pieces):
        stream.push_text(piece)
        time.sleep(pause_s)
        if k == 0 and len(pieces) > 1:  # its first prefill alone, whatever the load: later units come after it
            assert wait_until(lambda: "prefill" in stream.marks, 30)
    stream.end()
    chunks = []
    while (chunk := stream.read(timeout=60)) is not None:
        chunks.append(chunk)
    return np.concatenate(chunks), stream.take_word_timings()


def _slow_steps(seconds):
    """A step factory whose steps take at least ``seconds``: the AR runs far behind text that comes fast."""

    def factory(model, caches, batch, device):
        def step(*args):
            time.sleep(seconds)
            return decode_step(*args)

        return step

    return factory


@pytest.fixture(scope="module")
def engines():
    on, off = (
        tiny_random(max_streams=1, sampling=GREEDY),
        tiny_random(max_streams=1, sampling=GREEDY, speculative=False),
    )
    yield on, off
    on.close()
    off.close()


def test_whole_text_takes_no_speculative_path(engines):
    on, off = engines
    before, spoken, confirmed = (
        on.stats()[k] for k in ("revised_units", "units_spoken_speculative", "confirmed_units")
    )
    audio, timings = _speak(on, [TEXT])
    assert on.counters["revised_units"] == before  # nothing encoded twice
    assert on.stats()["units_spoken_speculative"] == spoken
    assert on.stats()["confirmed_units"] - confirmed == sum(len(units) for _, units, _ in text_sentences(TEXT))
    reference, reference_timings = _speak(off, [TEXT])
    np.testing.assert_array_equal(audio, reference)
    assert timings == reference_timings
    np.testing.assert_array_equal(synthesize(TEXT, engine=on, seed=5), synthesize(TEXT, engine=off, seed=5))


def test_revisions_that_land_before_the_ar_reads_give_the_whole_texts_audio():
    """Text word by word, much faster than the (slowed) AR steps: every speculative unit is revised before a step
    reads it, so audio and word timings equal the whole text's (which takes no speculative path)."""
    engine = tiny_random(max_streams=1, sampling=GREEDY, step_factory=_slow_steps(0.02))
    engine.slots.stretch_max = 1.0  # revisions alone: elastic pacing changes durations (`test_elastic_pacing_...`)
    words = [w + " " for w in TEXT.split()]
    pieces = ["".join(words[:4])] + words[4:]  # a first piece of ~20 units: the first steps read final units
    whole, whole_timings = _speak(engine, [TEXT])
    before = engine.counters["revised_units"]
    audio, timings = _speak(engine, pieces, pause_s=0.01)
    assert engine.counters["revised_units"] > before  # the speculative path ran
    np.testing.assert_array_equal(audio, whole)
    assert timings == whole_timings
    engine.close()


def _stalled(engine, stream_step):
    """Wait until slot 0 stops stepping (its text ran dry); returns its step."""

    def still():
        first = int(engine.slots.step[0])
        time.sleep(0.1)
        stream_step[0] = int(engine.slots.step[0])
        return first == stream_step[0] and first > 0

    assert wait_until(still, 30)
    return stream_step[0]


def test_a_speculative_unit_is_revised_and_a_started_one_is_not():
    engine = tiny_random(max_streams=1, sampling=GREEDY, parking=NO_PARKING)
    engine.slots.stretch_max = 1.0  # revisions alone, without elastic pacing's factor
    look, ahead = engine.cfg.text_lookahead, engine.cfg.ahead
    stream = engine.open(seed=1, lookahead_words=0)
    spoken = engine.stats()["units_spoken_speculative"]
    stream.push_text("The birch ")
    step = _stalled(engine, [0])
    ring = engine.caches.text[0]
    encoded = int(engine.slots.encoded[0])
    keys, start, end = ring.keys[0].clone(), engine.slots.unit_start[0].clone(), engine.slots.unit_end[0].clone()
    started = [u for u in range(encoded) if start[u] < step]
    waiting = [u for u in range(encoded - look, encoded) if start[u] >= step]  # speculative, not started
    assert started and waiting and encoded < ring.capacity  # no unit's entry was reused
    assert max(started) + ahead < encoded <= max(started) + ahead + look  # the AR read speculative units
    stream.push_text("canoe slid ")
    _stalled(engine, [0])
    # the started units read before their right context came are confirmed now, and counted
    assert engine.stats()["units_spoken_speculative"] - spoken == len([u for u in started if u >= encoded - look])
    after_keys = engine.caches.text[0].keys[0]
    assert int(engine.slots.encoded[0]) <= ring.capacity  # no entry reused
    for u in started:  # frames started: never revised (begin, end and keys)
        assert (engine.slots.unit_start[0, u], engine.slots.unit_end[0, u]) == (start[u], end[u])
        torch.testing.assert_close(after_keys[:, u], keys[:, u], rtol=0, atol=0)
    revised = [u for u in waiting if not torch.equal(after_keys[:, u], keys[:, u])]
    assert revised == waiting  # every speculative unit not yet started was encoded again, with more context
    durations = (end - start)[waiting]
    assert not torch.equal(durations, (engine.slots.unit_end[0] - engine.slots.unit_start[0])[waiting])
    stream.end()
    while stream.read(timeout=30) is not None:
        pass
    engine.close()


def test_place_keeps_started_units_and_chains_the_rest_from_the_confirmed_end():
    """`Slots.place`, the module docstring's example in small: units 4..9 speculative from frame 20, the AR at
    step 25 (units 4 and 5 started); a re-encode of 4..12 keeps their frames and chains unit 6 on from 25."""
    from streaming.slots import Slots
    from tts.model import MODEL_PRESETS

    slots = Slots(MODEL_PRESETS["tiny"], 1, 32)
    rows = torch.tensor([0])
    first = torch.arange(4, 10)[None]
    slots.settled[0], slots.frames[0] = 20, 20
    begin, durations, write = slots.place(
        rows, first, torch.ones(1, 6, dtype=torch.bool), torch.tensor([[3, 2, 5, 1, 1, 1]]), torch.tensor([0])
    )
    assert begin.tolist() == [[20, 23, 25, 30, 31, 32]] and write.all() and int(slots.settled[0]) == 20
    slots.add_units(rows, first, write, begin, begin + durations)
    slots.step[0] = 25
    positions = torch.arange(4, 13)[None]
    begin, durations, write = slots.place(
        rows,
        positions,
        torch.ones(1, 9, dtype=torch.bool),
        torch.tensor([[9, 9, 4, 2, 2, 2, 2, 2, 2]]),
        torch.tensor([3]),
    )
    assert durations.tolist() == [[3, 2, 4, 2, 2, 2, 2, 2, 2]]  # units 4, 5 keep 3 and 2 frames
    assert begin[0, :4].tolist() == [20, 23, 25, 29]
    assert write.tolist() == [[False, False] + [True] * 7]
    assert int(slots.settled[0]) == 29  # the end of unit 6, the last confirmed


def test_pace_eases_with_the_lead_never_grows_back_and_ends_with_the_text():
    """`Slots.pace`, its docstring's example: 1.2 at a thin lead, 1.1 halfway, never more than before, 1 for
    text in one piece (its factor kept) and for closed text (for good)."""
    from streaming.slots import PACE_LEAD, PACE_LEAD_FULL, Slots
    from tts.model import MODEL_PRESETS

    slots = Slots(MODEL_PRESETS["shipped"], 4, 32)
    slots.stretch_max = 1.2
    rows = torch.arange(4)
    slots.start(rows, torch.arange(4), torch.ones(4))
    half = (PACE_LEAD + PACE_LEAD_FULL) / 2
    yes, no = torch.ones(4, dtype=torch.bool), torch.tensor([True, True, True, False])
    factor = slots.pace(rows, torch.tensor([PACE_LEAD - 2, half, PACE_LEAD_FULL + 10, 5]), yes, no)
    torch.testing.assert_close(factor, torch.tensor([1.2, 1.1, 1.0, 1.0]))
    torch.testing.assert_close(slots.stretch, torch.tensor([1.2, 1.1, 1.0, 1.2]))  # one piece: kept
    factor = slots.pace(rows, torch.tensor([PACE_LEAD - 2, PACE_LEAD - 2, PACE_LEAD - 2, 5]), yes, yes)
    torch.testing.assert_close(factor, torch.tensor([1.2, 1.1, 1.0, 1.2]))  # a thinner lead: never back up
    factor = slots.pace(rows, torch.tensor([5, 5, 5, 5]), torch.tensor([False, True, True, True]), yes)
    torch.testing.assert_close(factor, torch.tensor([1.0, 1.1, 1.0, 1.2]))
    assert float(slots.stretch[0]) == 1.0 and "stretch" in slots.rows()  # closed: for good; parking carries it


def test_elastic_pacing_slows_a_thin_start_and_whole_text_takes_no_such_path():
    """Word by word with a thin lead, the first units get longer durations than with pacing off (the same seed
    and text); whole text gives the same audio, bit for bit, with pacing on or off."""
    engine = tiny_random(max_streams=1, sampling=GREEDY, parking=NO_PARKING)

    def first_frames(stretch):
        engine.slots.stretch_max = stretch
        stream = engine.open(seed=2, lookahead_words=0)
        stream.text.hold_off()
        for piece in ("The ", "birch ", "canoe "):
            stream.push_text(piece)
            time.sleep(0.05)
        step = _stalled(engine, [0])
        frames = int(engine.slots.unit_end[0, :8].max())  # the frames of the first units (all confirmed or started)
        factor = float(engine.slots.stretch[0])
        stream.end()
        while stream.read(timeout=30) is not None:
            pass
        return frames, factor, step

    paced, factor, _ = first_frames(1.2)
    plain, plain_factor, _ = first_frames(1.0)
    assert factor == pytest.approx(1.2) and plain_factor == 1.0
    assert paced > plain
    engine.slots.stretch_max = 1.2
    whole_paced = _speak(engine, [TEXT])
    engine.slots.stretch_max = 1.0
    whole_plain = _speak(engine, [TEXT])
    np.testing.assert_array_equal(whole_paced[0], whole_plain[0])
    assert whole_paced[1] == whole_plain[1]
    engine.close()
