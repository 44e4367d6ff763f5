"""Parked streams, open streams beyond slots, and streams moved between engines, on the tiny random engine:
a parked, spilled or moved stream's audio equals the same stream never parked (bit for bit on the CPU)."""

import functools
import os
import threading
import time

import numpy as np
import pytest
import torch

from streaming.codec_worker import AudioOutbox, CodecWorker, FrameCodec
from streaming.engine import BadState, EngineError, SamplingConfig, ServerFull
from streaming.parking import Parked, ParkingConfig, ParkingStore, RowPool, pack, unpack
from streaming.slot_mover import SlotMover
from streaming.slots import CHUNK_SCHEDULE, Slots
from streaming.step_caches import TEXT_RING, StepCaches
from testkit import held_codec_worker, tiny_model_and_codec, tiny_random, wait_until

GREEDY = SamplingConfig(temperature=0.0)
TEXT = "Hello there. How are you today? The ring never grows."
CUT = 26  # "Hello there. How are you t": the text runs dry mid-sentence, mid-word
OTHER = "Something else entirely, said by another voice."
QUICK = ParkingConfig(park_after_s=0.05)
NEVER = ParkingConfig(park_after_s=0)


def read_all(stream, timeout=30.0, chunks=None) -> tuple[list[np.ndarray], bool]:
    """Chunks until the end (True), a read that times out (False), or ``chunks`` chunks (False)."""
    out = []
    while chunks is None or len(out) < chunks:
        try:
            chunk = stream.read(timeout=timeout)
        except TimeoutError:
            return out, False
        if chunk is None:
            return out, True
        out.append(chunk)
    return out, False


def unparked(text, seed, sampling, frame_codec=False, cut=None) -> np.ndarray:
    return _unparked(text, seed, sampling.temperature, frame_codec, cut)


@functools.cache
def _unparked(text, seed, temperature, frame_codec, cut=None) -> np.ndarray:
    """The stream's audio from a one-slot engine that never parks; with ``cut``, its text comes in two pieces, the
    second once the first is spoken (the AR read the first piece's last units speculatively, `Engine._prefill`)."""
    engine = tiny_random(
        max_streams=1, sampling=SamplingConfig(temperature=temperature), frame_codec=frame_codec, parking=NEVER
    )
    stream = engine.open(seed=seed)
    stream.push_text(text[:cut])
    first = read_until_dry(stream) if cut else []
    stream.push_text(text[cut:] if cut else "")
    stream.end()
    audio, finished = read_all(stream)
    audio = first + audio
    engine.close()
    assert finished
    return np.concatenate(audio)


def read_until_dry(stream) -> list[np.ndarray]:
    """The audio of the text so far: the first chunk (however slow), then chunks until none comes for 0.5 s."""
    return [stream.read(timeout=30)] + read_all(stream, timeout=0.5)[0]


def assert_same(got: list[np.ndarray], expected: np.ndarray) -> None:
    audio = np.concatenate(got)
    assert len(audio) == len(expected)
    np.testing.assert_allclose(audio, expected, atol=1e-4)
    assert np.array_equal(audio, expected)  # on the CPU: bit for bit


@pytest.mark.parametrize("frame_codec, sampling", [(False, GREEDY), (True, SamplingConfig())])
def test_a_parked_stream_gives_its_slot_away_and_continues_exactly(frame_codec, sampling):
    """One slot, two open streams: the first runs out of text mid-sentence and is parked, the second speaks
    in its slot meanwhile, then the first gets its text and is restored."""
    engine = tiny_random(max_streams=1, max_open=2, sampling=sampling, frame_codec=frame_codec, parking=QUICK)
    first = engine.open(seed=5)
    first.push_text(TEXT[:CUT])
    before = read_until_dry(first)
    assert wait_until(lambda: engine.stats()["parking"]["parked"]["host"] == 1, 30)
    second = engine.open(seed=6)
    second.push_text(OTHER)
    second.end()
    other, finished = read_all(second)
    assert finished
    first.push_text(TEXT[CUT:])
    first.end()
    after, finished = read_all(first)
    assert finished
    assert_same(before + after, unparked(TEXT, 5, sampling, frame_codec, CUT))
    assert_same(other, unparked(OTHER, 6, sampling, frame_codec))
    stats = engine.stats()
    assert stats["parks"] >= 1 and stats["restores"] >= 1 and stats["parking"]["park_ms"]["count"] >= 1
    assert stats["parking"]["parked"] == {"host": 0, "disk": 0} and stats["parking"]["host_bytes"] == 0
    assert stats["parking"]["pool"] == {"rows": 2, "in_use": 0, "misses": 0}  # rows: max_open; all given back
    engine.close()


