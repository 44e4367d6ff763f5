"""Choose each voice's default pace and sampling temperature (``pace`` and ``temperature`` in
``voices/voices.json``; a voice without one samples at ``SamplingConfig``'s) by intelligibility. One JSON object.

    python -m bench.pace --voices joe --paces 1.0 0.9 0.85 0.8 --n 40
    python -m bench.pace --voices joe --paces 0.8 --temperatures 0.7 0.5 0.3

Speaks held-out corpus sentences (`corpus-heldout`, never trained on and not the Harvard evaluation text)
at each pace and scores Whisper tiny.en WER. A pace below 1 gives every phoneme more frames than the
duration predictor's estimate of the teacher's: slower, and for a small model, clearer speech.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch

from bench.common import ROOT, heldout_rows
from tts import SAMPLE_RATE
from tts.api import get_engine, synthesize
from tts.asr import transcribe, wer


def mean_wer(engine, voice: str, texts: list[str]) -> float:
    spoken = (synthesize(text, voice=voice, engine=engine) for text in texts)
    return round(float(np.mean([wer(text, transcribe(audio, SAMPLE_RATE)) for text, audio in zip(texts, spoken)])), 4)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--voices", nargs="*")
    parser.add_argument("--paces", nargs="+", type=float, default=[1.0, 0.9, 0.8])
    parser.add_argument("--temperatures", nargs="+", type=float, default=None, help="default: the voice's")
    parser.add_argument("--n", type=int, default=40, help="sentences per voice, from the end of its held-out list")
    parser.add_argument("--corpus", type=Path, default=ROOT / "corpus-heldout")
    args = parser.parse_args()
    torch.set_flush_denormal(True)
    engine = get_engine(compile=True)
    rows = heldout_rows(args.corpus, 10_000)
    report = {}
    for voice in args.voices or list(engine.voices):
        texts = [r["text"] for r in rows if r["voice"] == voice][-args.n :]
        preset = engine.voices[voice]
        shipped = dict(preset)
        scores = {}
        for pace in args.paces:
            for temperature in args.temperatures or [preset.get("temperature", engine.sampling.temperature)]:
                preset["pace"], preset["temperature"] = pace, temperature
                key = str(pace) if args.temperatures is None else f"pace={pace},temperature={temperature}"
                scores[key] = mean_wer(engine, voice, texts)
        preset.clear()
        preset.update(shipped)
        best = min(scores, key=scores.get)
        report[voice] = {"sentences": len(texts), "wer": scores, "best": best}
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
