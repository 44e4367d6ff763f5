"""Fast paths for the decode step, as step factories for `Engine(step_factory=...)` and
`Engine.set_step_factory` (`factory(model, caches, batch, device) -> step`). Kill switches:
TTS_NO_GRAPH=1 (no CUDA graph), TTS_NO_COMPILE=1 (no compiled step), TTS_NO_ORT=1 (no ONNX Runtime step),
TTS_NO_QUANT=1 (the ONNX Runtime step keeps fp32 weights instead of int8)."""

from __future__ import annotations

from streaming.codec_worker import fast_path_enabled as enabled

__all__ = ["default_step_factory", "enabled"]


def default_step_factory(device="cpu", compile: bool = False):
    """The best step factory for ``device``: CUDA graphs on a GPU; on a CPU the ONNX Runtime step, served by
    the lean eager step until it is built (`kernels.auto`). ``compile`` asks for the TorchInductor step on a
    CPU instead (benchmarks; compiling takes tens of seconds to minutes per slot bucket)."""
    if compile and not str(device).startswith("cuda") and enabled("compile"):
        from kernels.compiled import CompiledStep

        def compiled(model, caches, batch, device):
            return CompiledStep(model, caches, batch, device)

        return compiled
    from kernels.auto import auto_step_factory as best

    return best(device)
