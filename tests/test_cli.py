"""The `tts` command line, run as a real subprocess."""
import subprocess
import sys

import soundfile as sf

from tts.voices import voice_presets


def tts(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "tts.cli", *args], capture_output=True, text=True, timeout=300,
                          cwd=cwd)


def test_say_writes_a_24khz_mono_wav(tmp_path):
    out = tmp_path / "out.wav"
    result = tts("say", "Good morning.", "--voice", "slt", "--speed", "1.1", "-o", str(out))
    assert result.returncode == 0, result.stderr
    audio, sr = sf.read(out)
    info = sf.info(out)
    assert sr == 24_000 and info.channels == 1 and info.subtype == "PCM_16"
    assert 0.3 < len(audio) / sr < 5
    assert list(tmp_path.iterdir()) == [out]  # no temp file left behind


def test_voices_lists_every_voice():
    result = tts("voices")
    assert result.returncode == 0
    assert all(name in result.stdout for name in voice_presets())
    assert "(default)" in result.stdout


def test_bad_input_is_a_clear_error_and_writes_nothing(tmp_path):
    out = tmp_path / "never.wav"
    for args in (["say", "Hi.", "--voice", "nobody"], ["say", "   "], ["say", "Hi.", "--speed", "9"]):
        result = tts(*args, "-o", str(out))
        assert result.returncode == 2 and result.stderr.startswith("error:")
        assert not out.exists()
