"""The fast CPU steps compute what the eager `decode_step` computes, and fall back to it when they cannot be built."""

import time

import pytest
import torch

from kernels import auto, ort
from kernels.lean import LeanStep, lean_factory, ring_tensors, write_rings
from streaming.step_caches import StepCaches, decode_step
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


@pytest.mark.parametrize(
    "omp, affinity, expected", [("2", 16, 1), ("8", 16, 4), ("", 6, 3), ("", 1, 1), ("lots", 4, 2), ("0", 4, 2)]
)
def test_session_threads_half_the_cores_the_process_may_use(monkeypatch, omp, affinity, expected):
    """ONNX Runtime gets half the cores this process may use: OMP_NUM_THREADS (a Ray actor's num_cpus) where it
    is a positive number, else the CPU affinity; never the whole machine's count."""
    monkeypatch.setenv("OMP_NUM_THREADS", omp)
    monkeypatch.setattr(ort.os, "sched_getaffinity", lambda pid: set(range(affinity)))
    monkeypatch.setattr(ort.os, "cpu_count", lambda: 64)
    assert ort.threads() == expected


def test_session_threads_without_an_affinity_call_take_the_machines_cores(monkeypatch):
    """Where the platform has no CPU affinity call (macOS), the machine's core count stands in for it."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delattr(ort.os, "sched_getaffinity")
    monkeypatch.setattr(ort.os, "cpu_count", lambda: 8)
    assert ort.threads() == 4


def run_side_by_side(model, step, batch, steps=None, seed=0, reference_step=decode_step, per_step=None):
    """Drive the eager step (or ``reference_step``) and ``step`` with the same random traffic: slots switch
    between active and inactive (inactive slots get frame 0, as the engine gives them), text units arrive
    into the text ring, frames run past 5x both rings' capacities. Returns the largest logit difference over
    active slots. With a list ``per_step``: before every step the reference's audio rings become a copy of
    ``step``'s (so one step's difference does not carry into the next), and each step's largest difference,
    logits and the ring entries it wrote, is appended to it."""
    cfg = model.cfg
    g = torch.Generator().manual_seed(seed)
    reference, fast = StepCaches.empty(cfg, batch), StepCaches.empty(cfg, batch)
    rings = max(reference.audio[0].capacity, reference.text[0].capacity)
    full = steps is None
    steps = steps or 8 * rings * 3  # a unit every 3 frames or so: the text ring wraps 5 times too
    prefix = model.voice_prefix(torch.tensor([1]))  # (L, 1, H, S, D): every slot's
    reference.start(torch.arange(batch), prefix)
    fast.start(torch.arange(batch), prefix)
    frame = torch.zeros(batch, dtype=torch.long)
    written = torch.zeros(batch, dtype=torch.long)
    worst = 0.0
    with torch.no_grad():
        for _ in range(steps):
            active = torch.rand(batch, generator=g) < 0.8
            if batch > 1:
                active[0] = True  # one slot always moves, so every ring wraps
            arrive = active & (torch.rand(batch, generator=g) < 0.4)
            kv = [
                (
                    torch.randn(batch, cfg.heads, 1, cfg.head_dim, generator=g),
                    torch.randn(batch, cfg.heads, 1, cfg.head_dim, generator=g),
                )
                for _ in range(cfg.layers)
            ]
            kv = tuple(torch.stack(part) for part in zip(*kv))  # (L, B, H, 1, D) keys, values
            positions = torch.where(arrive, written, -1)[:, None]
            reference.write_text(kv, positions)
            fast.write_text(kv, positions)
            written += arrive.long()
            tokens = torch.randint(0, cfg.codebook_size + 1, (batch, cfg.codebooks), generator=g)
            step_frame = torch.where(active, frame, 0)
            unit = torch.where(active, (written - 2).clamp(min=0), 0)
            if per_step is not None:
                for a, b in zip(reference.audio, fast.audio):
                    for mine, theirs in ((a.keys, b.keys), (a.values, b.values), (a.positions, b.positions)):
                        mine.copy_(theirs)
            want = reference_step(model, reference, tokens, step_frame, unit, active)
            got = step(model, fast, tokens, step_frame, unit, active)
            if active.any():
                worst = max(worst, float((want - got)[active].abs().max()))
                if per_step is not None:
                    rings = max(float((a.keys - b.keys).abs().max()) for a, b in zip(reference.audio, fast.audio))
                    per_step.append(max(float((want - got)[active].abs().max()), rings))
            frame += active.long()
    if full:
        assert (
            int(frame.max()) > 5 * reference.audio[0].capacity and int(written.max()) > 5 * reference.text[0].capacity
        )
    if per_step is not None:
        return worst
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


@pytest.fixture(scope="module")
def quantized(exported):
    path = exported.with_name("step-int8.onnx")  # the name tells OrtStep its kind
    ort.quantize(exported, path)
    return path


class EmulatedInt8(LeanStep):
    """The fair reference for the int8 step: `LeanStep` in float64 with the int8 file's weights dequantized
    ((q - 128) * scale, one scale per block of ``block_size`` input rows of each output column) and each
    matmul's input quantised as MatMulNBits' accuracy level 4 does it: per block of ``block_size`` values,
    scale = max |x| / 127, x -> round(x / scale) * scale (ties to even). Example, block [0.5, -1.27]: scale
    0.01, quantised [50, -127], the same values back; block [0.3, 0.001]: scale 0.3/127, 0.001 -> 0."""

    def __init__(self, model, path):
        import onnx
        from onnx import numpy_helper

        super().__init__(model)
        graph = onnx.load(str(path)).graph
        weights = {t.name: numpy_helper.to_array(t) for t in graph.initializer}
        for node in (n for n in graph.node if n.op_type == "MatMulNBits"):
            attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
            k, n, block = attrs["K"], attrs["N"], attrs["block_size"]
            q = torch.from_numpy(weights[node.input[1]].reshape(n, -1)[:, :k].astype("float64"))  # (N, K)
            scale = torch.from_numpy(weights[node.input[2]].reshape(n, -1).astype("float64"))  # (N, blocks)
            dequantized = (q - 128) * scale.repeat_interleave(block, dim=1)[:, :k]
            getattr(self, node.input[1].rsplit("_Q", 1)[0]).copy_(dequantized.t())  # (K, N), as LeanStep holds it
        self.block = ort.INT8["block_size"]

    def linear(self, x, weight):
        rows, k = x.shape
        blocks = torch.nn.functional.pad(x, (0, -k % self.block)).view(rows, -1, self.block).double()
        scale = blocks.abs().amax(-1, keepdim=True) / 127
        inverse = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale)).float()
        quantised = torch.round(blocks.float() * inverse).double() * scale
        return (quantised.view(rows, -1)[:, :k] @ getattr(self, weight).double()).float()

    def __call__(self, model, caches, tokens, frame, unit, active):
        logits, *writes = super().__call__(
            tokens, frame, unit, active, caches.text[0].positions, caches.audio[0].positions, *ring_tensors(caches)
        )
        write_rings(caches, *writes)
        return logits


@needs_ort
@pytest.mark.parametrize("batch", [1, 3])
def test_int8_step_equals_its_dequantized_reference(model, quantized, batch):
    """The int8 step computes what `EmulatedInt8` computes: within 1e-4 at nearly every step over 5x both
    rings' capacities. Not at every one: an activation that lies on a rounding boundary (x / scale = n + 0.5
    give or take 1e-6) may round the other way in ONNX Runtime's fp32 than in the reference, which moves the
    outputs by about one quantisation step (a few 1e-3 here); each step starts from the same rings, so such
    a step does not carry into the next."""
    step = ort.factory(quantized)(model, StepCaches.empty(model.cfg, batch), batch, "cpu")
    assert step.kind == "onnxruntime-int8"
    diffs = []
    run_side_by_side(model, step, batch, reference_step=EmulatedInt8(model, quantized).eval(), per_step=diffs)
    diffs = torch.tensor(diffs)
    assert (diffs < 1e-4).float().mean() >= 0.97 and diffs.max() < 0.02, diffs.max()


@needs_ort
def test_int8_step_stays_close_to_fp32(model, quantized):
    """Quantisation error, bounded: the int8 step's logits and ring writes against the fp32 eager step's."""
    step = ort.factory(quantized)(model, StepCaches.empty(model.cfg, 2), 2, "cpu")
    diffs = []
    run_side_by_side(model, step, 2, steps=60, per_step=diffs)
    assert max(diffs) < 0.1, max(diffs)


@needs_ort
def test_onnxruntime_step_over_views_of_larger_caches(model, exported):
    """One export serves every batch size; a step follows the caches it is given (a new view object of
    the same storage each tick, or other storage), and writes through views into the larger caches."""
    step = ort.factory(exported)(model, StepCaches.empty(model.cfg, 2), 2, "cpu")
    assert run_side_by_side(model, step, 2, steps=30, seed=1) < 1e-4
    whole = StepCaches.empty(model.cfg, 4)
    view = whole.view(2)  # the first 2 slots, sharing storage (what the engine's buckets run on)
    step = ort.factory(exported)(model, view, 2, "cpu")
    cfg = model.cfg
    tokens = torch.zeros(2, cfg.codebooks, dtype=torch.long)
    ones = torch.ones(2, dtype=torch.long)
    logits = step(model, whole.view(2), tokens, ones, ones, torch.ones(2, dtype=torch.bool)).clone()
    reference = StepCaches.empty(cfg, 4).view(2)
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
    assert handed == [faster] and faster.kind == "onnxruntime-int8"
    reference = EmulatedInt8(model, ort.onnx_path(model, int8=True)).eval()
    assert (
        run_side_by_side(model, faster(model, caches, 2, "cpu"), 2, steps=30, reference_step=reference, per_step=[])
        < 1e-4
    )
    assert len(list(cache_dir.glob("*.onnx"))) == 2 and not list(cache_dir.glob("*.tmp"))  # fp32 and int8

    ort._sessions.clear()  # a new process: the export is on disk, so the fast step comes at once
    second = auto.DefaultStepFactory()
    started = time.perf_counter()
    step = second(model, caches, 2, "cpu")
    assert second.kind == "onnxruntime-int8" and time.perf_counter() - started < 2
    assert second.faster.result(timeout=0) is None
    assert run_side_by_side(model, step, 2, steps=30, reference_step=reference, per_step=[]) < 1e-4


@needs_ort
def test_cached_fp32_step_serves_while_the_int8_one_is_made(model, cache_dir, exported):
    """A cache from before int8 (the fp32 export only): the fp32 step at once, then the int8 one."""
    cache_dir.mkdir(parents=True)
    ort.onnx_path(model).write_bytes(exported.read_bytes())
    factory = auto.DefaultStepFactory()
    step = factory(model, StepCaches.empty(model.cfg, 2), 2, "cpu")
    assert factory.kind == "onnxruntime" and run_side_by_side(model, step, 2, steps=30) < 1e-4
    assert factory.faster.result(timeout=300).kind == "onnxruntime-int8"
    assert ort.onnx_path(model, int8=True).exists()


@needs_ort
def test_no_quant_switch_keeps_the_fp32_step(model, cache_dir, monkeypatch):
    monkeypatch.setenv("TTS_NO_QUANT", "1")
    factory = auto.DefaultStepFactory()
    factory(model, StepCaches.empty(model.cfg, 1), 1, "cpu")
    faster = factory.faster.result(timeout=300)
    assert faster.kind == "onnxruntime" and not ort.onnx_path(model, int8=True).exists()
    step = faster(model, StepCaches.empty(model.cfg, 2), 2, "cpu")
    assert run_side_by_side(model, step, 2, steps=30) < 1e-4


@needs_ort
def test_int8_step_swaps_in_while_a_stream_speaks(tmp_path):
    """The engine starts on the lean step; the int8 step is swapped in mid-utterance: the stream goes on to
    its full length, its audio before the swap is the lean step's, and the engine runs the int8 step."""
    from streaming.engine import SamplingConfig
    from testkit import tiny_random

    text = "Hello there, this is a somewhat longer sentence. " * 2
    engine = tiny_random(max_streams=2, sampling=SamplingConfig(temperature=0), step_factory=lean_factory)
    ort.export(engine.model, tmp_path / "step.onnx")
    ort.quantize(tmp_path / "step.onnx", tmp_path / "step-int8.onnx")
    want = engine.open(seed=3)
    want.push_text(text)
    want.end()
    expected = []
    while (chunk := want.read(timeout=30)) is not None:
        expected.append(chunk)
    stream = engine.open(seed=3)
    stream.push_text(text)
    stream.end()
    chunks = [stream.read(timeout=30)]
    engine.set_step_factory(ort.factory(tmp_path / "step-int8.onnx"))
    while (chunk := stream.read(timeout=30)) is not None:
        chunks.append(chunk)
    engine.close()
    assert engine.step_kind == "onnxruntime-int8" and stream.error is None
    assert sum(map(len, chunks)) == sum(map(len, expected))
    torch.testing.assert_close(torch.from_numpy(chunks[0]), torch.from_numpy(expected[0]), atol=1e-5, rtol=0)


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
    def broken(module, path, runner, *more):
        raise RuntimeError("no exporter here")

    monkeypatch.setattr(ort, "export_in_background_process", broken)
    monkeypatch.setattr(ort, "available", lambda: True)
    factory = auto.DefaultStepFactory()
    with pytest.warns(UserWarning, match="staying on the step in use: no exporter here"):
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
