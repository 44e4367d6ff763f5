"""The serving engine on a tiny random model: scheduling, slots, incremental text, limits, faults."""

import threading
import time

import numpy as np
import pytest
import torch

from streaming.engine import Engine, EngineError, SamplingConfig, ServerFull, UnknownVoice
from streaming.step_caches import TEXT_RING, decode_step
from testkit import held_codec_worker, tiny_model_and_codec, tiny_random, wait_until
from tts.api import synthesize, synthesize_stream
from tts.text import TextError

GREEDY = SamplingConfig(temperature=0.0)
TEXT = "Hello there. How are you today? The ring never grows."
OTHER = "Something else entirely, said by another voice."


@pytest.fixture(scope="module")
def engine():
    return tiny_random(max_streams=3, sampling=GREEDY)


def speak(engine, text, voice=None, seed=None, start_after=0.0, results=None, key=None):
    time.sleep(start_after)
    stream = engine.open(voice, seed=seed, wait_s=60)
    stream.push_text(text)
    stream.end()
    chunks = []
    while (chunk := stream.read(timeout=60)) is not None:
        chunks.append(chunk)
    audio = np.concatenate(chunks)
    if results is not None:
        results[key] = audio
    return audio


def test_speaks_whole_frames_and_stops(engine):
    audio = synthesize(TEXT, engine=engine)
    assert audio.dtype == np.float32 and len(audio) > 0
    assert len(audio) % engine.codec.cfg.hop == 0
    assert np.isfinite(audio).all()


def test_first_chunk_is_small_and_comes_before_the_rest(engine):
    chunks = list(synthesize_stream(TEXT, engine=engine))
    assert len(chunks) > 3
    assert len(chunks[0]) == 4 * engine.codec.cfg.hop  # CHUNK_SCHEDULE: 80 ms, then 80, 120, 160, 240, 320 ms


def test_incremental_text_equals_whole_text(engine):
    whole = synthesize(TEXT, engine=engine)
    pieces = ["Hello there. ", "How are you", " today? ", "The ring never grows."]
    np.testing.assert_allclose(synthesize(iter(pieces), engine=engine), whole, atol=1e-5)