def test_a_stream_spilled_to_disk_continues_exactly_and_leaves_no_file(tmp_path, frame_codec=False):
    parking = ParkingConfig(park_after_s=0.05, disk_after_s=0.1, directory=str(tmp_path))
    engine = tiny_random(max_streams=1, sampling=GREEDY, frame_codec=frame_codec, parking=parking)
    stream = engine.open(seed=7)
    stream.push_text(TEXT[:CUT])
    before = read_until_dry(stream)
    assert wait_until(lambda: engine.stats()["parking"]["parked"]["disk"] == 1, 30)
    (folder,) = os.listdir(tmp_path)
    assert len(os.listdir(tmp_path / folder)) == 1
    stream.push_text(TEXT[CUT:])
    stream.end()
    after, finished = read_all(stream)
    assert finished
    assert_same(before + after, unparked(TEXT, 7, GREEDY, frame_codec))
    assert os.listdir(tmp_path / folder) == []
    stats = engine.stats()["parking"]
    assert stats["spill_ms"]["count"] == 1 and stats["load_ms"]["count"] == 1 and stats["disk_bytes"] == 0
    engine.close()
    assert os.listdir(tmp_path) == []


def test_a_reader_far_behind_is_parked_and_resumes_exactly():
    engine = tiny_random(max_streams=1, max_open=2, sampling=GREEDY, max_queued_seconds=0.3, parking=QUICK)
    slow = engine.open(seed=3)
    slow.push_text(TEXT)
    slow.end()
    first = slow.read(timeout=30)
    assert wait_until(lambda: engine.counters["parks"] >= 1, 30)  # paused by backpressure, then parked
    other = engine.open(seed=4)  # speaks in the slot while the slow reader sleeps
    other.push_text(OTHER)
    other.end()
    assert read_all(other)[1]
    rest, finished = read_all(slow)
    assert finished
    assert_same([first] + rest, unparked(TEXT, 3, GREEDY))
    assert engine.counters["restores"] >= 1
    engine.close()


def test_open_streams_beyond_slots_wait_for_one_and_a_full_engine_says_so():
    engine = tiny_random(max_streams=1, max_open=3, sampling=GREEDY, parking=QUICK)
    streams = [engine.open(seed=10 + i) for i in range(3)]
    with pytest.raises(ServerFull):
        engine.open()
    texts = [TEXT, OTHER, TEXT[:30]]
    for stream, text in zip(streams, texts):
        stream.push_text(text)
        stream.end()
    results = {}
    threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, read_all(streams[i]))) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for i, text in enumerate(texts):
        audio, finished = results[i]
        assert finished
        assert_same(audio, unparked(text, 10 + i, GREEDY))
    stats = engine.stats()
    assert stats["slot_waits"] >= 1 and stats["max_open"] == 3 and stats["max_streams"] == 1
    assert wait_until(lambda: engine.active_streams == 0, 30)
    engine.close()


