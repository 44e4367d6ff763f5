"""The WebSocket start message's per-request options, validated and carried to the engine stream."""

import asyncio
import json

import pytest
import websockets
from pydantic import ValidationError

from serving.protocol import CLIENT_MESSAGE, validation_error

SLOW_WORDS = [w + " " for w in "The birch canoe slid on the".split()]  # 2.5 words/s: slower than speech


def test_start_holds_by_default_and_hold_takes_only_a_boolean():
    assert CLIENT_MESSAGE.validate_json('{"type": "start"}').hold is True
    assert CLIENT_MESSAGE.validate_json('{"type": "start", "hold": false}').hold is False
    with pytest.raises(ValidationError) as err:
        CLIENT_MESSAGE.validate_json('{"type": "start", "hold": "no"}')
    assert validation_error(err.value).param == "hold"


async def _audio_before_end(url: str, **start) -> bool:
    """Send SLOW_WORDS 0.4 s apart; whether audio came before the end was sent (waiting up to 30 s for it
    after the last word, or 1 s when ``hold`` is on: a held start waits for text, not for time). The utterance
    is then ended and read to its done."""
    async with websockets.connect(url) as ws:
        await ws.send(json.dumps({"type": "start", **start}))
        assert json.loads(await ws.recv())["type"] == "ready"
        for word in SLOW_WORDS:
            await ws.send(json.dumps({"type": "text", "text": word}))
            await asyncio.sleep(0.4)
        try:
            async with asyncio.timeout(1 if start.get("hold", True) else 30):
                early = isinstance(await ws.recv(), bytes)
        except TimeoutError:
            early = False
        await ws.send(json.dumps({"type": "end"}))
        async with asyncio.timeout(60):
            while isinstance(message := await ws.recv(), bytes):
                pass
        assert json.loads(message)["type"] == "done"
        return early


def test_hold_false_speaks_slow_text_before_it_ends_and_the_default_holds_it(server):
    """Text slower than speech: the default start hold waits for more words (here, for the end); hold false
    hands the words to the engine as they come, which starts speaking before the end."""
    assert asyncio.run(_audio_before_end(server.ws_url, hold=False))
    assert not asyncio.run(_audio_before_end(server.ws_url))
