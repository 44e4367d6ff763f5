"""tts: a streaming text-to-speech engine.

``from tts import synthesize_stream`` is the Python entry point; attributes load lazily so that the
submodules (model, codec, text) import without pulling in the engine.
"""

from tts.rates import SAMPLE_RATE

__all__ = ["SAMPLE_RATE", "get_engine", "synthesize", "synthesize_stream"]


def __getattr__(name):
    if name in ("get_engine", "synthesize", "synthesize_stream"):
        from tts import api

        return getattr(api, name)
    raise AttributeError(name)
