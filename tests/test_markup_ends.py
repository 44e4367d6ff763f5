"""Every text ends: generated texts with markup (closing tags at the end, nested, unclosed, stray ``<``, ``>``
and ``&``) through `synthesize_stream()`, the WebSocket and ``POST /v1/audio/speech`` always end in audio and
``done`` (a 200 with audio over HTTP) or a typed error, within a deadline. The tiny engine and the real server
on loopback.

Before the fix, any text whose last token was a closing tag ("Hello there.</speak>") never ended: the text
front end kept the tag as unread text, so the stream was never told its text had ended.

CI draws a few examples; more is one variable away:

    TTS_MARKUP_EXAMPLES=500 python -m pytest -q tests/test_markup_ends.py
"""

from __future__ import annotations

import asyncio
import json
import os
import threading

import httpx2 as httpx
import pytest
import websockets
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from tts.api import synthesize_stream
from tts.text import TextError

EXAMPLES = int(os.environ.get("TTS_MARKUP_EXAMPLES", "8"))
MARKUP = settings(
    max_examples=EXAMPLES,
    deadline=None,
    database=None,
    derandomize=EXAMPLES <= 100,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
ENDS_S = 30.0  # an utterance of a few words ends well within this on the tiny engine
ENDING = [
    "<speak>Hello there.</speak>",
    "Hello there.</speak>",
    "Hi.<break time='200ms'/></s></p>",
    "<p><s>One.</s></p>",
    "Tom & Jerry </speak>",
]

WORDS = st.sampled_from(["Hello", "there.", "cat", "5", "Dr.", "ok,", "IBM", "1/2", "x", "é"])
TAGS = st.sampled_from(
    [
        "<speak>",
        "</speak>",
        "<p>",
        "</p>",
        "<s>",
        "</s>",
        "<b>",
        "</b>",
        "<break/>",
        "<break time=\"300ms\"/>",
        "<break strength=\"weak\"/>",
        "<say-as interpret-as=\"characters\">",
        "</say-as>",
        "<sub alias=\"tomato\">",
        "</sub>",
        "<prosody rate=\"fast\">",
        "</prosody>",
        "<phoneme ph=\"k æ t\">cat</phoneme>",
        "<emphasis>",
        "</emphasis>",
        "<",
        ">",
        "&",
        "&amp;",
        "&lt;",
        "<b",
        "</",
        "<unknown a='1'>",
        "[[k æ t]]",
        "<!-- c -->",
    ]
)
PIECES = st.lists(st.one_of(WORDS, TAGS), min_size=1, max_size=8)
SEPARATORS = st.sampled_from(["", " ", "\n"])


@st.composite
def texts(draw) -> str:
    """Words and markup, joined with or without spaces; half of them end with a closing tag."""
    pieces = draw(PIECES)
    text = "".join(p + draw(SEPARATORS) for p in pieces)
    return text + draw(st.sampled_from(["", "</speak>", "</s></p>", "</say-as>"]))


def _in_thread(call, seconds: float = ENDS_S):
    """Run ``call`` in a thread; fail if it does not return within ``seconds`` (a text that never ends)."""
    result: dict = {}

    def run():
        try:
            result["value"] = call()
        except BaseException as err:  # noqa: BLE001  (the test judges it)
            result["error"] = err

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), "the text never ended"
    return result


def _api_ends(engine, text: str) -> None:
    got = _in_thread(lambda: sum(len(chunk) for chunk in synthesize_stream(text, engine=engine, seed=1)))
    if "error" in got:
        assert isinstance(got["error"], (TextError, ValueError)), repr(got["error"])  # typed, not a crash
    else:
        assert got["value"] > 0


async def _socket_ends(url: str, text: str) -> None:
    async with websockets.connect(url) as ws:
        await ws.send(json.dumps({"type": "start", "format": "pcm_s16le"}))
        await ws.send(json.dumps({"type": "text", "text": text}))
        await ws.send(json.dumps({"type": "end"}))
        audio, errors = 0, []
        async with asyncio.timeout(ENDS_S):
            while True:
                message = await ws.recv()
                if isinstance(message, bytes):
                    audio += len(message)
                    continue
                event = json.loads(message)
                if event["type"] == "error":
                    errors.append(event["code"])
                if event["type"] == "done":
                    break
        assert audio > 0 or errors, "done without audio or an error"
        assert set(errors) <= {"bad_text", "text_too_long"}, errors


async def _speech_ends(url: str, text: str) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=ENDS_S) as http:
        response = await http.post("/v1/audio/speech", json={"input": text, "voice": "joe", "response_format": "pcm"})
    if response.status_code == 200:
        assert response.content
    else:
        assert response.status_code == 400 and response.json()["error"]["code"] == "bad_text", response.text


@pytest.mark.parametrize("text", ENDING)
def test_closing_tag_at_the_end_ends_everywhere(tiny_engine, server, text):
    _api_ends(tiny_engine, text)
    asyncio.run(_socket_ends(server.ws_url, text))
    asyncio.run(_speech_ends(server.url, text))


@MARKUP
@given(text=texts())
@example(text="<speak>Hello there.</speak>")
def test_generated_markup_always_ends(tiny_engine, server, text):
    _api_ends(tiny_engine, text)
    asyncio.run(_socket_ends(server.ws_url, text))
    asyncio.run(_speech_ends(server.url, text))
