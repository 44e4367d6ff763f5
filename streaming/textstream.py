"""Incremental text -> phoneme units, for text that arrives in pieces (an LLM's tokens, a socket).

Complete sentences are phonemised as soon as their terminator and a following space arrive. A long run
of words with no terminator is spoken anyway, all but its last two words (which may still be growing),
as a partial sentence: its closing ``$`` and the next piece's opening ``^`` are left out, and a word
space joins them. ``flush``/``end`` phonemise whatever is buffered.

Example: pieces "Hello the", "re. How are", " you" then end ->
  "Hello there. " is complete -> ^ h ə l ˈ o ʊ   ð ɛ ɹ . $ ; "How are you" is spoken at end -> ^ ... $
"""
from __future__ import annotations

import re
import threading

from tts.text import MAX_TEXT_CHARS, SYMBOL_ID, TextError, normalize, phonemize

_SENTENCE_END = re.compile(r"[.!?;:][\"')\]]*\s")
PARTIAL_WORDS = 12


class TextStream:
    def __init__(self, max_chars: int = MAX_TEXT_CHARS):
        self.max_chars = max_chars
        self._buffer, self._chars, self._in_sentence = "", 0, False
        self._final = self._closed = False
        self._lock = threading.Lock()
        self.spoken_any = False

    def push(self, text: str) -> None:
        if not isinstance(text, str):
            raise TextError(f"text must be a string, not {type(text).__name__}")
        with self._lock:
            if self._closed:
                raise TextError("the utterance has ended; start a new one")
            if self._chars + len(text) > self.max_chars:
                raise TextError(f"utterance text would be {self._chars + len(text)} characters; "
                                f"the limit is {self.max_chars}")
            self._chars += len(text)
            self._buffer += text

    def flush(self) -> None:
        with self._lock:
            self._final = True

    def end(self) -> None:
        with self._lock:
            self._final = self._closed = True

    @property
    def ended(self) -> bool:
        return self._closed and not self._buffer and not self._in_sentence

    def take(self) -> tuple[list[int], bool]:
        """Unit ids ready to speak now (possibly none), and whether a flush or the end closed them:
        then nothing more follows them for now, so they are spoken to the last unit."""
        with self._lock:
            buffer, final = self._buffer, self._final
            if final:
                cut = len(buffer)
                self._final = False
            else:
                ends = [m.end() for m in _SENTENCE_END.finditer(buffer)]
                cut = ends[-1] if ends else 0
                if not cut and len(buffer.split()) >= PARTIAL_WORDS:
                    cut = len(buffer.rstrip().rsplit(" ", 2)[0])
            piece, self._buffer = buffer[:cut], buffer[cut:]
            closes = final or bool(_SENTENCE_END.search(piece.rstrip() + " "))
        return self._units(piece, closes), final

    def _units(self, piece: str, closes: bool) -> list[int]:
        sentences = phonemize(normalize(piece)) if piece.strip() else []
        units = [u for s in sentences for u in s]
        if units and self._in_sentence:
            units = [" ", *units[1:]]  # continue the open sentence: no second '^'
        if not units and self._in_sentence and closes:
            units = ["$"]
        if units and not closes:
            units = units[:-1]  # leave the sentence open
            self._in_sentence = True
        elif units:
            self._in_sentence = False
        if units:
            self.spoken_any = True
        return [SYMBOL_ID[u] for u in units]
