"""ONNX Runtime from a fresh machine's first sentence: the step's and the codec's graphs ship without weights.

Exporting the step (`kernels.ort.export`, ~3 s of TorchScript tracing) and quantising it (~1 s), in a
background process that first imports torch, brought the int8 step in 6.7 s after the model loaded on an
empty cache (2-core AMD EPYC, idle); the codec decoder's export (`kernels.ort_codec`, ~4 s) came in at
5.6 s. Until then a fresh machine's first process spoke on the lean step and the torch decoder, with the
exports competing for the two cores. Yet a graph depends only on the code and the config, not on the
weights. ``kernels/graphs/`` ships each one (``step-<key>.onnx`` fp32, ``step-int8-<key>.onnx``,
``codec-<key>.onnx``, ~100 KB each) with every weight left out, plus ``<same>.json``, the recipe of each
left-out weight: one row per initializer, ``[name, form, source, ...]`` over the module's named tensors:

* ``["embed", "plain", "embed"]``: the tensor as is; ``["x", "reshape", "decoder.b"]``: as is, reshaped;
* ``["qkv0_Q8", "q8", "qkv0"]`` / ``["qkv0_scales", "scales", "qkv0"]``: `kernels.ort.INT8`'s MatMulNBits
  blocks and scales, made by ONNX Runtime's own quantiser kernel (bit for bit what `kernels.ort.quantize`
  writes);
* ``["g", "row", "quantizer.codebooks", 3]``: one row (``codebooks[3]``);
* ``["w", "gates", "lstm.weight_ih_l0"]`` and ``["b", "gates", "lstm.bias_ih_l0", "lstm.bias_hh_l0"]``: an
  LSTM's weights or biases with torch's gate order (i, f, g, o) put in ONNX's (i, o, f, g), then stacked.

At load the weights are made in memory and handed to ONNX Runtime as external initializers (~0.5 s for
both shipped graphs): nothing is exported, quantised in Python or written to disk. `write` only keeps a
recipe that reproduces the export's weight byte for byte, so a filled graph is the export.

Key: the config, the source of the graph's code and export (and for the step the ring capacities and the
quantiser's settings); not the weights, which come from the model loaded. A change that alters the key
finds no graph here: `kernels.auto` then builds in the background as before (still correct, slower to
start), and tests/test_ort_graphs.py fails until ``python -m kernels.weightless`` (run by a developer)
rewrites them from fresh exports.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import tempfile
import threading
import weakref
from pathlib import Path

import numpy as np
import torch

import kernels.lean as lean
import kernels.ort as ort
import tts.codec
from kernels.lean import lean_module
from streaming.step_caches import StepCaches

GRAPHS = Path(__file__).resolve().with_name("graphs")
_sessions: weakref.WeakKeyDictionary[torch.nn.Module, dict[str, object]] = weakref.WeakKeyDictionary()
_lock = threading.Lock()


# ---- what each graph depends on, and the tensors its weights come from --------------------------------
def step_kind(int8: bool) -> str:
    return "step-int8" if int8 else "step"


def key(module: torch.nn.Module, kind: str) -> str:
    """What graph ``kind`` ("step", "step-int8", "codec") of ``module`` (a `TTSModel` or a `Codec`) depends
    on (see the module docstring), hashed."""
    import kernels.ort_codec as ort_codec

    if kind == "codec":
        parts = [repr(module.cfg), inspect.getsource(tts.codec), inspect.getsource(ort_codec)]
    else:
        rings = StepCaches.empty(module.cfg, 1)
        parts = [
            repr(module.cfg),
            f"rings {rings.text[0].capacity} {rings.audio[0].capacity}",
            inspect.getsource(lean),
            inspect.getsource(ort.export),
            inspect.getsource(ort.input_names),
            repr(ort.INPUTS),
            repr(ort.OUTPUTS),
            *([repr(ort.INT8)] if kind == "step-int8" else []),
        ]
    return hashlib.sha256("\n".join([kind, *parts]).encode()).hexdigest()[:24]


def graph_path(module: torch.nn.Module, kind: str, folder: Path | None = None) -> Path:
    """Where graph ``kind`` of ``module`` ships (it may not: a config without one), in ``folder``
    (default `GRAPHS`)."""
    return (folder or GRAPHS) / f"{kind}-{key(module, kind)}.onnx"


def sources(module: torch.nn.Module, kind: str) -> dict[str, torch.Tensor]:
    """The named tensors the graph's weights are made from: `LeanStep`'s buffers for the step, the
    `CodecStep`'s state (names as the export saw them, e.g. ``codec.decoder.out.weight``) for the codec."""
    if kind == "codec":
        from kernels.ort_codec import CodecStep

        return CodecStep(module).state_dict()
    return dict(lean_module(module).named_buffers())


