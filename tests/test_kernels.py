"""The fast CPU steps compute what the eager `decode_step` computes, and fall back to it when they cannot be built."""
import time

import pytest
import torch

from kernels import auto, ort
from kernels.lean import lean_factory
from streaming.decode import StepCaches, decode_step
from tts.model import MODEL_PRESETS, TTSModel

needs_ort = pytest.mark.skipif(not ort.available(), reason="onnxruntime/onnx not installed or TTS_NO_ORT set")


@pytest.fixture(autouse=True)
def one_thread():
    """The engine's step runs on one thread of two cores; more threads on tiny shapes only add barriers."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return TTSModel(MODEL_PRESETS["tiny"]).eval()


def run_side_by_side(model, step, batch, steps=None, seed=0):
    """Drive the eager step and ``step`` with the same random traffic: slots switch between active and
    inactive (inactive slots get frame 0, as the engine gives them), text units arrive into the text
    ring, frames run past 5x both rings' capacities. Returns the largest logit difference over active slots."""
    cfg = model.cfg
    g = torch.Generator().manual_seed(seed)
    reference, fast = StepCaches.empty(cfg, batch), StepCaches.empty(cfg, batch)
    rings = max(reference.audio[0].capacity, reference.text[0].capacity)
    full = steps is None
    steps = steps or 8 * rings * 3  # a unit every 3 frames or so: the text ring wraps 5 times too
    prefix = model.voice_prefix(torch.tensor([1]))
    for slot in range(batch):
        reference.start(slot, prefix)
        fast.start(slot, prefix)
    frame = torch.zeros(batch, dtype=torch.long)
    written = torch.zeros(batch, dtype=torch.long)
    worst = 0.0
    with torch.no_grad():
        for _ in range(steps):
            active = torch.rand(batch, generator=g) < 0.8
            if batch > 1:
                active[0] = True  # one slot always moves, so every ring wraps
            arrive = active & (torch.rand(batch, generator=g) < 0.4)
            kv = [(torch.randn(batch, cfg.heads, 1, cfg.head_dim, generator=g),
                   torch.randn(batch, cfg.heads, 1, cfg.head_dim, generator=g)) for _ in range(cfg.layers)]
            positions = torch.where(arrive, written, -1)[:, None]
            reference.write_text(kv, positions)
            fast.write_text(kv, positions)
            written += arrive.long()
            tokens = torch.randint(0, cfg.codebook_size + 1, (batch, cfg.codebooks), generator=g)
            step_frame = torch.where(active, frame, 0)
            unit = torch.where(active, (written - 2).clamp(min=0), 0)
            want = decode_step(model, reference, tokens, step_frame, unit, active)
            got = step(model, fast, tokens, step_frame, unit, active)
            if active.any():
                worst = max(worst, float((want - got)[active].abs().max()))
            frame += active.long()
    if full:
        assert int(frame.max()) > 5 * reference.audio[0].capacity and int(written.max()) > 5 * reference.text[0].capacity
    for a, b in zip(reference.audio, fast.audio):  # the rings hold the same keys, values and positions
        torch.testing.assert_close(b.positions, a.positions, rtol=0, atol=0)
        torch.testing.assert_close(b.keys, a.keys, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(b.values, a.values, rtol=1e-4, atol=1e-5)
    return worst


@pytest.mark.parametrize("batch", [1, 3])
def test_lean_step_equals_eager(model, batch):
    step = lean_factory(model, StepCaches.empty(model.cfg, batch), batch, "cpu")
    assert run_side_by_side(model, step, batch) < 1e-4


@pytest.fixture(scope="module")
def exported(model, tmp_path_factory):
    path = tmp_path_factory.mktemp("onnx") / "step.onnx"
    ort.export(model, path)
    return path


@needs_ort
@pytest.mark.parametrize("batch", [1, 3])
def test_onnxruntime_step_equals_eager(model, exported, batch):
    step = ort.factory(exported)(model, StepCaches.empty(model.cfg, batch), batch, "cpu")
    assert run_side_by_side(model, step, batch) < 1e-4


def first_slots(caches: StepCaches, n: int) -> StepCaches:
    """The first ``n`` slots of ``caches``, sharing its storage (what the engine's buckets run on)."""
    from streaming.kv_cache import RingKVCache
    def rings(rs):
        return [RingKVCache(r.keys[:n], r.values[:n], r.positions[:n]) for r in rs]
    return StepCaches([(k[:n], v[:n]) for k, v in caches.sinks], rings(caches.text), rings(caches.audio))


@needs_ort
def test_onnxruntime_step_over_views_of_larger_caches(model, exported):
    """One export serves every batch size; a step follows the caches it is given (a new view object of
    the same storage each tick, or other storage), and writes through views into the larger caches."""
    step = ort.factory(exported)(model, StepCaches.empty(model.cfg, 2), 2, "cpu")
    assert run_side_by_side(model, step, 2, steps=30, seed=1) < 1e-4
    whole = StepCaches.empty(model.cfg, 4)
    view = first_slots(whole, 2)
    step = ort.factory(exported)(model, view, 2, "cpu")
    cfg = model.cfg
    tokens = torch.zeros(2, cfg.codebooks, dtype=torch.long)
    ones = torch.ones(2, dtype=torch.long)
    logits = step(model, first_slots(whole, 2), tokens, ones, ones, torch.ones(2, dtype=torch.bool)).clone()
    reference = first_slots(StepCaches.empty(cfg, 4), 2)
    want = decode_step(model, reference, tokens, ones, ones, torch.ones(2, dtype=torch.bool))
    torch.testing.assert_close(logits, want, rtol=1e-4, atol=1e-4)
    assert (whole.audio[0].positions[:2, 1] == 1).all() and (whole.audio[0].positions[2:] == -1).all()
    torch.testing.assert_close(whole.audio[-1].keys[:2], reference.audio[-1].keys, rtol=1e-4, atol=1e-5)


@needs_ort
def test_default_factory_builds_in_background_then_loads_from_disk(model, cache_dir):
    caches = StepCaches.empty(model.cfg, 2)
    first = auto.DefaultStepFactory()
    started = time.perf_counter()
    step = first(model, caches, 2, "cpu")
    assert first.kind == "lean" and time.perf_counter() - started < 2  # no build wait
    handed = []
    first.when_faster(handed.append)
    faster = first.faster.result(timeout=300)
    assert handed == [faster] and faster.kind == "onnxruntime"
    assert run_side_by_side(model, faster(model, caches, 2, "cpu"), 2, steps=30) < 1e-4
    assert list(cache_dir.glob("*.onnx")) and not list(cache_dir.glob("*.tmp"))

    ort._sessions.clear()  # a new process: the export is on disk, so the fast step comes at once
    second = auto.DefaultStepFactory()
    started = time.perf_counter()
    step = second(model, caches, 2, "cpu")
    assert second.kind == "onnxruntime" and time.perf_counter() - started < 2
    assert second.faster.result(timeout=0) is None
    assert run_side_by_side(model, step, 2, steps=30) < 1e-4


@needs_ort
def test_corrupted_cache_file_is_rebuilt(model, cache_dir, exported):
    path = ort.onnx_path(model)
    path.parent.mkdir(parents=True)
    path.write_bytes(exported.read_bytes()[:1000])  # a truncated write
    ort._sessions.pop(path, None)
    factory = auto.DefaultStepFactory()
    with pytest.warns(UserWarning, match="does not load"):
        factory(model, StepCaches.empty(model.cfg, 1), 1, "cpu")
    assert factory.kind == "lean"
    assert factory.faster.result(timeout=300) is not None
    assert path.stat().st_size == exported.stat().st_size


def test_failed_build_warns_and_stays_eager_and_correct(model, cache_dir, monkeypatch):
    def broken(module, path):
        raise RuntimeError("no exporter here")
    monkeypatch.setattr(ort, "export_in_background_process", broken)
    monkeypatch.setattr(ort, "available", lambda: True)
    factory = auto.DefaultStepFactory()
    with pytest.warns(UserWarning, match="staying on the lean eager step"):
        step = factory(model, StepCaches.empty(model.cfg, 2), 2, "cpu")
        assert factory.faster.result(timeout=60) is None
    assert factory.kind == "lean" and run_side_by_side(model, step, 2, steps=30) < 1e-4


@needs_ort
def test_unloadable_cache_warns_and_stays_eager(model, cache_dir, monkeypatch):
    def unreadable(model):
        raise PermissionError("cache directory not readable")
    monkeypatch.setattr(ort, "load", unreadable)
    factory = auto.DefaultStepFactory()
    with pytest.warns(UserWarning, match="staying on the lean eager step"):
        step = factory(model, StepCaches.empty(model.cfg, 1), 1, "cpu")
    assert factory.kind == "lean" and factory.faster.result(timeout=0) is None
    assert run_side_by_side(model, step, 1, steps=20) < 1e-4


def test_kill_switch_means_no_onnxruntime(model, cache_dir, monkeypatch):
    monkeypatch.setenv("TTS_NO_ORT", "1")
    factory = auto.DefaultStepFactory()
    factory(model, StepCaches.empty(model.cfg, 1), 1, "cpu")
    assert factory.kind == "lean" and factory.faster.result(timeout=0) is None
    assert not cache_dir.exists()
