"""Text front end: normalisation, phonemes, typed errors (the normalisation table: test_normalize.py;
incremental text: test_textstream.py)."""

import pytest

from tts.text import SYMBOLS, TextError, normalize, phonemize, text_to_sentences


@pytest.mark.parametrize(
    "raw, spoken",
    [
        ("Dr. Smith paid $3.50.", "doctor Smith paid three dollars and fifty cents."),
        ("On 3/4/2021 at 10:30", "On March fourth, twenty twenty-one at ten thirty"),
        ("In 1851 the 2nd ship", "In eighteen fifty-one the second ship"),
        ("It costs £1", "It costs one pound"),
        ("45.5% of 1,200", "forty-five point five percent of one thousand two hundred"),
        ("Mr. & Mrs. Brown", "mister and missus Brown"),
    ],
)
def test_normalize(raw, spoken):
    assert normalize(raw) == spoken


def test_phonemize_wraps_sentences():
    sentences = phonemize("Hi there. Go!")
    assert len(sentences) == 2
    assert all(s[0] == "^" and s[-1] == "$" for s in sentences)
    assert all(u in SYMBOLS for s in sentences for u in s)


def test_unknown_words_still_get_phonemes():
    (sentence,) = phonemize("Zyxqu blorf.")
    assert len(sentence) > 6


@pytest.mark.parametrize("bad", ["", "   ", "?!...", "a" * 20_001])
def test_unspeakable_text_raises(bad):
    with pytest.raises(TextError):
        text_to_sentences(bad)


@pytest.mark.parametrize(
    "text",
    [
        "Hi, you. Wait; then: go!",
        "The birch canoe slid on the smooth planks.",
        "Un café, s'il vous plaît.",
        "Is it? Yes! No",
    ],
)
def test_phonemes_are_pipers(text):
    """Our espeak calls (the voice set once) give Piper's phonemiser's units, sentence by sentence."""
    from piper.phonemize_espeak import EspeakPhonemizer

    want = [
        ["^", *"".join(u for u in units if u in SYMBOLS and u not in "^$_").rstrip(" "), "$"]
        for units in EspeakPhonemizer().phonemize("en-us", text)
    ]
    assert phonemize(text) == want
