"""Map a teacher's phone timings onto our espeak phoneme units.

flite and festival report ARPAbet-style phones with end times; the model speaks
espeak IPA units. We spell each teacher phone in IPA, align the two character
sequences by edit distance, and give every teacher character's time to the unit
it aligned with (or, if it aligned with nothing, to the unit before it).

Worked example: units ``^ h ə l ˈ o ʊ $`` and teacher phones
``pau(0-.16) hh(-.25) ax(-.28) l(-.33) ow(-.40) pau(-.60)``. ``ow`` spells ``oʊ``,
each of its two characters gets .035 s; ``ˈ`` aligns with nothing and gets 0 s;
``^`` takes the first pause and ``$`` the last, so the durations are
``[.16, .09, .03, .05, 0, .035, .035, .20]`` and they sum to the audio length.
"""

from __future__ import annotations

import numpy as np

ARPABET_IPA = {
    "aa": "ɑ",
    "ae": "æ",
    "ah": "ʌ",
    "ao": "ɔ",
    "aw": "aʊ",
    "ax": "ə",
    "axr": "ɚ",
    "ay": "aɪ",
    "eh": "ɛ",
    "er": "ɚ",
    "ey": "eɪ",
    "ih": "ɪ",
    "ix": "ɪ",
    "iy": "i",
    "ow": "oʊ",
    "oy": "ɔɪ",
    "uh": "ʊ",
    "uw": "u",
    "b": "b",
    "ch": "tʃ",
    "d": "d",
    "dh": "ð",
    "dx": "ɾ",
    "el": "əl",
    "em": "əm",
    "en": "ən",
    "f": "f",
    "g": "ɡ",
    "hh": "h",
    "h": "h",
    "jh": "dʒ",
    "k": "k",
    "l": "l",
    "m": "m",
    "n": "n",
    "ng": "ŋ",
    "nx": "ŋ",
    "p": "p",
    "r": "ɹ",
    "s": "s",
    "sh": "ʃ",
    "t": "t",
    "th": "θ",
    "v": "v",
    "w": "w",
    "y": "j",
    "z": "z",
    "zh": "ʒ",
    "pau": " ",
    "h#": " ",
    "sil": " ",
    "ssil": " ",
}
VOWELS = set("aeiouæɐɑɒɔəɚɛɜɪʊʌᵻɘɵʉɨ")
PAUSE_LIKE = set("^$ ,.!?;:-")
MODIFIERS = set("ˈˌːˑʲ̩̯̃")


def _cost(unit: str, char: str) -> float:
    if unit == char:
        return 0.0
    if char == " ":
        return 0.0 if unit in PAUSE_LIKE else 4.0
    if unit in PAUSE_LIKE or unit in MODIFIERS:
        return 4.0
    if (unit in VOWELS) == (char in VOWELS):
        return 1.0
    return 2.5


def _gap_unit(unit: str) -> float:
    return 0.1 if unit in MODIFIERS or unit in PAUSE_LIKE else 1.0


def align_durations(units: list[str], phones: list[tuple[str, float]], total_s: float) -> np.ndarray:
    """Seconds per unit, summing to ``total_s``. ``phones`` holds (name, end time)."""
    chars, spans, start = [], [], 0.0
    for name, end in phones:
        spelling = ARPABET_IPA.get(name.lower(), "ə")
        step = max(end - start, 0.0) / len(spelling)
        chars += list(spelling)
        spans += [step] * len(spelling)
        start = end
    if chars:
        spans[-1] += max(total_s - start, 0.0)
    n, m = len(units), len(chars)
    cost = np.zeros((n + 1, m + 1))
    cost[1:, 0] = np.cumsum([_gap_unit(u) for u in units])
    cost[0, 1:] = np.arange(1, m + 1) * 1.0
    move = np.zeros((n + 1, m + 1), dtype=np.int8)  # 0 diagonal, 1 skip unit, 2 skip char
    move[1:, 0], move[0, 1:] = 1, 2
    for i in range(1, n + 1):
        unit, gap = units[i - 1], _gap_unit(units[i - 1])
        for j in range(1, m + 1):
            options = (cost[i - 1, j - 1] + _cost(unit, chars[j - 1]), cost[i - 1, j] + gap, cost[i, j - 1] + 1.0)
            best = min(range(3), key=options.__getitem__)
            cost[i, j], move[i, j] = options[best], best
    owner = np.zeros(m, dtype=np.int64)
    i, j = n, m
    while i > 0 or j > 0:
        step = move[i, j]
        if step == 0:
            owner[j - 1] = i - 1
            i, j = i - 1, j - 1
        elif step == 1:
            i -= 1
        else:
            owner[j - 1] = max(i - 1, 0)  # an unmatched teacher char belongs to the unit before it
            j -= 1
    seconds = np.zeros(n)
    np.add.at(seconds, owner, spans)
    return seconds
