"""The engine's typed errors: every one a stream can end with, or a caller can get, with its protocol code."""

from __future__ import annotations


class EngineError(RuntimeError):
    code = "engine_error"


class ServerFull(EngineError):
    code = "server_full"


class UnknownVoice(EngineError, ValueError):
    code = "unknown_voice"


class ParkedStateLost(EngineError):
    """A parked stream's state could not be read back from disk (its file truncated or damaged): it cannot
    continue, and ends with this error (code ``engine_error``); the other streams go on."""


class BadState(EngineError, ValueError):
    """`Engine.attach` was given bytes that are not a stream state of an engine with the same weights."""

    code = "bad_state"
