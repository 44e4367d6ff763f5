"""Incremental text -> phoneme units, for text that arrives in pieces (an LLM's tokens, a socket).

Words are spoken as they arrive. A word is complete once whitespace follows it; it is spoken once
``lookahead_words`` complete words follow it (its right context), and never while it may still end its
sentence or be changed by what comes next: with no lookahead (the default) a number waits for its unit
("$5" million), a title for the next word ("St." Mark), "the" for its noun ("the apple" reads ðɪ). The open
sentence is normalised and phonemised again as words arrive, over a window that starts `CONTEXT_WORDS` before
the first word not yet spoken, and only that word onwards is taken: what was spoken is never changed. A
sentence's ``$`` comes when its end is known. ``lookahead_words="auto"`` waits for whole sentences instead
(or, without punctuation, for `PARTIAL_WORDS` words, and speaks all but the last two). ``flush``/``end``
speak whatever is buffered. Until something is spoken a take reads one sentence: when many streams start at
once, the text thread hands each its first sentence before it reads anyone's second. A stream's first
`START_UNITS` units come sooner: they wait for a next word that changes the words, not for one that changes
only the sounds, so the engine can start speaking a word or so earlier. An engine's stream (``hold_start``)
holds its first units until a player starting at the first chunk would not run dry at the text's pace so far
(`TextStream._may_start`): slow text starts later, fast text as soon as the engine can. The hold may also end
between pieces (`TextStream.release_at`: waiting moves the player's deadlines later), and a text thread takes
again then.

Example, lookahead 1, pieces "The ", "birch ", "canoe ", "slid." then end (units shown apart, "␣" a space):
  after "birch ": "The" is followed by one complete word -> ^ ð ə  (its space waits for the next word)
  after "canoe ": ␣ b ˈ ɜ ː t ʃ;  after "slid.": nothing ("slid." is not complete: it may be "slide")
  end: ␣ k ə n ˈ u ː ␣ s l ˈ ɪ d . $
A complete "slid. " would still wait for the next word: "slid. He" ends the sentence, "Dr. He" would not.

Word timings: every unit taken is remembered with the word (as written) it speaks; `word_timings` turns
the engine's schedule of units into start/end seconds per word.
"""
from __future__ import annotations

import threading
import time
from typing import Callable

from streaming.slots import CHUNK_SCHEDULE
from tts.normalize import (Token, complete_length, reads_by_next, sentence_end, sounds_by_next, speak,
                           split_sentences, tokenize)
from tts.model import ModelConfig
from tts.text import MAX_TEXT_CHARS, SYMBOL_ID, TextError, sentence_units

