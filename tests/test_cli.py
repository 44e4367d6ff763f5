"""The `tts` command line, run as a real subprocess on the shipped voices; its sinks and subtitle writer in-process."""

import io
import json
import os
import signal
import subprocess
import sys
import time

import av
import numpy as np
import pytest
import soundfile as sf

from tts import SAMPLE_RATE, subtitles
from tts.cli import utterances
from tts.output import FORMATS, file_sink, format_for, stdout_sink
from tts.voices import voice_presets

PARAGRAPHS = "Good morning. The train leaves at seven.\n\nPlease bring a warm coat and an umbrella."


def tts(*args, stdin=None, env=None, timeout=300):
    return subprocess.run(
        [sys.executable, "-m", "tts.cli", *args],
        input=stdin,
        capture_output=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


def decoded(path, fmt: str) -> np.ndarray:
    """The audio of a written file, decoded by FFmpeg (PyAV), as float32 mono."""
    if fmt == "pcm":
        return np.fromfile(path, dtype="<i2").astype(np.float32) / 32767
    with av.open(str(path)) as container:
        audio = np.concatenate([frame.to_ndarray().reshape(-1) for frame in container.decode(audio=0)])
    return audio / 32768 if audio.dtype == np.int16 else audio.astype(np.float32)


def test_say_writes_a_24khz_mono_wav(tmp_path):
    out = tmp_path / "out.wav"
    result = tts("say", "Good morning.", "--voice", "slt", "--speed", "1.1", "-o", str(out))
    assert result.returncode == 0, result.stderr
    audio, sr = sf.read(out)
    info = sf.info(out)
    assert sr == 24_000 and info.channels == 1 and info.subtype == "PCM_16"
    assert 0.3 < len(audio) / sr < 5
    assert list(tmp_path.iterdir()) == [out]  # no temp file left behind


def test_stdin_to_stdout_streams_a_wav():
    result = tts("say", "-", "-o", "-", "-q", stdin=b"Hello from standard input.")
    assert result.returncode == 0, result.stderr
    audio, sr = sf.read(io.BytesIO(result.stdout))
    assert sr == SAMPLE_RATE and 0.5 < len(audio) / sr < 6 and result.stderr == b""


def test_files_become_utterances_with_subtitles(tmp_path):
    first, second = tmp_path / "one.txt", tmp_path / "two.txt"
    first.write_text(PARAGRAPHS)
    second.write_text("The end.")
    out, srt, vtt = tmp_path / "book.ogg", tmp_path / "book.srt", tmp_path / "book.vtt"
    result = tts("say", "-i", str(first), "-i", str(second), "-o", str(out), "--subtitles", str(srt))
    assert result.returncode == 0, result.stderr
    duration = len(decoded(out, "opus")) / 48_000
    cues = srt.read_text().strip().split("\n\n")
    spoken = " ".join(cue.split("\n", 2)[2] for cue in cues).split()
    assert spoken == (PARAGRAPHS + " The end.").split()  # every word as written, in order, once
    times = [cue.split("\n")[1].split(" --> ") for cue in cues]
    starts = [subtitles.timestamp(0, ",") <= a <= b for a, b in times]
    assert all(starts) and [a for a, _ in times] == sorted(a for a, _ in times)
    assert times[-1][1] <= subtitles.timestamp(duration + 0.05, ",")
    result = tts("say", "Short and sweet.", "-o", str(tmp_path / "x.mp3"), "--subtitles", str(vtt))
    assert result.returncode == 0 and vtt.read_text().startswith("WEBVTT\n\n00:00:0")


def test_say_through_a_running_server(server, tmp_path):
    """`--server`: the same outputs, the audio streamed from the server (conftest: a real one, tiny engine)."""
    out = tmp_path / "served.flac"
    result = tts("say", "Hello over the wire.", "--server", server.ws_url, "-o", str(out), "--voice", "slt")
    assert result.returncode == 0, result.stderr
    assert sf.info(out).samplerate == SAMPLE_RATE and sf.info(out).frames > SAMPLE_RATE // 4
    result = tts("say", "Hello.", "--server", server.ws_url, "--voice", "nobody", "-o", str(out))
    assert result.returncode == 2 and b"unknown_voice" in result.stderr


def test_every_failure_has_its_exit_code_and_leaves_no_file(tmp_path):
    out = tmp_path / "never.wav"
    cases = {
        2: [
            ["say", "Hi.", "--voice", "nobody"],
            ["say", "   "],
            ["say", "Hi.", "--speed", "9"],
            ["say"],
            ["say", "Hi.", "-o", str(tmp_path / "never.txt")],
            ["say", "Hi.", "--subtitles", "x.doc"],
        ],
        3: [["say", "-i", str(tmp_path / "missing.txt")], ["say", "Hi.", "-o", str(tmp_path / "no" / "x.wav")]],
        5: [["say", "Hi.", "--server", "ws://127.0.0.1:9"]],
    }
    for code, runs in cases.items():
        for args in runs:
            args = args + ["-o", str(out)] if "-o" not in args else args
            result = tts(*args)
            assert result.returncode == code, (args, result.stderr)
            assert result.stderr.decode().startswith("error:"), args
    assert list(tmp_path.iterdir()) == []


def test_ctrl_c_stops_cleanly_and_leaves_no_partial_file(tmp_path):
    text = tmp_path / "long.txt"
    text.write_text("\n\n".join(["The quick brown fox jumps over the lazy dog near the river bank."] * 40))
    proc = subprocess.Popen(
        [sys.executable, "-m", "tts.cli", "say", "-i", str(text), "-o", str(tmp_path / "a.mp3")], stderr=subprocess.PIPE
    )
    deadline = time.monotonic() + 120
    while not any(p.suffix == ".part" and p.stat().st_size for p in tmp_path.iterdir()):  # audio is being written
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=30) == 130
    assert b"interrupted" in proc.stderr.read()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["long.txt"]


