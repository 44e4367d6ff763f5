"""Text front end: normalise English text (`tts.normalize`), then phonemise it with espeak-ng.

The phoneme units are espeak-ng IPA code points (the inventory Piper uses), with
``^``/``$`` around every sentence. Every teacher's durations are mapped onto
these units, so one front end serves every voice.

`sentence_units` phonemises one sentence of tokens and says which token each unit speaks, so
word timings refer to what the user wrote and incremental text can be spoken word by word.
"""

from __future__ import annotations

import re
import threading
import unicodedata
from functools import lru_cache

from tts.normalize import TextError, Token, end_mark, join_spoken, normalize, speak, split_sentences, tokenize
from tts.symbols import SYMBOL_ID, SYMBOLS

__all__ = [
    "SYMBOLS",
    "SYMBOL_ID",
    "MAX_TEXT_CHARS",
    "TextError",
    "normalize",
    "phonemize",
    "text_to_sentences",
    "sentence_units",
    "to_ids",
    "check_characters",
    "has_speakable",
    "validate_text",
]


PAD, BOS, EOS = 0, SYMBOL_ID["^"], SYMBOL_ID["$"]
MAX_TEXT_CHARS = 20_000


ESPEAK_VOICE = "en-us"
_espeak_lock = threading.Lock()  # espeak-ng is one state per process, not thread-safe


@lru_cache(maxsize=1)
def _espeak():
    """Piper's espeak-ng binding, with our voice set once: setting it costs about as much as phonemising a
    sentence, and the voice stays set (a later `initialize`, as a Piper voice's phonemiser does, keeps it;
    Piper sets its own voice before each call, and every voice here speaks en-us)."""
    from piper import espeakbridge
    from piper.phonemize_espeak import ESPEAK_DATA_DIR

    espeakbridge.initialize(str(ESPEAK_DATA_DIR))
    espeakbridge.set_voice(ESPEAK_VOICE)
    return espeakbridge


def _espeak_units(text: str) -> list[list[str]]:
    """espeak's sentences of ``text`` as units (no ``^``/``$``), trailing spaces removed; the units are
    what Piper's `EspeakPhonemizer.phonemize` gives (clause text, its terminator, a space after a clause
    break, code points decomposed). Example: "Hi, you." -> [['h', 'ˈ', 'a', 'ɪ', ',', ' ', 'j', 'u', 'ː', '.']]"""
    text = _DOTS.sub(".", text)  # espeak keeps a trailing ".." and says "dot" in its next call
    espeak = _espeak()
    with _espeak_lock:
        clauses = espeak.get_phonemes(text)
    sentences, sentence = [], []
    for phonemes, terminator, end in clauses:
        phonemes = _LANGUAGE_FLAG.sub("", phonemes) + terminator + (" " if terminator in ",:;" and terminator else "")
        sentence += [u for u in unicodedata.normalize("NFD", phonemes) if u in SYMBOL_ID and u not in "^$_"]
        if end:
            sentences.append(sentence)
            sentence = []
    if sentence:
        sentences.append(sentence)
    for units in sentences:
        while units and units[-1] == " ":
            units.pop()
    return sentences


_DOTS = re.compile(r"\.(?:\s*\.)+")
_LANGUAGE_FLAG = re.compile(r"\([^)]+\)")  # "(fr)" around words espeak reads in another language


def _speakable(units: list[str]) -> bool:
    return any(u.isalpha() or u in "ɐɑɒɔəɚɛɜɪʊʌ" for u in units)


def phonemize(text: str) -> list[list[str]]:
    """Normalised text -> sentences of phoneme units, each wrapped in ``^ ... $`` (espeak's sentences).

    >>> phonemize("Hi. Go!")   # doctest: +SKIP
    [['^', 'h', 'ˈ', 'a', 'ɪ', '.', '$'], ['^', 'ɡ', 'ˈ', 'o', 'ʊ', '!', '$']]
    """
    return [["^", *units, "$"] for units in _espeak_units(text) if _speakable(units)]


# A pause is spoken as commas, which the model pauses on: with none, two words are about PAUSE_BASE_MS
# apart (a word gap and a stop's closure); each comma adds about PAUSE_COMMA_MS. Measured on the shipped
# model with `python -m bench.incremental --pauses` (silence for 0/250/500/1000/2000 ms asked).
PAUSE_BASE_MS, PAUSE_COMMA_MS = 280, 240
_GAP = set(" ,.;:!?")  # units between words


def pause_units(ms: int) -> list[str]:
    """Units for a pause of about ``ms`` milliseconds between two words. Example: 1000 -> ", , ," (three
    commas: 280 + 3 * 240 = 1000 ms); 250 -> none (a word gap is already about that long)."""
    commas = max(0, round((ms - PAUSE_BASE_MS) / PAUSE_COMMA_MS))
    return [",", " "] * commas


@lru_cache(maxsize=65536)
def _word_units(word: str) -> str:
    """One spoken word's units on its own: the reference the sentence's units are aligned to."""
    return "".join(u for sentence in _espeak_units(word) for u in sentence if u not in _GAP)


