"""Incremental text: words spoken as they arrive, the same units as whole sentences, holds, sentence ends,
flush/end, markup split across pieces, word timings."""

import time

import pytest

from streaming import textstream
from streaming.slots import CHUNK_SCHEDULE, INCREMENTAL_CHUNKS
from streaming.textstream import CUSHION_FRAMES, FRAME_S, PARTIAL_WORDS, START_LATENCY_S, StartLatency, TextStream
from tts.text import SYMBOLS, TextError, text_to_sentences

SENTENCES = [
    "The birch canoe slid on the smooth planks.",
    "Dr. Smith paid $5 million on March 4, 2024 in the apple store. Then he left!",
    "It's easy to tell the depth of a well, isn't it? Yes: over the fence and into the river.",
    "St. Mark St. is 3.5 km away; e.g. about 10 min by car at 9:30 am.",
]


def spell(ids):
    return "".join(SYMBOLS[i] for i in ids)


def word_by_word(text, lookahead, pieces=None):
    stream, taken = TextStream(lookahead_words=lookahead), []
    for piece in pieces or [w + " " for w in text.split()]:
        stream.push(piece)
        taken.append(spell(stream.take()[0]))
    stream.end()
    units, closed = stream.take()
    assert closed and stream.ended
    return taken + [spell(units)]


def whole(text):
    return "".join(u for s in text_to_sentences(text) for u in s)


@pytest.mark.parametrize("lookahead", [1, 2, "auto"])
@pytest.mark.parametrize("text", SENTENCES)
def test_word_by_word_equals_whole(text, lookahead):
    assert "".join(word_by_word(text, lookahead)) == whole(text)


@pytest.mark.parametrize("text", SENTENCES)
def test_no_lookahead_differs_at_most_in_how_function_words_sound_and_loses_no_word(text):
    """Lookahead 0 reads a word before its next one comes (FLUENT): "the" as before a consonant, no linking,
    and a word espeak would join into one already spoken ("of a": əvə) is read on its own, not lost."""
    from rapidfuzz.distance import Levenshtein

    got, want = "".join(word_by_word(text, 0)), whole(text)
    assert Levenshtein.distance(got, want) <= 0.05 * len(want)
    plain = str.maketrans("", "", "ʲɹˈˌ ")
    words = {"ðɪ": "ðə", "əvə": "ʌvɐ"}  # the function words' other sounds
    for theirs, ours in words.items():
        want = want.translate(plain).replace(theirs, ours)
    assert got.translate(plain) == want


def test_llm_pieces_speak_only_complete_words():
    pieces = ["The", " bi", "rch", " can", "oe", " slid", " on", " the", " smooth", " planks", "."]
    taken = word_by_word(None, 1, pieces)
    assert taken[:3] == ["", "", ""]  # "The" is complete only once " bi" arrives, and then waits for one word
    assert taken[3] == "^ðə"
    assert "".join(taken) == whole("The birch canoe slid on the smooth planks.")


def test_lookahead_zero_speaks_a_content_word_at_once_and_holds_what_the_next_word_changes():
    stream = TextStream(lookahead_words=0)
    stream.push("Birds ")
    assert spell(stream.take()[0]) == "^bˈɜːdz "  # a stream's first units take the gap after them too
    for piece in ["paid ", "$5 "]:  # "$5" may be "$5 million": it waits for the next word
        stream.push(piece)
    assert spell(stream.take()[0]) == "pˈeɪd"  # later gaps wait for the next word
    stream.push("million ")
    assert spell(stream.take()[0]) == " fˈaɪv mˈɪliən dˈɑːlɚz "  # the gap after the last word comes with it
    stream.push("the ")  # read before its next word comes (FLUENT): as before a consonant
    assert spell(stream.take()[0]) == "ðə "
    stream.push("apple ")
    assert spell(stream.take()[0]).startswith("ˈæpəl")