def test_cancelling_a_parked_or_waiting_stream_frees_everything(tmp_path):
    engine = tiny_random(
        max_streams=1,
        max_open=3,
        sampling=GREEDY,
        parking=ParkingConfig(park_after_s=0.05, disk_after_s=0.05, directory=str(tmp_path)),
    )
    parked = engine.open()
    parked.push_text(TEXT[:CUT])
    assert wait_until(lambda: engine.stats()["parking"]["parked"]["disk"] == 1, 30)
    speaking, waiting = engine.open(), engine.open()
    speaking.push_text(TEXT * 3)
    waiting.push_text(OTHER)
    assert speaking.read(timeout=30) is not None
    for stream in (parked, waiting, speaking):
        stream.cancel()
        assert stream.read(timeout=5) is None
    assert wait_until(lambda: engine.active_streams == 0, 30)
    stats = engine.stats()
    assert stats["slots_used"] == 0 and stats["waiting_for_slot"] == 0
    assert stats["parking"]["parked"] == {"host": 0, "disk": 0} and stats["parking"]["disk_bytes"] == 0
    assert stats["parking"]["pool"]["in_use"] == 0
    (folder,) = os.listdir(tmp_path)
    assert os.listdir(tmp_path / folder) == []
    engine.close()


@pytest.mark.parametrize("frame_codec, sampling", [(False, GREEDY), (True, SamplingConfig())])
def test_a_held_stream_gives_its_slot_back_at_once_and_continues_exactly(frame_codec, sampling):
    """`hold` mid-utterance (its reader's connection dropped, say): parked at once, not after the grace (an
    hour here), so another stream speaks in the one slot; text pushed while held is kept; `release` goes on
    sample-exactly."""
    engine = tiny_random(
        max_streams=1, max_open=2, sampling=sampling, frame_codec=frame_codec, parking=ParkingConfig(park_after_s=3600)
    )
    held = engine.open(seed=5)
    held.push_text(TEXT[:CUT])
    before, _ = read_all(held, chunks=2)  # speaking: the hold comes mid-utterance
    held.hold()
    held.push_text(TEXT[CUT:])
    held.end()
    assert wait_until(lambda: engine.stats()["parking"]["parked"]["host"] == 1, 30)
    before += read_all(held, timeout=0.5)[0]  # audio decoded before the hold still comes
    other = engine.open(seed=6)
    other.push_text(OTHER)
    other.end()
    audio, finished = read_all(other, timeout=30)
    assert finished
    assert_same(audio, unparked(OTHER, 6, sampling, frame_codec))
    with pytest.raises(TimeoutError):
        held.read(timeout=0.3)  # nothing while held, the slot free or not
    held.release()
    after, finished = read_all(held)
    assert finished
    assert_same(before + after, unparked(TEXT, 5, sampling, frame_codec))
    assert engine.counters["parks"] == 1 and engine.counters["restores"] == 1
    assert wait_until(lambda: engine.active_streams == 0, 30)
    engine.close()


def test_a_stream_held_while_waiting_for_a_slot_lets_others_pass_until_released():
    engine = tiny_random(max_streams=1, max_open=3, sampling=GREEDY, parking=ParkingConfig(park_after_s=3600))
    first, held = engine.open(seed=41), engine.open(seed=42)
    first.push_text(OTHER)
    first.end()
    assert first.read(timeout=30) is not None  # `held` waits for the slot behind it
    held.push_text(TEXT[:30])
    held.end()
    held.hold()
    third = engine.open(seed=43)
    third.push_text(OTHER)
    third.end()
    assert read_all(first)[1] and read_all(third)[1]  # the held one's turn goes to the next
    with pytest.raises(TimeoutError):
        held.read(timeout=0.3)
    held.hold()  # again: no change
    held.release()
    audio, finished = read_all(held)
    assert finished
    assert_same(audio, unparked(TEXT[:30], 42, GREEDY))
    assert wait_until(lambda: engine.active_streams == 0, 30)
    engine.close()


@pytest.mark.parametrize("frame_codec, sampling", [(False, GREEDY), (True, SamplingConfig())])
def test_a_stream_detached_mid_utterance_continues_on_another_engine(frame_codec, sampling):
    here = tiny_random(max_streams=2, sampling=sampling, frame_codec=frame_codec)
    there = tiny_random(max_streams=2, sampling=sampling, frame_codec=frame_codec)
    stream = here.open(seed=21)
    stream.push_text(TEXT[:30])
    before, _ = read_all(stream, chunks=3)  # it is speaking: more text is encoded than spoken
    state = here.detach(stream)
    assert stream.moved and stream.read(timeout=1) is None
    assert wait_until(lambda: here.active_streams == 0, 30)
    moved = there.attach(state)
    moved.push_text(TEXT[30:])
    moved.end()
    after, finished = read_all(moved)
    assert finished
    assert_same(before + after, unparked(TEXT, 21, sampling, frame_codec))
    assert wait_until(lambda: there.active_streams == 0, 30)
    here.close()
    there.close()


