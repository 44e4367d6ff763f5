"""Written English -> the words a reader says aloud, token by token, so every word keeps its origin.

Text is split at whitespace into tokens (what the user wrote, kept for word timings). Each token gets a
spoken form, looking at its neighbours where English needs them ("$5 million", "10 am", "Chapter IV",
"St. Mark St.", "March 4, 2024"). The facts live in `tts.normalize_tables`; number words come from
num2words. Examples (``normalize``):

    2024-03-04 -> March fourth, twenty twenty-four      3:45pm -> three forty-five P.M.
    1/2 cup -> one half cup                           555-123-4567 -> five five five, one two three, four five six seven
    5kg -> five kilograms      72°F -> seventy-two degrees Fahrenheit      -3 -> minus three
    1990s -> nineteen nineties     2.0.1 -> two point zero point one     $5M -> five million dollars
    St. Mark St. -> saint Mark street     https://example.com/docs -> example dot com slash docs
    e.g. -> for example     U.S. -> U.S.     Chapter IV -> chapter four     Henry VIII -> Henry the eighth

Markup (the user's control; spaces inside ``[[...]]`` are ignored):

    [[h ə l ˈoʊ]]                              these phonemes (espeak IPA, as `tts.text.SYMBOLS`) as one word
    <phoneme ph="h ə l ˈoʊ">hello</phoneme>    SSML: the word "hello", spoken with these phonemes
    <break time="500ms"/>  <break time="1s"/>  a pause (also ``<break/>``: a medium pause; ``strength="weak"``)
    <say-as interpret-as="characters">cat</say-as>, <sub alias="tomato">Zorblax</sub>, <p>, <s>, <prosody>:
                                               `tts.ssml` says what they say; malformed ones are a TextError
    <speak>...</speak> and other tags          dropped; their text is read

Sentences end at ``.``, ``!``, ``?`` or a blank line, not after a title ("Dr. Li"), a mid-sentence
abbreviation ("e.g.", "No. 5"), an initial before a name ("J. Smith"), a decimal or a URL; ``;`` and ``:``
are clause breaks inside a sentence. Whether a token ends its sentence can depend on the next one, so
`sentence_end` may answer "not known yet" for the last token of a text that is still arriving.
"""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass, replace

from tts.normalize_rules import Context, clean, first_rule, split_token
from tts.normalize_tables import BEFORE_NUMBER, CURRENCY_CODES, MONTH_OF, NONFINAL, TITLES
from tts.ssml import (
    ELEMENTS,
    NEEDS_CLOSING,
    OPEN_ELEMENT,
    SENTENCE_TAGS,
    MarkupError,
    element_words,
    pause_ms,
    prosody_rate,
)
from tts.symbols import SYMBOL_ID  # the unit inventory is the phonemiser's fact


class TextError(ValueError):
    """Text that cannot be spoken: empty, nothing speakable, bad markup, or too long."""


@dataclass(frozen=True)
class Token:
    """One whitespace-separated word as written, or one markup element."""

    text: str
    start: int  # character offsets in the text it came from
    end: int
    kind: str = "word"  # "word", "phonemes" (a pronunciation override) or "pause"
    phonemes: str = ""  # "phonemes": the units, spaces removed
    pause_ms: int = 0  # "pause"
    para_end: bool = False  # a blank line follows: the sentence ends here
    said: str = ""  # "word": words said instead of its own (<say-as>, <sub>, a lexicon's respelling)
    # "word" with phonemes: said with these units (a lexicon's entry), its text still the word as written

    @property
    def word(self) -> str:
        """What the user wrote, for word timings (an element's content; "" for a pause or [[...]])."""
        if self.text.startswith("<"):
            inner = re.search(r">(.*)<", self.text, re.S)
            return inner.group(1).strip() if inner else ""
        return "" if self.kind == "pause" or self.text.startswith("[[") else self.text

    @property
    def fixed(self) -> bool:
        """A word whose spoken form markup or a lexicon fixed: the normaliser's rules do not read it."""
        return self.kind == "word" and bool(self.said or self.phonemes)


# ---- tokens ---------------------------------------------------------------------------------------
_MARKUP = re.compile(
    r"\[\[(?P<ipa>[^\[\]]*)\]\]"
    r"|<phoneme\b[^>]*?\bph\s*=\s*(?P<q>[\"'])(?P<ph>.*?)(?P=q)[^>]*>(?P<word>.*?)</phoneme\s*>"
    r"|<break\b(?P<attrs>[^>]*?)/?>"
    rf"|{ELEMENTS}"
    r"|<(?P<end>/?)(?P<tag>[A-Za-z][\w:-]*)(?P<tag_attrs>(?:\s[^<>]*)?)/?>",
    re.S,
)
_OPEN_MARKUP = re.compile(
    r"\[\[(?![^\]]*\]\])|<(?=[A-Za-z/])[^>]*$|<phoneme\b(?![\s\S]*</phoneme\s*>)"
    rf"|{OPEN_ELEMENT}"
)


