"""Loudness (`tts.loudness`): every shipped voice at about -16 LUFS (ITU-R BS.1770, pyloudnorm's meter) with its
true peak at or below -1 dBTP, all within 1 LU of each other, on sentences the gains were not fitted on (they
were fitted on Harvard sentences 0-29, `bench.loudness`); a blend's gain is its voices' weighted mean; `tts say
--loudness` brings a file to the loudness asked."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import soundfile as sf

pytest.importorskip("pyloudnorm", reason='needs pip install "tts[loudness]"')

from tts import SAMPLE_RATE  # noqa: E402
from tts.loudness import PEAK_DBTP, TARGET_LUFS, integrated_lufs, limited, true_peak_dbtp  # noqa: E402
from tts.voices import blend_preset, voice_presets  # noqa: E402

HELD_OUT = [
    "Please bring a warm coat and an umbrella to the station.",
    "The museum opens at nine and closes late on Fridays.",
    "She folded the map, thanked the driver and walked up the hill.",
    "Our new kettle boils water in less than two minutes.",
    "A quiet river runs behind the old mill near the village.",
]


@pytest.fixture(scope="module")
def levels(shipped_engine):
    from tts.api import synthesize

    out = {}
    for voice in shipped_engine.voices:
        audio = np.concatenate(
            [synthesize(t, voice=voice, engine=shipped_engine, seed=i) for i, t in enumerate(HELD_OUT)]
        )
        out[voice] = (integrated_lufs(audio, SAMPLE_RATE), true_peak_dbtp(audio, SAMPLE_RATE))
    return out


def test_every_voice_at_about_minus_16_lufs_under_minus_1_dbtp(levels):
    for voice, (lufs, peak) in levels.items():
        assert abs(lufs - TARGET_LUFS) <= 1.0, (voice, lufs)
        assert peak <= PEAK_DBTP, (voice, peak)
    spread = max(lufs for lufs, _ in levels.values()) - min(lufs for lufs, _ in levels.values())
    assert spread <= 1.0, levels


def test_every_shipped_voice_has_a_gain_and_a_blend_gets_the_weighted_mean():
    presets = voice_presets()
    assert all("gain_db" in p for p in presets.values())
    blend = blend_preset("joe:0.25+slt:0.75", presets, 0.7)
    assert blend["gain_db"] == pytest.approx(
        0.25 * presets["joe"]["gain_db"] + 0.75 * presets["slt"]["gain_db"], abs=0.01
    )


def test_the_limiter_bends_peaks_under_the_ceiling_and_leaves_the_rest():
    x = np.array([0.1, -0.3, 0.6, -2.0, 5.0], dtype=np.float32)
    y = limited(x)
    assert np.array_equal(y[:2], x[:2]) and np.all(np.abs(y) < 0.85) and np.all(np.sign(y) == np.sign(x))
    assert np.all(np.diff(limited(np.linspace(0, 3, 1000, dtype=np.float32))) >= 0)  # monotonic


def test_say_loudness_brings_a_file_to_the_loudness_asked(tmp_path):
    out = tmp_path / "quiet.wav"
    done = subprocess.run(
        [sys.executable, "-m", "tts.cli", "say", " ".join(HELD_OUT[:2]), "-q", "-o", str(out), "--loudness", "-23"],
        capture_output=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    audio, rate = sf.read(out, dtype="float32")
    assert abs(integrated_lufs(audio, rate) + 23) <= 0.5 and true_peak_dbtp(audio, rate) <= PEAK_DBTP
    refused = subprocess.run(
        [sys.executable, "-m", "tts.cli", "say", "Hi.", "--loudness", "-16"], capture_output=True, timeout=300
    )
    assert refused.returncode == 2 and b"--loudness" in refused.stderr
