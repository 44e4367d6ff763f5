"""The disk tier's file format (`streaming.parked_file`) and the store around it: a state read back equals the
one written, bit for bit; a truncated, extended, damaged or foreign file is a typed error; a failed write keeps
the state in memory; a failed read ends that stream alone, with a typed error, and leaves no file."""

import os

import numpy as np
import pytest
import torch

import streaming.parked_file as parked_file
import streaming.parking as parking
from streaming.engine import ParkedStateLost, SamplingConfig
from streaming.parked_file import ALIGN, CorruptParkedFile, read_state, write_state
from streaming.parking import Parked, ParkingConfig, ParkingStore, RowLayout, RowPool
from testkit import tiny_random, wait_until

GREEDY = SamplingConfig(temperature=0.0)


def a_state(seed: int = 0) -> tuple[RowLayout, torch.Tensor, dict[str, torch.Tensor]]:
    """A packed row of several dtypes and loose rows of odd byte counts (bfloat16 and bool too)."""
    generator = torch.Generator().manual_seed(seed)
    tensors = {
        "keys": torch.randn(3, 2, 5, generator=generator),
        "step": torch.arange(3),
        "live": torch.tensor([True, False, True]),
        "half": torch.randn(3, 7, generator=generator).half(),
    }
    layout = RowLayout(tensors)
    flat = torch.empty(layout.row_bytes, dtype=torch.uint8)
    layout.copy([layout.packed(flat)], [layout.slot(tensors, 1)])
    loose = {
        "codec.0": torch.randn(1, 3, 3, generator=generator),
        "codec.h": torch.randn(1, 1, 5, generator=generator).bfloat16(),
        "flag": torch.tensor([[True, False, True]]),
        "outbox": torch.randn(1, 13, generator=generator),
    }
    return layout, flat, loose


def test_a_state_read_back_equals_the_one_written(tmp_path):
    layout, flat, loose = a_state()
    path = str(tmp_path / "1.park")
    info = write_state(path, flat, loose, layout.fingerprint)
    assert os.listdir(tmp_path) == ["1.park"] and os.path.getsize(path) == info.size
    assert len(info.head) % ALIGN == 0  # the packed row's views need their dtypes' alignment
    got_flat, got_loose = read_state(path, info)
    assert torch.equal(got_flat, flat)
    assert got_loose.keys() == loose.keys()
    for name, tensor in loose.items():
        assert got_loose[name].dtype == tensor.dtype and torch.equal(got_loose[name], tensor), name
    for name, view in layout.views(got_flat).items():  # the packed row's named views read the same
        assert torch.equal(view, layout.views(flat)[name]), name


def test_a_state_read_into_a_given_row_equals_the_one_written(tmp_path):
    """``into`` (a pool row): the packed row lands in it, bit for bit; a row of another size is not used; a
    damaged payload read into a row is still a typed error."""
    layout, flat, loose = a_state()
    path = str(tmp_path / "1.park")
    info = write_state(path, flat, loose, layout.fingerprint)
    row = torch.full((layout.row_bytes,), 0xAB, dtype=torch.uint8)
    got_flat, got_loose = read_state(path, info, into=row)
    assert got_flat is row and torch.equal(row, flat)
    assert all(torch.equal(got_loose[name], tensor) for name, tensor in loose.items())
    other = torch.zeros(layout.row_bytes + 16, dtype=torch.uint8)
    got_flat, _ = read_state(path, info, into=other)
    assert got_flat is not other and torch.equal(got_flat, flat) and not other.any()
    data = bytearray(open(path, "rb").read())
    data[len(info.head) + 3] ^= 0x01  # inside the packed row: only the checksum tells
    open(path, "wb").write(bytes(data))
    with pytest.raises(CorruptParkedFile):
        read_state(path, info, into=row)


def test_states_loaded_from_disk_take_pool_rows_and_give_them_back(tmp_path):
    """A load reads its packed row into a free pool row (no fresh block), a take and release give it back; a
    damaged file's row goes back at once."""
    store = ParkingStore(ParkingConfig(disk_after_s=0.01, directory=str(tmp_path)), lambda: None)
    states = stored(store, 3)
    store.pool = RowPool(3, states[0].layout.row_bytes, pin=False)
    expected = [dict(p.rows) for p in states]
    load_all_but_one_truncated(store, states, 2)
    assert all(p.pool_row is not None for p in states[:2]) and store.pool.in_use == 2
    for i in (0, 1):
        rows = store.take(states[i])
        assert all(torch.equal(rows[name], t) for name, t in expected[i].items())
        states[i].release()  # as a restore does once its copy is queued
    assert store.pool.in_use == 0 and store.pool.misses == 0
    store.discard(store.lost()[0])
    store.close()


