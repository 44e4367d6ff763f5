"""Text front end: normalise English text, then phonemise it with espeak-ng.

The phoneme units are espeak-ng IPA code points (the inventory Piper uses), with
``^``/``$`` around every sentence. Every teacher's durations are mapped onto
these units, so one front end serves every voice.
"""
from __future__ import annotations

import re
import unicodedata
from functools import lru_cache


# Index 0 is padding. The order is frozen: model checkpoints index into it.
SYMBOLS = ("_^$ !'(),-.:;?abcdefhijklmnopqrstuvwxyzæçðøħŋœǀǁǂǃɐɑɒɓɔɕɖɗɘəɚɛɜɞɟɠɡɢɣɤɥɦɧɨɪɫɬɭɮɯɰɱɲɳɴɵɶɸ"
           "ɹɺɻɽɾʀʁʂʃʄʈʉʊʋʌʍʎʏʐʑʒʔʕʘʙʛʜʝʟʡʢʲˈˌːˑ˞βθχᵻⱱ0123456789̧̪̯̩̃ʰˤε↓#")
SYMBOL_ID = {s: i for i, s in enumerate(SYMBOLS)}
PAD, BOS, EOS = 0, SYMBOL_ID["^"], SYMBOL_ID["$"]
MAX_TEXT_CHARS = 20_000


class TextError(ValueError):
    """Text that cannot be spoken: empty, nothing speakable, or too long."""


def num2words(number: int, **kwargs) -> str:
    from num2words import num2words as spell  # imported on use: training on the GPU needs only SYMBOLS
    return spell(number, **kwargs)


_ABBREVIATIONS = {
    "mr": "mister", "mrs": "missus", "ms": "miz", "dr": "doctor", "st": "saint", "jr": "junior",
    "sr": "senior", "prof": "professor", "gen": "general", "col": "colonel", "capt": "captain",
    "lt": "lieutenant", "sgt": "sergeant", "gov": "governor", "rev": "reverend", "hon": "honorable",
    "vs": "versus", "etc": "et cetera", "no": "number", "approx": "approximately", "dept": "department",
    "jan": "january", "feb": "february", "mar": "march", "apr": "april", "aug": "august",
    "sept": "september", "oct": "october", "nov": "november", "dec": "december",
}
_MONTHS = ["january", "february", "march", "april", "may", "june", "july", "august",
           "september", "october", "november", "december"]
_CURRENCY = {"$": ("dollar", "dollars", "cent", "cents"), "£": ("pound", "pounds", "penny", "pence"),
             "€": ("euro", "euros", "cent", "cents")}
_PUNCT_MAP = str.maketrans({"—": ", ", "–": ", ", "‘": "'", "’": "'", "“": '"', "”": '"', "…": ".", "&": " and ",
                            "%": " percent", "+": " plus ", "=": " equals ", "@": " at ", "/": " slash "})


def _money(match: re.Match) -> str:
    unit, units, sub, subs = _CURRENCY[match.group(1)]
    whole = int(match.group(2).replace(",", ""))
    cents = int((match.group(3) or "0").ljust(2, "0")[:2])
    parts = []
    if whole or not cents:
        parts.append(f"{num2words(whole)} {unit if whole == 1 else units}")
    if cents:
        parts.append(f"{num2words(cents)} {sub if cents == 1 else subs}")
    return " and ".join(parts)


def _date(match: re.Match) -> str:
    month, day, year = int(match.group(1)), int(match.group(2)), int(match.group(3))
    if not (1 <= month <= 12 and 1 <= day <= 31):
        return match.group(0).replace("/", " ")
    return f"{_MONTHS[month - 1]} {num2words(day, to='ordinal')}, {num2words(year, to='year')}"


def _clock(match: re.Match) -> str:
    hours, minutes = int(match.group(1)), int(match.group(2))
    if minutes == 0:
        return f"{num2words(hours)} o'clock"
    return f"{num2words(hours)} {'oh ' if minutes < 10 else ''}{num2words(minutes)}"


def _number(match: re.Match) -> str:
    text = match.group(0).replace(",", "")
    if re.fullmatch(r"\d+(st|nd|rd|th)", text):
        return num2words(int(text[:-2]), to="ordinal")
    if "," not in match.group(0) and re.fullmatch(r"1[1-9]\d\d|20\d\d", text):
        return num2words(int(text), to="year")
    if "." in text:
        whole, frac = text.split(".", 1)
        return f"{num2words(int(whole or 0))} point {' '.join(num2words(int(d)) for d in frac)}"
    return num2words(int(text))


def normalize(text: str) -> str:
    """Spell out what a reader would say: ``"Dr. Li paid $3.50 on 3/4/2021"`` ->
    ``"doctor Li paid three dollars and fifty cents on march fourth, twenty twenty-one"``."""
    text = unicodedata.normalize("NFKC", text)
    text = re.sub(r"([$£€])\s?(\d[\d,]*)(?:\.(\d{1,2}))?", _money, text)
    text = re.sub(r"\b(\d{1,2})/(\d{1,2})/(\d{4})\b", _date, text)
    text = re.sub(r"\b(\d{1,2}):(\d\d)\b", _clock, text).translate(_PUNCT_MAP)
    text = re.sub(r"\b(\d+)-(\d+)\b", r"\1 to \2", text)
    text = re.sub(r"\b([A-Za-z]+)\.(?=\s|$)",
                  lambda m: _ABBREVIATIONS.get(m.group(1).lower(), m.group(0)) if m.group(1).lower() in _ABBREVIATIONS
                  and m.group(1)[0].isupper() else m.group(0), text)
    text = re.sub(r"\d[\d,]*(?:\.\d+)?(?:st|nd|rd|th)?", _number, text)
    text = re.sub(r"[\"()\[\]{}*_#<>|~^\\]", " ", text)
    text = re.sub(r"\s+", " ", text).strip()
    return text


@lru_cache(maxsize=1)
def _espeak():
    from piper.phonemize_espeak import EspeakPhonemizer
    return EspeakPhonemizer()


def phonemize(text: str) -> list[list[str]]:
    """Normalised text -> sentences of phoneme units, each wrapped in ``^ ... $``.

    >>> phonemize("Hi. Go!")   # doctest: +SKIP
    [['^', 'h', 'ˈ', 'a', 'ɪ', '.', '$'], ['^', 'ɡ', 'ˈ', 'o', 'ʊ', '!', '$']]
    """
    sentences = []
    for units in _espeak().phonemize("en-us", text):
        units = [u for u in units if u in SYMBOL_ID and u not in "^$_"]
        while units and units[-1] == " ":
            units.pop()
        if any(u.isalpha() or u in "ɐɑɒɔəɚɛɜɪʊʌ" for u in units):
            sentences.append(["^", *units, "$"])
    return sentences


def to_ids(units: list[str]) -> list[int]:
    return [SYMBOL_ID[u] for u in units]


def text_to_sentences(text: str) -> list[list[str]]:
    """Validated front end: raw text -> phoneme sentences. Raises TextError."""
    if not isinstance(text, str):
        raise TextError(f"text must be a string, not {type(text).__name__}")
    if len(text) > MAX_TEXT_CHARS:
        raise TextError(f"text is {len(text)} characters; the limit is {MAX_TEXT_CHARS}")
    if not text.strip():
        raise TextError("text is empty")
    sentences = phonemize(normalize(text))
    if not sentences:
        raise TextError("text has nothing speakable in it")
    return sentences
