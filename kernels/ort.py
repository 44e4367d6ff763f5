"""The decode step run by ONNX Runtime, exported once per model and kept in a disk cache.

`kernels.lean.LeanStep` is exported to ONNX (batch size left dynamic, so one file serves every bucket of
slots) and run on ONNX Runtime's CPU provider: its per-node overhead is a few microseconds where eager
PyTorch's is tens, so the step costs about what its matrix products cost. The ring caches are bound
in place with IOBinding (ONNX Runtime reads the torch tensors' memory: no copies); the few keys and values
a step writes come back in small output buffers and `kernels.lean.write_rings` stores them.

Weights in int8 (the default): the step reads its weights once per frame, 34 MB in fp32, and on two cores
that read is most of its time. `quantize` turns the export's 33 weight MatMuls into ONNX Runtime's
``MatMulNBits`` (8-bit weights, symmetric, one scale per ``block_size`` rows; ``accuracy_level`` 4: the
activations are quantised per block to int8 too, so the products run as int8 dot products). Measured on
the shipped model (2-core AMD EPYC, one thread, shared machine): step CPU time p50 3.97 -> 2.38 ms at batch
1 and 7.58 -> 6.04 ms at batch 8 (``python -m bench.steps --kinds onnxruntime onnxruntime-int8``); largest
logit difference from fp32 0.64 (logits' std ~4.8); on 40 Harvard sentences (101-140, 4 voices, the same
seeds; ``python -m bench.steps --quality 40``) Whisper WER 8.05 -> 8.27 % (+0.22 +- 1.62 points) and
DNSMOS OVRL 2.797 -> 2.854 (+0.057 +- 0.036), both within what two samplings of the fp32 step differ by
(-1.06 +- 1.85 points, +0.035 +- 0.034). Rejected: 8-bit weights with fp32 arithmetic (accuracy level 0:
no fast kernel, 18 ms), 4-bit weights (largest logit difference 3-4), ``quantize_dynamic`` (slower than
MatMulNBits at batch 1). TTS_NO_QUANT=1 keeps the fp32 step.

Cache: ``$TTS_CACHE_DIR`` (default ``~/.cache/tts``) ``/kernels/step-<key>.onnx`` (fp32) and
``step-int8-<key>.onnx``, the key hashing the weights, the model config, this step's source, the
quantiser's settings and the torch and onnxruntime versions. A file that does not load is deleted and
rebuilt. Exporting takes a few seconds (TorchScript exporter; the dynamo exporter took 18-60 s here for
the same graph) and quantising about one more, so `kernels.auto` runs both in a background process, under
a file lock (`build_lock`: a second process waits, then finds the files made), for a model whose graph
does not ship; the shipped model's graphs ship without weights (`kernels.weightless`) and need neither.
Kill switch: TTS_NO_ORT=1. The cache, export and session helpers here also serve `kernels.ort_codec`.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import inspect
import os
import subprocess
import sys
import tempfile
import threading
import warnings
import weakref
from pathlib import Path

import numpy as np
import torch

import kernels.lean as lean
from kernels.lean import lean_module, ring_tensors, write_rings
from streaming.codec_worker import fast_path_enabled as enabled
from streaming.step_caches import StepCaches
from tts.model import TTSModel

INPUTS = ["tokens", "frame", "unit", "active", "text_pos", "audio_pos"]
OUTPUTS = ["logits", "new_keys", "new_values", "new_pos", "slot"]
_NUMPY = {torch.float32: np.float32, torch.int64: np.int64, torch.bool: np.bool_}
_sessions: dict[Path, object] = {}
_keys: weakref.WeakKeyDictionary[torch.nn.Module, dict[str, str]] = weakref.WeakKeyDictionary()
_lock = threading.Lock()
# MatMulNBits settings of the int8 step. Block 128 against 32: 0.55 against 0.33 largest logit difference
# from fp32 over 20 steps (logits' std ~4.8), 10-20 % less step time; quality: see the module docstring.
INT8 = {"bits": 8, "block_size": 128, "is_symmetric": True, "accuracy_level": 4}


def available() -> bool:
    """ONNX Runtime and the ONNX exporter's dependency are installed and TTS_NO_ORT is not set."""
    return enabled("ort") and all(importlib.util.find_spec(m) for m in ("onnxruntime", "onnx"))