class FakeEvent:
    """A CUDA event's face (`query`, `synchronize`) on the CPU: a device copy still queued until waited for."""

    def __init__(self):
        self.done, self.waits = False, 0

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.waits += 1
        self.done = True


def test_the_row_pool_gives_a_load_a_row_no_device_copy_is_pending_on():
    """`RowPool`'s worked example: parks take the lowest rows; a row a restore gave back with its copy still
    queued is the last a load takes (no wait while another is free), and parks take it at once; a load waits
    only when every free row is pending, for the oldest given back."""
    pool = RowPool(4, 16, pin=False)
    assert pool.take(2) == [0, 1]  # a park
    restored = FakeEvent()
    pool.give(1, restored)  # a restore's copy out of row 1 still queued: free [2, 3, 1]
    assert pool.take_settled() == 2 and restored.waits == 0  # a load
    assert pool.take(2) == [1, 3]  # a park: its copy queues after the restore's
    first, second = FakeEvent(), FakeEvent()
    pool.give(3, first)
    pool.give(1, second)
    pool.give(0)  # free [3, 1, 0]: 3 and 1 pending
    assert pool.take_settled() == 0 and first.waits == second.waits == 0
    assert pool.take_settled() == 3 and (first.waits, second.waits) == (1, 0)  # the oldest pending: waited for
    second.done = True  # the device got there
    assert pool.take_settled() == 1 and second.waits == 0
    assert pool.take_settled() is None and pool.misses == 1 and pool.in_use == 4


def test_a_load_from_disk_takes_a_settled_row_and_its_time_is_split(tmp_path):
    """A pool with a free row a restore's copy is pending on and a settled one: the load reads into the settled
    one without waiting; its time is the row's wait plus the read (``load_row_wait`` + ``load_read``)."""
    store = ParkingStore(ParkingConfig(disk_after_s=0.01, directory=str(tmp_path)), lambda: None)
    [state] = stored(store, 1)
    store.pool = RowPool(3, state.layout.row_bytes, pin=False)
    assert store.pool.take(3) == [0, 1, 2]
    pending = FakeEvent()
    store.pool.give(0, pending)
    store.pool.give(2)
    assert wait_until(lambda: store.stats()["parked"] == {"host": 0, "disk": 1})
    store.want(state)
    assert wait_until(lambda: store.want(state))
    assert state.pool_row == 2 and pending.waits == 0 and store.pool.in_use == 2
    times = {kind: list(store.times[kind]) for kind in ("load", "load_row_wait", "load_read")}
    assert all(len(values) == 1 for values in times.values())
    assert times["load"][0] == pytest.approx(times["load_row_wait"][0] + times["load_read"][0])
    store.take(state)
    state.release()
    store.close()


def test_a_state_without_a_packed_row_round_trips(tmp_path):
    _, _, loose = a_state()
    info = write_state(str(tmp_path / "2.park"), None, loose, None)
    got_flat, got_loose = read_state(str(tmp_path / "2.park"), info)
    assert got_flat is None and all(torch.equal(got_loose[n], t) for n, t in loose.items())


@pytest.mark.parametrize("damage", ["truncated", "extended", "payload byte", "header byte", "other state"])
def test_a_damaged_file_is_a_typed_error(tmp_path, damage):
    layout, flat, loose = a_state()
    path = str(tmp_path / "3.park")
    info = write_state(path, flat, loose, layout.fingerprint)
    data = bytearray(open(path, "rb").read())
    if damage == "truncated":
        data = data[:-5]
    elif damage == "extended":
        data += b"\0"
    elif damage == "payload byte":
        data[len(info.head) + 17] ^= 0x10
    elif damage == "header byte":
        data[3] ^= 0x01
    else:  # another state's file of the same size under this name
        other = write_state(str(tmp_path / "other.park"), a_state(seed=1)[1], a_state(seed=1)[2], layout.fingerprint)
        data = bytearray(open(tmp_path / "other.park", "rb").read())
        assert other.size == info.size
    open(path, "wb").write(bytes(data))
    with pytest.raises(CorruptParkedFile):
        read_state(path, info)


def test_a_failed_write_leaves_no_file(tmp_path, monkeypatch):
    layout, flat, loose = a_state()

    def full(fd, buffers):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(parked_file.os, "writev", full)
    with pytest.raises(OSError):
        write_state(str(tmp_path / "4.park"), flat, loose, layout.fingerprint)
    assert os.listdir(tmp_path) == []


def stored(store: ParkingStore, count: int) -> list[Parked]:
    states = []
    for seed in range(count):
        layout, flat, loose = a_state(seed)
        parked = Parked()
        parked.add_packed(flat, layout)
        parked.add(loose)
        parked.captured.set()
        store.put(parked)
        states.append(parked)
    return states


