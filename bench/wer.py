"""Intelligibility of every shipped voice against its teacher on Harvard sentences. One JSON object.

    python -m bench.wer              # first 100 sentences
    python -m bench.wer --n 200      # also the run-away / cut-short check on 200
    python -m bench.wer --quick      # 5 sentences per voice, about a minute
    python -m bench.wer --tokens     # default voice: 40 token-heavy sentences against 40 plain ones

WER is Whisper tiny.en on normalised text. ``runaway``: our duration over 2.5x the teacher's (or no
stop); ``cut_short``: under 0.5x. Durations are compared after the same silence trim as the corpus.

``--tokens`` speaks `bench/data/token_sentences.txt` (dates, times, money, units, phone numbers, URLs,
abbreviations, Roman numerals: what users paste) and the first 40 Harvard sentences with the default voice;
reference and transcript are normalised the same way (`tts.asr.words`), so "$5M" and a transcript's
"5 million dollars" agree. Target: the token-heavy WER within 5 points of the plain one.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch

from bench.common import harvard
from training.corpus import finish_audio, speak_teacher
from tts import SAMPLE_RATE
from tts.api import get_engine, synthesize
from tts.asr import transcribe, wer


def trimmed_seconds(audio: np.ndarray, sr: int) -> float:
    return len(finish_audio(audio, sr, np.array([len(audio) / sr]))[0]) / SAMPLE_RATE


TOKEN_SENTENCES = Path(__file__).with_name("data") / "token_sentences.txt"


def token_check(engine) -> dict:
    """WER of the default voice on token-heavy sentences against plain ones, and the worst sentences."""
    voice = engine.default_voice
    token_lines = [line.strip() for line in TOKEN_SENTENCES.read_text().splitlines() if line.strip()]
    scores = {}
    for name, lines in (("tokens", token_lines), ("plain", harvard(len(token_lines)))):
        rows = []
        for text in lines:
            heard = transcribe(synthesize(text, voice=voice, engine=engine), SAMPLE_RATE)
            rows.append((wer(text, heard), text, heard))
        scores[name] = rows
    mean = {name: round(float(np.mean([w for w, _, _ in rows])), 4) for name, rows in scores.items()}
    worst = sorted(scores["tokens"], reverse=True)[:5]
    return {
        "voice": voice,
        "sentences": len(token_lines),
        "wer_tokens": mean["tokens"],
        "wer_plain": mean["plain"],
        "gap_points": round(100 * (mean["tokens"] - mean["plain"]), 2),
        "worst": [{"wer": round(w, 3), "text": t, "heard": h} for w, t, h in worst],
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=100)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--voices", nargs="*")
    parser.add_argument("--tokens", action="store_true", help="token-heavy sentences against plain ones")
    args = parser.parse_args()
    torch.set_flush_denormal(True)
    if args.tokens:
        print(json.dumps(token_check(get_engine(compile=True)), indent=1))
        return
    sentences = harvard(5 if args.quick else args.n)
    engine = get_engine(compile=True)  # same step, faster: the long run finishes sooner
    report = {}
    for voice in args.voices or list(engine.voices):
        ours_wer, teacher_wer, ratios = [], [], []
        for text in sentences:
            audio = synthesize(text, voice=voice, engine=engine)
            reference, sr = speak_teacher(voice, text)[:2]
            ours_wer.append(wer(text, transcribe(audio, SAMPLE_RATE)))
            teacher_wer.append(wer(text, transcribe(reference, sr)))
            ratios.append(trimmed_seconds(audio, SAMPLE_RATE) / max(trimmed_seconds(reference, sr), 1e-3))
        ratios = np.asarray(ratios)
        report[voice] = {
            "wer": round(float(np.mean(ours_wer)), 4),
            "teacher_wer": round(float(np.mean(teacher_wer)), 4),
            "teacher": engine.voices[voice]["teacher"],
            "sentences": len(sentences),
            "duration_ratio_median": round(float(np.median(ratios)), 3),
            "runaway": int((ratios > 2.5).sum()),
            "cut_short": int((ratios < 0.5).sum()),
        }
    default = engine.default_voice
    summary = {"default_voice": default}
    if default in report:
        summary.update(default_wer=report[default]["wer"], default_teacher_wer=report[default]["teacher_wer"])
    print(json.dumps({**summary, "voices": report}, indent=1))


if __name__ == "__main__":
    main()
