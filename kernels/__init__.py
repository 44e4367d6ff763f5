"""Fast paths for the decode step. Kill switches: TTS_NO_GRAPH=1 (no CUDA graph), TTS_NO_COMPILE=1."""
import os


def enabled(name: str) -> bool:
    return os.environ.get(f"TTS_NO_{name.upper()}", "0") in ("", "0")
