"""Weightless graphs (`kernels.weightless`): the shipped ones are current, a graph filled with another model's
weights is that model's export, the default paths run them from the first call with nothing written to
disk, an unusable one falls back to the build, and concurrent builds of one export build it once."""

import threading
import time

import pytest
import torch
from test_kernels import EmulatedInt8, one_thread, run_side_by_side  # noqa: F401 (one_thread: autouse)

from kernels import auto, ort, ort_codec, weightless
from streaming.step_caches import StepCaches
from tts.codec import CODEC_PRESETS, Codec
from tts.model import MODEL_PRESETS, TTSModel

pytestmark = pytest.mark.skipif(not ort.available(), reason="onnxruntime/onnx not installed or TTS_NO_ORT set")
KINDS = ("step", "step-int8", "codec")


def tiny_model(seed: int) -> TTSModel:
    torch.manual_seed(seed)
    return TTSModel(MODEL_PRESETS["tiny"]).eval()


def tiny_codec(seed: int) -> Codec:
    torch.manual_seed(seed)
    codec = Codec(CODEC_PRESETS["tiny"]).eval()  # LSTM included, as the shipped codec
    codec.quantizer.codebooks.normal_()
    return codec


@pytest.fixture(scope="module")
def graphs(tmp_path_factory):
    """Weightless graphs of tiny configs, written from models other than the ones the tests fill them with."""
    folder = tmp_path_factory.mktemp("graphs")
    for module, kind in ((tiny_model(10), "step"), (tiny_model(10), "step-int8"), (tiny_codec(10), "codec")):
        weightless.write_graph(module, kind, folder)
    return folder


def test_shipped_graphs_are_current(tmp_path):
    """Fails when a change to the model's config, `kernels.lean`, the export or the codec left the shipped
    graphs stale: rewrite them with ``python -m kernels.weightless`` (the default paths would otherwise
    build in the background again, as on an empty cache)."""
    from tts.voices import load_shipped

    model, codec, _ = load_shipped()
    for module, kind in ((model, "step"), (model, "step-int8"), (codec, "codec")):
        shipped = weightless.graph_path(module, kind)
        assert shipped.exists(), f"no {kind} graph for the current code: run python -m kernels.weightless"
        fresh = weightless.write_graph(module, kind, tmp_path)
        assert fresh.read_bytes() == shipped.read_bytes(), f"{shipped.name} is stale: python -m kernels.weightless"
        assert fresh.with_suffix(".json").read_text() == shipped.with_suffix(".json").read_text()
    assert sum(f.stat().st_size for f in weightless.GRAPHS.iterdir()) < 1_000_000  # the repo travels small


def test_shipped_int8_graph_runs_what_the_export_runs(tmp_path):
    """The shipped model's int8 step from its weightless graph gives exactly the logits of its own export."""
    from tts.voices import load_shipped

    model = load_shipped()[0]
    ort.export(model, tmp_path / "step.onnx")
    ort.quantize(tmp_path / "step.onnx", tmp_path / "step-int8.onnx")
    step = ort.session_factory(weightless.graph_session(model, "step-int8"), "onnxruntime-int8")
    export = ort.factory(tmp_path / "step-int8.onnx")(model, StepCaches.empty(model.cfg, 2), 2, "cpu")
    assert (
        run_side_by_side(
            model, step(model, StepCaches.empty(model.cfg, 2), 2, "cpu"), 2, steps=40, reference_step=export
        )
        == 0
    )


@pytest.mark.parametrize("batch", [1, 3])
def test_filled_fp32_graph_equals_eager(graphs, batch):
    """Over more than 5x both rings' capacities, another model's weights in the graph: its eager logits."""
    model = tiny_model(1)
    step = ort.session_factory(weightless.graph_session(model, "step", graphs), "onnxruntime")
    assert run_side_by_side(model, step(model, StepCaches.empty(model.cfg, batch), batch, "cpu"), batch) < 1e-4


