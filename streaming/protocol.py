"""The server's client messages and errors, validated by pydantic; docs/protocol.md specifies them.

A WebSocket client sends JSON messages tagged by ``type`` (``start``, ``text``, ``flush``, ``end``, ``cancel``);
an OpenAI-style HTTP client posts one `SpeechRequest`. Any invalid message becomes a `ProtocolError` whose
``code`` is one of the documented error codes, e.g. an unknown key -> ``unknown_key``.
"""
from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError


class ProtocolError(Exception):
    """A failure reported to the client as {"type": "error", "code": ..., "message": ...}."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code, self.message = code, message


WS_FORMATS = ("pcm_s16le", "f32le", "wav", "mp3", "opus", "aac", "flac")
HTTP_FORMATS = ("wav", "pcm", "mp3", "opus", "aac", "flac")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class Start(_Strict):
    type: Literal["start"]
    voice: str | None = None
    format: Literal[WS_FORMATS] = "pcm_s16le"
    speed: float = Field(1.0, ge=0.25, le=4.0)
    timings: bool = False  # also send {"type": "timing", "phonemes": [[unit, start_s, end_s], ...]} events


class Text(_Strict):
    type: Literal["text"]
    text: str


class Flush(_Strict):
    type: Literal["flush"]


class End(_Strict):
    type: Literal["end"]


class Cancel(_Strict):
    type: Literal["cancel"]


CLIENT_MESSAGE = TypeAdapter(Annotated[Union[Start, Text, Flush, End, Cancel], Field(discriminator="type")])


class SpeechRequest(BaseModel):
    """OpenAI's POST /v1/audio/speech body. `model` and `instructions` are accepted and ignored."""
    model_config = ConfigDict(extra="forbid")
    model: str = "tts"
    input: str
    voice: str | None = None
    response_format: Literal[HTTP_FORMATS] = "mp3"
    speed: float = Field(1.0, ge=0.25, le=4.0)
    instructions: str | None = None
    stream_format: Literal["audio"] = "audio"


_ERROR_CODES = {"json_invalid": "bad_json", "union_tag_invalid": "unknown_type", "extra_forbidden": "unknown_key",
                "literal_error": "unsupported_format", "greater_than_equal": "bad_value",
                "less_than_equal": "bad_value", "finite_number": "bad_value"}


def validation_error(err: ValidationError) -> ProtocolError:
    first = err.errors(include_url=False)[0]
    where = ".".join(str(p) for p in first["loc"] if p not in ("start", "text", "flush", "end", "cancel"))
    return ProtocolError(_ERROR_CODES.get(first["type"], "bad_message"), f"{where or 'message'}: {first['msg']}")