def test_a_word_espeak_joins_into_one_already_spoken_is_read_on_its_own():
    stream = TextStream(lookahead_words=0)
    taken = []
    for piece in ["The ", "depth ", "of ", "a ", "well "]:
        stream.push(piece)
        taken.append(spell(stream.take()[0]))
    assert taken[2:] == ["ʌv ", "ɐ ", "wˈɛl "]  # "of a" reads əvə, all of it the spoken "of"'s


def test_words_wait_only_for_words_that_change_the_words():
    """A word espeak sounds by the next one is read as before any word (FLUENT: "the" apple gets ðə, not ðɪ),
    and its gap comes with it; a number still waits."""
    stream = TextStream(lookahead_words=0)
    stream.push("The ")
    assert spell(stream.take()[0]) == "^ðə "
    stream.push("apple ")
    assert spell(stream.take()[0]).startswith("ˈæ")
    stream = TextStream(lookahead_words=0)
    stream.push("Pay $5 ")
    assert spell(stream.take()[0]) == "^pˈeɪ"  # its gap waits with "$5"
    stream.push("million ")
    assert "mˈɪliən" in spell(stream.take()[0])


def test_sentence_end_comes_with_the_next_word_or_the_end():
    stream = TextStream(lookahead_words=0)
    stream.push("I met Dr. ")
    assert "$" not in spell(stream.take()[0])  # "Dr." may end the sentence or be a title: it waits
    stream.push("Li. ")
    assert "dˈɑːktɚ" in spell(stream.take()[0])
    stream.push("Then ")
    assert spell(stream.take()[0]).endswith(".$^ðˈɛn ")


def test_auto_waits_for_sentence_ends_or_twelve_words():
    stream = TextStream(lookahead_words="auto")
    stream.push("Hello the")
    assert stream.take() == ([], False)
    stream.push("re. How are")
    units, closed = stream.take()
    assert spell(units).startswith("^") and spell(units).endswith(".$") and not closed
    stream = TextStream(lookahead_words="auto")
    stream.push(" ".join(["word"] * (PARTIAL_WORDS + 8)))
    first, _ = stream.take()
    assert first and spell(first)[0] == "^" and spell(first)[-1] != "$"
    stream.flush()
    rest, closed = stream.take()
    assert spell(rest)[0] == " " and spell(rest)[-1] == "$" and closed
    assert spell(first + rest) == whole(" ".join(["word"] * (PARTIAL_WORDS + 8)))


def test_flush_closes_the_open_sentence_and_the_stream_goes_on():
    stream = TextStream()
    stream.push("Hold on")
    stream.flush()
    units, closed = stream.take()
    assert spell(units) == whole("Hold on") and closed and not stream.ended
    stream.push("Next one.")
    stream.end()
    units, closed = stream.take()
    assert spell(units) == whole("Next one.") and closed and stream.ended


def test_take_without_new_text_is_empty():
    stream = TextStream()
    stream.push("Some words here ")
    assert stream.pending and stream.take()[0]
    assert not stream.pending and stream.take() == ([], False)


def test_markup_split_across_pieces_waits_until_closed():
    stream = TextStream(lookahead_words=1)
    for piece in ["Say ", "<break ti", 'me="500ms"/> ', "hi ", "there "]:
        stream.push(piece)
        stream.take()
    stream.end()
    stream.take()
    assert stream.ended
    pieces = word_by_word(None, 1, ["Say ", "<break ti", 'me="500ms"/> ', "hi ", "[[h ə", " l ˈoʊ]] ", "there."])
    assert "".join(pieces) == whole('Say <break time="500ms"/> hi [[h ə l ˈoʊ]] there.')


def test_bad_markup_is_a_text_error_at_take():
    stream = TextStream()
    stream.push("[[QQ]] and more")
    stream.end()
    with pytest.raises(TextError):
        stream.take()


@pytest.mark.parametrize("bad", [-1, 33, 1.5, "two", True])
def test_lookahead_must_be_words_or_auto(bad):
    with pytest.raises(ValueError):
        TextStream(lookahead_words=bad)


def test_text_limit():
    stream = TextStream(max_chars=10)
    stream.push("short")
    with pytest.raises(TextError):
        stream.push("this is too long")
    with pytest.raises(TextError):
        stream.push(b"bytes")


