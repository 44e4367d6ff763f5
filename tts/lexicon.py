"""Pronunciation lexicons: how a word is said, every time (names, brands, jargon).

An entry maps a word to its pronunciation: IPA phonemes between slashes (espeak's symbols, as `tts.text.SYMBOLS`;
spaces ignored), or a respelling, words the normaliser and espeak read instead:

    Zorblax     /z ˈɔː ɹ b l æ k s/     the phonemes
    nginx       engine x                a respelling
    SQL         sequel

Case: an entry written all in lower case matches the word in any case ("nginx" matches "Nginx" and "NGINX"); an
entry with a capital matches that spelling only ("US" matches "US", not "us"), and wins over a lower-case entry
for it. A word matches without the punctuation around it ("Zorblax," and "(Zorblax)" match "Zorblax"; the comma
still makes its pause); a word inside markup (<say-as>, <sub>, <phoneme>) is the markup's to say.

Files (`tts serve --lexicon FILE`, `tts say --lexicon FILE`): JSON, an object ``{"word": "pronunciation", ...}``,
or TSV (any other suffix), one ``word<TAB>pronunciation`` a line, ``#`` starting a comment line. Per request, the
same object: the WebSocket ``start`` message's and the speech request's ``lexicon``, `synthesize_stream(lexicon=)`.
A request's entries win over the server's. A bad entry is a `LexiconError` (a `TextError`) naming it.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field, replace
from pathlib import Path

from tts.normalize import TextError, Token, ipa_units
from tts.normalize_rules import clean, split_token

MAX_ENTRIES = 10_000
MAX_WORD_CHARS = 64
MAX_SAID_CHARS = 256
_WORD = re.compile(r"[^\s<>\[\]]+")  # one written word, no markup


class LexiconError(TextError):
    """A lexicon entry that cannot be used; the message names it."""


@dataclass(frozen=True)
class Lexicon:
    """Entries by key: exact spellings (a capital in them) and lower-case ones (any case)."""

    exact: dict[str, tuple[str, str]] = field(default_factory=dict)  # word -> ("phonemes", units) / ("said", words)
    folded: dict[str, tuple[str, str]] = field(default_factory=dict)

    @classmethod
    def of(cls, entries: Lexicon | dict[str, str] | None) -> Lexicon:
        """A lexicon from ``{"word": "pronunciation"}`` (or one as is). Raises LexiconError naming a bad entry."""
        if entries is None or isinstance(entries, Lexicon):
            return entries or cls()
        if not isinstance(entries, dict):
            raise LexiconError(f"a lexicon is an object of word -> pronunciation, not {type(entries).__name__}")
        if len(entries) > MAX_ENTRIES:
            raise LexiconError(f"a lexicon has at most {MAX_ENTRIES} entries, not {len(entries)}")
        exact: dict[str, tuple[str, str]] = {}
        folded: dict[str, tuple[str, str]] = {}
        for word, said in entries.items():
            key, how = _entry(word, said)
            (folded if key == key.lower() else exact)[key] = how
        return cls(exact, folded)

    @classmethod
    def load(cls, path: str | Path) -> Lexicon:
        """A lexicon file (`read_entries`). Raises LexiconError naming the file and the bad entry."""
        entries = read_entries(path)
        try:
            return cls.of(entries)
        except LexiconError as err:
            raise LexiconError(f"lexicon {path}: {err}") from None

    def merged(self, other: Lexicon | dict[str, str] | None) -> Lexicon:
        """These entries, with ``other``'s winning."""
        other = Lexicon.of(other)
        if not other:
            return self
        return Lexicon({**self.exact, **other.exact}, {**self.folded, **other.folded})

    def state(self) -> tuple[dict, dict]:
        """Plain data (a stream's exported state): ``Lexicon(*lexicon.state())`` is the same lexicon."""
        return dict(self.exact), dict(self.folded)

    def __bool__(self) -> bool:
        return bool(self.exact or self.folded)

    def __len__(self) -> int:
        return len(self.exact) + len(self.folded)

    def apply(self, tokens: list[Token]) -> list[Token]:
        """The tokens, each word with an entry said as the entry says (`Token.said` or `Token.phonemes`)."""
        if not self:
            return tokens
        return [self._said(token) if token.kind == "word" and not token.fixed else token for token in tokens]

    def _said(self, token: Token) -> Token:
        core = split_token(clean(token.text))[1].strip("\"'()[]{}")
        how = self.exact.get(core) or self.folded.get(core.lower())
        if how is None:
            return token
        kind, value = how
        return replace(token, phonemes=value) if kind == "phonemes" else replace(token, said=value)


def _entry(word, said) -> tuple[str, tuple[str, str]]:
    """One entry checked: (its key, how it is said)."""
    if not isinstance(word, str) or not _WORD.fullmatch(word) or len(word) > MAX_WORD_CHARS:
        raise LexiconError(
            f"lexicon entry {word!r}: the word must be one word of at most {MAX_WORD_CHARS} "
            "characters, without spaces or markup"
        )
    if not isinstance(said, str) or not said.strip() or len(said) > MAX_SAID_CHARS:
        raise LexiconError(
            f"lexicon entry {word!r}: the pronunciation must be a non-empty string of at most "
            f"{MAX_SAID_CHARS} characters, not {said!r}"
        )
    said = said.strip()
    if len(said) >= 2 and said[0] == said[-1] == "/":
        try:
            return word, ("phonemes", ipa_units(said[1:-1]))
        except TextError as err:
            raise LexiconError(f"lexicon entry {word!r}: {err}") from None
    if re.search(r"[<>\[\]/]", said):
        raise LexiconError(
            f"lexicon entry {word!r}: a respelling is plain words (IPA goes between slashes: /h ə l ˈoʊ/), not {said!r}"
        )
    return word, ("said", " ".join(said.split()))


def read_entries(path: str | Path) -> dict[str, str]:
    """A lexicon file's entries as written, ``{"word": "pronunciation"}``: JSON (``.json``) or TSV (checked by
    `Lexicon.of`). Raises LexiconError naming the file."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
        entries = json.loads(text) if path.suffix.lower() == ".json" else dict(_tsv_entries(text))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, LexiconError) as err:
        raise LexiconError(f"lexicon {path}: {err}") from None
    if not isinstance(entries, dict):
        raise LexiconError(f"lexicon {path}: want an object of word -> pronunciation")
    return entries


def _tsv_entries(text: str):
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        parts = line.split("\t")
        if len(parts) != 2:
            raise LexiconError(f"line {number}: want word<TAB>pronunciation, not {line!r}")
        yield parts[0].strip(), parts[1].strip()