def test_playback_streams_to_the_sound_device_or_says_there_is_none(tmp_path):
    """With PortAudio, ALSA's default device is pointed at a file (HOME/.asoundrc) and must receive the
    speech; without it the command says how to write a file instead, with exit code 4."""
    try:
        import sounddevice  # noqa: F401
    except (ImportError, OSError):  # no sounddevice package, or the package without the PortAudio library
        result = tts("say", "Hello.")
        assert result.returncode == 4 and b"-o out.wav" in result.stderr
        return
    played, written = tmp_path / "played.raw", tmp_path / "written.wav"
    (tmp_path / ".asoundrc").write_text(
        f'pcm.!default {{ type file; slave.pcm "null"; file "{played}"; format "raw" }}\n'
    )
    text = "Hello there, this goes to the speaker."
    result = tts("say", text, "--seed", "3", env={"HOME": str(tmp_path)})
    assert result.returncode == 0, result.stderr
    assert tts("say", text, "--seed", "3", "-o", str(written)).returncode == 0
    audio, reference = np.fromfile(played, dtype="<f4"), sf.read(written, dtype="float32")[0]
    assert len(audio) == len(reference) and np.abs(audio - reference).max() < 1e-4  # all of it, as generated


def test_voices_lists_every_voice():
    result = tts("voices")
    assert result.returncode == 0
    assert all(name in result.stdout.decode() for name in voice_presets())
    assert "(default)" in result.stdout.decode()
    listing = json.loads(tts("voices", "--json").stdout)
    assert [v["name"] for v in listing["voices"]] == list(voice_presets())
    assert listing["sample_rate"] == SAMPLE_RATE and listing["default"] in voice_presets()


# ---- in-process: formats, utterances, subtitles -----------------------------------------------------
def speechlike(seconds: float = 1.0) -> np.ndarray:
    t = np.arange(int(seconds * SAMPLE_RATE)) / SAMPLE_RATE
    return (0.4 * np.sin(2 * np.pi * 220 * t) * np.sin(2 * np.pi * 3 * t)).astype(np.float32)


