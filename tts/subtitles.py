"""Subtitles from word timings: SRT and WebVTT files for `tts say --subtitles`.

Words are ``{"word", "start", "end"}`` dicts (seconds on the audio's clock), as `Stream.take_word_timings()`
gives them. They are grouped into cues that a reader can follow: a cue ends with its sentence, holds at most
MAX_CUE_WORDS words and lasts at most MAX_CUE_S seconds (unless one word alone is longer). The two formats
differ only in their header and the decimal mark of the time stamps, so both are written here rather than
by two libraries.
"""

from __future__ import annotations

from pathlib import Path

from tts.output import atomic_file

MAX_CUE_WORDS = 7
MAX_CUE_S = 3.5


def cues(words: list[dict]) -> list[tuple[float, float, str]]:
    """Words -> (start s, end s, text) cues. Each sentence (the text front end's: "Dr. Li" does not end one)
    is cut into the fewest cues of at most MAX_CUE_WORDS words, as even as can be, and a cue that would run
    past MAX_CUE_S seconds is cut before the word that would take it there.
    Example: "Hello there." + a 9-word sentence -> "Hello there." | first 5 words | last 4 words."""
    from tts.normalize import Token, split_sentences

    out = []
    for start, stop, _ in split_sentences([Token(w["word"], 0, 0) for w in words], final=True):
        count = -(-(stop - start) // MAX_CUE_WORDS)
        sizes = [(stop - start) // count + (i < (stop - start) % count) for i in range(count)]
        for size in sizes:
            out += _within_duration(words[start : start + size])
            start += size
    return [(c[0]["start"], max(c[-1]["end"], c[0]["start"]), " ".join(w["word"] for w in c)) for c in out]


def _within_duration(words: list[dict]) -> list[list[dict]]:
    runs = [[]]
    for word in words:
        if runs[-1] and word["end"] - runs[-1][0]["start"] > MAX_CUE_S:
            runs.append([])
        runs[-1].append(word)
    return runs


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
