"""The CPU step every path gets by default, with no build wait anyone can see.

`auto_step_factory()` returns a factory that, for a model:
  1. runs ONNX Runtime at once from the graph shipped for the model's config (`kernels.weightless`: the
     int8 step, or with TTS_NO_QUANT=1 the fp32 one, its weights made from the model at load);
  2. else at once if the model's int8 export is in the disk cache (`kernels.ort`; with TTS_NO_QUANT=1 the
     fp32 export);
  3. otherwise runs the fp32 export if that is cached, else the lean eager step (`kernels.lean`; nothing to
     build), and starts the export (and quantisation) in a background process; when it is ready, the
     callbacks given to ``when_faster`` get the ONNX Runtime factory (the engine's ``set_step_factory``
     swaps it in at a tick boundary);
  4. if ONNX Runtime cannot be used (TTS_NO_ORT=1, not installed, the export fails) it warns once and stays
     on the lean eager step, which computes the same logits.
`faster_codec_step(codec)` does the same for the CPU codec worker's decoder (`kernels.ort_codec`): a Future
of the ONNX Runtime decode step, at once from the shipped graph or the disk cache, else after a background
export, for `Engine.set_codec_step`; meanwhile, and whenever it cannot be had, the torch decoder decodes.
Measured choices (2-core machine, one thread): see ``python -m bench.steps`` (``--codec-only``: the decoder).
"""

from __future__ import annotations

import threading
import warnings
import weakref
from concurrent.futures import Future
from pathlib import Path

import kernels.ort as ort
import kernels.weightless as weightless
from kernels.lean import EagerLeanStep


class DefaultStepFactory:
    """``factory(model, caches, batch, device) -> step``. ``kind`` names the step the last call built;
    ``faster`` resolves to the ONNX Runtime factory once built (None when there is none to wait for)."""

    def __init__(self):
        self.faster: Future = Future()
        self.kind = "lean"
        self._lock = threading.Lock()
        self._building = False
        self._shipped_steps: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> factory or None

    def prepare(self, model) -> None:
        """Open ``model``'s shipped graph now, while the engine loads, rather than on its first tick (about
        0.5 s for the shipped model): ``kind`` then names the step the engine will run."""
        if ort.available():
            self._shipped_factory(model)

    def __call__(self, model, caches, batch, device):
        if str(device).startswith("cuda"):  # ONNX Runtime here is a CPU runner; the GPU has its CUDA graph
            self._resolve(None)
            return self._cuda(model, caches, batch, device)
        if ort.available() and (shipped := self._shipped_factory(model)) is not None:
            return shipped(model, caches, batch, device)
        if ort.available():
            try:
                int8 = ort.int8_wanted()
                path = ort.load(model, int8)
                if path is None:
                    path = ort.load(model) if int8 else None  # the fp32 step, while the int8 one is made
                    self._build(model, int8)  # after: a broken fp32 file is gone, so the build remakes it
                elif not self._building:
                    self._resolve(None)  # the fastest step is already here: nothing better will come
                if path is not None:
                    step = ort.factory(path)(model, caches, batch, device)
                    self.kind = step.kind
                    return step
            except Exception as err:  # an unreadable cache, say: serve on rather than fail the engine
                warnings.warn(f"ONNX Runtime step unavailable, staying on the lean eager step: {err}")
                self._resolve(None)
        else:
            self._resolve(None)
        self.kind = EagerLeanStep.kind
        return EagerLeanStep(model, caches, batch, device)

    def _shipped_factory(self, model):
        """The factory of the model's shipped weightless graph (`kernels.weightless`), opened once per model;
        None if none ships for its key or it cannot be used (then with a warning: the disk cache or a build
        serves instead)."""
        if model not in self._shipped_steps:
            kind = "onnxruntime-int8" if ort.int8_wanted() else "onnxruntime"
            shared = shipped_session(model, weightless.step_kind(ort.int8_wanted()), "step")
            self._shipped_steps[model] = None if shared is None else ort.session_factory(shared, kind)
        shipped = self._shipped_steps[model]
        if shipped is not None:
            self.kind = shipped.kind
            self._resolve(None)  # the fastest step, at once: nothing better will come
        return shipped

    def _cuda(self, model, caches, batch, device):
        from streaming.codec_worker import fast_path_enabled as enabled

        if enabled("graph"):
            from kernels.cuda_graph import GraphedStep

            self.kind = "cuda_graph"
            return GraphedStep(model, caches, batch, device)
        from streaming.step_caches import decode_step

        self.kind = "eager"
        return decode_step

    def when_faster(self, callback) -> None:
        """Call ``callback(factory)`` when a faster factory is ready (at once if it already is; never if
        none will be). Typical: ``factory.when_faster(engine.set_step_factory)``."""

        def hand_over(done: Future):
            if done.result() is not None:
                callback(done.result())

        self.faster.add_done_callback(hand_over)

    def _resolve(self, value) -> None:
        with self._lock:
            if not self.faster.done():
                self.faster.set_result(value)

    def _build(self, model, int8: bool) -> None:
        """Export the fp32 step (unless cached) and, with ``int8``, quantise it, in a background process."""
        with self._lock:
            if self._building or self.faster.done():
                return
            self._building = True
        paths = [ort.onnx_path(model)] + ([ort.onnx_path(model, int8=True)] if int8 else [])
        build_in_background(
            model,
            paths,
            "kernels.ort",
            ort.factory,
            self._resolve,
            "ONNX Runtime step unavailable, staying on the step in use",
        )


