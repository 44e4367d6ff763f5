"""Pronunciation lexicons (`tts.lexicon`): an entry changes how its word is said in every interface. Seeded speech
is repeatable, so "said as the entry says" is checked exactly: the text with the entry gives the same audio, bit
for bit, as the text written with the entry's pronunciation, and other audio than without it. The tiny engine
behind the real server on loopback; `tts say` as a subprocess on the shipped voices."""

from __future__ import annotations

import asyncio
import base64
import json
import subprocess
import sys

import httpx2 as httpx
import numpy as np
import pytest
import soundfile as sf
import websockets

from tts.api import synthesize, synthesize_stream
from tts.lexicon import Lexicon, LexiconError
from tts.normalize import tokenize
from tts.text import TextError

ENTRY = {"Zorblax": "tomato"}
TEXT, RESPELT = "I like Zorblax.", "I like tomato."


def test_case_rules_and_punctuation():
    lexicon = Lexicon.of({"nginx": "engine x", "US": "you ess", "Zorblax": "/z ˈɔː ɹ b l æ k s/"})
    said = {t.text: t.said or t.phonemes for t in lexicon.apply(tokenize("NGINX, Nginx us US (Zorblax) zorblax"))}
    assert said == {
        "NGINX,": "engine x",
        "Nginx": "engine x",
        "us": "",
        "US": "you ess",
        "(Zorblax)": "zˈɔːɹblæks",
        "zorblax": "",
    }
    assert Lexicon.of({"us": "oops"}).merged({"US": "you ess"}).apply(tokenize("US"))[0].said == "you ess"


@pytest.mark.parametrize(
    "entries, names",
    [
        ({"two words": "x"}, "'two words'"),
        ({"x": "/h@llo/"}, "'x'.*@"),
        ({"x": ""}, "'x'"),
        ({"x": "<b>y</b>"}, "'x'"),
        ({"x": 5}, "'x'"),
        ([1], "object"),
    ],
)
def test_bad_entries_are_typed_errors_naming_the_entry(entries, names):
    with pytest.raises(LexiconError, match=names):
        Lexicon.of(entries)
    assert issubclass(LexiconError, TextError)


def test_files_json_and_tsv(tmp_path):
    (tmp_path / "a.json").write_text(json.dumps(ENTRY))
    (tmp_path / "a.tsv").write_text("# names\nZorblax\ttomato\nnginx\t/ˈɛ n dʒ ɪ n ˈɛ k s/\n")
    assert Lexicon.load(tmp_path / "a.json").folded == {} and Lexicon.load(tmp_path / "a.json").exact
    assert len(Lexicon.load(tmp_path / "a.tsv")) == 2
    (tmp_path / "bad.tsv").write_text("Zorblax tomato\n")
    with pytest.raises(LexiconError, match="bad.tsv.*line 1"):
        Lexicon.load(tmp_path / "bad.tsv")


def test_synthesize_stream(tiny_engine):
    with_entry = synthesize(TEXT, engine=tiny_engine, seed=7, lexicon=ENTRY)
    assert np.array_equal(with_entry, synthesize(RESPELT, engine=tiny_engine, seed=7))
    assert not np.array_equal(with_entry, synthesize(TEXT, engine=tiny_engine, seed=7))
    ipa = synthesize(TEXT, engine=tiny_engine, seed=7, lexicon={"zorblax": "/t ə m ˈeɪ t oʊ/"})
    assert np.array_equal(ipa, synthesize("I like [[t ə m ˈeɪ t oʊ]].", engine=tiny_engine, seed=7))
    words = [w["word"] for c in synthesize_stream(TEXT, engine=tiny_engine, seed=7, lexicon=ENTRY) for w in c.words]
    assert words == ["I", "like", "Zorblax."]  # timings show what was written
    with pytest.raises(LexiconError, match="'x'"):
        synthesize(TEXT, engine=tiny_engine, lexicon={"x": "/h@llo/"})


