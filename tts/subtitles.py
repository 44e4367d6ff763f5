"""Subtitles from word timings: SRT and WebVTT files for `tts say --subtitles`.

Words are ``{"word", "start", "end"}`` dicts (seconds on the audio's clock), as `Stream.take_word_timings()`
gives them. They are grouped into cues that a reader can follow: a cue ends after a sentence's last word,
after MAX_CUE_WORDS words, or before it would run past MAX_CUE_S seconds. The two formats differ only in
their header and the decimal mark of the time stamps, so both are written here rather than by two libraries.
"""
from __future__ import annotations

from pathlib import Path

from tts.output import atomic_file

MAX_CUE_WORDS = 7
MAX_CUE_S = 3.5


def cues(words: list[dict]) -> list[tuple[float, float, str]]:
    """Words -> (start s, end s, text) cues. Sentence ends are the text front end's ("Dr. Li" is not one).
    Example: [Hello 0.0-0.4] [there. 0.4-0.9] [How 1.2-1.4] ... -> (0.0, 0.9, "Hello there.") (1.2, ...)"""
    from tts.normalize import Token, split_sentences
    ends = {stop - 1 for _, stop, _ in split_sentences([Token(w["word"], 0, 0) for w in words], final=True)}
    out, current = [], []
    for i, word in enumerate(words):
        if current and (len(current) == MAX_CUE_WORDS or word["end"] - current[0]["start"] > MAX_CUE_S):
            out.append(current)
            current = []
        current.append(word)
        if i in ends:
            out.append(current)
            current = []
    if current:
        out.append(current)
    return [(c[0]["start"], max(c[-1]["end"], c[0]["start"]), " ".join(w["word"] for w in c)) for c in out]


def timestamp(seconds: float, mark: str) -> str:
    """3725.5 s -> "01:02:05,500" (mark ",", SRT) or "01:02:05.500" (mark ".", WebVTT)."""
    ms = round(max(seconds, 0.0) * 1000)
    return f"{ms // 3_600_000:02d}:{ms // 60_000 % 60:02d}:{ms // 1000 % 60:02d}{mark}{ms % 1000:03d}"


def render(words: list[dict], fmt: str) -> str:
    """The text of an ``srt`` or ``vtt`` file."""
    mark = "," if fmt == "srt" else "."
    blocks = [f"{timestamp(start, mark)} --> {timestamp(end, mark)}\n{text}\n" for start, end, text in cues(words)]
    if fmt == "srt":
        return "\n".join(f"{i}\n{block}" for i, block in enumerate(blocks, 1))
    return "WEBVTT\n\n" + "\n".join(blocks)


def subtitle_format(path: str | Path) -> str:
    suffix = Path(path).suffix.lower().lstrip(".")
    if suffix not in ("srt", "vtt"):
        raise ValueError(f"subtitles are written as .srt or .vtt, not {str(path)!r}")
    return suffix


def write(path: str | Path, words: list[dict]) -> None:
    """Write subtitles atomically: the file appears complete or not at all."""
    text = render(words, subtitle_format(path))
    with atomic_file(path, "w") as file:
        file.write(text)