@pytest.mark.parametrize("suffix", sorted(FORMATS))
def test_every_suffix_writes_its_format_chunk_by_chunk(tmp_path, suffix):
    audio, path = speechlike(), tmp_path / f"out{suffix}"
    fmt = format_for(path)
    with file_sink(path, fmt) as write:
        for start in range(0, len(audio), 1920):
            write(audio[start : start + 1920])
    assert [p.name for p in tmp_path.iterdir()] == [path.name]
    back = decoded(path, fmt)
    rate = 48_000 if fmt == "opus" else SAMPLE_RATE
    assert abs(len(back) / rate - 1.0) < 0.1  # codecs pad a little
    if fmt in ("wav", "flac", "pcm"):  # lossless: the samples themselves, to 16-bit rounding
        assert np.abs(back[: len(audio)] - audio).max() < 1e-4
        if fmt != "pcm":
            assert sf.info(path).frames == len(audio)  # the header was completed: the length is known


def test_a_failed_write_leaves_no_file(tmp_path):
    path = tmp_path / "out.flac"
    with pytest.raises(KeyboardInterrupt), file_sink(path, "flac") as write:
        write(speechlike())
        raise KeyboardInterrupt
    assert list(tmp_path.iterdir()) == []


def test_stdout_sink_streams_bytes_as_they_come():
    out = io.BytesIO()
    with stdout_sink("pcm", out) as write:
        write(speechlike(0.1))
        assert len(out.getvalue()) == 2 * 2400  # written before the end
    assert len(out.getvalue()) == 2 * 2400


def test_format_from_suffix_or_flag():
    assert [format_for(p) for p in ("a.wav", "b.OGG", "c.opus", "d.raw", "-")] == ["wav", "opus", "opus", "pcm", "wav"]
    assert format_for("-", "mp3") == "mp3" and format_for("x.wav", "flac") == "flac"
    for bad in ("notes.txt", "noext"):
        with pytest.raises(ValueError, match="suffix"):
            format_for(bad)


def test_utterances_are_paragraphs_and_long_ones_split_between_sentences():
    assert utterances(PARAGRAPHS) == [
        "Good morning. The train leaves at seven.",
        "Please bring a warm coat and an umbrella.",
    ]
    assert utterances("One. Two.\n\nA long first sentence. And more.", limit=30) == [
        "One. Two.",
        "A long first sentence.",
        "And more.",
    ]
    assert utterances("  \n\n ") == []
    book = " ".join(f"Sentence number {i} is here." for i in range(400))
    parts = utterances(book)
    assert " ".join(parts) == book and all(len(p) <= 1500 for p in parts)


WORDS = [
    {"word": "Hello", "start": 0.05, "end": 0.4},
    {"word": "there.", "start": 0.4, "end": 0.9},
    {"word": "It", "start": 1.2, "end": 1.3},
    {"word": "costs", "start": 1.3, "end": 1.6},
    {"word": "$5", "start": 1.6, "end": 2.4},
    {"word": "and", "start": 2.4, "end": 2.5},
    {"word": "it", "start": 2.5, "end": 2.6},
    {"word": "is", "start": 2.6, "end": 2.7},
    {"word": "worth", "start": 2.7, "end": 3.0},
    {"word": "every", "start": 3.0, "end": 3.3},
    {"word": "cent!", "start": 3.3, "end": 3.6},
]


def test_srt_and_vtt_from_a_word_list():
    assert subtitles.render(WORDS, "srt") == (
        "1\n00:00:00,050 --> 00:00:00,900\nHello there.\n\n"
        "2\n00:00:01,200 --> 00:00:02,600\nIt costs $5 and it\n\n"  # 9 words: two even cues of at most 7
        "3\n00:00:02,600 --> 00:00:03,600\nis worth every cent!\n"
    )
    assert subtitles.timestamp(3725.5, ",") == "01:02:05,500" and subtitles.timestamp(-0.01, ".") == "00:00:00.000"
    assert subtitles.render(WORDS[:2], "vtt") == "WEBVTT\n\n00:00:00.050 --> 00:00:00.900\nHello there.\n"
    assert subtitles.render([], "srt") == "" and subtitles.render([], "vtt") == "WEBVTT\n\n"


def test_long_words_make_short_cues():
    slow = [{"word": f"w{i}", "start": i * 1.0, "end": i * 1.0 + 0.9} for i in range(6)]
    assert [c[2] for c in subtitles.cues(slow)] == ["w0 w1 w2", "w3 w4 w5"]  # no cue runs past 3.5 s