def test_word_timings_refer_to_what_was_written():
    stream, taken = TextStream(lookahead_words=1), []
    for piece in ["Dr. ", "Li ", "paid ", "$3.50 ", "<break/> ", "on ", "3/4/2021."]:
        stream.push(piece)
        taken.append(stream.take()[0])
    stream.end()
    taken.append(stream.take()[0])
    words, unit, frame = [], 0, 0
    for ids in taken:  # schedule each take as it came, every unit 2 frames long, 20 ms frames
        starts = list(range(frame, frame + 2 * len(ids), 2))
        words += stream.word_timings(unit, starts, [2] * len(ids), 0.02)
        unit, frame = unit + len(ids), frame + 2 * len(ids)
    assert [w["word"] for w in words] == ["Dr.", "Li", "paid", "$3.50", "on", "3/4/2021."]
    assert all(0 <= w["start"] < w["end"] for w in words)
    assert all(a["end"] <= b["start"] for a, b in zip(words, words[1:]))
    money = words[3]  # "three dollars and fifty cents": 5 words of units, ~26 units of 40 ms
    assert money["end"] - money["start"] > 0.6


def test_word_timings_wait_for_all_of_a_words_units():
    stream = TextStream(lookahead_words=1)
    stream.push("Hello world ")
    ids, _ = stream.take()
    assert spell(ids) == "^həlˈoʊ"
    half = len(ids) - 2
    assert stream.word_timings(0, list(range(half)), [1] * half, 0.02) == []
    assert stream.word_timings(half, [half, half + 1], [1, 1], 0.02) == [{"word": "Hello", "start": 0.02, "end": 0.14}]


def test_a_long_text_reaches_the_engine_a_few_sentences_a_take():
    from streaming.textstream import TAKE_CHARS

    text = " ".join(SENTENCES * 12)
    assert len(text) > 3 * TAKE_CHARS
    stream = TextStream()
    stream.push(text)
    stream.end()
    first, closed = stream.take()
    assert first and not closed and len(first) < len(text) / 2
    taken = [first]
    assert stream.pending
    while not stream.ended:
        units, closed = stream.take()
        taken.append(units)
    assert closed and spell([u for ids in taken for u in ids]) == whole(text)


@pytest.mark.parametrize("end", [True, False])
def test_a_first_take_reads_one_sentence(end):
    """Many streams starting at once each get their first sentence's units before anyone's second is read:
    a first take stops after the first sentence; the rest follows, the same units as the whole text."""
    text = " ".join(SENTENCES[:3])
    stream = TextStream()
    stream.push(text)
    if end:
        stream.end()
    first, closed = stream.take()
    assert spell(first) == whole(SENTENCES[0]) and not closed and stream.pending
    taken = [first]
    while stream.pending:
        taken.append(stream.take()[0])
    if not end:
        stream.end()
        taken.append(stream.take()[0])
    assert stream.ended and spell([u for ids in taken for u in ids]) == whole(text)
    assert len(taken) <= 4  # after the first sentence, the rest in one take


class _Clocked(TextStream):
    """A stream on a clock the test moves (`TextStream.clock`)."""

    now = 0.0
    clock = staticmethod(lambda: _Clocked.now)


def _speak(pieces: list[str], rate: float, hold: bool = True) -> tuple[int | None, list[int]]:
    """Pieces pushed at ``rate`` a second, then the end: (index of the piece whose take first gave units, or
    None if only the end did; all units)."""
    stream, got, first = _Clocked(hold_start=hold), [], None
    for i, piece in enumerate(pieces):
        _Clocked.now = i / rate
        stream.push(piece)
        got += stream.take()[0]
        first = i if first is None and got else first
    stream.end()
    return first, got + stream.take()[0]


def _words(text: str) -> list[str]:
    return [w + " " for w in text.split()]


WORDS = _words("The birch canoe slid on the smooth planks and the ducks swam by")