TAKE_CHARS = 600  # text phonemised in one take at most: a long text reaches the engine a few sentences a tick
PARTIAL_WORDS = 12  # "auto": a sentence without an end is spoken once this many words wait
CONTEXT_WORDS = 8  # words before the first unspoken one that are phonemised with it (espeak's left context)
_TO_COME = Token("people", 0, 0)  # never taken: its index is past every ready token
_GAP = " ,;:"  # units between two words of a sentence
# A stream's first START_UNITS units wait only for a next word that changes the words ("$5" million), not for
# one that changes only the sounds ("the" apple: ðɪ; "on the": ɔnðə): a word espeak sounds by the next one is
# read as before any word, and the gap after the last word goes with it (`TextStream._first_gap`). The
# engine's first step needs about that many units (the shipped model: text_lookahead 6 + ahead 4 + 1 = 11),
# the units of two or three words. Measured on the 720 Harvard sentences with lookahead 0 (`--units`): the
# first step's units are there after the 2nd word for 51 % of them, the 3rd for 99 % (26 % and 78 % when the
# first units wait as later ones do); 609 sentences get the units of the whole sentence (676).
START_UNITS = 16
# Complete words after a word before it is spoken. 0: at once, unless the next word can change it
# (`tts.normalize.needs_next`; see START_UNITS for a stream's first units). Measured on 720 Harvard sentences
# (`python -m bench.incremental --units`): the same units as whole sentences for 609 (0), 719 (1) and 720 (2);
# the rest differ by a linking glide, a stress mark or a first word's sound. Each word of lookahead costs a
# word's time before the first sound (100 ms at 10 words/s).
DEFAULT_LOOKAHEAD = 0
# A stream's first units are handed on only once a player starting at the first chunk is predicted never to run
# dry at the text's pace so far (`TextStream._may_start`). Why: the engine speaks a frame once ENGINE_UNITS follow
# its unit (text encoder +6, AR step +4, and itself) and completes it DELAY_FRAMES steps later (delay pattern),
# and hands out chunks of 2, 4, 8, then 16 frames (`CHUNK_SCHEDULE`), so the text it needs runs ahead of the player
# by 8 frames + 11 units at the first chunk and 22 frames + 11 units from the 4th. Text 1.2 times faster than
# speech closes only a fifth of that gap per second: slow text must be waited for before the start, fast text
# not (at 10 words/s the units of the first chunk are about enough).
SPEECH_UNITS_PER_S = 17.4  # the shipped voices at speed 1: 3.16 words/s, 5.47 units a word (Harvard sentences)
UNITS_PER_CHAR = 1.08  # units per character of English text, spaces included (720 Harvard sentences)
FRAME_S = 0.02  # ENGINE_UNITS and DELAY_FRAMES come from the model's config (`engine_lookahead`)
# A piece's units are counted 1.5 pieces after it comes: a word that the next can change waits for it, and "on the"
# waits for its noun ("The birch canoe slid on the smooth": 4, 7, 7, 5, 0, 0, 12 units a word); that is what made
# the starts that stalled (modelled, every stall came at chunks 2-6 with the text mid-sentence). The hold may also
# end between pieces (`release_at`). Modelled on Harvard sentences 100-299 (`bench.incremental --simulate`), mean
# first audio and stalls/min at 5 / 10 / 20 w/s and 1.2x, before (pieces counted on arrival, 2 units of margin,
# starts only when a piece comes) -> now: 819 / 316 / 161 / 1093 ms, 6.9 / 4.1 / 0.1 / 10.8 -> 831 / 341 / 188 /
# 1285 ms, 4.6 / 1.2 / 0.1 / 2.6. Other points: lag 1 (317 ms and 2.4 stalls/min at 10 w/s, 13.0 at 1.2x); lag 2
# (384 ms, 0.7; 0.9); lag 1.5 and a unit of margin (372 ms, 0.7; 1.1).
PIECE_LAG = 1.5
START_LATENCY_S = 0.07  # from the start to the first chunk on 2 cores (`bench.incremental`'s engine_ms, whole text)
HOLD_HORIZON_FRAMES = 150  # the prediction looks 3 s ahead: text slower than speech waits that long, then stalls


def engine_lookahead(cfg: ModelConfig) -> tuple[int, int]:
    """(ENGINE_UNITS, DELAY_FRAMES) of a model: the units a frame needs from its own on (text encoder's right
    context + the AR step's + itself) and the steps from a frame's start to its completion (codebooks - 1).
    Example, the shipped shapes (text_lookahead 6, ahead 4, 8 codebooks): (11, 7)."""
    return cfg.text_lookahead + cfg.ahead + 1, cfg.codebooks - 1


def read_sentence(tokens: list[Token], first: int, closed: bool) -> tuple[list[str], list[int]]:
    """A sentence's units from token ``first`` on (the tokens before it are context for the spoken forms) and,
    per unit, the index of its token in ``tokens`` (-1: none); the sentence ends after the last token if
    ``closed``. A pure function of its arguments: a `TextWorker`'s processes can run it."""
    spoken = speak(tokens, closed)
    window, said = tokens[first:], spoken[first:]
    if not closed:  # a word for those still to come: the last word read is not read as the clause's end
        window, said = window + [_TO_COME], said + [_TO_COME.text]
    units, owners = sentence_units(window, said, closed)
    return units, [o + first if o >= 0 else -1 for o in owners]