def test_parked_and_waiting_streams_detach_too():
    here = tiny_random(max_streams=1, max_open=2, sampling=GREEDY, parking=QUICK)
    there = tiny_random(max_streams=1, sampling=GREEDY)
    parked = here.open(seed=31)
    parked.push_text(TEXT[:CUT])
    before = read_until_dry(parked)
    assert wait_until(lambda: here.counters["parks"] >= 1, 30)
    busy = here.open(seed=32)  # holds the slot while speaking
    busy.push_text(TEXT * 4)
    assert busy.read(timeout=30) is not None
    parked.push_text(TEXT[CUT:])  # now it waits for the slot, to be restored
    moved = there.attach(here.detach(parked))
    moved.end()
    after, finished = read_all(moved)
    assert finished
    assert_same(before + after, unparked(TEXT, 31, GREEDY))
    busy.cancel()
    never_started = here.open(seed=33)  # waits for the slot behind `busy`... or gets it: either moves
    never_started.push_text(OTHER)
    never_started.end()
    moved = there.attach(here.detach(never_started))
    audio, finished = read_all(moved)
    assert finished and audio
    assert wait_until(lambda: here.active_streams == 0, 30)
    here.close()
    there.close()


def test_attach_refuses_what_is_not_a_state_of_the_same_weights():
    here, other = tiny_random(max_streams=1), tiny_random(max_streams=1)
    with pytest.raises(BadState):
        here.attach(b"not a stream")
    with pytest.raises(BadState):
        here.attach("text")
    with pytest.raises(BadState):
        here.attach(pack({}, {}, [], "someone else's weights"))
    other.model.sinks.data += 1  # other weights
    other._fingerprint = None
    stream = other.open(seed=1)
    stream.push_text(TEXT[:CUT])
    with pytest.raises(BadState):
        here.attach(other.detach(stream))
    with pytest.raises(EngineError):
        other.detach(stream)  # it has moved
    here.close()
    other.close()


def test_attach_refuses_a_state_that_lacks_rows():
    here = tiny_random(max_streams=1)
    stream = here.open(seed=1)
    stream.push_text(TEXT[:CUT])
    assert stream.read(timeout=30) is not None  # it holds a slot, so its state has rows
    host, rows, unread = unpack(here.detach(stream), here.fingerprint)
    del rows["step"]
    with pytest.raises(BadState):
        here.attach(pack(host, rows, unread, here.fingerprint))
    here.close()


def test_packed_rows_hold_each_tensor_row_at_its_offset():
    """The worked example of `RowLayout`: offsets, and a gather/scatter round trip between slots."""
    import torch

    from streaming.parking import RowLayout

    tensors = {"keys": torch.randn(4, 2, 3), "step": torch.arange(4) * 7, "live": torch.tensor([1, 0, 1, 0]).bool()}
    layout = RowLayout(tensors)
    assert [(name, offset, nbytes) for name, offset, nbytes, _, _ in layout.entries] == [
        ("keys", 0, 24),
        ("step", 32, 8),
        ("live", 48, 1),
    ] and layout.row_bytes == 64
    flats = [torch.zeros(64, dtype=torch.uint8) for _ in range(2)]
    layout.copy([layout.packed(f) for f in flats], [layout.slot(tensors, r) for r in (2, 1)])
    assert torch.equal(layout.views(flats[0])["keys"], tensors["keys"][2:3])
    assert layout.views(flats[1])["step"].item() == 7
    before = {name: t.clone() for name, t in tensors.items()}
    layout.copy([layout.slot(tensors, r) for r in (0, 3)], [layout.packed(f) for f in flats])  # 2 -> 0, 1 -> 3
    for name, t in tensors.items():
        assert torch.equal(t[0], before[name][2]) and torch.equal(t[3], before[name][1])
        assert torch.equal(t[1:3], before[name][1:3])
    assert torch.equal(layout.flatten(layout.views(flats[0])), flats[0])