def test_a_stream_starts_later_when_its_text_comes_slower_and_then_speaks_every_unit():
    """The first units wait until a player starting at the first chunk would not run dry at the text's pace:
    the slower the text, the more words first; nothing is lost or changed by the wait."""
    slow, fast, unheld = _speak(WORDS, 3.8), _speak(WORDS, 20.0), _speak(WORDS, 3.8, hold=False)
    assert slow[0] > fast[0] > unheld[0]  # 1.2x the speaking rate waits for more words than 20 words/s
    assert slow[1] == fast[1] == unheld[1]


def test_a_held_start_ends_with_a_flush_or_the_end_and_one_piece_starts_once_the_first_chunk_is_there():
    assert _speak(WORDS[:2], 3.8) == (None, _speak(WORDS[:2], 3.8, hold=False)[1])  # the end hands all on
    stream = _Clocked(hold_start=True)
    stream.push("The birch ")
    stream.flush()
    assert spell(stream.take()[0]) == whole("The birch")
    stream = _Clocked(hold_start=True)
    stream.push("The birch canoe slid on the smooth planks and the ducks ")  # one piece: no pace to wait for
    assert len(stream.take()[0]) >= 16
    unheld = _Clocked()
    unheld.push("The ")
    assert spell(unheld.take()[0]) == "^ðə "  # without hold_start (the default) take is as before


def test_hold_off_hands_units_on_as_a_stream_without_the_hold_does():
    held, off = _Clocked(hold_start=True), _Clocked(hold_start=True)
    off.hold_off()
    unheld = _Clocked()
    for i, piece in enumerate(WORDS[:2]):
        _Clocked.now = i / 3.8
        for stream in (held, off, unheld):
            stream.push(piece)
        assert off.take() == unheld.take()
        assert held.take()[0] == []  # 1.2x the speaking rate: still held


def _released_at(pieces: list[str], rate: float) -> float | None:
    """When a held start of ``pieces`` pushed at ``rate`` a second went on (at a take after a piece, or at
    `TextStream.release_at` between pieces); None: only the end would have started it."""
    stream = _Clocked(hold_start=True)
    for i, piece in enumerate(pieces):
        _Clocked.now = i / rate
        stream.push(piece)
        if stream.take()[0]:
            return _Clocked.now
        if (at := stream.release_at()) is not None:
            _Clocked.now = at
            if stream.take()[0]:
                return at
    return None


def test_a_long_second_word_is_not_taken_for_the_texts_pace(monkeypatch):
    """The hold counts the pieces to come at their mean size so far or, when that is less, with one more piece
    of PRIOR_CHARS: at 1.2x the speaking rate, "The beauty " says little of the words after it and starts later
    than by its own mean, "The boy " (shorter than the prior) starts as by its own."""
    long, short = (
        _words(text)
        for text in ("The beauty of the view stunned the young boy.", "The boy was there when the sun rose.")
    )
    with_prior = _released_at(long, 3.8), _released_at(short, 3.8)
    monkeypatch.setattr(textstream, "PRIOR_CHARS", 1e6)  # the mean so far is always the less
    by_own_mean = _released_at(long, 3.8), _released_at(short, 3.8)
    assert with_prior[0] > by_own_mean[0] and with_prior[1] == by_own_mean[1]


def test_fast_text_counts_its_pieces_sooner_than_slow_text(monkeypatch):
    """Pieces of text at SLOW_PACE times speech or faster are counted PIECE_DELAY_S after they are due, slower
    text's SLOW_DELAY_S after: a longer slow delay holds 1.2x the speaking rate longer, 5 words/s as before."""
    fast, slow = _released_at(WORDS, 5), _released_at(WORDS, 3.8)
    monkeypatch.setattr(textstream, "SLOW_DELAY_S", textstream.SLOW_DELAY_S + 0.1)
    assert _released_at(WORDS, 5) == fast and _released_at(WORDS, 3.8) > slow


