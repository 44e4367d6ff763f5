"""Loudness: ITU-R BS.1770 integrated loudness (pyloudnorm's meter) and true peak, per-voice gains, and
`tts say --loudness LUFS` for files.

Every shipped voice carries ``gain_db`` in voices/voices.json (`python -m bench.loudness --write` measures it on
Harvard sentences), so that each comes out at about TARGET_LUFS with its true peak at or below PEAK_DBTP (the
gain, then a soft limiter: `level`); a blend's gain is the weighted mean of its voices'
(`tts.voices.blend_preset`), and the engine applies it to every chunk it delivers (`streaming.stream.Stream.deliver`).
pyloudnorm (``pip install "tts[loudness]"``) is needed only to measure, not to apply a gain.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import numpy as np
import soxr

TARGET_LUFS = -16.0  # what podcast and voice platforms normalise speech to
PEAK_DBTP = -1.0  # true-peak ceiling (EBU R128 / ITU-R BS.1770's inter-sample peaks)
OVERSAMPLE = 4  # true peak: the signal's peak after 4x oversampling (BS.1770-4 Annex 2)
# The shipped voices' speech is peaky (joe: true peak +0.25 dBTP at -21 LUFS, a 21 dB peak-to-loudness ratio), so a
# gain alone cannot give -16 LUFS under -1 dBTP: a soft limiter follows the gain. Memoryless (no look-ahead, no
# state: no latency, chunk boundaries do not matter): samples above KNEE_DB below CEILING_DBFS bend smoothly
# (tanh) towards the ceiling, which leaves room for the peaks between samples. Why a 2 dB knee: Whisper tiny.en WER
# on Harvard 60-89, slt at its gain alone (peaks unbounded) 8.60 %, with a 6 dB knee 11.46 %, 2 dB 10.03 %; a
# block limiter (2 ms blocks, gain down at once, 0.5 dB a block back up) 11.46 %; rms 12.49 % alone and with 6 dB.
CEILING_DBFS, KNEE_DB = -1.5, 2.0


def gain(db: float) -> float:
    """Decibels -> a linear factor. Example: -6.02 -> 0.5."""
    return float(10 ** (db / 20))


def limited(audio: np.ndarray) -> np.ndarray:
    """``audio`` (float32) with its peaks bent under CEILING_DBFS (`CEILING_DBFS`'s comment). Example, ceiling
    -1.5 dBFS (0.841), knee 2 dB (from 0.668): 0.5 -> 0.5; 0.75 -> 0.744; 2.0 -> 0.841."""
    ceiling = gain(CEILING_DBFS)
    knee = ceiling * gain(-KNEE_DB)
    magnitude = np.abs(audio)
    over = magnitude > knee
    if not over.any():
        return audio
    out = audio.copy()
    bent = knee + (ceiling - knee) * np.tanh((magnitude[over] - knee) / (ceiling - knee))
    out[over] = np.sign(audio[over]) * bent
    return out


def level(audio: np.ndarray, db: float) -> np.ndarray:
    """A voice's output at its gain: ``audio`` times the gain, then `limited` (what `Stream.deliver` does)."""
    return limited(audio * np.float32(gain(db)))


def integrated_lufs(audio: np.ndarray, sample_rate: int) -> float:
    """Integrated loudness (LUFS, gated, K-weighted) of mono float audio."""
    try:
        import pyloudnorm
    except ImportError as err:
        raise ImportError('measuring loudness needs pyloudnorm: pip install "tts[loudness]"') from err
    return float(pyloudnorm.Meter(sample_rate).integrated_loudness(np.asarray(audio, dtype=np.float64)))


def true_peak_dbtp(audio: np.ndarray, sample_rate: int) -> float:
    """The true peak in dBTP: the largest magnitude after OVERSAMPLE x oversampling."""
    up = soxr.resample(np.asarray(audio, dtype=np.float32), sample_rate, sample_rate * OVERSAMPLE, quality="VHQ")
    peak = max(float(np.max(np.abs(up))) if len(up) else 0.0, float(np.max(np.abs(audio))) if len(audio) else 0.0)
    return 20 * np.log10(max(peak, 1e-9))


def gain_to(audio: np.ndarray, sample_rate: int, lufs: float = TARGET_LUFS, rounds: int = 4) -> float:
    """The gain in dB that brings ``audio`` to ``lufs`` through `level` (the limiter takes a little loudness off
    the peaks: a few rounds of measuring again)."""
    db = 0.0
    for _ in range(rounds):
        db += lufs - integrated_lufs(level(audio, db), sample_rate)
    return db


def normalized(chunks: Iterable, sample_rate: int, lufs: float) -> Iterator:
    """The chunks (``None`` markers passed through) brought to ``lufs`` as a whole through `level`: all are read
    first (a whole file's loudness is known only at its end), then given again. For files."""
    held = list(chunks)
    audio = [c for c in held if c is not None]
    if not audio or not sum(map(len, audio)):
        yield from held
        return
    db = gain_to(np.concatenate(audio), sample_rate, lufs)
    for chunk in held:
        if chunk is None:
            yield chunk
            continue
        scaled = chunk.copy()  # a Chunk's copy keeps its words and times
        scaled[:] = level(np.asarray(chunk), db)
        yield scaled