def test_other_streams_do_not_change_a_stream(engine):
    alone = synthesize(TEXT, voice="slt", engine=engine)
    results = {}
    threads = [
        threading.Thread(target=speak, args=(engine, TEXT, "slt"), kwargs=dict(results=results, key="a")),
        threading.Thread(target=speak, args=(engine, OTHER, "joe"), kwargs=dict(results=results, key="b")),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    # the AR tokens are identical; audio may differ by float rounding when the codec decodes two streams at once
    np.testing.assert_allclose(results["a"], alone, atol=1e-5)


@pytest.mark.parametrize("frame_codec, sampling", [(False, GREEDY), (True, GREEDY), (False, SamplingConfig())])
def test_batched_streams_equal_each_alone(frame_codec, sampling):
    """Streams starting, ending and reusing slots at different ticks, beyond the text ring's and the audio
    window's capacity, sound as each does alone in a one-slot engine: greedy, with the GPU's frame codec, and
    sampling with each stream's own seed (then the tokens are the same, so the audio is too)."""
    long_text = " ".join([TEXT, OTHER] * 4)
    jobs = [
        ("a", long_text, "joe", 0.0),
        ("b", TEXT, "slt", 0.05),
        ("c", OTHER, "rms", 0.1),
        ("d", TEXT, "joe", 0.3),
        ("e", OTHER, "awb", 0.35),
    ]
    seeds = {key: 100 + i for i, (key, *_) in enumerate(jobs)}
    alone = tiny_random(max_streams=1, sampling=sampling, frame_codec=frame_codec)
    expected = {key: speak(alone, text, voice, seeds[key]) for key, text, voice, _ in jobs}
    busy = tiny_random(max_streams=3, sampling=sampling, frame_codec=frame_codec)
    results = {}
    threads = [
        threading.Thread(target=speak, args=(busy, text, voice, seeds[key], delay, results, key))
        for key, text, voice, delay in jobs
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert len(expected["a"]) / busy.sample_rate / busy.frame_seconds > 5 * busy.cfg.window
    for key in expected:
        np.testing.assert_allclose(results[key], expected[key], atol=1e-4)
    alone.close()
    busy.close()


def test_frame_codec_equals_chunk_codec(engine):
    frames = tiny_random(max_streams=2, sampling=GREEDY, frame_codec=True)
    np.testing.assert_allclose(synthesize(TEXT, engine=frames), synthesize(TEXT, engine=engine), atol=1e-5)
    frames.close()


def test_same_seed_same_audio_alone_or_in_a_busy_batch():
    seeded = tiny_random(max_streams=3)
    first = speak(seeded, TEXT, seed=1234)
    results = {}
    threads = [
        threading.Thread(target=speak, args=(seeded, OTHER), kwargs=dict(results=results, key="other")),
        threading.Thread(
            target=speak, args=(seeded, TEXT), kwargs=dict(seed=1234, start_after=0.05, results=results, key="again")
        ),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    np.testing.assert_allclose(results["again"], first, atol=1e-4)
    assert len(speak(seeded, TEXT, seed=99)) != len(first) or not np.allclose(speak(seeded, TEXT, seed=99), first)
    seeded.close()


def test_unseeded_streams_draw_their_own_seeds():
    engine = tiny_random(max_streams=2)
    seeds = {engine.open().seed for _ in range(2)}
    assert len(seeds) == 2
    engine.close()


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
    with pytest.raises(UnknownVoice):
        engine.open("")
    with pytest.raises(ValueError):
        engine.open(speed=9)
    with pytest.raises(ValueError):
        engine.open(seed="x")
    with pytest.raises(TextError):
        synthesize("", engine=engine)
    with pytest.raises(TextError):
        synthesize("?!.,", engine=engine)
    with pytest.raises(TextError):
        synthesize("a" * (engine.max_chars + 1), engine=engine)


def test_server_full_then_a_cancelled_slot_is_reusable_next_tick(engine):
    assert wait_until(lambda: engine.active_streams == 0)
    streams = [engine.open() for _ in range(engine.max_streams)]
    with pytest.raises(ServerFull):
        engine.open()
    streams[1].cancel()
    assert streams[1].read(timeout=5) is None
    started = time.monotonic()
    reused = engine.open(wait_s=5)  # granted as soon as the engine thread has freed the slot
    assert time.monotonic() - started < 1.0
    reused.push_text("Hi there.")
    reused.end()
    assert reused.read(timeout=30) is not None
    for s in streams + [reused]:
        s.cancel()
    assert wait_until(lambda: engine.active_streams == 0)


def test_waiting_callers_get_slots_in_order_and_time_out():
    engine = tiny_random(max_streams=1, sampling=GREEDY, max_waiting=2)
    holder = engine.open()
    order, errors = [], []

    def wait(name, seconds):
        try:
            stream = engine.open(wait_s=seconds)
            order.append(name)
            stream.cancel()
        except ServerFull:
            errors.append(name)

    first = threading.Thread(target=wait, args=("first", 10))
    first.start()
    time.sleep(0.1)
    second = threading.Thread(target=wait, args=("second", 10))
    second.start()
    time.sleep(0.1)
    with pytest.raises(ServerFull):  # the queue holds two callers
        engine.open(wait_s=10)
    started = time.monotonic()
    with pytest.raises(ServerFull):
        engine.open()  # no wait: refused at once
    assert time.monotonic() - started < 0.1
    holder.cancel()
    first.join(10)
    second.join(10)
    assert order == ["first", "second"] and not errors
    late = engine.open(wait_s=5)
    started = time.monotonic()
    with pytest.raises(ServerFull):
        engine.open(wait_s=0.3)  # the deadline passes
    assert 0.25 < time.monotonic() - started < 2
    late.cancel()
    engine.close()


def test_cancel_stops_at_once(engine):
    stream = engine.open()
    stream.push_text(TEXT * 5)
    stream.end()
    assert stream.read(timeout=30) is not None
    stream.cancel()
    assert stream.read(timeout=5) is None


def test_a_stream_whose_text_breaks_the_front_end_fails_alone(engine, monkeypatch):
    import streaming.sentence_reader as reader  # where `read_sentence` (the text thread's reading) finds it

    real = reader.sentence_units

    def sentence_units(tokens, spoken, closed):
        if any("poison" in word for word in spoken):
            raise OverflowError("the phonemiser choked")
        return real(tokens, spoken, closed)

    monkeypatch.setattr(reader, "sentence_units", sentence_units)
    results = {}
    good = threading.Thread(target=speak, args=(engine, TEXT * 2), kwargs=dict(results=results, key="good"))
    good.start()
    time.sleep(0.05)
    bad = engine.open()
    bad.push_text("This is poison. ")
    bad.end()
    with pytest.raises(TextError):
        while bad.read(timeout=30) is not None:
            pass
    good.join(60)
    np.testing.assert_allclose(results["good"], synthesize(TEXT * 2, engine=engine), atol=1e-5)


def test_a_fault_after_a_streams_text_is_read_fails_it_and_the_text_thread_goes_on(engine):
    """A bug met after the front end (here: its hold timer) fails that stream; the text thread, which every
    stream's text needs, keeps reading the others' (it used to end, leaving later streams waiting forever)."""

    def broken_release_at():
        raise AttributeError("a job without a hold")

    bad = engine.open()
    bad.text.release_at = broken_release_at  # this stream's front end only
    bad.push_text("This is")  # no end: the take hands out nothing yet, so the thread asks for its timer
    with pytest.raises(TextError, match="could not be read"):
        while bad.read(timeout=30) is not None:
            pass
    np.testing.assert_allclose(speak(engine, TEXT), synthesize(TEXT, engine=engine), atol=1e-5)


def test_a_fault_in_the_batch_fails_its_streams_and_the_engine_recovers():
    engine = tiny_random(max_streams=2, sampling=GREEDY)
    expected = synthesize(TEXT, engine=engine)
    calls = {"n": 0}

    def flaky_factory(model, caches, batch, device):
        def step(*args):
            calls["n"] += 1
            if calls["n"] == 5:
                raise RuntimeError("device fault")
            return decode_step(*args)

        return step

    engine.set_step_factory(flaky_factory)
    with pytest.raises(EngineError):
        synthesize(TEXT, engine=engine)
    assert wait_until(lambda: engine.active_streams == 0)
    np.testing.assert_allclose(synthesize(TEXT, engine=engine), expected, atol=1e-5)
    engine.close()


def test_step_factory_switches_while_streams_are_live():
    engine = tiny_random(max_streams=2, sampling=GREEDY)
    expected = synthesize(TEXT * 2, engine=engine)
    built = []

    def factory(model, caches, batch, device):
        built.append(batch)
        return decode_step

    stream = engine.open()
    stream.push_text(TEXT * 2)
    stream.end()
    chunks = [stream.read(timeout=30)]
    engine.set_step_factory(factory)
    while (chunk := stream.read(timeout=30)) is not None:
        chunks.append(chunk)
    np.testing.assert_allclose(np.concatenate(chunks), expected, atol=1e-5)
    assert built == [1] and engine.step_kind == "factory"
    engine.close()


def test_step_cost_follows_the_live_slots():
    """One stream steps a bucket of one slot; a stream in slot 2 needs the bucket of 4 (slots 0-1 held meanwhile
    may have stepped the bucket of 2)."""
    built = []

    def factory(model, caches, batch, device):
        built.append((batch, caches.batch))
        return decode_step

    engine = tiny_random(max_streams=5, sampling=GREEDY, step_factory=factory)
    synthesize("Hi.", engine=engine)
    held = [engine.open() for _ in range(2)]
    synthesize("Hi.", engine=engine)
    for s in held:
        s.cancel()
    assert built[0] == (1, 1) and (4, 4) in built and max(built) == (4, 4) and all(b == c for b, c in built)
    engine.close()


def test_warm_up_builds_every_bucket_before_streams_arrive():
    built = []

    def factory(model, caches, batch, device):
        built.append(batch)
        return decode_step

    engine = tiny_random(max_streams=5, sampling=GREEDY, step_factory=factory, frame_codec=True)
    engine.warm_up()
    assert built == [1, 2, 4, 5]
    synthesize("Hi.", engine=engine)
    assert built == [1, 2, 4, 5]  # nothing more to build while speaking
    engine.close()


def test_backpressure_bounds_queued_audio():
    engine = tiny_random(max_streams=1, sampling=GREEDY, max_queued_seconds=0.5)
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
    engine.close()


def test_cache_memory_is_fixed(engine):
    before = engine.caches.nbytes
    synthesize(TEXT * 3, engine=engine)
    assert engine.caches.nbytes == before
    assert engine.caches.text[0].capacity == TEXT_RING


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


def test_stats_report_live_figures(engine):
    synthesize("Stats.", engine=engine)
    stats = engine.stats()
    assert {"active_streams", "queued", "max_streams", "step_kind", "tick_ms", "step_ms", "codec_ms"} <= set(stats)
    assert stats["tick_ms"]["p50"] > 0 and stats["step_ms"]["p99"] >= stats["step_ms"]["p50"]


def test_max_streams_defaults_to_a_cpu_figure_and_takes_a_cap():
    model, codec, voices = tiny_model_and_codec()
    engine = Engine(model, codec, voices)
    assert engine.max_streams == 8
    engine.close()


def test_per_row_temperature_in_one_batched_sample():
    from streaming.sampling import sample

    logits = torch.zeros(2, 3, 50)
    logits[..., 7] = 5.0  # token 7 is the clear favourite of every row and codebook
    draws = torch.stack([sample(logits, torch.tensor([1e-6, 1e3])[:, None, None], 40) for _ in range(50)])  # (50, B, K)
    assert (draws[:, 0] == 7).all()  # near zero: greedy
    assert (draws[:, 1] != 7).any()  # very hot: anything in the top 40


def test_counter_noise_depends_on_seed_and_step_only():
    from streaming.sampling import counter_uniform, stream_key

    keys, steps = stream_key(torch.tensor([5, 2**40 + 5, 5])), torch.tensor([9, 9, 10])
    noise = counter_uniform(keys, steps, (4, 40))
    alone = counter_uniform(keys[2:], steps[2:], (4, 40))
    assert torch.equal(noise[2], alone[0])  # the same block in any batch and row
    assert not torch.equal(noise[0], noise[1]) and not torch.equal(noise[0], noise[2])
    many = counter_uniform(stream_key(torch.arange(500)), torch.zeros(500, dtype=torch.long), (8, 40))
    assert 0 < float(many.min()) and float(many.max()) < 1 and abs(float(many.mean()) - 0.5) < 0.01


def test_a_stream_samples_at_its_voices_temperature():
    engine = tiny_random(max_streams=2)
    engine.voices["slt"] = {**engine.voices["slt"], "temperature": 0.3}
    synthesize("Hello there.", voice="slt", engine=engine)
    assert engine.slots.temperature.flatten().tolist() == pytest.approx([0.3, 1.0])
    engine.close()


def test_frame_codec_with_idle_rows_equals_the_offline_decode():
    """The GPU's codec path on the CPU: one frame per row per call, rows idle at different calls (their
    state untouched), one row restarted midway; each row's frames decode as `Codec.decode` does offline."""
    from streaming.codec_worker import FrameCodec

    _, codec, _ = tiny_model_and_codec()
    frames = 12
    codes = torch.randint(0, codec.cfg.codebook_size, (3, codec.cfg.codebooks, frames))
    decoder = FrameCodec(codec.eval(), 3, "cpu")
    schedule = torch.tensor([[1] * 16, [1, 0] * 8, [1] * 16]).bool()  # (rows, calls): who decodes
    junk = torch.randint(0, codec.cfg.codebook_size, (codec.cfg.codebooks,))
    taken, audio = [0, 0, 0], [[], [], []]
    with torch.no_grad():
        for call in range(16):
            active = schedule[:, call] & torch.tensor([t < frames for t in taken])
            current = torch.stack([codes[r, :, min(taken[r], frames - 1)] for r in range(3)])
            if call < 3:
                current[2] = junk  # row 2 speaks something else first, then restarts with a new stream
            out = decoder.run(3, current, active, torch.tensor([False, False, call == 3]))
            for r in range(3):
                if active[r] and (r != 2 or call >= 3):
                    audio[r].append(out[r].clone())
                    taken[r] += 1
    offline = codec.decode(codes)
    for r in range(3):
        got = torch.cat(audio[r])
        torch.testing.assert_close(got, offline[r, : len(got)], atol=1e-5, rtol=1e-4)
        assert len(got) >= 8 * codec.cfg.hop


def test_a_long_run_of_units_without_frames_never_stalls_the_stream():
    """A model predicting zero frames for ~30 units in a row: the aligned unit used to stay behind them, the text
    ring full of units without frames, and the utterance never ended. Now the slot is topped up when it cannot
    step, and the unit that would make the run longer than the ring allows gets one frame (`Slots.cap_silence`)."""
    engine = tiny_random(max_streams=1)
    engine.model.text.duration[-1].bias.data.fill_(0.4)
    stream = engine.open(speed=2.0, seed=1)
    stream.push_text("The other client is speaking. ")
    time.sleep(0.3)
    stream.push_text("And it goes on.")
    stream.end()
    audio = []
    while (chunk := stream.read(timeout=10)) is not None:  # raised TimeoutError when stuck
        audio.append(chunk)
    assert audio
    engine.close()


def test_cap_silence_gives_a_frame_to_the_unit_that_makes_a_run_too_long():
    from streaming.slots import Slots
    from tts.model import MODEL_PRESETS

    cfg = MODEL_PRESETS["tiny"]
    slots = Slots(cfg, 2, 2 + cfg.behind + cfg.ahead + 2)  # at most 2 zero-frame units in a row
    slots.silent[0] = 1
    rows, keep = torch.tensor([0, 1]), torch.tensor([[True] * 6, [True] * 4 + [False] * 2])
    durations = slots.cap_silence(rows, torch.tensor([[0, 0, 3, 0, 0, 0], [2, 0, 0, 0, 0, 0]]), keep)
    assert durations.tolist() == [[0, 1, 3, 0, 0, 1], [2, 0, 0, 1, 0, 0]]
    assert slots.silent.tolist() == [0, 0]
    keep = torch.tensor([[True, True, False], [True, False, False]])
    assert slots.cap_silence(rows, torch.zeros(2, 3, dtype=torch.long), keep).tolist() == [[0, 0, 0], [0, 0, 0]]
    assert slots.silent.tolist() == [2, 1]  # the runs carry over to the next units


def test_a_first_chunk_goes_ahead_of_the_codec_backlog_and_each_stream_decodes_in_order():
    """The CPU codec worker: a new stream's first chunk runs before chunks queued earlier for other streams, even
    in the slot a stream with chunks still queued has just left (each slot has two decoder rows), and every
    stream's audio equals its own chunks decoded in order from the start state."""
    from streaming.stream import Stream

    engine = tiny_random(max_streams=1)
    codec = engine.codec
    worker, gate, lengths = held_codec_worker(codec, 1)  # its first decode held until the test has queued the rest
    a, b = (Stream(engine, "joe", 1.0, 1000, seed) for seed in (1, 2))
    codes = torch.Generator().manual_seed(0)
    a1, a2, b1 = (
        torch.randint(0, codec.cfg.codebook_size, (1, codec.cfg.codebooks, t), generator=codes) for t in (16, 16, 2)
    )
    worker.reset([0])
    worker.decode([0], [a], a1, [16])
    assert wait_until(lambda: lengths == [16])  # the worker is busy with a's first chunk
    worker.decode([0], [a], a2, [16])
    worker.finish(a, None)
    worker.reset([0])  # b starts in the slot a left, while a's second chunk is still queued
    worker.decode([0], [b], b1, [2], first=True)
    gate.set()
    audio = {}
    for name, stream in (("a", a), ("b", b)):
        chunks = []
        while (chunk := stream.read(timeout=30)) is not None:
            chunks.append(chunk)
            if name == "b":
                stream.finish()
        audio[name] = np.concatenate(chunks)
    assert lengths == [16, 2, 16]  # b's first chunk before a's second
    with torch.no_grad():
        state = codec.init_state(1)
        expected_a = np.concatenate([codec.decode_step(c, state)[0].numpy() for c in (a1, a2)])
        expected_b = codec.decode_step(b1, codec.init_state(1))[0].numpy()
    np.testing.assert_allclose(audio["a"], expected_a, atol=1e-5)
    np.testing.assert_allclose(audio["b"], expected_b, atol=1e-5)
    worker.close()
    engine.close()


def _read_until_quiet(stream, quiet_s=1.5) -> list[np.ndarray]:
    """The chunks a stream hands out until none comes for ``quiet_s`` (it has said all it can)."""
    chunks = []
    while True:
        try:
            chunk = stream.read(timeout=quiet_s)
        except TimeoutError:
            return chunks
        assert chunk is not None
        chunks.append(chunk)


def test_a_flush_hands_out_all_of_the_closed_texts_audio_without_more_text():
    """A flush's text is spoken to its last frame before any more text comes (a pause of K - 1 frames after it
    lets the delay pattern complete its frames), and the stream goes on when text comes."""
    engine = tiny_random(max_streams=1, sampling=SamplingConfig(temperature=0.0))
    hop, books = engine.codec.cfg.hop, engine.slots.books
    first, rest = "The birch canoe slid on the smooth planks.", "Glue the sheet to the dark blue background."
    whole = synthesize(first, engine=engine, seed=4)  # `end` right after: the utterance's own tail
    stream = engine.open(seed=4)
    stream.push_text(first)
    stream.flush()
    said = np.concatenate(_read_until_quiet(stream))
    assert len(said) == len(whole)  # every frame of the flushed text, nothing of the pause
    same = len(whole) - (books - 1) * hop  # the last K - 1 frames' later codebooks saw the pause, not the end
    np.testing.assert_allclose(said[:same], whole[:same], atol=1e-5)
    stream.push_text(rest)
    stream.end()
    after = []
    while (chunk := stream.read(timeout=60)) is not None:
        after.append(chunk)
    assert sum(map(len, after)) > (books - 1) * hop  # the pause, then the rest
    engine.close()


def test_text_ring_writes_all_layers_at_once_as_layer_by_layer():
    """`StepCaches.write_text` on the stacked text rings (`empty`) stores exactly what a layer-by-layer write
    (`RingKVCache.update` of each layer's own ring) stores, with holes (``keep``), a subset of rows, and ring
    wrap-around."""
    from streaming.kv_cache import RingKVCache
    from streaming.step_caches import StepCaches

    cfg = tiny_model_and_codec()[0].cfg
    g = torch.Generator().manual_seed(0)
    stacked = StepCaches.empty(cfg, 5)
    positions_apart = stacked.text[0].positions.clone()  # layers share one positions tensor, as in `empty`
    apart = [RingKVCache(r.keys.clone(), r.values.clone(), positions_apart) for r in stacked.text]
    for start in (0, 7, 30):
        rows = torch.tensor([4, 1, 2])
        positions = start + torch.arange(12)[None, :].repeat(3, 1) + torch.tensor([[0], [3], [5]])
        keep = torch.rand(3, 12, generator=g) < 0.7
        kv = [
            (
                torch.randn(3, cfg.heads, 12, cfg.head_dim, generator=g),
                torch.randn(3, cfg.heads, 12, cfg.head_dim, generator=g),
            )
            for _ in range(cfg.layers)
        ]
        stacked.write_text(tuple(torch.stack(part) for part in zip(*kv)), positions, keep, rows)
        for ring, (k, v) in zip(apart, kv):
            ring.update(k, v, positions, keep, rows)
        for a, b in zip(stacked.text, apart):
            assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
            assert torch.equal(a.positions, b.positions)
    view = stacked.view(3)
    assert view.text_stack.keys.data_ptr() == stacked.text_stack.keys.data_ptr()
    assert view.text[1].keys.data_ptr() == stacked.text_stack.keys[1].data_ptr()


def test_text_keys_of_all_layers_at_once_equal_each_layers_own():
    """`TTSModel.text_keys_values` (one head split and rotation for all layers) gives exactly what each
    layer's `Attention.keys_values` gives."""
    from tts.model import MODEL_PRESETS, TTSModel, rope_angles

    torch.manual_seed(0)
    model = TTSModel(MODEL_PRESETS["shipped"]).eval()
    states, starts = torch.randn(3, 17, model.cfg.dim), torch.randint(0, 500, (3, 17))
    with torch.no_grad():
        angles = rope_angles(starts, model.cfg.head_dim, model.cfg.rope_base)
        apart = [block.attn.keys_values(block.attn_norm(states), angles) for block in model.blocks]
        keys, values = model.text_keys_values(states, starts)
    assert keys.shape == (model.cfg.layers, 3, model.cfg.heads, 17, model.cfg.head_dim)
    for layer, (k, v) in enumerate(apart):
        assert torch.equal(keys[layer], k) and torch.equal(values[layer], v)


def test_chunk_schedules_per_slot_staggered_and_chosen_once_at_the_first_prefill():
    """Each slot's chunk sizes: CHUNK_SCHEDULE from `start`, INCREMENTAL_CHUNKS chosen at a fresh slot's first
    prefill when its text came in pieces; the stagger cuts each table's first chunk of its last size."""
    from streaming.slots import CHUNK_SCHEDULE, INCREMENTAL_CHUNKS, Slots, schedule_table
    from tts.model import MODEL_PRESETS

    table = schedule_table((6, 6, 8, 12, 16), 3, stagger=True)
    assert table.tolist() == [[6, 6, 8, 12, 16, 16], [6, 6, 8, 12, 15, 16], [6, 6, 8, 12, 14, 16]]
    slots = Slots(MODEL_PRESETS["tiny"], 4, TEXT_RING, stagger=True)
    whole = [*CHUNK_SCHEDULE, CHUNK_SCHEDULE[-1]]
    pieces = [*INCREMENTAL_CHUNKS, INCREMENTAL_CHUNKS[-1]]
    pieces = pieces + [pieces[-1]] * (len(whole) - len(pieces))  # one width for both tables
    rows = torch.tensor([0, 1, 2])
    slots.start(rows, torch.tensor([1, 2, 3]), torch.ones(3))
    slots.choose_schedules(rows, torch.tensor([True, True, False]), torch.tensor([True, False, True]))
    assert slots.schedule[0].tolist() == pieces
    assert slots.schedule[1].tolist() == [*whole[:5], whole[5] - 1, whole[6]]  # slot 1: staggered by 1
    assert slots.schedule[2].tolist() == [*whole[:5], whole[5] - 2, whole[6]]  # not fresh: kept
    slots.start(torch.tensor([0]), torch.tensor([4]), torch.ones(1))  # a new stream in slot 0: whole again
    assert slots.schedule[0].tolist() == whole


def test_fast_words_start_with_the_incremental_first_chunk_and_whole_text_with_the_small_one(engine):
    """Words at 20 a second outrun the start hold (`TextStream.released_at_once`): INCREMENTAL_CHUNKS; text sent
    whole: CHUNK_SCHEDULE."""
    from streaming.slots import CHUNK_SCHEDULE, INCREMENTAL_CHUNKS

    hop = engine.codec.cfg.hop
    stream = engine.open(seed=3)
    for word in "The birch canoe slid on the smooth planks and the ducks swam by.".split():
        stream.push_text(word + " ")
        time.sleep(0.05)
    stream.end()
    sizes = []
    while (chunk := stream.read(timeout=30)) is not None:
        sizes.append(len(chunk) // hop)
    assert stream.text.released_at_once
    assert sizes[:2] == list(INCREMENTAL_CHUNKS[:2])
    assert len(next(iter(synthesize_stream(TEXT, engine=engine)))) == CHUNK_SCHEDULE[0] * hop