# ---- recipes: a left-out weight from the source tensors ---------------------------------------------
def quantize8(weight: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A (K, N) fp32 MatMul weight as MatMulNBits' 8-bit symmetric blocks of `ort.INT8` ``block_size`` rows:
    (packed (N, blocks, block_size) uint8, scales (N, blocks) fp32), by the C++ kernel that ONNX Runtime's
    `MatMulNBitsQuantizer` calls. Example: K = 256, block 128, N = 768: packed (768, 2, 128), scales (768, 2)."""
    from onnxruntime.capi.onnxruntime_pybind11_state import quantize_matmul_8bits

    rows, cols = weight.shape
    block = ort.INT8["block_size"]
    blocks = -(-rows // block)
    weight = np.ascontiguousarray(np.pad(weight, ((0, blocks * block - rows), (0, 0))), dtype=np.float32)
    packed = np.zeros((cols, blocks, block), dtype=np.uint8)
    scales = np.zeros((cols, blocks), dtype=np.float32)
    zero_points = np.zeros((cols, blocks), dtype=np.uint8)  # unused: symmetric
    quantize_matmul_8bits(packed, weight, scales, zero_points, block, cols, rows, ort.INT8["is_symmetric"])
    return packed, scales


def gates(tensor: np.ndarray) -> np.ndarray:
    """An LSTM weight (4H, X) or bias (4H,) with torch's gate blocks (i, f, g, o) in ONNX's order
    (i, o, f, g). Example, H = 1, bias [i, f, g, o] = [1, 2, 3, 4] -> [1, 4, 2, 3]."""
    i, f, g, o = np.split(tensor, 4)
    return np.concatenate([i, o, f, g])


def make(row: list, arrays: dict[str, np.ndarray], quantized: dict) -> np.ndarray:
    """The weight one manifest row describes (see the module docstring), not yet in the graph's shape."""
    form, first = row[1], arrays[row[2]]
    if form in ("plain", "reshape"):
        return first
    if form in ("q8", "scales"):
        if row[2] not in quantized:
            quantized[row[2]] = quantize8(first)
        return quantized[row[2]][form == "scales"]
    if form == "row":
        return np.ascontiguousarray(first[row[3]])
    if form == "gates":
        return np.concatenate([gates(arrays[name]) for name in row[2:]])[None]  # (1, 4H, X) or (1, 8H)
    raise ValueError(f"unknown weight recipe {row}")


def weights(tensors: dict[str, torch.Tensor], manifest: list[list]) -> dict[str, np.ndarray]:
    """Every left-out weight, by its recipe, as a contiguous array (not yet in the graph's shape)."""
    arrays = {name: tensor.detach().cpu().contiguous().numpy() for name, tensor in tensors.items()}
    quantized: dict = {}
    return {row[0]: make(row, arrays, quantized) for row in manifest}


# ---- load ---------------------------------------------------------------------------------------------
def graph_session(module: torch.nn.Module, kind: str, folder: Path | None = None):
    """An ONNX Runtime session of graph ``kind`` of ``module`` from its shipped weightless graph, made once
    per module and kind; None when no graph ships for its key. Raises if the graph does not load or does not
    fit the weights."""
    import onnxruntime

    with _lock:
        made = _sessions.setdefault(module, {})
        if kind not in made:
            path = graph_path(module, kind, folder)
            if not path.exists():
                return None
            meta = json.loads(path.with_suffix(".json").read_text())
            arrays = weights(sources(module, kind), meta["weights"])
            for name, shape in meta["shapes"].items():
                arrays[name] = arrays[name].reshape(shape)
            options = ort.session_options()
            values = [onnxruntime.OrtValue.ortvalue_from_numpy(array) for array in arrays.values()]
            options.add_external_initializers(list(arrays), values)
            made[kind] = onnxruntime.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
            made[kind].weights = values  # ONNX Runtime may use their memory as is: keep them alive
        return made[kind]


# ---- write (a developer's step: needs the onnx package and an export) -------------------------------
def recipe(name: str, weight: np.ndarray, arrays: dict[str, np.ndarray], quantized: dict) -> list | None:
    """The manifest row that remakes ``weight`` byte for byte from ``arrays``, or None."""
    candidates = [[name, "plain", name]] if name in arrays else []
    for suffix, form in (("_Q8", "q8"), ("_scales", "scales")):
        if name.endswith(suffix) and name.removesuffix(suffix) in arrays:
            candidates.append([name, form, name.removesuffix(suffix)])
    for source, tensor in arrays.items():
        if tensor.size == weight.size and tensor.dtype == weight.dtype:
            candidates.append([name, "reshape", source])
        if tensor.ndim > 1 and tensor.shape[1:] == weight.shape:
            candidates += [[name, "row", source, i] for i in range(tensor.shape[0])]
        if weight.ndim in (2, 3) and weight.shape[0] == 1 and tensor.shape[0] % 4 == 0:
            if tensor.shape == weight.shape[1:]:
                candidates.append([name, "gates", source])
            if source.endswith("bias_ih_l0") and 2 * tensor.size == weight.size:
                candidates.append([name, "gates", source, source.replace("bias_ih", "bias_hh")])
    found = []
    for row in candidates:
        try:
            made = make(row, arrays, quantized)
        except (KeyError, ValueError):
            continue
        if made.dtype == weight.dtype and made.tobytes() == weight.tobytes():
            if row[1] in ("plain", "q8", "scales"):  # by name: what the export called it
                return row
            found.append(row)
    if len(found) > 1:  # equal bytes from different tensors (zeros, say): which one a new model needs is unknown
        raise ValueError(f"weight {name} is ambiguous: {found[:3]}")
    return found[0] if found else None


def export_weightless(module: torch.nn.Module, kind: str, path: Path) -> None:
    """Export graph ``kind`` of ``module`` to ``path`` as `kernels.auto` would build it."""
    import kernels.ort_codec as ort_codec

    if kind == "codec":
        ort_codec.export(module, path)
        return
    ort.export(module, path.with_name("fp32.onnx"))
    if kind == "step-int8":
        ort.quantize(path.with_name("fp32.onnx"), path)
    else:
        path.with_name("fp32.onnx").rename(path)


def write_graph(module: torch.nn.Module, kind: str, folder: Path | None = None, keep_bytes: int = 4096) -> Path:
    """Export graph ``kind`` of ``module``, then write it to ``folder`` without its weights, with their
    recipes beside it; older graphs of that kind there are removed. A weight no recipe remakes stays in
    the graph if it is at most ``keep_bytes`` (a constant), else this raises."""
    import onnx
    from onnx import TensorProto, numpy_helper

    with tempfile.TemporaryDirectory() as tmp:
        exported = Path(tmp) / "graph.onnx"
        export_weightless(module, kind, exported)
        graph = onnx.load(str(exported))
    arrays = {name: tensor.detach().cpu().contiguous().numpy() for name, tensor in sources(module, kind).items()}
    manifest, shapes, quantized = [], {}, {}
    for tensor in graph.graph.initializer:
        weight = numpy_helper.to_array(tensor)
        row = recipe(tensor.name, weight, arrays, quantized)
        if row is None:
            if weight.nbytes > keep_bytes:
                raise ValueError(f"{kind}: no recipe remakes weight {tensor.name} {weight.shape}")
            continue
        manifest.append(row)
        shapes[tensor.name] = list(weight.shape)
        tensor.ClearField("raw_data")
        tensor.data_location = TensorProto.EXTERNAL
        tensor.external_data.add(key="location", value="given-at-load")  # by `session`
    path = graph_path(module, kind, folder)
    path.parent.mkdir(parents=True, exist_ok=True)
    for old in path.parent.glob(f"{kind}-*"):
        if old.stem.count("-") == path.stem.count("-"):  # "step-<key>" is not "step-int8-<key>"
            old.unlink()
    onnx.save(graph, str(path))
    rows = ",\n".join(json.dumps(row) for row in manifest)
    path.with_suffix(".json").write_text(f'{{"shapes": {json.dumps(shapes)},\n"weights": [\n{rows}\n]}}\n')
    return path


if __name__ == "__main__":  # python -m kernels.weightless: rewrite the shipped model's graphs after a change
    from tts.voices import load_shipped

    model, codec, _ = load_shipped()
    for module, kind in ((model, "step"), (model, "step-int8"), (codec, "codec")):
        print(write_graph(module, kind))
