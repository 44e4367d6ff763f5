"""SSML elements beyond phonemes and breaks: what ``<say-as>``, ``<sub>``, ``<prosody>``, ``<p>``/``<s>`` and
``<break strength>`` say. `tts.normalize.tokenize` finds the elements; this module turns each into its spoken
words (or a pause, or a rate) and refuses malformed ones with `MarkupError` (a `TextError` there).

    <say-as interpret-as="characters">cat</say-as>     see ay tee     (also "spell-out"; digits are named)
    <say-as interpret-as="cardinal">1234</say-as>      one thousand two hundred thirty-four
    <say-as interpret-as="ordinal">3</say-as>          third          ("3rd" too)
    <say-as interpret-as="digits">1234</say-as>        one two three four
    <say-as interpret-as="date" format="dmy">4/3/2024</say-as>   March fourth, twenty twenty-four
        format: any order of d, m, y (default "mdy"; "ymd" for 2024-03-04); parts split at "/", "-" or "."
    <say-as interpret-as="time">15:30</say-as>         fifteen thirty  ("3:45pm": three forty-five P.M.)
    <say-as interpret-as="telephone">555-123-4567</say-as>   five five five, one two three, four five six seven
    <sub alias="tomato">Zorblax</sub>                  tomato (the word timings still show "Zorblax")
    <prosody rate="slow">...</prosody>                 x-slow 0.5, slow 0.75, medium 1, fast 1.25, x-fast 1.5,
                                                       "80%" 0.8, "1.2" 1.2; the result 0.25 to 4 (the engine's range)
    <p>, <s>                                           their end ends the sentence (a sentence's pause follows)
    <break strength="weak"/>                           none 0, x-weak 100, weak 250, medium 500, strong 750,
                                                       x-strong 1000 ms; or time="300ms" / "1.5s" (at most 10 s)
"""

from __future__ import annotations

import re
from types import SimpleNamespace

from tts.normalize_rules import Context, _date, _phone, _time, cardinal, digits, ordinal, year
from tts.normalize_tables import LETTER_NAMES, MONTHS

# An element with content, found whole (the tokeniser waits while one is open): said as one word
ELEMENTS = r"<(?P<el>say-as|sub)\b(?P<el_attrs>[^<>]*)>(?P<el_inner>[^<>]*)</(?P=el)\s*>"
OPEN_ELEMENT = r"<(?:say-as|sub)\b(?![\s\S]*</(?:say-as|sub)\s*>)"  # one still open (text still arriving)
NEEDS_CLOSING = {"say-as", "sub", "phoneme"}  # a lone start or end tag of these is malformed
SENTENCE_TAGS = {"p", "s"}  # their start or end ends the sentence before it
PAUSES_MS = {"none": 0, "x-weak": 100, "weak": 250, "medium": 500, "strong": 750, "x-strong": 1000}
RATES = {"x-slow": 0.5, "slow": 0.75, "medium": 1.0, "default": 1.0, "fast": 1.25, "x-fast": 1.5}
SPEED_RANGE = (0.25, 4.0)  # `Engine.open`'s speed range
MAX_PAUSE_MS = 10_000


class MarkupError(ValueError):
    """Malformed or unsupported SSML; the message names the element."""


def attribute(attrs: str, name: str) -> str | None:
    """The value of ``name="..."`` (or single quotes) in a tag's attributes, else None."""
    found = re.search(rf"(?:^|\s){re.escape(name)}\s*=\s*([\"'])(.*?)\1", attrs, re.S)
    return found.group(2) if found else None


def element_words(name: str, attrs: str, inner: str) -> str:
    """What a ``<say-as>`` or ``<sub>`` element says."""
    element = f"<{name}{attrs}>{inner}</{name}>"
    if name == "sub":
        alias = attribute(attrs, "alias")
        if not alias or not alias.strip():
            raise MarkupError(f"{element}: <sub> needs a non-empty alias")
        return " ".join(alias.split())
    kind = attribute(attrs, "interpret-as")
    read = _SAY_AS.get(kind or "")
    if read is None:
        raise MarkupError(f"{element}: interpret-as must be one of {sorted(_SAY_AS)}, not {kind!r}")
    said = read(inner.strip(), attribute(attrs, "format"))
    if not said:
        raise MarkupError(f"{element}: {inner.strip()!r} cannot be read as {kind}")
    return said


def _characters(text: str, _format) -> str | None:
    names = [LETTER_NAMES.get(c.lower()) or (digits(c) if c.isdigit() else None) for c in text if not c.isspace()]
    said = [name for name in names if name is not None]
    return " ".join(said) if said and len(said) == len(names) else None