def complete_length(text: str) -> int:
    """How much of a text that is still arriving can be tokenised now: up to its last whitespace or closed
    markup element, and never into a markup element that is still open. Example: "Hi there, frie" -> 10."""
    opened = _OPEN_MARKUP.search(text)
    stop = opened.start() if opened else len(text)
    ends = [m.end() for m in re.finditer(r"\s+", text[:stop])] + [m.end() for m in _MARKUP.finditer(text[:stop])]
    return stop if opened else max(ends, default=0)


def tokenize(text: str) -> list[Token]:
    """Whitespace-separated words and markup elements, with their offsets. Raises TextError for malformed
    markup."""
    try:
        return _tokenize(text)
    except MarkupError as err:
        raise TextError(str(err)) from None


def _tokenize(text: str) -> list[Token]:
    tokens: list[Token] = []
    position = 0
    for match in _MARKUP.finditer(text):
        tokens += _words(text, position, match.start())
        whole, start, end = match.group(0), match.start(), match.end()
        if match.group("ipa") is not None or match.group("ph") is not None:
            ipa = match.group("ipa") if match.group("ipa") is not None else match.group("ph")
            tokens.append(Token(whole, start, end, "phonemes", ipa_units(ipa)))
        elif whole.startswith("<break"):
            tokens.append(Token(whole, start, end, "pause", pause_ms=pause_ms(match.group("attrs") or "")))
        elif match.group("el"):
            said = element_words(match.group("el"), match.group("el_attrs"), match.group("el_inner"))
            tokens.append(Token(whole, start, end, said=said))
        else:
            _tag(match, tokens)
        position = match.end()
    return tokens + _words(text, position, len(text))


def _tag(match: re.Match, tokens: list[Token]) -> None:
    """A tag without content of its own: ``</p>`` or ``<s>`` ends the sentence before it; ``<prosody>``'s
    rate is checked; a lone ``<say-as>`` or ``</sub>`` is malformed; other tags say nothing."""
    tag = match.group("tag").lower()
    if tag in NEEDS_CLOSING:
        raise MarkupError(
            f"{match.group(0)} at offset {match.start()} has no "
            f"{'start' if match.group('end') else 'end'} tag (or holds markup)"
        )
    if tag == "prosody" and not match.group("end"):
        prosody_rate(match.group("tag_attrs"))
    if tag in SENTENCE_TAGS and tokens and tokens[-1].kind == "word":
        tokens[-1] = replace(tokens[-1], para_end=True)


def _words(text: str, start: int, stop: int) -> list[Token]:
    blank_line = re.compile(r"[ \t]*\r?\n[ \t]*\r?\n")
    return [
        Token(m.group(0), m.start(), m.end(), para_end=bool(blank_line.match(text, m.end())))
        for m in re.compile(r"\S+").finditer(text, start, stop)
    ]


def ipa_units(phonemes: str) -> str:
    units = unicodedata.normalize("NFD", re.sub(r"\s+", "", phonemes))
    bad = sorted({u for u in units if u not in SYMBOL_ID or u in "_^$"})
    if bad or not units:
        raise TextError(f"inline phonemes {phonemes!r}: " + (f"unknown symbols {bad}" if bad else "empty"))
    return units


# ---- sentences ------------------------------------------------------------------------------------
_CLOSERS = "\"')]}”’»*_"


def sentence_end(tokens: list[Token], i: int) -> bool | None:
    """Does token ``i`` end its sentence? None: it depends on a token that has not arrived yet."""
    token = tokens[i]
    if token.kind != "word":
        return False
    if token.para_end:
        return True
    if token.said:
        return False  # an element's words end no sentence
    text = token.text.rstrip(_CLOSERS)
    if not text or text[-1] not in ".!?":
        return False
    following = next((t for t in tokens[i + 1 :] if t.kind == "word"), None)
    if following is None:
        return None
    first = following.text.lstrip(_CLOSERS + "\"'([{¿¡“‘«")[:1]
    if first.islower():
        return False  # "3 p.m. today", "'Wow!' he said"
    if text[-1] != ".":
        return True
    core = split_token(token.text)[1].rstrip(".").lower()
    if core in TITLES or core in NONFINAL:
        return False
    if core in BEFORE_NUMBER and first.isdigit():
        return False  # "No. 5", "Jan. 4"
    if re.fullmatch(r"[a-z]", core) and first.isupper() and not text.endswith(".."):
        return False  # an initial: "J. Smith"
    return True