def load_all_but_one_truncated(store: ParkingStore, states: list[Parked], bad: int) -> None:
    """Once every state is on disk, truncate state ``bad``'s file, ask for all, and wait until the others are in
    memory and the bad one is reported lost."""
    assert wait_until(lambda: store.stats()["parked"] == {"host": 0, "disk": len(states)})
    with open(states[bad].path, "r+b") as file:
        file.truncate(os.path.getsize(states[bad].path) - 1)
    for parked in states:
        store.want(parked)
    assert wait_until(lambda: all(store.want(p) for i, p in enumerate(states) if i != bad) and store.has_lost)


def test_a_full_disk_keeps_the_state_in_memory(tmp_path, monkeypatch):
    def full(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(parking, "write_state", full)
    store = ParkingStore(ParkingConfig(disk_after_s=0.01, directory=str(tmp_path)), lambda: None)
    expected = {name: t.clone() for name, t in a_state(0)[2].items()}
    (parked,) = stored(store, 1)
    assert wait_until(lambda: store.stats()["failures"]["spill"] >= 1)
    assert parked.tier == "host" and store.want(parked)  # still in memory, and restorable at once
    rows = store.take(parked)
    assert all(torch.equal(rows[name], t) for name, t in expected.items())
    assert store.host_bytes == 0 and store.disk_bytes == 0
    store.close()
    assert os.listdir(tmp_path) == []


def test_a_state_whose_file_was_damaged_is_reported_lost_and_the_others_load(tmp_path):
    store = ParkingStore(ParkingConfig(disk_after_s=0.01, directory=str(tmp_path)), lambda: None)
    states = stored(store, 3)
    expected = [dict(p.rows) for p in states]
    load_all_but_one_truncated(store, states, 1)
    (lost,) = store.lost()
    assert lost is states[1] and isinstance(lost.error, CorruptParkedFile) and lost.tier == "lost"
    assert not store.want(lost)  # not asked for again
    for i in (0, 2):
        rows = store.take(states[i])
        assert all(torch.equal(rows[name], t) for name, t in expected[i].items())
    store.discard(lost)
    assert store.host_bytes == 0 and store.disk_bytes == 0 and store.stats()["parked"] == {"host": 0, "disk": 0}
    (folder,) = os.listdir(tmp_path)
    assert os.listdir(tmp_path / folder) == []
    store.close()


def test_a_stream_whose_parked_file_was_damaged_ends_with_a_typed_error(tmp_path):
    """The engine ends that stream (ParkedStateLost, code engine_error), forgets its state and goes on."""
    parking_config = ParkingConfig(park_after_s=0.05, disk_after_s=0.1, directory=str(tmp_path))
    engine = tiny_random(max_streams=1, sampling=GREEDY, parking=parking_config)
    stream = engine.open(seed=7)
    stream.push_text("Hello there. How are you t")
    assert stream.read(timeout=30) is not None
    assert wait_until(lambda: engine.stats()["parking"]["parked"]["disk"] == 1, 30)
    (folder,) = os.listdir(tmp_path)
    (name,) = os.listdir(tmp_path / folder)
    with open(tmp_path / folder / name, "r+b") as file:
        file.seek(-3, os.SEEK_END)
        file.write(b"\xff\x00\xff")  # damaged, same length: only the checksum tells
    stream.push_text("oday?")
    stream.end()
    with pytest.raises(ParkedStateLost) as raised:
        while stream.read(timeout=30) is not None:
            pass
    assert raised.value.code == "engine_error"
    figures = engine.stats()["parking"]
    assert figures["parked"] == {"host": 0, "disk": 0} and figures["disk_bytes"] == 0
    assert figures["failures"]["load"] == 1 and os.listdir(tmp_path / folder) == []
    other = engine.open(seed=8)  # the engine goes on
    other.push_text("Bye.")
    other.end()
    audio = []
    while (chunk := other.read(timeout=30)) is not None:
        audio.append(chunk)
    assert np.concatenate(audio).size > 0
    engine.close()


def test_the_directory_holds_at_most_max_disk_bytes_of_states(tmp_path):
    """Past ``max_disk_bytes`` nothing more spills: the third state stays in memory and still restores."""
    size = stored(ParkingStore(ParkingConfig(disk_after_s=None), lambda: None), 1)[0].nbytes  # (no I/O threads)
    store = ParkingStore(
        ParkingConfig(disk_after_s=0.01, max_disk_bytes=2 * size + 1, directory=str(tmp_path)), lambda: None
    )
    states = stored(store, 3)
    assert wait_until(lambda: store.stats()["parked"] == {"host": 1, "disk": 2})
    (folder,) = os.listdir(tmp_path)
    assert len(os.listdir(tmp_path / folder)) == 2 and store.disk_bytes == 2 * size
    assert [p.tier for p in states] == ["disk", "disk", "host"]  # the oldest went first
    assert store.want(states[2])
    store.take(states[2])
    store.close()
    assert os.listdir(tmp_path) == []
