"""Intelligibility of every shipped voice against its teacher on Harvard sentences. One JSON object.

    python -m bench.wer              # first 100 sentences
    python -m bench.wer --n 200      # also the run-away / cut-short check on 200
    python -m bench.wer --quick      # 5 sentences per voice, about a minute

WER is Whisper tiny.en on normalised text. ``runaway``: our duration over 2.5x the teacher's (or no
stop); ``cut_short``: under 0.5x. Durations are compared after the same silence trim as the corpus.
"""
from __future__ import annotations

import argparse
import json

import numpy as np
import torch

from bench.common import harvard
from training.corpus import finish_audio, speak_teacher
from tts import SAMPLE_RATE
from tts.api import get_engine, synthesize
from tts.asr import transcribe, wer


def trimmed_seconds(audio: np.ndarray, sr: int) -> float:
    return len(finish_audio(audio, sr, np.array([len(audio) / sr]))[0]) / SAMPLE_RATE


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=100)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--voices", nargs="*")
    args = parser.parse_args()
    torch.set_flush_denormal(True)
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
        report[voice] = {"wer": round(float(np.mean(ours_wer)), 4), "teacher_wer": round(float(np.mean(teacher_wer)), 4),
                         "teacher": engine.voices[voice]["teacher"], "sentences": len(sentences),
                         "duration_ratio_median": round(float(np.median(ratios)), 3),
                         "runaway": int((ratios > 2.5).sum()), "cut_short": int((ratios < 0.5).sum())}
    default = engine.default_voice
    summary = {"default_voice": default}
    if default in report:
        summary.update(default_wer=report[default]["wer"], default_teacher_wer=report[default]["teacher_wer"])
    print(json.dumps({**summary, "voices": report}, indent=1))


if __name__ == "__main__":
    main()