def shipped_session(module, kind: str, what: str):
    """`kernels.weightless.graph_session` of ``module``'s graph ``kind``: None when none ships for its key, or
    (with a warning naming ``what``) when ONNX Runtime cannot use it; the caller then builds instead."""
    try:
        return weightless.graph_session(module, kind)
    except Exception as err:  # a graph this ONNX Runtime cannot load, say
        warnings.warn(f"shipped {what} graph unusable, building the {what} instead: {err}")
        return None


def build_in_background(module, paths: list[Path], runner: str, make, resolve, failure: str) -> None:
    """On a thread: export ``module`` to ``paths[0]`` (unless there) and derive the rest from it in a child
    process (``python -m runner``), open the last one's session, then ``resolve(make(paths[-1]))``; on any
    failure warn ``failure: error`` and ``resolve(None)``."""
    path = paths[-1]

    def run():
        try:
            ort.export_in_background_process(module, paths[0], runner, *paths[1:])
            ort.session(path)
            resolve(make(path))
        except Exception as err:  # no compiler needed, but onnx may be missing or the export may fail
            warnings.warn(f"{failure}: {err}")
            resolve(None)

    threading.Thread(target=run, name=f"tts-build-{path.stem}", daemon=True).start()


def auto_step_factory(device="cpu") -> DefaultStepFactory:
    """The step factory every path should use (``device`` is where the engine runs; the factory also
    reads it per call). Typical use::

        factory = auto_step_factory(device)
        engine = Engine(model, codec, voices, device=device, step_factory=factory)
        factory.when_faster(engine.set_step_factory)
    """
    return DefaultStepFactory()


def faster_codec_step(codec, device="cpu") -> Future:
    """A Future of the CPU codec worker's fastest decode step for ``codec`` (for `Engine.set_codec_step`):
    the ONNX Runtime one (`kernels.ort_codec`), resolved at once from the graph shipped for the codec's
    config (`kernels.weightless`) or the export in the disk cache, else once a background process has
    exported it (meanwhile the engine decodes with the torch decoder). It
    resolves to None when nothing faster will come: a GPU (its frame codec runs a CUDA graph), TTS_NO_ORT=1,
    onnxruntime missing, or a failed export or unreadable cache (with a warning). Typical::

        faster_codec_step(codec).add_done_callback(lambda done: engine.set_codec_step(done.result()))
    """
    import kernels.ort_codec as ort_codec

    faster: Future = Future()
    if str(device).startswith("cuda") or not ort.available():
        faster.set_result(None)
        return faster
    lstm = codec.decoder.lstm is not None

    def make(source):
        return ort_codec.OrtCodecStep(source, lstm)

    def resolve(value) -> None:
        if not faster.done():
            faster.set_result(value)

    failure = "ONNX Runtime codec decoder unavailable, staying on the torch decoder"
    shared = shipped_session(codec, "codec", "codec decoder")
    if shared is not None:
        resolve(make(shared))
        return faster
    try:
        path = ort_codec.load(codec)
        if path is not None:
            resolve(make(path))
        else:
            build_in_background(codec, [ort_codec.onnx_path(codec)], "kernels.ort_codec", make, resolve, failure)
    except Exception as err:  # an unreadable cache, say: decode on with torch rather than fail
        warnings.warn(f"{failure}: {err}")
        resolve(None)
    return faster
