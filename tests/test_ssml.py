"""SSML beyond phonemes and breaks (`tts.ssml`): the words each element says, sentence ends at <p>/<s>, pauses
by strength, typed errors for malformed markup, and an end-to-end check that the shipped voice says them."""

from __future__ import annotations

import numpy as np
import pytest

from tts.asr import transcribe, words
from tts.normalize import tokenize
from tts.text import TextError, normalize, text_sentences

SAID = [
    ('<say-as interpret-as="characters">cat</say-as>', "see ay tee"),
    ('I said <say-as interpret-as="spell-out">IBM</say-as>.', "I said eye bee em."),
    ('<say-as interpret-as="characters">R2</say-as>', "ar two"),
    ('<sub alias="tomato">Zorblax</sub> is red.', "tomato is red."),
    ('<say-as interpret-as="cardinal">1234</say-as>', "one thousand two hundred thirty-four"),
    ('<say-as interpret-as="cardinal">-12,000</say-as>', "minus twelve thousand"),
    ('<say-as interpret-as="ordinal">3</say-as>', "third"),
    ('<say-as interpret-as="ordinal">21st</say-as>', "twenty-first"),
    ('<say-as interpret-as="digits">1234</say-as>', "one two three four"),
    ('<say-as interpret-as="date">3/4/2024</say-as>', "March fourth, twenty twenty-four"),
    ('<say-as interpret-as="date" format="dmy">4/3/2024</say-as>', "March fourth, twenty twenty-four"),
    ('<say-as interpret-as="date">2024-03-04</say-as>', "March fourth, twenty twenty-four"),
    ('<say-as interpret-as="date" format="md">3/4</say-as>', "March fourth"),
    ('<say-as interpret-as="date" format="y">1990</say-as>', "nineteen ninety"),
    ('<say-as interpret-as="time">3:45pm</say-as>', "three forty-five P.M."),
    ('<say-as interpret-as="time">15:30</say-as>', "fifteen thirty"),
    ('<say-as interpret-as="telephone">555-123-4567</say-as>', "five five five, one two three, four five six seven"),
    (
        '<say-as interpret-as="telephone">+44 20 7946 0958</say-as>',
        "plus four four, two oh, seven nine four six, oh nine five eight",
    ),
    ('<speak>A <prosody rate="slow">slow</prosody> word.</speak>', "A slow word."),
]


@pytest.mark.parametrize("text, said", SAID)
def test_elements_say_these_words(text, said):
    assert normalize(text) == said


def test_element_timings_show_what_was_written():
    token = next(t for t in tokenize('Hi <sub alias="tomato">Zorblax</sub>.') if t.said)
    assert (token.word, token.said) == ("Zorblax", "tomato")


@pytest.mark.parametrize("text", ["<s>Hello</s><s>world</s>", "<p>One</p><p>Two</p>", "<p>One<s>Two</s></p>"])
def test_paragraphs_and_sentences_end_sentences(text):
    assert len(text_sentences(text)) == 2


@pytest.mark.parametrize(
    "strength, units", [("none", 0), ("x-weak", 1), ("weak", 2), ("medium", 5), ("strong", 7), ("x-strong", 10)]
)
def test_break_strengths_are_pauses_of_their_length(strength, units):
    pause = next(t for t in tokenize(f'Wait <break strength="{strength}"/> here.') if t.kind == "pause")
    assert (
        pause.pause_ms
        == {"none": 0, "x-weak": 100, "weak": 250, "medium": 500, "strong": 750, "x-strong": 1000}[strength]
    )
    assert next(t for t in tokenize('<break time="1.5s"/>')).pause_ms == 1500


@pytest.mark.parametrize(
    "text, names",
    [
        ('<say-as interpret-as="bogus">x</say-as>', "interpret-as"),
        ('<say-as interpret-as="cardinal">abc</say-as>', "cardinal"),
        ('<say-as interpret-as="date" format="mdy">13/40/2024</say-as>', "date"),
        ("<sub>x</sub>", "alias"),
        ('a <say-as interpret-as="characters">cat', "no end tag"),
        ("x </sub> y", "no start tag"),
        ('<prosody rate="10x">a</prosody>', "rate"),
        ('<prosody rate="900%">a</prosody>', "rate"),
        ('<break time="fast"/>', "time"),
        ('<break strength="loud"/>', "strength"),
    ],
)
def test_malformed_markup_is_a_text_error_naming_it(text, names):
    with pytest.raises(TextError, match=names):
        text_sentences(text)


def test_the_shipped_voice_says_the_elements(shipped_engine):
    from tts.api import synthesize

    text = (
        '<speak><p>The code is <say-as interpret-as="cardinal">42</say-as>.</p>'
        '<p>Buy a <sub alias="tomato">Zorblax</sub> today.</p></speak>'
    )
    heard = words(transcribe(synthesize(text, engine=shipped_engine, seed=3)))  # Whisper writes "42"
    assert {"forty", "two", "tomato"} <= set(heard), heard
    assert "zorblax" not in heard and "speak" not in heard
    assert np.isfinite(
        synthesize("<say-as interpret-as=\"characters\">ok</say-as>", engine=shipped_engine, seed=3)
    ).all()