def _run_units(run: list[tuple[int, str]]) -> tuple[list[str], list[int]]:
    """Units of consecutive words phonemised together (espeak's clause context), and the token of each unit.

    Owners come from aligning the units with each word's units on its own (longest common subsequence), so words
    that espeak joins ("on the" -> ɔnðə) are still told apart. -1: spaces and punctuation.
    Example: [(4, "on"), (5, "the")] -> units ɔ n ð ə, owners 4 4 5 5."""
    from rapidfuzz.distance import Indel

    text = join_spoken(said for _, said in run)
    sentences = [s for s in _espeak_units(text) if s]
    units = [u for k, s in enumerate(sentences) for u in ([" "] if k else []) + s]
    reference, ref_owner = [], []
    for index, said in run:
        for word in said.split():
            ref = _word_units(word)
            reference.append(ref + " ")
            ref_owner += [index] * len(ref) + [-1]
    owners = [-1] * len(units)
    # insertions and deletions only (a longest common subsequence): equal units pair up, others attach
    for tag, a0, a1, b0, b1 in Indel.opcodes("".join(reference), "".join(units)):
        if tag == "equal":
            owners[b0:b1] = ref_owner[a0:a1]
        elif tag == "insert" and a0 < len(ref_owner):  # units the words alone lack: the word they stand in
            owners[b0:b1] = [ref_owner[a0]] * (b1 - b0)
    last = run[0][0] if run else -1
    for k, unit in enumerate(units):  # gaps own nothing; units still unowned belong to the word before
        if unit in _GAP:
            owners[k] = -1
        else:
            owners[k] = last = max(owners[k], last)
    return units, owners


def sentence_units(tokens: list[Token], spoken: list[str], closed: bool) -> tuple[list[str], list[int]]:
    """One sentence's units (``^`` first, ``$`` last if ``closed``) and, per unit, the index of the token
    it speaks (-1: ``^``, ``$``, spaces and punctuation). Words are phonemised a run at a time; inline
    phonemes and pauses go in as they are."""
    units, owners = ["^"], [-1]
    run: list[tuple[int, str]] = []

    def add(more: list[str], more_owners: list[int]) -> None:
        if more and len(units) > 1 and units[-1] != " " and more[0] != " ":
            units.append(" ")
            owners.append(-1)
        units.extend(more)
        owners.extend(more_owners)

    for index, (token, said) in enumerate(zip(tokens, spoken)):
        if token.kind == "word" and not token.phonemes:
            if said:
                run.append((index, said))
            continue
        if run:
            add(*_run_units(run))
            run = []
        more = list(token.phonemes) if token.phonemes else pause_units(token.pause_ms)
        add(more, [index] * len(more))
    if run:
        add(*_run_units(run))
    while units[-1] == " ":
        units.pop()
        owners.pop()
    mark = end_mark(tokens)
    if closed and mark and units[-1] not in ".!?":  # the sentence ends after markup: "... [[ˈoʊ]]."
        units.append(mark)
        owners.append(-1)
    if closed:
        units.append("$")
        owners.append(-1)
    return units, owners


def text_sentences(text: str) -> list[tuple[list[Token], list[str], list[int]]]:
    """Raw text -> per sentence: its tokens, units (``^ ... $``) and each unit's token."""
    tokens = tokenize(text)
    result = []
    for start, stop, _ in split_sentences(tokens, final=True):
        sentence = tokens[start:stop]
        units, owners = sentence_units(sentence, speak(sentence), closed=True)
        if _speakable(units):
            result.append((sentence, units, owners))
    return result


# C0 controls but tab, newline and carriage return; DEL; C1 controls; lone surrogates (JSON can carry them).
_FORBIDDEN = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f\ud800-\udfff]")
SPEAKABLE_CONTEXT = 32  # characters of earlier text a new piece is read with ("$" then "5": "five dollars")


def check_characters(text: str, what: str = "text") -> None:
    """Refuse control characters (TextError): they are never speech, and an escape or a NUL in an LLM's output is
    a bug upstream that should be seen, not silently dropped. Tab, newline and carriage return are spaces. Every
    front end gets this through the engine's `Stream.push_text`. Example: "Hello\\u0000 world." -> "text contains
    the control character U+0000 at offset 5; ..."."""
    if found := _FORBIDDEN.search(text):
        raise TextError(
            f"{what} contains the control character U+{ord(found.group()):04X} at offset "
            f"{found.start()}; only tab, newline and carriage return are allowed"
        )


def has_speakable(text: str) -> bool:
    """Whether the normaliser finds a word to say in ``text`` (a letter or a digit in what it would speak),
    sentence by sentence, stopping at the first: about what the first sentence costs. Examples: "?", "...",
    "$", an emoji, a zero-width space -> False; "$5" ("five dollars"), "Hi ?" -> True."""
    tokens = tokenize(text)
    for start, stop, _ in split_sentences(tokens, final=True):
        if any(ch.isalnum() for word in speak(tokens[start:stop]) for ch in word):
            return True
    return False


def validate_text(text: str, limit: int = MAX_TEXT_CHARS, what: str = "text") -> None:
    """The one check of a whole text, before anything is spoken, on every front end (the WebSocket, HTTP,
    Wyoming, the Python API, the command line): a string, not over ``limit`` characters, no control character,
    not empty, something speakable. Raises TextError."""
    if not isinstance(text, str):
        raise TextError(f"{what} must be a string, not {type(text).__name__}")
    if len(text) > limit:
        raise TextError(f"{what} is {len(text)} characters; the limit is {limit}")
    check_characters(text, what)
    if not text.strip():
        raise TextError(f"{what} is empty")
    if not has_speakable(text):
        raise TextError(f"{what} has nothing speakable in it")


def to_ids(units: list[str]) -> list[int]:
    return [SYMBOL_ID[u] for u in units]


def text_to_sentences(text: str) -> list[list[str]]:
    """Validated front end: raw text -> phoneme sentences. Raises TextError."""
    validate_text(text)
    sentences = [units for _, units, _ in text_sentences(text)]
    if not sentences:
        raise TextError("text has nothing speakable in it")
    return sentences