def test_a_held_start_ends_between_pieces_at_release_at_without_more_text():
    stream, unheld, units = _Clocked(hold_start=True), _Clocked(), []
    for i, piece in enumerate(WORDS[:3]):
        _Clocked.now = i / 3.2  # 3 words are held (at 4 words/s the 3rd is enough, with elastic pacing)
        stream.push(piece)
        unheld.push(piece)
        assert stream.take()[0] == []
        units += unheld.take()[0]
    at = stream.release_at()
    assert 2 / 3.2 < at < 3 / 3.2  # after the 3rd piece, before the 4th is due
    _Clocked.now = at - 0.006
    assert stream.take()[0] == []  # a little sooner: still held
    _Clocked.now = at
    assert stream.take() == (units, False)  # what the words gave, unchanged
    assert stream.release_at() is None  # started


def test_text_that_outruns_the_hold_is_released_at_once_and_held_text_is_not():
    """`released_at_once` (the engine's cue for INCREMENTAL_CHUNKS): words at 20 a second go on with the take that
    first has enough units; at 3 a second the hold waits for their pace; text sent whole never counts."""

    def release(rate):
        stream = _Clocked(hold_start=True)
        for i, piece in enumerate(WORDS):
            _Clocked.now = i / rate
            stream.push(piece)
            if stream.take()[0]:
                return stream, i
            if (at := stream.release_at()) is not None and at < (i + 1) / rate:
                _Clocked.now = at
                if stream.take()[0]:
                    return stream, i
        return stream, None

    fast, at = release(20)
    assert at == 1 and fast.released_at_once and fast.paced_release is None  # "The birch ": 11 units
    held, at = release(3)
    assert at is not None and at >= 1 and not held.released_at_once and held.paced_release is not None
    whole = _Clocked(hold_start=True)
    whole.push(" ".join(WORDS))
    assert whole.take()[0] and not whole.released_at_once


def test_the_hold_plans_with_a_first_chunk_smaller_than_the_engines(monkeypatch):
    """The start hold decides as if the engine's first chunk were CUSHION_FRAMES shorter: two words at 4.5 a second
    are released about that much audio (40 ms) later than by the same plan with the engine's first chunk, so the
    player starts with that much more in hand than the text's pace needs; and no sooner than by a plan with the
    engine's own chunks, which grow more slowly (`textstream.PLANNED_CHUNKS`)."""

    def release_at():
        stream = _Clocked(hold_start=True)
        for i, piece in enumerate(WORDS[:2]):
            _Clocked.now = i / 4.5  # (at 5 a second the engine's own chunks start at the 2nd word)
            stream.push(piece)
            assert stream.take()[0] == []
        return stream.release_at()

    cushioned = release_at()
    monkeypatch.setattr(textstream, "PLANNED_CHUNKS", (CHUNK_SCHEDULE[0], *textstream.PLANNED_CHUNKS[1:]))
    uncushioned = release_at()
    monkeypatch.setattr(textstream, "PLANNED_CHUNKS", CHUNK_SCHEDULE)
    own = release_at()
    cushion_s = CUSHION_FRAMES * FRAME_S
    assert 0.5 * cushion_s < cushioned - uncushioned <= cushion_s + 0.005  # release_at bisects to 5 ms
    assert own <= uncushioned


def test_start_latency_is_the_guess_until_measured_then_a_low_one_of_the_last_starts():
    latency = StartLatency()
    for ms in (200, 210, 220):
        latency.record(ms / 1000)
    assert latency.estimate() == START_LATENCY_S  # 3 starts: not enough to go by
    for ms in range(80, 112):  # 32 more: the 3 slow ones fall out of the window
        latency.record(ms / 1000)
    assert latency.estimate() == pytest.approx(0.087)  # sorted 80..111, index int(0.25 * 31) = 7


def test_a_longer_start_latency_releases_a_held_start_that_much_sooner():
    """The player starts when the first chunk comes: planning with a start latency 40 ms longer moves every
    chunk's deadline 40 ms later, so the hold ends 40 ms sooner (`TextStream.start_latency_s`)."""

    def release_at(latency_s):
        stream = _Clocked(hold_start=True)
        stream.start_latency_s = latency_s
        for i, piece in enumerate(WORDS[:2]):
            _Clocked.now = i / 5
            stream.push(piece)
            assert stream.take()[0] == []
        return stream.release_at()

    assert release_at(START_LATENCY_S) - release_at(START_LATENCY_S + 0.04) == pytest.approx(0.04, abs=0.006)


