"""How well our word timings match the audio: each word's start as `synthesize_stream()` reports it (the
chunks' ``words``) against where the ASR judge (Whisper tiny.en, word timestamps) hears it. One JSON object.

    python -m bench.word_timings            # the default voice, 50 Harvard sentences (held out of training)
    python -m bench.word_timings --n 20 --voice slt

Words are compared after the judge's normalisation (`tts.asr.words`), matched in order (difflib over the two
word sequences: a word Whisper misheard is left out, not mismatched). Reports the median and p90 of
|ours - Whisper's| start, over matched words, and the share of written words matched. Issue 23's target: median
within 80 ms. Whisper's own word timestamps are approximate (tens of ms), so this bounds our error from above.
"""

from __future__ import annotations

import argparse
import difflib
import json

import numpy as np

from bench.common import harvard
from tts.api import synthesize_stream
from tts.asr import transcribe_words, words


def start_errors(ours: list[dict], heard: list[tuple[str, float, float]]) -> tuple[list[float], int]:
    """Matched words' |start difference| in seconds, and how many of ours there were. Each side's words are
    normalised to single tokens first; a written word that reads as several ("5" -> "five") keeps its first.
    Example: ours [the 0.10, birch 0.30], heard [the 0.12, bird 0.31] -> [0.02] (birch/bird do not match), 2."""
    mine = [(t[0], w["start"]) for w in ours if (t := words(w["word"]))]
    theirs = [(t[0], start) for word, start, _ in heard if (t := words(word))]
    matcher = difflib.SequenceMatcher(a=[w for w, _ in mine], b=[w for w, _ in theirs], autojunk=False)
    errors = [
        abs(mine[block.a + k][1] - theirs[block.b + k][1])
        for block in matcher.get_matching_blocks()
        for k in range(block.size)
    ]
    return errors, len(mine)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=50)
    parser.add_argument("--voice", default=None)
    args = parser.parse_args()
    errors, total = [], 0
    for i, sentence in enumerate(harvard(args.n)):
        chunks = list(synthesize_stream(sentence, voice=args.voice, seed=i))
        audio = np.concatenate(chunks)
        found, count = start_errors([w for c in chunks for w in c.words], transcribe_words(audio))
        errors += found
        total += count
    ms = np.array(errors) * 1000
    print(
        json.dumps(
            {
                "voice": args.voice or "default",
                "sentences": args.n,
                "words": total,
                "matched": len(errors),
                "matched_share": round(len(errors) / max(total, 1), 3),
                "start_error_ms": {
                    "median": round(float(np.median(ms)), 1),
                    "p90": round(float(np.percentile(ms, 90)), 1),
                    "mean": round(float(ms.mean()), 1),
                },
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