def test_pack_round_trips_and_reads_no_code():
    import torch

    rows = {"a": torch.arange(6).view(1, 2, 3), "b": torch.ones(1, 4)}
    host, back, unread = unpack(pack({"units": [1, 2], "x": {"y": 1}}, rows, [np.ones(3, np.float32)], "fp"), "fp")
    assert host == {"units": [1, 2], "x": {"y": 1}} and torch.equal(back["a"], rows["a"])
    assert np.array_equal(unread[0], np.ones(3, np.float32))

    class Evil:
        def __reduce__(self):
            return (os.system, ("echo owned",))

    import io

    buffer = io.BytesIO()
    torch.save({"format": "tts-parked-stream/1", "fingerprint": "fp", "host": Evil()}, buffer)
    with pytest.raises(ValueError):
        unpack(buffer.getvalue(), "fp")


def test_store_bounds_host_memory_by_spilling_the_oldest(tmp_path):
    import torch

    from streaming.parking import Parked

    store = ParkingStore(ParkingConfig(disk_after_s=60, max_host_bytes=1000, directory=str(tmp_path)), lambda: None)
    parked = []
    for i in range(3):
        p = Parked()
        p.add({"rows": torch.full((1, 100), float(i))})  # 400 bytes each
        p.captured.set()
        store.put(p)
        parked.append(p)
    assert wait_until(lambda: store.stats()["parked"] == {"host": 2, "disk": 1}, 30)
    assert parked[0].tier == "disk" and store.host_bytes == 800
    loaded = threading.Event()
    store.on_loaded = loaded.set
    assert not store.want(parked[0])
    assert loaded.wait(5) and store.want(parked[0])
    assert torch.equal(store.take(parked[0])["rows"], torch.zeros(1, 100))
    store.close()
    assert os.listdir(tmp_path) == []


def test_text_arriving_as_the_grace_ends_is_never_lost():
    """Text handled in the same tick as the decision to park: the stream is restored and speaks (a race that
    once left such streams parked for good)."""
    engine = tiny_random(max_streams=1, sampling=GREEDY, parking=ParkingConfig(park_after_s=0.01))
    rng = np.random.default_rng(0)
    for i in range(12):
        stream = engine.open(seed=i)
        time.sleep(float(rng.uniform(0, 0.03)))
        stream.push_text("Hi there. ")
        time.sleep(float(rng.uniform(0, 0.03)))
        stream.push_text("Bye.")
        stream.end()
        audio, finished = read_all(stream, timeout=10)
        assert finished and audio, f"utterance {i} never finished"
    engine.close()


def test_codec_restore_reads_the_rows_its_capture_queued_before_it_made():
    """A stream parked and restored at once (the CPU codec worker still busy): the restore's decoder rows are
    read when its job runs, after the capture queued before it, not when the engine asks (then they were not
    there yet: KeyError 'codec.h' in the codec thread, and the slot kept another stream's decoder state)."""
    import torch

    from streaming.stream import Stream

    engine = tiny_random(max_streams=2)
    codec = engine.codec
    worker, gate, calls = held_codec_worker(codec, 2)  # its first decode held until the capture and restore are queued
    a, b, c = (Stream(engine, "joe", 1.0, 1000, seed) for seed in (1, 2, 3))
    gen = torch.Generator().manual_seed(0)
    first, second = (
        torch.randint(0, codec.cfg.codebook_size, (1, codec.cfg.codebooks, 4), generator=gen) for _ in range(2)
    )
    worker.reset([0, 1])
    worker.decode([0], [a], first, [4])
    assert wait_until(lambda: calls == [4])  # busy with slot 0's chunk
    captured: list[dict] = []
    worker.capture([0], captured.extend)
    worker.restore([1], lambda: captured)  # slot 1 continues as slot 0 would
    gate.set()
    worker.decode([0], [b], second, [4])
    worker.decode([1], [c], second, [4])
    worker.finish(a, None)
    out = {}
    for name, stream in (("a", a), ("b", b), ("c", c)):
        out[name] = stream.read(timeout=30)
        assert out[name] is not None
    np.testing.assert_array_equal(out["b"], out["c"])
    worker.close()
    engine.close()


