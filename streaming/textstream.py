"""Incremental text -> phoneme units, for text that arrives in pieces (an LLM's tokens, a socket).

Words are spoken as they arrive. A word is complete once whitespace follows it; it is spoken once
``lookahead_words`` complete words follow it (its right context), and never while it may still end its
sentence or be changed in its words by what comes next: with no lookahead (the default) a number waits for its
unit ("$5" million), a title for the next word ("St." Mark); a word whose sounds alone the next one changes does
not wait ("the" is read as before a consonant, "on the" without espeak's linking: `FLUENT`). The open
sentence is normalised and phonemised again as words arrive, over a window that starts `CONTEXT_WORDS` before
the first word not yet spoken, and only that word onwards is taken: what was spoken is never changed. A
sentence's ``$`` comes when its end is known. ``lookahead_words="auto"`` waits for whole sentences instead
(or, without punctuation, for `PARTIAL_WORDS` words, and speaks all but the last two). ``flush``/``end``
speak whatever is buffered. Until something is spoken a take reads one sentence: when many streams start at
once, the text thread hands each its first sentence before it reads anyone's second. An engine's stream (``hold_start``)
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
from collections import deque
from collections.abc import Callable

from streaming.sentence_reader import read_sentence
from streaming.slots import CHUNK_SCHEDULE, PACE_STRETCH, pace_factor
from tts.codec import CodecConfig
from tts.lexicon import Lexicon
from tts.model import ModelConfig
from tts.normalize import Token, complete_length, reads_by_next, sentence_end, split_sentences, tokenize
from tts.text import MAX_TEXT_CHARS, SYMBOL_ID, TextError

TAKE_CHARS = 600  # text phonemised in one take at most: a long text reaches the engine a few sentences a tick
PARTIAL_WORDS = 12  # "auto": a sentence without an end is spoken once this many words wait
CONTEXT_WORDS = 8  # words before the first unspoken one that are phonemised with it (espeak's left context)
_GAP = " ,;:"  # units between two words of a sentence
# FLUENT (lookahead 0): words wait only for a next word that changes the words ("$5" million), not for one that
# changes only their sounds ("the" apple: ðɪ; "on the": ɔnðə): such a word is read as before any word, and the gap
# after the last complete word goes with it (`TextStream._gap_with_word`). Why: the engine spoke a unit only once
# 11 more were there (text_lookahead 6 + ahead 4 + 1; 5 since speculative encoding), and with Harvard sentences' many
# "the"s and "on the"s, words
# waiting for their next made the text come in lumps (4, 7, 7, 5, 0, 0, 12 units a word for "The birch canoe slid
# on the smooth"), which the start hold had to wait out and which still stalled. Before, only a stream's first 16
# units read this way. Cost, 720 Harvard sentences (lookahead 0): units equal to the whole sentence's in 476 (609
# before), unit edit rate 1.4 % (0.4 %), the edits ðə for ðɪ and espeak's linking; no word lost (`_swallowed`).
# Whisper WER of the first 50 word by word at 5 / 10 / 20 w/s and 1.2x: 12.4 / 11.2 / 11.9 / 12.4 % against 13.4 %
# sent whole (the same seeds), DNSMOS 2.79 / 2.77 / 2.81 / 2.79 against 2.76. Modelled on 100 (`--simulate`,
# 100-199, main's hold): stalls/min at 5 / 10 / 20 w/s and 1.2x 5.9 / 2.2 / 0.3 / 3.0 -> 0.5 / 0 / 0.3 / 0.7 with
# the same or sooner first audio. A lookahead of 1 or more still gives the whole sentence's units.
# Complete words after a word before it is spoken. 0: at once, unless the next word can change its words. Each
# word of lookahead costs a word's time before the first sound (100 ms at 10 words/s).
DEFAULT_LOOKAHEAD = 0
# A stream's first units are handed on only once a player starting at the first chunk is predicted never to run
# dry at the text's pace so far (`TextStream._may_start`). Why: the engine speaks a frame once ENGINE_UNITS follow
# its unit (AR step +4, and itself: units are encoded speculatively, `Engine._prefill`) and completes it
# DELAY_FRAMES steps later (delay pattern), and hands out chunks of 4, 4, 6, 8, 12, then 16 frames
# (`CHUNK_SCHEDULE`), which the hold plans as 2, 4, 8, 16 (`PLANNED_CHUNKS`: a cushion), so the text it needs
# runs ahead of the player by 8 frames + 5 units at the first chunk and 22 frames + 5 units from the 4th (as
# planned). Slow text must be waited for before the start, fast text not. The engine's elastic pacing
# (`streaming.slots.Slots.pace`: up to PACE_STRETCH slower while the text's lead is thin) lets the start come
# sooner: hindsight's earliest start that never stalls (no hold, Harvard 0-49, `--simulate`) 358 -> 300 ms p50 at
# 5 w/s with 1.2 (1.15: 312, 1.25: 291).
# Tuned on Harvard 100-199 and checked on 0-49 through `tts serve` (the tuning history: docs/decisions.md).
SPEECH_UNITS_PER_S = 17.4  # the shipped voices at speed 1: 3.16 words/s, 5.47 units a word (Harvard sentences)
FAST_START = 1.12  # the start's units counted this much faster than SPEECH_UNITS_PER_S (fast first words)
UNITS_PER_CHAR = 1.08  # units per character of English text, spaces included (720 Harvard sentences)
FRAME_S = 1 / CodecConfig().frame_rate  # 20 ms; ENGINE_UNITS and DELAY_FRAMES come from the model's config
PIECE_SPREAD = 0.6  # k pieces to come are counted as k - PIECE_SPREAD * sqrt(k) of the mean size
SLOW_PACE, SLOW_SPREAD = 1.5, 0.9  # text under SLOW_PACE times speech counts with SLOW_SPREAD
PIECE_DELAY_S, SLOW_DELAY_S = 0.03, 0.05  # and each as read this long after it is due (SLOW_DELAY_S: slow text)
# The mean piece counts one more piece of PRIOR_CHARS when that is less (a word's mean length with its space, Harvard
# sentences after the first word; 5.58 units): a long second word ("The beauty ") says little of the next
PRIOR_CHARS = 5.17
START_LATENCY_S = 0.07  # from the start to the first chunk, until the engine has measured its own (`StartLatency`)
# Text in one piece so far (no pace known) starts once the units of its first 14 frames (3 planned chunks) are
# there: with the first chunk's alone (7.8 units) a first piece of 2 words started at once and stalled (100-199,
# 5 w/s: 8 stalls/min at (2, 1.2), 1.0 with 14 frames; 30 frames changed nothing more)
NO_PACE_FRAMES = 14
# The prediction looks 4 s ahead: text slower than speech waits that long, then stalls. 3 s (150 frames) before
# speculative encoding; with 5 units of need it started "The birch canoe slid on the" at 2.5 words/s (slower than
# speech) before the next word, bound to stall (`test_protocol`'s hold case). Simulated 0-49 unchanged but 1.2x p99
# (1,388 -> 1,459 ms): faster text is bound by its first chunks, not by this horizon.
HOLD_HORIZON_FRAMES = 200
# The chunks the hold plans with: those it was tuned with, a first chunk CUSHION_FRAMES shorter than the engine's
# and then chunks that double, where the engine's grow by half (`CHUNK_SCHEDULE`, (4, 4, 6, 8, 12, 16)): its
# start decision is the one it made when the engine's chunks were (2, 4, 8, 16), and the player then starts with
# the engine's larger first chunk, 40 ms more audio in hand when it reaches the 2nd. Why: with 2-frame first
# chunks the 2nd chunk (4 more steps and a codec call after the 1st) came about 16 ms before the player reached
# it (`bench.incremental --simulate`, least_margin_ms), and a slow tick on 2 cores stalled it (one stall at 5 w/s
# and at 1.2x in 50 sentences). The engine's first chunk costs 2 more steps (~12 ms on 2 cores) of first audio
# and no hold. Planning with the engine's own chunks would start sooner (~40 ms at 5 w/s) and spend the cushion
# (--simulate with (4, 4, 8, 16) planned as is: a stall at 1.2x). The plan asks, at each of its chunks' due
# times, for the text of 6 frames + the chunk's size ahead of the player (8, 10, 14, 22, 22, ...); the engine's
# chunks ask for 10, 10, 12, 14, 18, 22, ... at theirs (0, 4, 8, 14, 22, 34 frames against 0, 2, 6, 14, 30):
# from the 2nd on, no more than the plan's last due time before asked; the 1st's 2 frames (0.7 units) more are
# the 2 steps more before the first audio.
PLANNED_CHUNKS = (2, 4, 8, 16)
CUSHION_FRAMES = CHUNK_SCHEDULE[0] - PLANNED_CHUNKS[0]


class StartLatency:
    """An engine's start latency as its streams' start holds plan with it (`TextStream._may_start`): from a held
    start's release (the first units handed on, once the text came in pieces) to the stream's first audio, over
    its last KEEP such starts. Why measured: the player starts when the first chunk comes, so a hold that plans
    with a shorter latency than the engine's waits longer than it needs to (on the 2-core box the first chunk
    comes ~90 ms after the release, the fixed guess was 70 ms) and one that plans with a longer one leaves the
    player less in hand than planned (a GPU's first chunk comes sooner). The hold takes a low one (the
    QUANTILE-th of the kept): a player that starts sooner than planned is the risky side. Until MIN_STARTS
    starts were measured: START_LATENCY_S. Example, KEEP 32, QUANTILE 0.25: 32 starts of 80, 81, ..., 111 ms
    -> sorted, index int(0.25 * 31) = 7 -> 87 ms; 3 starts -> 70 ms (START_LATENCY_S)."""

    KEEP, QUANTILE, MIN_STARTS = 32, 0.25, 4

    def __init__(self):
        self._kept: deque[float] = deque(maxlen=self.KEEP)  # appended by the codec thread, read by callers

    def record(self, seconds: float) -> None:
        self._kept.append(seconds)

    def estimate(self) -> float:
        kept = sorted(self._kept)
        return kept[int(self.QUANTILE * (len(kept) - 1))] if len(kept) >= self.MIN_STARTS else START_LATENCY_S


def engine_lookahead(cfg: ModelConfig, speculative: bool = True) -> tuple[int, int]:
    """(ENGINE_UNITS, DELAY_FRAMES) of a model: the units a frame needs from its own on (the AR step's right
    context + itself; without speculative encoding also the text encoder's right context, `Engine._on_text`)
    and the steps from a frame's start to its completion (codebooks - 1). Example, the shipped shapes
    (text_lookahead 6, ahead 4, 8 codebooks): (5, 7); not speculative (11, 7)."""
    return cfg.text_lookahead * (not speculative) + cfg.ahead + 1, cfg.codebooks - 1


class TextStream:
    # How a sentence is read: `read_sentence` here, or in a process of its own (`ProcessReader`, set per stream)
    reader: Callable[[list[Token], int, bool], tuple[list[str], list[int]]] = staticmethod(read_sentence)
    TRANSIENT = ("reader", "lexicon")  # not in `streaming.stream.object_state` (the lexicon: `Stream.export_state`)
    clock: Callable[[], float] = staticmethod(time.perf_counter)  # when text arrives (`_may_start`)
    lexicon: Lexicon | None = None  # how its words are said (`tts.lexicon`; set before the first text)

    def __init__(
        self,
        max_chars: int = MAX_TEXT_CHARS,
        lookahead_words: int | str | None = None,
        hold_start: bool | ModelConfig = False,
    ):
        """``hold_start``: hold the first units until a player starting at the first chunk would not run dry
        (`_may_start`; what an engine's stream asks for, with its model's config; True: the default shapes)."""
        if lookahead_words is None:
            lookahead_words = DEFAULT_LOOKAHEAD
        if lookahead_words != "auto" and (
            not isinstance(lookahead_words, int) or isinstance(lookahead_words, bool) or not 0 <= lookahead_words <= 32
        ):
            raise ValueError(f"lookahead_words must be 0 to 32 or 'auto', not {lookahead_words!r}")
        self.max_chars, self.lookahead_words = max_chars, lookahead_words
        self._text = ""  # from the open sentence's start on
        self._chars = 0
        self._final = self._closed = self._dirty = False
        self._in_sentence = False  # its '^' was taken, its '$' not yet
        self._done = 0  # tokens of the open sentence whose units were all taken
        self._partial = 0  # units of token _done already taken (espeak joined it to the next word)
        self._gap_taken = False  # the gap after the last unit taken was taken (`_gap_with_word`)
        self._read_alone = False  # the last word taken was the last word there (`_swallowed`)
        self._held: list[int] | None = [] if hold_start else None  # units held before the start (None: started)
        self._may_hold = True  # False: held units go with the next take (`hold_off`)
        self._engine_units, self._delay_frames = engine_lookahead(
            hold_start if isinstance(hold_start, ModelConfig) else ModelConfig()
        )
        self._stretch = PACE_STRETCH  # the engine's elastic pacing at the start (`set_engine_lookahead`)
        self.start_latency_s = START_LATENCY_S  # release -> first chunk, as the engine measured it (`StartLatency`)
        self.paced_release: float | None = None  # when held units went on with the text's pace known (`StartLatency`)
        # the first units, in pieces, went on as soon as they were enough for the first chunk: the text outran the
        # hold's plan, so the engine, not the text, is what the player waits for (`Slots.choose_schedules`)
        self.released_at_once = False
        self._pushes: list[float] = []  # when the first text came, and the latest (perf_counter seconds)
        self._first_chars = 0  # characters of the first piece
        self._unread = 0  # characters come but not yet read into units (a word waiting for the next one)
        self._pieces = 0
        self._lock = threading.Lock()
        self.spoken_any = False
        self._silent: list[int] = []  # units taken before any speech (`_once_speech`)
        self._timings = _WordTimings()
        # When (`clock`) the start went through its stages, the first time each happened (a stats-only timeline,
        # `bench.incremental --timeline`): "read" units first read, "enough" the units held first covered the
        # first chunk (what a start without a pace waits for), "released" units first handed on
        self.marks: dict[str, float] = {}

    # ---- caller side ----------------------------------------------------------------------------
    def push(self, text: str) -> None:
        if not isinstance(text, str):
            raise TextError(f"text must be a string, not {type(text).__name__}")
        with self._lock:
            if self._closed:
                raise TextError("the utterance has ended; start a new one")
            if self._chars + len(text) > self.max_chars:
                raise TextError(
                    f"utterance text would be {self._chars + len(text)} characters; the limit is {self.max_chars}"
                )
            if not text:  # no piece: the text's pace, `in_pieces` and `released_at_once` count text that came
                return
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
    def in_pieces(self) -> bool:
        """Whether the text came in more than one piece so far (a text sent whole never did): the engine's
        elastic pacing (`streaming.slots.Slots.pace`) is for text still arriving."""
        return self._pieces > 1

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
            return self._once_speech(ids, closes)

    def _once_speech(self, ids: list[int], closes: bool) -> tuple[list[int], bool]:
        """Units go on only once something among them is speech (a word or a pause): text that turns out to say
        nothing ("...", "<b>-</b>") then reaches the engine as no units at all, which it refuses before any audio
        (over HTTP a 400, not a 200 whose body breaks off). Example: "..." then "Hi." -> [] then "... Hi." 's units."""
        if self.spoken_any and not self._silent:
            return ids, closes
        self._silent += ids
        if not self.spoken_any:
            return [], closes
        ids, self._silent = self._silent, []
        return ids, closes

    def release_at(self) -> float | None:
        """When (`clock` seconds) the held first units go on if no more text comes before the next piece is due:
        waiting makes a start safer, as the player's deadlines move later while the text keeps its pace. None:
        nothing held, or not before the next piece (whose take decides again). A text thread takes again then
        (`take` re-checks the hold without new text). Example, 5 words/s, "The birch canoe " (18 units held at
        0.4 s, short of what a start then needs): 0.509 s, before the 4th piece is due at 0.6 s (each chunk's
        deadline is 109 ms later, so more of the pieces to come are counted against it)."""
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
        if self.lexicon:
            tokens = self.lexicon.apply(tokens)
        spans = split_sentences(tokens, closes)
        later = not self.spoken_any and len(spans) > 1  # a first take reads the first sentence alone
        if later:
            spans, closes = spans[:1], False
        units, consumed, read_upto = [], 0, 0
        for start, stop, closed in spans:
            sentence = tokens[start:stop]
            units += self._speak(sentence, len(sentence) if closed else self._ready(sentence, usable < ready), closed)
            read_upto = sentence[-1].end if closed or self._done >= len(sentence) else sentence[self._done].start
            consumed = sentence[-1].end if closed else self._forget_spoken(sentence, consumed)
        self._unread = len(text) - read_upto if spans else len(text)  # text come but not read (`_may_start`)
        # closed: every token was read, and what follows the last one says nothing (a closing tag, "</speak>")
        self._text = "" if closes else text[consumed:]
        self._dirty = usable < ready or later  # the rest comes in the next takes
        self._final = final and not closes
        return self._start([SYMBOL_ID[u] for u in units], closes)

    def _start(self, ids: list[int], closes: bool) -> tuple[list[int], bool]:
        """Hold a stream's first units until `_may_start` (or a flush or the end closes them); then hand them
        on, and every later take's units at once."""
        if ids:
            self.marks.setdefault("read", self.clock())
        if self._held is None:
            if ids:
                self.marks.setdefault("released", self.marks["read"])
            return ids, closes
        self._held += ids
        enough_now = "enough" not in self.marks and len(self._held) >= self._first_chunk_units()
        if enough_now:
            self.marks["enough"] = self.clock()
        if not closes and self._may_hold and not self._may_start(len(self._held)):
            return [], False
        ids, self._held = self._held, None
        if ids:
            self.marks["released"] = self.clock()
            if self._pieces > 1:
                self.released_at_once = enough_now and self._may_hold
                # the hold plans with the latency of the starts it held, whose first chunk is CHUNK_SCHEDULE's (the
                # engine gives those it let go at once INCREMENTAL_CHUNKS' larger one)
                self.paced_release = None if self.released_at_once else self.marks["released"]
        return ids, closes

    def set_engine_lookahead(self, units: int, delay_frames: int, stretch: float = PACE_STRETCH) -> None:
        """What the engine needs (`engine_lookahead`) and how much it slows the start (`Slots.pace`), when it is
        not the default (an engine that does not encode speculatively, or paces without stretching): the start
        hold (`_may_start`) counts with it."""
        with self._lock:
            self._engine_units, self._delay_frames, self._stretch = units, delay_frames, stretch

    def _every(self) -> float:
        """Seconds between pieces so far (two pushes or more)."""
        return (self._pushes[1] - self._pushes[0]) / (self._pieces - 1)

    def _may_start(self, units: int, at: float | None = None) -> bool:
        """Whether the engine, given ``units`` now and the rest at the text's pace so far, would hand out every chunk
        before a player that starts at the first one (``start_latency_s`` after ``at``, default now: `StartLatency`)
        reaches it. The
        text to come: what came but waits unread (a word waiting for the next one) with the next piece, and k pieces
        of the mean size (with one more piece of PRIOR_CHARS when that is less) less PIECE_SPREAD * sqrt(k) of one
        (sizes vary; their sum varies less), each counted PIECE_DELAY_S late (text under SLOW_PACE times speech:
        SLOW_SPREAD and SLOW_DELAY_S). Example of the mean: "The beauty " at 3.8 words/s, 7 characters a piece so
        far -> (7 + 5.17) / 2 = 6.1, 6.6 units a piece (25 a second: slow text). A chunk ending at frame E goes out
        once step E + 6 ran, whose unit needs ENGINE_UNITS - 1 after it: ``(E + 6) * 0.39 / stretch + 5`` units
        (SPEECH_UNITS_PER_S * FAST_START, 19.5 a second, slowed by the engine's elastic pacing,
        `streaming.slots.Slots.pace`, which eases off as the predicted lead grows: ``stretch``); it is due when the
        player reaches its first frame. The chunks are PLANNED_CHUNKS, whose first is CUSHION_FRAMES shorter than the
        engine's: a cushion the plan leaves the player. Example, planned (2, 4, 8, 16) for the engine's (4, 4, 6, 8,
        12, 16): the plan has frames 6-13 due when the player reaches frame 6, needing 20 frames' units; the engine
        hands out frames 8-13 due at frame 8 (40 ms of audio later), needing 20 frames' too. The text is as early as
        planned, and the player has 40 ms more in hand when it reaches each chunk, which the engine's steps alone
        make late or not. Example, 10 words/s ("The ", "birch ", "canoe ": 5.6 characters a piece with the prior,
        6.0 units, every 100 ms), stretch 1.2: after "birch " (0.1 s) 11 units wait; the first chunk needs 8 * 0.325
        + 5 = 7.6, the 3rd (frames 6-13, due 0.12 s after the first, 0.19 s after "birch ") 20 * 0.325 + 5 = 11.5,
        and "canoe " counts by then as 6.0 * (1 - 0.6) = 2.4: 13.4; each later one needs 5.2 more per 16 frames
        while 6.0 come every 5: the check passes at once. Text in one piece so far (no pace known: a text sent
        whole, or a client's first batch of words) starts once the units of the first NO_PACE_FRAMES frames are
        there (20 * 0.29 + 5 = 10.8, counted at SPEECH_UNITS_PER_S)."""
        if len(self._pushes) < 2 or self._pushes[1] <= self._pushes[0]:  # no pace known: the first chunk's units
            return units >= self._units_for(NO_PACE_FRAMES)
        last, every = self._pushes[1], self._every()
        came, n = self._chars - self._first_chars, self._pieces - 1  # characters and pieces since the first
        piece = UNITS_PER_CHAR * min(came / n, (came + PRIOR_CHARS) / (n + 1))  # units a piece: a long word is one
        waiting = UNITS_PER_CHAR * self._unread  # come but not read: read when the next piece comes
        since = (self.clock() if at is None else at) - last + self.start_latency_s  # last piece -> first chunk plays
        stretch, per_frame = self._stretch, SPEECH_UNITS_PER_S * FAST_START * FRAME_S
        slow = piece / every < SLOW_PACE * SPEECH_UNITS_PER_S
        spread, delay = (SLOW_SPREAD, SLOW_DELAY_S) if slow else (PIECE_SPREAD, PIECE_DELAY_S)
        spoken = (self._delay_frames - 1) * per_frame / stretch  # units the delay steps cover
        played, end, sizes = 0, 0, iter(PLANNED_CHUNKS)
        while played < HOLD_HORIZON_FRAMES:  # chunk by chunk: due when the player reaches its first frame
            played, end = end, end + (size := next(sizes, PLANNED_CHUNKS[-1]))
            spoken += size * per_frame / stretch
            pieces = max(0.0, (played * FRAME_S + since - delay) // every)  # to come and be read by then
            there = units + (waiting + piece * (pieces - spread * pieces**0.5) if pieces >= 1 else 0.0)
            if there < spoken + self._engine_units:
                return False
            stretch = min(stretch, pace_factor(there - spoken, self._stretch))  # the engine's, as its lead grows
        return True

    def _units_for(self, end: int) -> float:
        """Units the engine needs to hand out a chunk ending at frame ``end`` while it speaks at the start's
        pace (`_may_start`). Example, the shipped shapes (5 units, 7 delay frames), stretch 1.2: end 2 ->
        (2 + 6) * 0.348 / 1.2 + 5 = 7.3."""
        return (end + self._delay_frames - 1) * SPEECH_UNITS_PER_S * FRAME_S / self._stretch + self._engine_units

    def _first_chunk_units(self) -> float:
        return self._units_for(PLANNED_CHUNKS[0])

    def _ready(self, tokens: list[Token], more: bool = False) -> int:
        """How many of an open sentence's complete tokens may be spoken now; ``more``: complete words follow
        beyond this take (a long text read TAKE_CHARS at a time), so the last word waits to be read with them."""
        n = len(tokens)
        if self.lookahead_words == "auto":
            return n - 2 if n - self._done >= PARTIAL_WORDS else 0
        ready = n - self.lookahead_words
        last = tokens[-1]
        if ready == n and (reads_by_next(last) or more):
            ready -= 1  # the next word may change its words (FLUENT: not for its sounds alone), or is there
        if ready == n and sentence_end(tokens, n - 1) is None:
            ready -= 1  # "slid." may end the sentence: its '.' and '$' or not
        return ready

    def _speak(self, tokens: list[Token], ready: int, closed: bool) -> list[str]:
        """Take the units of tokens [_done, ready) of one sentence (all that is left if ``closed``)."""
        if not closed and ready <= self._done:
            return []
        units, owners = self.reader(tokens, max(0, self._done - CONTEXT_WORDS), closed)
        if self._in_sentence and self._swallowed(tokens, owners, len(tokens) if closed else ready):
            units, owners = self.reader(tokens, self._done, closed)  # without the words already spoken
        start = self._resume(units, owners) if self._in_sentence else 0
        cut = len(units) if closed else self._cut(units, owners, start, ready)
        if not closed:
            cut = self._gap_with_word(units, owners, cut, len(tokens))
        if cut > start:
            self._gap_taken = not closed and owners[cut - 1] < 0 and units[cut - 1] in _GAP
        taken = units[start:cut]
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
                self._read_alone = self._done == len(tokens)  # read before any next word (`_swallowed`)
            self._timings.complete(self._done)
        # a pause is something to say too: "<speak><break time='1s'/></speak>" is a second of silence, not an error
        self.spoken_any = (
            self.spoken_any
            or any(u.isalpha() for u in taken)
            or any(tokens[o].kind == "pause" and tokens[o].pause_ms > 0 for o in owners[start:cut] if o >= 0)
        )
        return taken

    def _swallowed(self, tokens: list[Token], owners: list[int], ready: int) -> bool:
        """Whether a word to take now owns no unit: espeak joined it into a word already spoken, read before this
        one came (FLUENT). Example: "of " was taken as ʌv (read as "of people"); with "a " come, "of a" reads
        əvə, all of it the spoken "of"'s, so "a" would be lost: it is read again without "of" (ɐ)."""
        if not self._read_alone:
            return False  # spoken as read with the words after it: what espeak joined to it went with it
        first = self._done + (1 if self._partial else 0)
        for k in range(first, ready):
            if k in owners:
                return False  # a word not yet spoken owns units before any later one could have lost its own
            if tokens[k].kind == "word" and any(c.isalnum() for c in tokens[k].text):
                return True
        return False

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
        (`_gap_with_word`). Example: owners [-1, 0, 0, -1, 1, 1, 2], _done 2 -> 6."""
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

    def _gap_with_word(self, units: list[str], owners: list[int], cut: int, complete: int) -> int:
        """The gap after the last complete word goes with it when every complete word is taken (FLUENT): the
        engine speaks a unit once 11 more are there, and this gap is often the one unit missing. The gap is read
        before the next word arrives, as before any word (`_TO_COME`): wrong only where espeak would run the two
        words together, almost only before "the" ("on the" -> ɔnðə): 3 % of the word gaps of the Harvard
        sentences. Example: ^ ð ə ␣ b ˈ ɜ ː t ʃ ␣ p ... ("The birch "): cut 10 -> 11."""
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

    def word_timings(
        self, first_unit: int, start_frames: list[int], durations: list[int], frame_s: float
    ) -> list[dict]:
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
                done.append(
                    {"word": self.words.pop(word), "start": round(start * frame_s, 3), "end": round(end * frame_s, 3)}
                )
                del self.last_unit[word]
        self._forget(first_unit + len(durations))
        return done

    def _forget(self, upto: int) -> None:
        """Drop the unit table before ``upto`` once it is long: memory stays flat on long speech."""
        old = upto - self.unit_base
        if old > 4096:
            del self.unit_word[:old]
            self.unit_base = upto
