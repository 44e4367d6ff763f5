"""The CPU step every path gets by default, with no build wait anyone can see.

`default_step_factory()` returns a factory that, for a model:
  1. runs ONNX Runtime at once if the model's export is in the disk cache (`kernels.ort`);
  2. otherwise runs the lean eager step (`kernels.lean`; nothing to build) and starts the export in a
     background process; when it is ready, the callbacks given to ``when_faster`` get the ONNX Runtime
     factory (the engine's ``set_step_factory`` swaps it in at a tick boundary);
  3. if ONNX Runtime cannot be used (TTS_NO_ORT=1, not installed, the export fails) it warns once and stays
     on the lean eager step, which computes the same logits.
Measured choices (2-core machine, one thread): see ``python -m bench.steps``.
"""
from __future__ import annotations

import threading
import warnings
from concurrent.futures import Future

from kernels import ort
from kernels.lean import EagerLeanStep


class DefaultStepFactory:
    """``factory(model, caches, batch, device) -> step``. ``kind`` names the step the last call built;
    ``faster`` resolves to the ONNX Runtime factory once built (None when there is none to wait for)."""

    def __init__(self):
        self.faster: Future = Future()
        self.kind = "lean"
        self._lock = threading.Lock()
        self._building = False

    def __call__(self, model, caches, batch, device):
        if str(device).startswith("cuda"):  # ONNX Runtime here is a CPU runner; the GPU has its CUDA graph
            self._resolve(None)
            return self._cuda(model, caches, batch, device)
        if ort.available():
            try:
                path = ort.load(model)
                if path is not None:
                    step = ort.OrtStep(model, caches, batch, path)
                    self._resolve(None)  # the fast step is already here: nothing better will come
                    self.kind = ort.OrtStep.kind
                    return step
                self._build(model)
            except Exception as err:  # an unreadable cache, say: serve on rather than fail the engine
                warnings.warn(f"ONNX Runtime step unavailable, staying on the lean eager step: {err}")
                self._resolve(None)
        else:
            self._resolve(None)
        self.kind = EagerLeanStep.kind
        return EagerLeanStep(model, caches, batch, device)

    def _cuda(self, model, caches, batch, device):
        from kernels import enabled
        if enabled("graph"):
            from kernels.cuda_graph import GraphedStep
            self.kind = "cuda_graph"
            return GraphedStep(model, caches, batch, device)
        from streaming.decode import decode_step
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

    def _build(self, model) -> None:
        with self._lock:
            if self._building or self.faster.done():
                return
            self._building = True
        path = ort.onnx_path(model)

        def run():
            try:
                ort.export_in_background_process(model, path)
                ort.session(path)
                self._resolve(ort.factory(path))
            except Exception as err:  # no compiler needed, but onnx may be missing or the export may fail
                warnings.warn(f"ONNX Runtime step unavailable, staying on the lean eager step: {err}")
                self._resolve(None)

        threading.Thread(target=run, name="tts-step-build", daemon=True).start()


def default_step_factory(device="cpu") -> DefaultStepFactory:
    """The step factory every path should use (``device`` is where the engine runs; the factory also
    reads it per call). Typical use::

        factory = default_step_factory(device)
        engine = Engine(model, codec, voices, device=device, step_factory=factory)
        factory.when_faster(engine.set_step_factory)
    """
    return DefaultStepFactory()