def a_slot_mover(store: ParkingStore, batch: int, frame_codec: bool):
    """A `SlotMover` over ``batch`` CPU slots of the tiny model, with the frame codec or the CPU codec worker:
    (mover, its codec parts)."""
    model, codec, _ = tiny_model_and_codec()
    cpu = torch.device("cpu")
    caches = StepCaches.empty(model.cfg, batch, cpu)
    slots = Slots(model.cfg, batch, TEXT_RING, cpu, stagger=frame_codec)
    if frame_codec:
        codec_parts = {
            "frame_decoder": FrameCodec(codec, batch, cpu),
            "outbox": AudioOutbox(batch, max(CHUNK_SCHEDULE), codec.cfg.hop),
        }
    else:
        codec_parts = {"codec_worker": CodecWorker(codec, batch, cpu)}
    return SlotMover(store, caches, slots, cpu, batch, **codec_parts), codec_parts


@pytest.mark.parametrize("frame_codec", [False, True])
def test_slot_mover_moves_every_row_of_a_slot_bit_for_bit(tmp_path, frame_codec):
    """`SlotMover` alone: slot 1's state parked, spilled to disk and loaded, then restored into slot 3 equals
    what slot 1 held, in every row tensor; no other slot changes. With the frame codec its decoder rows and
    audio outbox travel in the parked state; without it, the CPU codec worker's (its own thread, in order)."""
    store = ParkingStore(ParkingConfig(disk_after_s=0.05, directory=str(tmp_path)), on_loaded=lambda: None)
    mover, codec_parts = a_slot_mover(store, 4, frame_codec)
    generator = torch.Generator().manual_seed(0)
    for tensor in mover.row_tensors().values():  # every slot's state made distinct
        if tensor.dtype == torch.bool:
            tensor.copy_(torch.rand(tensor.shape, generator=generator) > 0.5)
        else:
            tensor.copy_(torch.randint(0, 100, tensor.shape, generator=generator).to(tensor.dtype))
    if frame_codec:
        codec_parts["outbox"].audio[:] = np.random.default_rng(0).standard_normal(codec_parts["outbox"].audio.shape)
    before = {name: tensor.clone() for name, tensor in mover.row_tensors().items()}
    audio_before = codec_parts["outbox"].audio.copy() if frame_codec else None
    parked = Parked()
    mover.park([(parked, 1)])
    assert parked.settled(timeout=10)
    assert wait_until(lambda: store.stats()["parked"]["disk"] == 1)  # spilled: a restore reads the file's rows
    assert wait_until(lambda: store.want(parked))
    store.take(parked)
    mover.restore([3], [parked])
    if not frame_codec:  # the codec worker restores on its thread: a capture queued after it reads it back
        decoded = threading.Event()
        codec_parts["codec_worker"].capture([3], lambda states: decoded.set())
        assert decoded.wait(10)
    for name, tensor in mover.row_tensors().items():
        assert torch.equal(tensor[3], before[name][1]), name
        assert torch.equal(tensor[:3], before[name][:3]), name
    if frame_codec:
        assert np.array_equal(codec_parts["outbox"].audio[3], audio_before[1])
        assert np.array_equal(codec_parts["outbox"].audio[:3], audio_before[:3])
    else:
        codec_parts["codec_worker"].close()
    figures = store.stats()
    assert figures["park_ms"]["count"] == figures["restore_ms"]["count"] == 1
    store.close()