def _cardinal(text: str, _format) -> str | None:
    number = re.fullmatch(r"[-+]?\d{1,3}(?:,\d{3})+|[-+]?\d+", text)
    return cardinal(int(text.replace(",", ""))) if number else None


def _ordinal(text: str, _format) -> str | None:
    number = re.fullmatch(r"(\d+)(?:st|nd|rd|th)?", text, re.I)
    return ordinal(int(number.group(1))) if number else None


def _digits(text: str, _format) -> str | None:
    return digits(text) if re.fullmatch(r"[\d\s,.-]+", text) and any(c.isdigit() for c in text) else None


def _date_words(text: str, form: str | None) -> str | None:
    """A date's parts in ``form``'s order ("mdy" unless given); the missing parts are not said."""
    form = (form or ("ymd" if re.fullmatch(r"\d{4}-\d\d?-\d\d?", text) else "mdy")).lower()
    parts = re.split(r"[-/.]", text)
    if (
        not re.fullmatch(r"[dmy]{1,3}", form)
        or len(set(form)) != len(form)
        or len(parts) != len(form)
        or not all(p.isdigit() for p in parts)
    ):
        return None
    got = dict(zip(form, map(int, parts)))
    if "m" in got and "d" in got and "y" in got:
        return _rule(_date, f"{got['y']:04d}-{got['m']:02d}-{got['d']:02d}")
    words = []
    if "m" in got:
        if not 1 <= got["m"] <= 12:
            return None
        words.append(MONTHS[got["m"] - 1])
    if "d" in got:
        words.append(ordinal(got["d"]) if 1 <= got["d"] <= 31 else "")
    said = " ".join(words)
    if "y" in got:
        said = f"{said}, {year(got['y'])}" if said else year(got["y"])
    return None if "" in words else said


def _time_words(text: str, _format) -> str | None:
    return _rule(_time, re.sub(r"\s+(?=[ap]\.?m\.?$)", "", text, flags=re.I))


def _telephone(text: str, _format) -> str | None:
    said = _rule(_phone, text)
    if said:
        return said
    groups = re.findall(r"\d+", text)
    if not groups or not re.fullmatch(r"\+?[\d\s().-]+", text):
        return None
    return ("plus " if text.startswith("+") else "") + ", ".join(digits(g, "oh") for g in groups)


def _rule(rule, text: str) -> str | None:
    """One of the normaliser's rules read over ``text`` as a sentence of one word."""
    said = rule(Context([SimpleNamespace(kind="word", text=text)]), 0)
    return " ".join(said) if said else None


_SAY_AS = {
    "characters": _characters,
    "spell-out": _characters,
    "cardinal": _cardinal,
    "number": _cardinal,
    "ordinal": _ordinal,
    "digits": _digits,
    "date": _date_words,
    "time": _time_words,
    "telephone": _telephone,
}


def pause_ms(attrs: str) -> int:
    """A ``<break>``'s pause: ``time="500ms"``/``"1.5s"`` (at most 10 s), else ``strength`` (default medium)."""
    time = attribute(attrs, "time")
    if time is not None:
        value = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(ms|s)\s*", time)
        if not value:
            raise MarkupError(f"<break{attrs}>: time must be like \"500ms\" or \"1.5s\", not {time!r}")
        return int(min(float(value.group(1)) * (1 if value.group(2) == "ms" else 1000), MAX_PAUSE_MS))
    strength = attribute(attrs, "strength")
    if strength is not None and strength not in PAUSES_MS:
        raise MarkupError(f"<break{attrs}>: strength must be one of {list(PAUSES_MS)}, not {strength!r}")
    return PAUSES_MS[strength or "medium"]


def prosody_rate(attrs: str) -> float | None:
    """A ``<prosody>`` start tag's rate as a speed factor (None: no rate given). Example: "80%" -> 0.8."""
    rate = attribute(attrs, "rate")
    if rate is None:
        return None
    value = RATES.get(rate.strip())
    percent = re.fullmatch(r"\s*\+?(\d+(?:\.\d+)?)\s*(%?)\s*", rate)
    if value is None and percent:
        value = float(percent.group(1)) / (100 if percent.group(2) else 1)
    if value is None or not SPEED_RANGE[0] <= value <= SPEED_RANGE[1]:
        raise MarkupError(
            f"<prosody{attrs}>: rate must be one of {list(RATES)}, a percentage or a factor from "
            f"{SPEED_RANGE[0]} to {SPEED_RANGE[1]}, not {rate!r}"
        )
    return value
