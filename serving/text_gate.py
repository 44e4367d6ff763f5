"""Audio held back until an utterance's text has something to say (docs/protocol.md, Text that is refused).

Text that streams in (a WebSocket utterance, a Wyoming synthesize-start) is spoken before all of it has come,
and the engine speaks its pauses ("?", "...") as silence. Text with nothing speakable in it ("?", "$", an emoji,
a zero-width space) must get `bad_text` before any audio, as a whole text does (`tts.text.validate_text`). So the
audio pump waits (`SpeakableGate.wait`) until a piece of text is speakable (`tts.text.has_speakable`, each piece
read with the last SPEAKABLE_CONTEXT characters before it: "$" then "5" is "five dollars") or the text has
ended; meanwhile the engine's queue fills and its generation pauses, so nothing is held without bound. Each
piece costs what its own length does: a client sending "?" a character at a time costs no more than one text.
Used from one event loop.
"""

from __future__ import annotations

import asyncio

from tts.text import SPEAKABLE_CONTEXT, TextError, has_speakable


class SpeakableGate:
    """`add` each text piece, `end` when the text ends; `await wait()` -> whether anything speakable came
    (False: the text ended first). ``text_seen``: whether any non-blank text came at all.
    Example: add("?"), add(" "), end() -> wait() is False; add("$"), add("5") -> wait() is True at once."""

    def __init__(self):
        self.speakable = self.text_seen = False
        self._tail = ""
        self._open = asyncio.Event()

    def add(self, text: str) -> None:
        if self.speakable:
            return
        self.text_seen = self.text_seen or bool(text.strip())
        try:
            speakable = has_speakable(self._tail + text)
        except TextError:  # markup cut in two by the pieces, or a tail cut mid-tag: the text stream itself
            speakable = False  # reports markup that is truly malformed, as a typed error
        if speakable:
            self.speakable = True
            self._open.set()
        self._tail = (self._tail + text)[-SPEAKABLE_CONTEXT:]

    def end(self) -> None:
        self._open.set()

    async def wait(self) -> bool:
        await self._open.wait()
        return self.speakable