def reads_by_next(token: Token) -> bool:
    """May the next word change the words this one is read as? A number ("5" kg, "$5" million, "10" am), a
    month ("March" 4), a title or abbreviation ("St." Mark or Main St.)."""
    core = split_token(clean(token.text))[1]
    key = core.rstrip(".").lower()
    return (
        token.kind == "word"
        and not token.fixed
        and (
            any(c.isdigit() for c in core)
            or key in MONTH_OF
            or key in TITLES
            or key in BEFORE_NUMBER
            or core.upper() in CURRENCY_CODES
        )
    )


def split_sentences(tokens: list[Token], final: bool) -> list[tuple[int, int, bool]]:
    """Sentence spans (start, stop, closed) over ``tokens``. The last span is open unless ``final`` or its
    end is decided. Example: "Dr. Li came. He" -> [(0, 3, True), (3, 4, False)]."""
    spans, start = [], 0
    for i in range(len(tokens)):
        if sentence_end(tokens, i):
            spans.append((start, i + 1, True))
            start = i + 1
    if start < len(tokens):
        spans.append((start, len(tokens), final))
    return spans


# ---- spoken forms ---------------------------------------------------------------------------------
def _trail_words(trail: str, last: bool) -> str:
    """Trailing punctuation as espeak should see it: one clause or sentence mark (quotes dropped)."""
    marks = [c for c in trail if c in ",;:!?."]
    if not marks:
        return ""
    if "?" in marks:
        return "?"
    if "!" in marks:
        return "!"
    if marks.count(".") > 1 and not last:
        return ","  # an ellipsis inside a sentence: a pause, not an end
    return marks[0]


def speak(tokens: list[Token], closed: bool = True) -> list[str]:
    """The spoken form of every token of one sentence ("" for a token that says nothing). ``closed``:
    the sentence's last token ends it, so its period is spoken as the sentence's end."""
    ctx = Context(tokens)
    spoken = [""] * len(tokens)
    i = 0
    while i < len(tokens):
        if tokens[i].kind != "word":
            i += 1
            continue
        if tokens[i].fixed:  # markup's or a lexicon's words, and the word's own trailing marks
            trail = _trail_words(ctx.trail[i], closed and i == len(tokens) - 1)
            spoken[i] = f"{tokens[i].said}{trail}" if tokens[i].said else ""
            i += 1
            continue
        said = first_rule(ctx, i)
        for k, words in enumerate(said):
            trail = _trail_words(ctx.trail[i + k], closed and i + k == len(tokens) - 1)
            if words.endswith(".") and trail == ".":
                trail = ""  # "A.M." ending a sentence: one period
            spoken[i + k] = f"{words}{trail}" if words else trail.strip(".")
        i += max(len(said), 1)
    if closed:
        _end_mark(tokens, spoken)
    if ctx.shouting:
        spoken = [s.lower() for s in spoken]
    return spoken


def end_mark(tokens: list[Token]) -> str:
    """The mark that ends a sentence of these tokens: ".", "!", "?" or ""."""
    mark = next((t.text.rstrip(_CLOSERS)[-1:] for t in reversed(tokens) if t.kind == "word"), "")
    return mark if mark in (".", "!", "?") else ""


def _end_mark(tokens: list[Token], spoken: list[str]) -> None:
    """A closed sentence's last spoken word carries its end mark: "in the U.S." -> "U.S." also ends it.
    After trailing markup the phonemiser adds the mark (`tts.text.sentence_units`)."""
    mark = end_mark(tokens)
    last = next(
        (
            k
            for k in range(len(spoken) - 1, -1, -1)
            if spoken[k].strip(",;:.!? ") or tokens[k].kind != "word" or tokens[k].phonemes
        ),
        None,
    )
    if (
        mark
        and last is not None
        and tokens[last].kind == "word"
        and not tokens[last].phonemes
        and not spoken[last].endswith((".", "!", "?"))
    ):
        spoken[last] = spoken[last].rstrip(",;:") + mark
        for k in range(last + 1, len(spoken)):
            spoken[k] = ""


def spoken_words(text: str) -> list[tuple[Token, str]]:
    """Every token of ``text`` with its spoken form, sentence by sentence."""
    tokens = tokenize(text)
    pairs = []
    for start, stop, closed in split_sentences(tokens, final=True):
        pairs += zip(tokens[start:stop], speak(tokens[start:stop], closed))
    return pairs


def normalize(text: str) -> str:
    """What a reader says, as text: ``"Dr. Li paid $3.50 on 3/4/2021"`` ->
    ``"doctor Li paid three dollars and fifty cents on March fourth, twenty twenty-one"``.
    Markup is dropped (a <phoneme> element leaves its word)."""
    return join_spoken(
        said if token.kind == "word" and not token.phonemes else token.word for token, said in spoken_words(text)
    )


def join_spoken(words) -> str:
    """Spoken forms joined into one text; a form that is only punctuation ("," for a dash) joins the word before."""
    return re.sub(r"\s+([,;:.!?])", r"\1", " ".join(w for w in words if w)).strip()