def test_the_engine_measures_word_by_word_starts_and_plans_the_next_with_them(tiny_engine):
    """A stream whose text came in pieces and was held adds its release -> first audio to the engine's start
    latency; one sent whole, or let go at once (`released_at_once`: another first chunk), adds nothing; the next
    stream's hold plans with the estimate."""
    kept = tiny_engine.start_latency._kept

    def speak(pieces, gap_s=0.05):
        stream = tiny_engine.open(seed=1)
        for piece in pieces:
            stream.push_text(piece)
            time.sleep(gap_s)
        stream.end()
        while stream.read(timeout=30) is not None:
            pass
        return stream

    before = list(kept)
    speak(["The birch canoe slid on the smooth planks."])
    assert list(kept) == before
    assert speak(WORDS).text.released_at_once and list(kept) == before
    stream = speak(WORDS[:6], gap_s=0.3)  # 3 words a second: held for its pace
    assert not stream.text.released_at_once
    assert kept[-1] == stream.first_audio_at - stream.text.paced_release > 0
    after = tiny_engine.open(seed=2)
    try:
        assert after.text.start_latency_s == tiny_engine.start_latency.estimate()
    finally:
        after.cancel()


def test_a_held_word_by_word_stream_hands_out_the_engines_chunk_schedule_from_the_first(tiny_engine):
    """The hold plans with a smaller first chunk, but the engine hands out its own: word by word at 10 a second
    (released as soon as there are units enough: `released_at_once`), the first chunks are INCREMENTAL_CHUNKS'
    sizes, the first one included."""
    stream = tiny_engine.open(seed=1)
    started = time.perf_counter()
    for i, piece in enumerate(WORDS):
        time.sleep(max(0.0, started + i / 10 - time.perf_counter()))
        stream.push_text(piece)
    stream.end()
    sizes = []
    while (chunk := stream.read(timeout=30)) is not None:
        sizes.append(len(chunk) // tiny_engine.codec.cfg.hop)
    assert sizes[:3] == list(INCREMENTAL_CHUNKS[:3])


def test_the_text_thread_ends_a_held_start_between_pieces(tiny_engine):
    """Three words at 6 a second, then nothing: the hold ends about 70 ms after the third (`release_at`, for
    this model) and the text thread hands the units on then, so audio comes without more text or an end."""
    stream = tiny_engine.open(seed=1)
    try:
        started = time.perf_counter()
        for i, piece in enumerate(WORDS[:3]):
            time.sleep(max(0.0, started + i / 6 - time.perf_counter()))
            stream.push_text(piece)
        assert stream.read(timeout=10) is not None
    finally:
        stream.cancel()


def test_synthesize_stream_hold_false_speaks_slow_text_before_it_ends(tiny_engine):
    """The API's ``hold=False``: words 0.4 s apart (slower than speech, which the default hold waits out) are
    spoken before the text ends; the text ends only once audio came."""
    import threading

    from tts.api import synthesize_stream

    heard = threading.Event()

    def words():
        for word in WORDS[:6]:
            yield word
            time.sleep(0.4)
        assert heard.wait(30)  # no end before the first audio

    chunks = synthesize_stream(words(), engine=tiny_engine, seed=1, hold=False)
    assert len(next(chunks))
    heard.set()
    for _ in chunks:  # and on to the end, which the text source now gives
        pass


def test_marks_say_when_the_start_was_read_covered_and_released():
    """The stats-only timeline of a held start (`TextStream.marks`, `bench.incremental --timeline`), on the
    virtual clock: units first read with the first word, released with a later one, never before they were
    read; a stream without the hold releases what it reads at once."""
    held, unheld = _Clocked(hold_start=True), _Clocked()
    for i, piece in enumerate(WORDS[:6]):
        _Clocked.now = i / 10
        for stream in (held, unheld):
            stream.push(piece)
            stream.take()
    assert held.marks["read"] == unheld.marks["read"] == unheld.marks["released"] == 0.0
    assert 0.0 < held.marks["enough"] <= held.marks["released"] <= 0.5