def test_row_pool_hands_out_its_lowest_rows_within_its_bound():
    """`RowPool`: the lowest free rows first, None past its rows (counted), rows given back are taken again;
    `runs` is its docstring's worked example."""
    pool = RowPool(3, 16, pin=False)
    assert pool.take(2) == [0, 1] and pool.in_use == 2
    assert pool.take(2) == [2, None] and pool.misses == 1 and pool.in_use == 3
    pool.give(1)
    pool.give(0)
    assert pool.take(3) == [0, 1, None] and pool.misses == 2
    assert pool.row(2).shape == (16,) and pool.row(2).data_ptr() == pool.slab[2].data_ptr()
    assert RowPool.runs([4, 5, 6, None, 9, 10, 2]) == [(0, 4, 3), (4, 9, 2), (6, 2, 1)]
    assert RowPool.runs([]) == [] and RowPool.runs([None, 3]) == [(1, 3, 1)]
    pool.give(0)
    dropped = Parked()
    dropped.add_packed(pool.row(0), None, pool, pool.take(1)[0])
    assert pool.in_use == 3
    del dropped  # never released (an error path): its row is not lost
    assert pool.in_use == 2


@pytest.mark.parametrize("frame_codec", [False, True])
def test_parks_beyond_the_row_pool_still_round_trip_bit_for_bit(frame_codec):
    """A pool of 2 rows (``max_host_bytes`` of 2.5 rows): 3 slots parked in one batch take both rows and one
    row of their own (a miss); restored into other slots, every row tensor equals what its slot held, and every
    pool row is back. A state discarded while parked gives its row back too."""
    store = ParkingStore(ParkingConfig(disk_after_s=None), on_loaded=lambda: None)
    mover, codec_parts = a_slot_mover(store, 6, frame_codec)
    store.config.max_host_bytes = mover.layout()[0].row_bytes * 5 // 2
    generator = torch.Generator().manual_seed(1)
    for tensor in mover.row_tensors().values():
        if tensor.dtype == torch.bool:
            tensor.copy_(torch.rand(tensor.shape, generator=generator) > 0.5)
        else:
            tensor.copy_(torch.randint(0, 100, tensor.shape, generator=generator).to(tensor.dtype))
    before = {name: tensor.clone() for name, tensor in mover.row_tensors().items()}
    parked = [Parked() for _ in range(3)]
    mover.park([(p, slot) for p, slot in zip(parked, (0, 1, 2))])
    assert all(p.settled(timeout=10) for p in parked)
    assert mover.pool.rows == 2 and mover.pool.in_use == 2 and mover.pool.misses == 1
    assert [p.pool_row for p in parked] == [0, 1, None]
    assert parked[0].flat.data_ptr() == mover.pool.slab[0].data_ptr()  # the park wrote into the pool
    for p in parked:
        store.take(p)
    mover.restore([5, 3, 4], parked)  # slot 0 -> 5, 1 -> 3, 2 -> 4
    if not frame_codec:  # the codec worker restores on its thread: a capture queued after it reads it back
        decoded = threading.Event()
        codec_parts["codec_worker"].capture([3], lambda states: decoded.set())
        assert decoded.wait(10)
    for name, tensor in mover.row_tensors().items():
        for source, target in ((0, 5), (1, 3), (2, 4)):
            assert torch.equal(tensor[target], before[name][source]), name
        assert torch.equal(tensor[:3], before[name][:3]), name
    assert mover.pool.in_use == 0 and all(p.flat is None for p in parked)
    gone = Parked()
    mover.park([(gone, 4)])
    assert gone.settled(timeout=10) and mover.pool.in_use == 1
    store.discard(gone)
    assert mover.pool.in_use == 0 and store.stats()["pool"] == {"rows": 2, "in_use": 0, "misses": 1}
    if not frame_codec:
        codec_parts["codec_worker"].close()
    store.close()


def test_warm_up_makes_the_row_pool_and_detach_gives_its_row_back():
    """After `warm_up` the pool exists before any park (no park allocates it); a detached stream's row goes
    back once its state is packed."""
    engine = tiny_random(max_streams=2, max_open=3, sampling=GREEDY, parking=QUICK)
    engine.warm_up()
    assert engine.stats()["parking"]["pool"] == {"rows": 3, "in_use": 0, "misses": 0}
    stream = engine.open(seed=5)
    stream.push_text(TEXT)
    assert stream.read(timeout=30) is not None
    state = engine.detach(stream)
    assert state and engine.stats()["parking"]["pool"]["in_use"] == 0
    engine.close()
