"""The server's client messages and errors, validated by pydantic; docs/protocol.md specifies them.

A WebSocket client sends JSON messages tagged by ``type`` (``start``, ``text``, ``flush``, ``end``, ``cancel``,
and ``ack`` / ``resume`` for resuming after a dropped connection),
each optionally naming a ``context_id`` (several utterances on one socket); an OpenAI-style HTTP client posts one
`SpeechRequest`. Any invalid message becomes a `ProtocolError` whose ``code`` is one of the documented error
codes (`ERRORS`), e.g. an unknown key -> ``unknown_key``; over HTTP the code also picks the status and OpenAI's
error type.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from tts.lexicon import MAX_ENTRIES
from tts.text import TextError, check_characters, validate_text

# code -> HTTP status. Over WebSocket the same codes come as {"type": "error", "code": ...}.
ERRORS = {
    "bad_json": 400,
    "bad_message": 400,
    "unknown_type": 400,
    "unknown_key": 400,
    "unsupported_format": 400,
    "bad_value": 400,
    "unknown_voice": 400,
    "bad_text": 400,
    "text_too_long": 400,
    "bad_state": 400,
    "too_many_contexts": 400,
    "body_too_large": 413,
    "invalid_api_key": 401,
    "origin_not_allowed": 403,
    "not_found": 404,
    "method_not_allowed": 405,
    "client_limit": 429,
    "server_full": 503,
    "engine_error": 500,
    "internal": 500,
    "idle_timeout": 408,
    "resume_expired": 410,
    "resume_used": 409,
    "resume_offset": 416,
    "resume_forbidden": 403,
    "audio_too_long": 400,
}
OPENAI_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    409: "invalid_request_error",
    410: "invalid_request_error",
    413: "invalid_request_error",
    416: "invalid_request_error",
    429: "rate_limit_error",
}  # any 5xx: server_error


class ProtocolError(Exception):
    """A failure reported to the client: {"type": "error", "code", "message"} on the WebSocket, OpenAI's
    {"error": {"message", "type", "code", "param"}} over HTTP. ``param`` names the offending field;
    ``retry_after`` (seconds) is set on refusals that a later retry may get past."""

    def __init__(self, code: str, message: str, param: str | None = None, retry_after: int | None = None):
        super().__init__(message)
        self.code, self.message, self.param, self.retry_after = code, message, param, retry_after

    @property
    def status(self) -> int:
        return ERRORS.get(self.code, 400)

    def openai(self) -> dict:
        kind = OPENAI_TYPES.get(self.status, "server_error")
        return {"error": {"message": self.message, "type": kind, "code": self.code, "param": self.param}}


OUTPUT_RATES = (16_000, 22_050, 24_000, 44_100)  # what a client may ask for; the engine speaks at 24 kHz
WS_FORMATS = ("pcm_s16le", "f32le", "wav", "mp3", "opus", "aac", "flac", "ulaw_8000")
HTTP_FORMATS = ("wav", "pcm", "mp3", "opus", "aac", "flac")
ContextId = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.:-]+$")]
Seed = Annotated[int, Field(ge=0, lt=2**63)]
SampleRate = Literal[OUTPUT_RATES]
LexiconEntries = Annotated[dict[str, str], Field(max_length=MAX_ENTRIES)]  # checked entry by entry: `Hub.lexicon_for`


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    context_id: ContextId | None = None  # which utterance on this socket; none: the default one


class Start(_Strict):
    type: Literal["start"]
    voice: str | None = None
    format: Literal[WS_FORMATS] = "pcm_s16le"
    sample_rate: SampleRate = 24_000
    speed: float = Field(1.0, ge=0.25, le=4.0)
    seed: Seed | None = None  # same seed, same request -> the same audio, whatever else runs
    timings: bool = False  # also send {"type": "timing", "phonemes": [[unit, start_s, end_s], ...]} events
    word_timings: bool = False  # also send {"type": "timing", "words": [{"word", "start", "end"}, ...]} events
    # Start hold: the first audio waits until text arriving at its pace so far would keep a player that starts
    # then from running dry (streaming/textstream.py, the start hold). false: speak as soon as the engine can
    # (the earliest first audio, but word-by-word text then stalls more: measured idle without the hold, 37 and
    # 9.6 stalls/min at 5 and 10 words/s, 44 at 1.2x the speaking rate).
    hold: bool = True
    lexicon: LexiconEntries | None = None  # {"word": "/IPA/" or "respelling"}: tts/lexicon.py


class Text(_Strict):
    type: Literal["text"]
    text: str


class Flush(_Strict):
    type: Literal["flush"]


class End(_Strict):
    type: Literal["end"]


class Cancel(_Strict):
    type: Literal["cancel"]


Count = Annotated[int, Field(ge=0, lt=2**63)]


class Ack(_Strict):
    """The client holds the context's output up to here: the server may drop it from its replay log."""

    type: Literal["ack"]
    bytes: Count  # audio bytes received on the context since the session began
    events: Count  # events received on it (not queued, audio, or the answers to a resume)


