"""Fast paths for the decode step, as step factories for `Engine(step_factory=...)` and
`Engine.set_step_factory` (`factory(model, caches, batch, device) -> step`). Kill switches:
TTS_NO_GRAPH=1 (no CUDA graph), TTS_NO_COMPILE=1 (no compiled step)."""
from __future__ import annotations

from streaming.codec_worker import fast_path_enabled as enabled

__all__ = ["default_step_factory", "enabled"]


def default_step_factory(device, compile: bool = False):
    """The best step factory for ``device``: CUDA graphs on a GPU; the TorchInductor-compiled step on a CPU
    when ``compile`` (long-lived engines: compiling takes seconds); else None, the eager step."""
    if str(device).startswith("cuda") and enabled("graph"):
        from kernels.cuda_graph import CudaGraphSteps
        return CudaGraphSteps()
    if compile and enabled("compile"):
        from kernels.compiled import CompiledStep

        def compiled(model, caches, batch, device):
            return CompiledStep(model, caches, batch, device)
        return compiled
    return None