def int8_wanted() -> bool:
    """Whether the default step is the int8 one (TTS_NO_QUANT=1: keep fp32 weights)."""
    return enabled("quant")


def threads() -> int:
    """Intra-op threads of every session: half the cores, the engine's share for the step (the codec worker
    has the other half), whichever thread makes the session and whenever. Taken from torch's thread count
    instead, a session made before the engine split the cores had two threads on a 2-core machine, and the
    second one took 1.6 ms of CPU a frame from the codec's core (one stream, measured here). The cores are
    those the process may use: OMP_NUM_THREADS where set (Ray sets it to an actor's ``num_cpus``), else its CPU
    affinity (taskset, a container's cpuset), not the machine's count. Example: a Ray Serve replica with
    ``num_cpus=2`` on a 16-core host gets 1 thread (8 before), so two replicas on 4 cores do not oversubscribe."""
    cores = os.environ.get("OMP_NUM_THREADS", "")
    if not (cores.isdigit() and int(cores) > 0):
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 2  # macOS
    return max(1, int(cores) // 2)


def cache_dir() -> Path:
    root = os.environ.get("TTS_CACHE_DIR") or Path.home() / ".cache" / "tts"
    return Path(root) / "kernels"


def versions() -> list[str]:
    """The versions a cached export depends on: torch (the exporter) and onnxruntime (the runner)."""
    import onnxruntime

    return [torch.__version__, onnxruntime.__version__]


def cached_path(kind: str, module: torch.nn.Module, *parts: str) -> Path:
    """``cache_dir() / <kind>-<key>.onnx``, the key hashing ``module``'s weights and ``parts`` (config,
    graph source, versions, baked-in shapes). Computed once per module and kind (hashing the shipped
    model's 46 MB takes about 0.1 s)."""
    keys = _keys.setdefault(module, {})
    if kind not in keys:
        weights = hashlib.sha256()
        for name, tensor in module.state_dict().items():
            weights.update(name.encode())
            weights.update(tensor.detach().cpu().contiguous().numpy())
        keys[kind] = hashlib.sha256("\n".join([weights.hexdigest(), *parts]).encode()).hexdigest()[:24]
    return cache_dir() / f"{kind}-{keys[kind]}.onnx"


def onnx_path(model: TTSModel, int8: bool = False) -> Path:
    """Where the export of ``model``'s step lives (``int8``: its quantised form). The key changes with the
    weights, the config, the graph's source, torch, onnxruntime, the ring capacities (baked into the graph's
    shapes) and, for int8, the quantiser's settings."""
    rings = StepCaches.empty(model.cfg, 1)
    return cached_path(
        "step-int8" if int8 else "step",
        model,
        repr(model.cfg),
        inspect.getsource(lean),
        *versions(),
        f"rings {rings.text[0].capacity} {rings.audio[0].capacity}",
        *([repr(INT8)] if int8 else []),
    )


def write_atomically(path: Path, write) -> None:
    """``write(tmp)`` to a temporary file beside ``path``, then rename it to ``path``: a reader never sees a
    half-written file, and a failed write leaves nothing behind."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".onnx.tmp", dir=path.parent)
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def input_names(layers: int) -> list[str]:
    """The graph's inputs: `INPUTS`, then per layer the six ring tensors of `kernels.lean.ring_tensors`."""
    rings = ("sink_k", "sink_v", "text_k", "text_v", "audio_k", "audio_v")
    return INPUTS + [f"{name}{i}" for i in range(layers) for name in rings]


def export(model: TTSModel, path: Path) -> None:
    """Write ``model``'s `LeanStep` as ONNX to ``path`` atomically (a temporary file, then a rename)."""
    module = lean_module(model)
    cfg, batch = model.cfg, 2
    caches = StepCaches.empty(cfg, batch)
    zeros = torch.zeros(batch, dtype=torch.long)
    args = (
        torch.zeros(batch, cfg.codebooks, dtype=torch.long),
        zeros,
        zeros.clone(),
        torch.zeros(batch, dtype=torch.bool),
        caches.text[0].positions,
        caches.audio[0].positions,
        *ring_tensors(caches),
    )
    names = input_names(cfg.layers)
    axes = {name: {0: "batch"} for name in names + ["logits", "new_pos", "slot"]}
    axes.update(new_keys={1: "batch"}, new_values={1: "batch"})

    def write(tmp: str) -> None:
        with warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("ignore")  # the exporter's notes on advanced indexing and deprecation
            torch.onnx.export(
                module,
                args,
                tmp,
                dynamo=False,
                input_names=names,
                output_names=OUTPUTS,
                dynamic_axes=axes,
                opset_version=17,
            )

    write_atomically(path, write)


def quantize(source: Path, path: Path) -> None:
    """Write the int8 form (`INT8`) of the step export ``source`` to ``path`` atomically."""
    import onnx
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer  # logs at INFO on import:

    quantizer = MatMulNBitsQuantizer(onnx.load(str(source)), **INT8)  # run it in the build's child process
    quantizer.process()
    write_atomically(path, lambda tmp: quantizer.model.save_model_to_file(tmp, False))


def export_in_background_process(
    module: torch.nn.Module, path: Path, runner: str = "kernels.ort", *more: Path
) -> list[Path]:
    """Export in a child process (``python -m runner MODULE.pt OUT.onnx [MORE.onnx ...]``, see `export_child`)
    at low priority: the export is seconds of Python that would otherwise hold this process's GIL and stall
    the engine thread. Returns the paths the child wrote (none if another process had made them all
    meanwhile); raises if the child fails."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, saved = tempfile.mkstemp(suffix=".pt.tmp", dir=path.parent)
    os.close(fd)
    try:
        torch.save(module, saved)
        done = subprocess.run(
            [sys.executable, "-m", runner, saved, str(path), *map(str, more)],
            capture_output=True,
            text=True,
            cwd=Path(__file__).resolve().parent.parent,
        )
        if done.returncode:
            raise RuntimeError(f"ONNX export failed: {done.stderr.strip()[-2000:]}")
        return [Path(line) for line in done.stdout.splitlines() if line.startswith(str(path.parent))]
    finally:
        Path(saved).unlink(missing_ok=True)


@contextlib.contextmanager
def build_lock(path: Path):
    """Hold an exclusive lock on ``path``'s build (``path.lock`` beside it) across processes: a second
    process that wants the same file waits here, then finds it made instead of making it again."""
    with open(path.with_name(path.name + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def export_child(export, derive=None) -> None:
    """The child's side of `export_in_background_process`: under `build_lock`, ``export(module, OUT)`` at low
    priority (unless OUT is already there), then ``derive(OUT, MORE)`` for each further path not there yet
    (the int8 step from the fp32 one). Prints each path it wrote."""
    os.nice(10)  # behind the engine and the codec, which are serving meanwhile
    torch.set_num_threads(1)
    module = torch.load(sys.argv[1], weights_only=False)
    os.unlink(sys.argv[1])  # ours now: if the parent has exited meanwhile, nothing is left behind
    path = Path(sys.argv[2])
    with build_lock(path):
        if not path.exists():
            export(module, path)
            print(path, flush=True)
        for more in map(Path, sys.argv[3:]):
            if not more.exists():
                derive(path, more)
                print(more, flush=True)


def session_options():
    """Every session's options: `threads` intra-op threads, sequential, no spinning (idle cores go to the codec)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads()
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")  # leave idle cores to the codec
    options.log_severity_level = 3
    return options


def session(path: Path):
    """The ONNX Runtime session of ``path``, created once per process (`session_options`).
    Raises if the file does not load (corrupted or truncated)."""
    import onnxruntime as ort

    with _lock:
        if path not in _sessions:
            _sessions[path] = ort.InferenceSession(str(path), session_options(), providers=["CPUExecutionProvider"])
        return _sessions[path]


def load(model: TTSModel, int8: bool = False) -> Path | None:
    """The cached export of ``model``'s step (``int8``: its quantised form) if it exists and loads (see `load_file`)."""
    return load_file(onnx_path(model, int8))


def load_file(path: Path) -> Path | None:
    """``path`` if it exists and loads; a file that does not load is deleted (with a warning) and None returned."""
    if not path.exists():
        return None
    try:
        session(path)
        return path
    except Exception as err:
        warnings.warn(f"cached ONNX export {path} does not load, rebuilding it: {err}")
        path.unlink(missing_ok=True)
        return None


def kind_of(path: Path) -> str:
    """The step kind an export runs as: "onnxruntime" (fp32) or "onnxruntime-int8"."""
    return "onnxruntime-int8" if path.name.startswith("step-int8") else "onnxruntime"


class OrtStep:
    """`decode_step` run by ONNX Runtime ``session`` (of a `LeanStep` graph) over ``caches`` bound in place.
    Inputs are copied into fixed buffers (tens of bytes); logits come back in one fixed (B, K, N) buffer,
    valid until the next call. ``kind`` says whether the weights are fp32 or int8 (`kind_of`)."""

    def __init__(self, model: TTSModel, caches: StepCaches, batch: int, session, kind: str):
        cfg = model.cfg
        self.kind, self.session = kind, session
        self.inputs = [
            torch.zeros(batch, cfg.codebooks, dtype=torch.long),
            torch.zeros(batch, dtype=torch.long),
            torch.zeros(batch, dtype=torch.long),
            torch.zeros(batch, dtype=torch.bool),
        ]
        rows = (cfg.layers, batch, cfg.heads, cfg.head_dim)
        self.outputs = [
            torch.zeros(batch, cfg.codebooks, cfg.codebook_size),
            torch.zeros(rows),
            torch.zeros(rows),
            torch.zeros(batch, dtype=torch.long),
            torch.zeros(batch, dtype=torch.long),
        ]
        self.binding, self.bound = self.session.io_binding(), []
        for name, tensor in zip(OUTPUTS, self.outputs):
            self._bind(self.binding.bind_output, name, tensor)
        for name, tensor in zip(INPUTS, self.inputs):
            self._bind(self.binding.bind_input, name, tensor)
        self._bind_caches(caches)

    def _bind(self, bind, name: str, tensor: torch.Tensor) -> None:
        if not tensor.is_contiguous() or tensor.device.type != "cpu":
            raise ValueError(f"{name}: ONNX Runtime binds contiguous CPU tensors only")
        bind(name, "cpu", 0, _NUMPY[tensor.dtype], tuple(tensor.shape), tensor.data_ptr())

    def _bind_caches(self, caches: StepCaches) -> None:
        """Bind the caches' memory, unless it is already bound: the engine may pass a new view object of
        the same storage every tick, and rebinding all 2 + 6 * layers tensors costs more than checking."""
        tensors = [caches.text[0].positions, caches.audio[0].positions] + ring_tensors(caches)
        where = [(t.data_ptr(), t.shape) for t in tensors]
        if where == self.bound:
            return
        for name, tensor in zip(input_names(len(caches.audio))[len(self.inputs) :], tensors):
            self._bind(self.binding.bind_input, name, tensor)
        self.bound = where

    def __call__(self, model, caches, tokens, frame, unit, active) -> torch.Tensor:
        self._bind_caches(caches)
        for buffer, value in zip(self.inputs, (tokens, frame, unit, active)):
            buffer.copy_(value)
        self.session.run_with_iobinding(self.binding)
        write_rings(caches, *self.outputs[1:])
        return self.outputs[0]


def factory(path: Path):
    """A step factory over the export at ``path`` (cheap to call: the session is shared)."""
    return session_factory(session(path), kind_of(path))


def session_factory(shared, kind: str):
    """A step factory over the ONNX Runtime session ``shared``, which every step it builds shares."""

    def build(model, caches, batch, device):
        return OrtStep(model, caches, batch, shared, kind)

    build.kind = kind
    return build


if __name__ == "__main__":  # the background build: python -m kernels.ort MODEL.pt FP32.onnx [INT8.onnx]
    export_child(export, quantize)
