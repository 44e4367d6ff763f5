"""Fast paths for the decode step. Kill switches: TTS_NO_GRAPH=1 (no CUDA graph), TTS_NO_COMPILE=1, TTS_NO_ORT=1."""
import os


def enabled(name: str) -> bool:
    return os.environ.get(f"TTS_NO_{name.upper()}", "0") in ("", "0")


def default_step_factory(device="cpu"):
    """The best decode-step factory for ``device`` (see `kernels.auto`)."""
    from kernels.auto import default_step_factory as best
    return best(device)