async def _socket_audio(url: str, text: str, **start) -> bytes | dict:
    async with websockets.connect(url) as ws:
        await ws.send(json.dumps({"type": "start", "format": "f32le", "seed": 7, "context_id": "a", **start}))
        await ws.send(json.dumps({"type": "text", "text": text, "context_id": "a"}))
        await ws.send(json.dumps({"type": "end", "context_id": "a"}))
        audio = b""
        async with asyncio.timeout(60):
            while (event := json.loads(await ws.recv()))["type"] != "done":
                if event["type"] == "error":
                    return event
                if event["type"] == "audio":
                    audio += base64.b64decode(event["audio"])
        return audio


def test_websocket_start(server):
    with_entry = asyncio.run(_socket_audio(server.ws_url, TEXT, lexicon=ENTRY))
    assert with_entry == asyncio.run(_socket_audio(server.ws_url, RESPELT))
    assert with_entry != asyncio.run(_socket_audio(server.ws_url, TEXT))
    error = asyncio.run(_socket_audio(server.ws_url, TEXT, lexicon={"Zorblax": "/h@llo/"}))
    assert error["code"] == "bad_value" and "'Zorblax'" in error["message"]


async def _speech(url: str, text: str, **extra) -> httpx.Response:
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        return await http.post(
            "/v1/audio/speech", json={"input": text, "voice": "joe", "response_format": "pcm", "seed": 7, **extra}
        )


def test_openai_endpoint_extra_body(server):
    from openai import OpenAI

    client = OpenAI(base_url=f"{server.url}/v1", api_key="unused")
    speech = client.audio.speech.create(
        model="tts-1", voice="alloy", input=TEXT, response_format="pcm", extra_body={"lexicon": ENTRY, "seed": 7}
    )
    assert speech.content == asyncio.run(_speech(server.url, RESPELT, voice="alloy")).content
    assert speech.content != asyncio.run(_speech(server.url, TEXT, voice="alloy")).content
    refused = asyncio.run(_speech(server.url, TEXT, lexicon={"Zorblax": ""}))
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "lexicon"
    assert "'Zorblax'" in refused.json()["error"]["message"]


def test_server_wide_lexicon_and_a_request_winning_over_it(tiny_engine, make_server):
    served = make_server(tiny_engine, lexicon={"zorblax": "potato"})
    assert asyncio.run(_socket_audio(served.ws_url, TEXT)) == asyncio.run(
        _socket_audio(served.ws_url, "I like potato.")
    )
    assert asyncio.run(_socket_audio(served.ws_url, TEXT, lexicon=ENTRY)) == asyncio.run(
        _socket_audio(served.ws_url, RESPELT)
    )


def test_tts_say_lexicon(tmp_path):
    (tmp_path / "names.tsv").write_text("Zorblax\ttomato\n")

    def say(text, *more):
        out = tmp_path / f"{len(list(tmp_path.iterdir()))}.wav"
        done = subprocess.run(
            [sys.executable, "-m", "tts.cli", "say", text, "--seed", "3", "-q", "-o", str(out), *more],
            capture_output=True,
            timeout=300,
        )
        return done, (sf.read(out)[0] if done.returncode == 0 else None)

    (done, with_entry), (_, respelt) = say(TEXT, "--lexicon", str(tmp_path / "names.tsv")), say(RESPELT)
    assert done.returncode == 0, done.stderr
    assert np.array_equal(with_entry, respelt)
    (tmp_path / "bad.json").write_text(json.dumps({"Zorblax": "/h@llo/"}))
    failed, _ = say(TEXT, "--lexicon", str(tmp_path / "bad.json"))
    assert failed.returncode == 2 and b"'Zorblax'" in failed.stderr


def test_a_moved_stream_keeps_its_lexicon(tiny_engine):
    """A stream's exported state (failover, parking to disk, detach) is plain data that `torch.load(weights_only)`
    reads back, lexicon included."""
    from streaming.parking import pack, unpack
    from streaming.stream import Stream

    stream = tiny_engine.open("joe", seed=7)
    try:
        stream.text.lexicon = Lexicon.of({"Zorblax": "tomato", "nginx": "/ˈɛ n dʒ ɪ n/"})
        host, _, _ = unpack(pack({"stream": stream.export_state()}, {}, [], "w"), "w")
        moved = Stream.from_state(tiny_engine, host["stream"], [])
        assert moved.text.lexicon == stream.text.lexicon and moved.gain_db == stream.gain_db
    finally:
        stream.cancel()