class TextStream:
    # How a sentence is read: `read_sentence` here, or a text worker's processes running it (set per stream)
    reader: Callable[[list[Token], int, bool], tuple[list[str], list[int]]] = staticmethod(read_sentence)
    clock: Callable[[], float] = staticmethod(time.perf_counter)  # when text arrives (`_may_start`)

    def __init__(self, max_chars: int = MAX_TEXT_CHARS, lookahead_words: int | str | None = None,
                 hold_start: bool | ModelConfig = False):
        """``hold_start``: hold the first units until a player starting at the first chunk would not run dry
        (`_may_start`; what an engine's stream asks for, with its model's config; True: the default shapes)."""
        if lookahead_words is None:
            lookahead_words = DEFAULT_LOOKAHEAD
        if lookahead_words != "auto" and (not isinstance(lookahead_words, int) or isinstance(lookahead_words, bool)
                                          or not 0 <= lookahead_words <= 32):
            raise ValueError(f"lookahead_words must be 0 to 32 or 'auto', not {lookahead_words!r}")
        self.max_chars, self.lookahead_words = max_chars, lookahead_words
        self._text = ""  # from the open sentence's start on
        self._chars = 0
        self._final = self._closed = self._dirty = False
        self._in_sentence = False  # its '^' was taken, its '$' not yet
        self._done = 0  # tokens of the open sentence whose units were all taken
        self._partial = 0  # units of token _done already taken (espeak joined it to the next word)
        self._gap_taken = False  # the gap after the last unit taken was taken (`_first_gap`)
        self._units_taken = 0
        self._held: list[int] | None = [] if hold_start else None  # units held before the start (None: started)
        self._may_hold = True  # False: held units go with the next take (`hold_off`)
        self._engine_units, self._delay_frames = engine_lookahead(
            hold_start if isinstance(hold_start, ModelConfig) else ModelConfig())
        self._pushes: list[float] = []  # when the first text came, and the latest (perf_counter seconds)
        self._first_chars = 0  # characters of the first piece
        self._pieces = 0
        self._lock = threading.Lock()
        self.spoken_any = False
        self._timings = _WordTimings()

    # ---- caller side ----------------------------------------------------------------------------
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
            self._text += text
            now = self.clock()
            self._pushes = [self._pushes[0], now] if self._pushes else [now]
            self._first_chars = self._first_chars or self._chars
            self._pieces += 1
            self._dirty = True

    def flush(self) -> None:
        with self._lock:
            self._final = self._dirty = True

    def end(self) -> None:
        with self._lock:
            self._final = self._closed = self._dirty = True

    def hold_off(self) -> None:
        """No start hold for this stream: units go to the engine as soon as they are read (a request's
        ``hold: false``: the earliest first audio, at the price of stalls when text comes slower than speech).
        Called before the first text (units already held would go with the next take after new text)."""
        with self._lock:
            self._may_hold = False

    @property
    def pending(self) -> bool:
        """Whether `take` has work: new text, a flush or the end, or the rest of a long text (a take reads
        at most TAKE_CHARS): an engine that takes on events must take again while this holds."""
        return self._dirty

    @property
    def ended(self) -> bool:
        return self._closed and not self._dirty and not self._text.strip() and not self._in_sentence

    # ---- engine side ----------------------------------------------------------------------------
    def take(self) -> tuple[list[int], bool]:
        """Unit ids ready to speak now (possibly none), and whether a flush or the end closed them:
        then nothing more follows them for now, so they are spoken to the last unit. Raises TextError
        for bad markup."""
        with self._lock:
            ids, closes = self._take()
            while not ids and self._held is not None and self._dirty:  # held: read on now, as a take that
                ids, closes = self._take()  # returned nothing is not taken again before new text
            return ids, closes

    def release_at(self) -> float | None:
        """When (`clock` seconds) the held first units go on if no more text comes before the next piece is due:
        waiting makes a start safer, as the player's deadlines move later while the text keeps its pace. None:
        nothing held, or not before the next piece (whose take decides again). A text thread takes again then
        (`take` re-checks the hold without new text). Example, 5 words/s, "The birch canoe " (18 units held at
        0.4 s, short of what a start then needs): 0.552 s, before the 4th piece is due at 0.6 s (each chunk's
        deadline is 152 ms later, so more of the pieces to come are counted against it)."""
        with self._lock:
            if not self._held or not self._may_hold or len(self._pushes) < 2:
                return None
            low, high = self.clock(), self._pushes[1] + self._every() - 1e-3
            if high <= low or not self._may_start(len(self._held), high):
                return None
            # _may_start is monotonic in the start time (each chunk's deadline moves later): bisect to 5 ms
            while high - low > 0.005:
                middle = (low + high) / 2
                low, high = (low, middle) if self._may_start(len(self._held), middle) else (middle, high)
            return high

    def _take(self) -> tuple[list[int], bool]:
        """One take under the lock (`take`)."""
        if not self._dirty:
            return self._start([], False) if self._held else ([], False)  # `release_at` may have come
        text, final = self._text, self._final
        ready = len(text) if final else complete_length(text)
        usable = complete_length(text[:TAKE_CHARS]) if ready > TAKE_CHARS else ready
        usable = usable or ready  # one token longer than TAKE_CHARS: all of it
        closes = final and usable == len(text)
        tokens = tokenize(text[:usable])
        spans = split_sentences(tokens, closes)
        later = not self.spoken_any and len(spans) > 1  # a first take reads the first sentence alone
        if later:
            spans, closes = spans[:1], False
        units, consumed = [], 0
        for start, stop, closed in spans:
            sentence = tokens[start:stop]
            units += self._speak(sentence, len(sentence) if closed else self._ready(sentence), closed)
            consumed = sentence[-1].end if closed else self._forget_spoken(sentence, consumed)
        self._text = "" if closes and not text[consumed:].strip() else text[consumed:]
        self._dirty = usable < ready or later  # the rest comes in the next takes
        self._final = final and not closes
        return self._start([SYMBOL_ID[u] for u in units], closes)

    def _start(self, ids: list[int], closes: bool) -> tuple[list[int], bool]:
        """Hold a stream's first units until `_may_start` (or a flush or the end closes them); then hand them
        on, and every later take's units at once."""
        if self._held is None:
            return ids, closes
        self._held += ids
        if not closes and self._may_hold and not self._may_start(len(self._held)):
            return [], False
        ids, self._held = self._held, None
        return ids, closes

    def _every(self) -> float:
        """Seconds between pieces so far (two pushes or more)."""
        return (self._pushes[1] - self._pushes[0]) / (self._pieces - 1)

    def _may_start(self, units: int, at: float | None = None) -> bool:
        """Whether the engine, given ``units`` now and the rest at the text's pace so far (a piece of the mean
        size every mean interval, counted PIECE_LAG pieces late), would hand out every chunk before a player that
        starts at the first one (START_LATENCY_S after ``at``, default now) reaches it. A chunk ending at frame E
        goes out once frame E - 1 is complete, i.e. step E + 6 ran, whose unit needs ENGINE_UNITS - 1 after it:
        ``(E + 6) * 0.348 + 11`` units (17.4 units/s of speech); it is due when the player reaches its first
        frame. Example, 10 words/s ("The ", "birch ", "canoe ": 6.5 units a piece every 100 ms): after "birch "
        11 units wait (the first chunk needs 8 * 0.348 + 11 = 13.8); after "canoe " 18 start: the 3rd chunk
        (frames 6-13, due 0.19 s after the start, no piece counted by then) needs 20 * 0.348 + 11 = 18.0, the 4th
        (frames 14-29, due 0.35 s after) 23.5 of the 24.5 or more there, and each later one 5.6 more per 16 frames
        while 6.5 come every 5. Text in one piece so far (no pace known: a text sent whole, or a client's first
        batch of words) starts once the first chunk's 13.8 are there (the engine waits for about that many)."""
        per_frame = SPEECH_UNITS_PER_S * FRAME_S
        if len(self._pushes) < 2 or self._pushes[1] <= self._pushes[0]:  # no pace known: the first chunk's units
            return units >= (CHUNK_SCHEDULE[0] + self._delay_frames - 1) * per_frame + self._engine_units
        last, every = self._pushes[1], self._every()
        piece = UNITS_PER_CHAR * (self._chars - self._first_chars) / (self._pieces - 1)  # units a piece
        since = (self.clock() if at is None else at) - last + START_LATENCY_S  # last piece -> first chunk plays
        played, end, sizes = 0, 0, iter(CHUNK_SCHEDULE)
        while played < HOLD_HORIZON_FRAMES:  # chunk by chunk: due when the player reaches its first frame
            played, end = end, end + next(sizes, CHUNK_SCHEDULE[-1])
            needed = (end + self._delay_frames - 1) * per_frame + self._engine_units
            pieces = max(0.0, (played * FRAME_S + since - PIECE_LAG * every) // every)  # to come and be read by then
            if units + piece * pieces < needed:
                return False
        return True

    def _ready(self, tokens: list[Token]) -> int:
        """How many of an open sentence's complete tokens may be spoken now."""
        n = len(tokens)
        if self.lookahead_words == "auto":
            return n - 2 if n - self._done >= PARTIAL_WORDS else 0
        ready = n - self.lookahead_words
        last = tokens[-1]
        if ready == n and (reads_by_next(last) or sounds_by_next(last) and self._units_taken >= START_UNITS):
            ready -= 1  # the next word may change it (a stream's first units wait only for changed words)
        if ready == n and sentence_end(tokens, n - 1) is None:
            ready -= 1  # "slid." may end the sentence: its '.' and '$' or not
        return ready

    def _speak(self, tokens: list[Token], ready: int, closed: bool) -> list[str]:
        """Take the units of tokens [_done, ready) of one sentence (all that is left if ``closed``)."""
        if not closed and ready <= self._done:
            return []
        units, owners = self.reader(tokens, max(0, self._done - CONTEXT_WORDS), closed)
        start = self._resume(units, owners) if self._in_sentence else 0
        cut = len(units) if closed else self._cut(units, owners, start, ready)
        if not closed and self._units_taken < START_UNITS:
            cut = self._first_gap(units, owners, cut, len(tokens))
        if cut > start:
            self._gap_taken = not closed and owners[cut - 1] < 0 and units[cut - 1] in _GAP
        taken = units[start:cut]
        self._units_taken += len(taken)
        self._timings.add(tokens, owners[start:cut])
        if closed:
            self._timings.close_sentence(len(tokens))
            self._in_sentence, self._done, self._partial = False, 0, 0
        elif cut > start:
            self._in_sentence = True
            taken_words = [o for o in owners[:cut] if o >= 0]
            if taken_words:  # the last word taken may go on after the cut: then it is taken in part
                last = taken_words[-1]
                whole = last not in owners[cut:]
                self._done, self._partial = (last + 1, 0) if whole else (last, taken_words.count(last))
            self._timings.complete(self._done)
        self.spoken_any = self.spoken_any or any(u.isalpha() for u in taken)
        return taken

    def _forget_spoken(self, tokens: list[Token], consumed: int) -> int:
        """Where the text kept for the next take may start: a long open sentence drops the words no later
        take reads (the window and a rule's left neighbour), so a take costs the same on its 500th word as on
        its 5th. Example: _done 40 -> the first 30 tokens go, _done becomes 10."""
        drop = self._done - CONTEXT_WORDS - 2
        if drop < 2 * CONTEXT_WORDS:
            return consumed
        self._done -= drop
        self._timings.sentence_base += drop
        return tokens[drop].start

    def _resume(self, units: list[str], owners: list[int]) -> int:
        """Where the units not yet taken start: after the last unit of the tokens before _done, and after
        the first _partial units of token _done, and after the gap that follows if it was taken
        (`_first_gap`). Example: owners [-1, 0, 0, -1, 1, 1, 2], _done 2 -> 6."""
        position, seen = 1, 0
        for k, owner in enumerate(owners):
            if 0 <= owner < self._done:
                position = k + 1
            elif owner == self._done and seen < self._partial:
                seen += 1
                position = k + 1
        while self._gap_taken and position < len(units) and owners[position] < 0 and units[position] in _GAP:
            position += 1
        return position

    def _first_gap(self, units: list[str], owners: list[int], cut: int, complete: int) -> int:
        """Among a stream's first START_UNITS units, the gap after the last complete word goes with it when
        every complete word is taken: the engine's first step needs the units of about two words and a half
        (the text encoder's right context and the step's lookahead), and this gap is often the one unit
        missing. The gap is read before the next word arrives, as before any word (`_TO_COME`): wrong only where
        espeak would run the two words together, almost only before "the" ("on the" -> ɔnðə): 3 % of the word
        gaps of the Harvard sentences. Example: ^ ð ə ␣ b ˈ ɜ ː t ʃ ␣ p ... ("The birch "): cut 10 -> 11."""
        if cut == 0 or owners[cut - 1] != complete - 1:
            return cut
        k = cut
        while k < len(units) and owners[k] < 0 and units[k] in _GAP:
            k += 1
        return k if k < len(units) and owners[k] == complete else cut

    @staticmethod
    def _cut(units: list[str], owners: list[int], start: int, ready: int) -> int:
        """Where to stop taking: after the last unit of the ready tokens, or, where espeak joined that word
        to the next ("on the" -> ɔnðə), before the joined group. The space after a taken word waits for
        the next word. Example: ^ ɔ n ð ə with "on" ready and "the" not: cut 1 (nothing but ^ now)."""
        cut = max((k + 1 for k in range(start, len(units)) if 0 <= owners[k] < ready), default=start)
        if cut < len(units) and owners[cut] >= 0:  # the next word's units follow without a gap
            k = cut
            while k > start and owners[k - 1] >= 0:
                k -= 1
            while k > start and owners[k - 1] < 0 and units[k - 1] != "^":
                k -= 1
            cut = max(k, start)
        return cut

    def word_timings(self, first_unit: int, start_frames: list[int], durations: list[int],
                     frame_s: float) -> list[dict]:
        """Timings of the words whose units are now all scheduled: the engine scheduled units
        ``first_unit, first_unit + 1, ...`` (absolute indices since the stream's start, in the order `take`
        returned them) at ``start_frames`` for ``durations`` frames each. Returns
        ``[{"word": as written, "start": s, "end": s}, ...]`` in order. Example: units 0-3 of "^ h i $"
        scheduled at frames 0, 2, 5, 9 for 2, 3, 4, 1 frames, 20 ms frames -> [{"word": "hi", "start": 0.04,
        "end": 0.18}]."""
        with self._lock:
            return self._timings.scheduled(first_unit, start_frames, durations, frame_s)


class _WordTimings:
    """Which word (as written) each taken unit speaks, and the words' times once the engine schedules them."""

    def __init__(self):
        self.unit_word: list[int] = []  # per taken unit since unit_base: word id, or -1
        self.unit_base = 0
        self.words: dict[int, str] = {}  # word id -> text, until reported
        self.last_unit: dict[int, int] = {}  # word id -> absolute index of its last unit taken so far
        self.complete_upto = 0  # word ids below this have had all their units taken
        self.sentence_base = 0  # word id of the open sentence's first token
        self.times: dict[int, list[float]] = {}

    def add(self, tokens: list[Token], owners: list[int]) -> None:
        for owner in owners:
            word = -1
            if owner >= 0 and tokens[owner].word:
                word = self.sentence_base + owner
                self.words[word] = tokens[owner].word
                self.last_unit[word] = self.unit_base + len(self.unit_word)
            self.unit_word.append(word)

    def complete(self, done: int) -> None:
        self.complete_upto = self.sentence_base + done

    def close_sentence(self, count: int) -> None:
        self.sentence_base += count
        self.complete_upto = self.sentence_base

    def scheduled(self, first_unit: int, start_frames: list[int], durations: list[int], frame_s: float) -> list[dict]:
        done = []
        for k, (frame, length) in enumerate(zip(start_frames, durations)):
            index = first_unit + k - self.unit_base
            word = self.unit_word[index] if 0 <= index < len(self.unit_word) else -1
            if word < 0:
                continue
            span = self.times.setdefault(word, [frame, frame + length])
            span[0], span[1] = min(span[0], frame), max(span[1], frame + length)
            if word < self.complete_upto and self.last_unit.get(word) == first_unit + k:
                start, end = self.times.pop(word)
                done.append({"word": self.words.pop(word), "start": round(start * frame_s, 3),
                             "end": round(end * frame_s, 3)})
                del self.last_unit[word]
        self._forget(first_unit + len(durations))
        return done

    def _forget(self, upto: int) -> None:
        """Drop the unit table before ``upto`` once it is long: memory stays flat on long speech."""
        old = upto - self.unit_base
        if old > 4096:
            del self.unit_word[:old]
            self.unit_base = upto