class Position(_Strict):
    """What the client has received of one context, in a resume."""

    bytes: Count
    events: Count


class Resume(_Strict):
    """Take over a session whose connection dropped: the rest of each context's output follows."""

    type: Literal["resume"]
    token: str = Field(min_length=1, max_length=64)
    contexts: list[Position] = Field(default=[], max_length=64)


CLIENT_MESSAGE = TypeAdapter(Annotated[Start | Text | Flush | End | Cancel | Ack | Resume, Field(discriminator="type")])
UNCOUNTED = ("ack", "resume")  # client messages a resume's `received` does not count


class VoiceRef(BaseModel):
    """OpenAI's custom-voice form, ``{"id": "voice_1234"}``: here the id is a voice name or alias."""

    model_config = ConfigDict(extra="forbid")
    id: str


class SpeechRequest(BaseModel):
    """OpenAI's POST /v1/audio/speech body. `model` and `instructions` are accepted and ignored; `seed` and
    `sample_rate` are this server's extensions."""

    model_config = ConfigDict(extra="forbid")
    model: str = "tts"
    # strict numbers: "speed": "2" or true is a client's bug to see (bad_message), not a speed to guess
    input: str
    voice: str | VoiceRef | None = None
    response_format: Literal[HTTP_FORMATS] = "mp3"
    speed: float = Field(1.0, ge=0.25, le=4.0, strict=True)
    instructions: str | None = None
    stream_format: Literal["audio", "sse"] = "audio"
    seed: Annotated[Seed, Field(strict=True)] | None = None
    sample_rate: SampleRate = 24_000  # a Literal: only these very ints (the string "16000" is refused)
    lexicon: LexiconEntries | None = None  # this server's extension, as the WebSocket's start

    @property
    def voice_name(self) -> str | None:
        return self.voice.id if isinstance(self.voice, VoiceRef) else self.voice


_ERROR_CODES = {
    "json_invalid": "bad_json",
    "union_tag_invalid": "unknown_type",
    "extra_forbidden": "unknown_key",
    "literal_error": "unsupported_format",
    "greater_than_equal": "bad_value",
    "less_than_equal": "bad_value",
    "less_than": "bad_value",
    "finite_number": "bad_value",
    "string_too_short": "bad_value",
    "string_too_long": "bad_value",
    "string_pattern_mismatch": "bad_value",
    "too_long": "bad_value",
}
_MESSAGE_TYPES = ("start", "text", "flush", "end", "cancel", "ack", "resume")


def validation_error(err: ValidationError) -> ProtocolError:
    """The first problem pydantic found, as a typed error naming the offending field (OpenAI's ``param``).
    Example: {"type": "start", "sample_rate": 8000} -> unsupported_format on ``sample_rate``."""
    first = err.errors(include_url=False)[0]
    loc = [str(p) for p in first["loc"]]
    if loc and loc[0] in _MESSAGE_TYPES:
        loc = loc[1:]  # the union's tag, not a field
    loc = [p for p in loc if p not in ("str", "VoiceRef")]  # union branches pydantic names in the path
    where = ".".join(loc) or None
    code = _ERROR_CODES.get(first["type"], "bad_message")
    if code == "unsupported_format" and where not in ("format", "response_format", "stream_format"):
        code = "bad_value"  # a literal that is not a format: sample_rate
    return ProtocolError(code, f"{where or 'message'}: {first['msg']}", param=where)


def check_text(text: str, param: str = "text") -> None:
    """`tts.text.check_characters` as a typed error (bad_text naming ``param``): the same refusal, in the same
    words, as every other front end's. Example: "Hello\\u0000 world." -> bad_text "... U+0000 at offset 5 ..."."""
    try:
        check_characters(text, param)
    except TextError as err:
        raise ProtocolError("bad_text", str(err), param) from None


def check_whole_text(text: str, limit: int, param: str = "input") -> None:
    """`tts.text.validate_text` as a typed error: a whole text (a speech request's input, a Wyoming synthesize)
    refused before anything is spoken, text_too_long past ``limit``, else bad_text."""
    try:
        validate_text(text, limit, param)
    except TextError as err:
        code = "text_too_long" if len(text) > limit else "bad_text"
        raise ProtocolError(code, str(err), param) from None