def test_filled_int8_graph_is_that_models_quantised_export(graphs, tmp_path):
    model = tiny_model(2)
    ort.export(model, tmp_path / "step.onnx")
    ort.quantize(tmp_path / "step.onnx", tmp_path / "step-int8.onnx")
    step = ort.session_factory(weightless.graph_session(model, "step-int8", graphs), "onnxruntime-int8")
    export = ort.factory(tmp_path / "step-int8.onnx")(model, StepCaches.empty(model.cfg, 3), 3, "cpu")
    assert (
        run_side_by_side(
            model, step(model, StepCaches.empty(model.cfg, 3), 3, "cpu"), 3, reference_step=export, per_step=[]
        )
        == 0
    )
    diffs = []
    run_side_by_side(
        model,
        step(model, StepCaches.empty(model.cfg, 3), 3, "cpu"),
        3,
        reference_step=EmulatedInt8(model, tmp_path / "step-int8.onnx").eval(),
        per_step=diffs,
    )
    assert (torch.tensor(diffs) < 1e-4).float().mean() >= 0.97  # as test_int8_step_equals_its_dequantized_reference


def test_filled_codec_graph_decodes_as_torch(graphs):
    codec = tiny_codec(3)
    step = ort_codec.OrtCodecStep(weightless.graph_session(codec, "codec", graphs), lstm=True)
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, codec.cfg.codebook_size, (2, codec.cfg.codebooks, 12), generator=g)
    ours, theirs = codec.decoder.init_state(2), codec.decoder.init_state(2)
    with torch.no_grad():
        for start in range(0, 12, 4):  # chunked, state carried
            got = step(codes[..., start : start + 4], ours)
            want = codec.decode_step(codes[..., start : start + 4], theirs)
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_default_paths_run_the_shipped_graphs_at_once(graphs, cache_dir, monkeypatch):
    """With a graph for the config: the int8 step (TTS_NO_QUANT=1: fp32) and the ONNX Runtime codec decoder
    from the first call, no background build (nothing faster to wait for), nothing written to disk."""
    monkeypatch.setattr(weightless, "GRAPHS", graphs)
    model, codec = tiny_model(4), tiny_codec(4)
    factory = auto.DefaultStepFactory()
    started = time.perf_counter()
    step = factory(model, StepCaches.empty(model.cfg, 2), 2, "cpu")
    assert factory.kind == step.kind == "onnxruntime-int8" and time.perf_counter() - started < 2
    assert factory.faster.result(timeout=0) is None
    assert isinstance(auto.faster_codec_step(codec).result(timeout=0), ort_codec.OrtCodecStep)
    monkeypatch.setenv("TTS_NO_QUANT", "1")
    fp32 = auto.DefaultStepFactory()
    step = fp32(model, StepCaches.empty(model.cfg, 2), 2, "cpu")
    assert fp32.kind == "onnxruntime" and run_side_by_side(model, step, 2, steps=30) < 1e-4
    assert not cache_dir.exists()


def test_unusable_graph_warns_and_builds_instead(graphs, cache_dir, monkeypatch, tmp_path):
    model = tiny_model(5)
    broken = weightless.graph_path(model, "step-int8", tmp_path)
    broken.write_bytes(b"not a graph")
    broken.with_suffix(".json").write_text((graphs / broken.name).with_suffix(".json").read_text())
    monkeypatch.setattr(weightless, "GRAPHS", tmp_path)
    factory = auto.DefaultStepFactory()
    with pytest.warns(UserWarning, match="shipped step graph unusable, building the step instead"):
        factory(model, StepCaches.empty(model.cfg, 1), 1, "cpu")
    assert factory.kind == "lean" and factory.faster.result(timeout=300).kind == "onnxruntime-int8"


def test_concurrent_builds_of_one_export_build_it_once(cache_dir):
    """Two processes wanting the same export at once (two `tts serve` started together on an empty cache):
    the second waits on the first's lock and finds the files made; no reader sees a half-written file."""
    model = tiny_model(6)
    paths = [ort.onnx_path(model), ort.onnx_path(model, int8=True)]
    built, errors = [], []

    def build():
        try:
            built.extend(ort.export_in_background_process(model, paths[0], "kernels.ort", paths[1]))
            ort.session(paths[1])  # loads: whole, renamed into place
        except Exception as err:
            errors.append(err)

    threads = [threading.Thread(target=build) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors and sorted(built) == sorted(paths)
    assert not list(cache_dir.glob("*.tmp"))
