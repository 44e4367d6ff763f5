"""Shared helpers for the benchmarks: timing percentiles, log-mel distance, held-out data."""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
HARVARD = Path(os.environ.get("TTS_HARVARD", ROOT.parent / "shared" / "eval" / "harvard-sentences.txt"))


def percentiles(values_ms: list[float]) -> dict:
    values = np.asarray(values_ms)
    return {"p50": round(float(np.percentile(values, 50)), 3), "p99": round(float(np.percentile(values, 99)), 3)}


def log_mel_l1(a: np.ndarray, b: np.ndarray, sample_rate: int = 24_000) -> float:
    """Mean |log-mel(a) - log-mel(b)| (80 mels, 1024-sample window, 256 hop) over the common length."""
    from training.losses import mel_filters
    n = min(len(a), len(b))
    window, filters = torch.hann_window(1024), mel_filters(1024, 80, sample_rate)

    def mel(x):
        spec = torch.stft(torch.from_numpy(x[:n]).float(), 1024, 256, window=window, return_complex=True).abs()
        return torch.log(filters @ spec + 1e-5)
    return float((mel(a) - mel(b)).abs().mean())


def harvard(n: int) -> list[str]:
    lines = [line.strip() for line in HARVARD.read_text().splitlines() if line.strip()]
    return lines[:n]


def heldout_rows(corpus: Path, per_voice: int, voices: list[str] | None = None, skip: int = 0) -> list[dict]:
    """``per_voice`` utterances of each voice's manifest (every voice in ``corpus``, or ``voices``), after its
    first ``skip``. Example: per_voice=100, skip=0 gives lines 0-99 (the reported set); per_voice=100, skip=100
    gives lines 100-199 where a manifest has them (a validation set for choosing between checkpoints)."""
    rows = []
    for manifest in sorted(corpus.glob("*.jsonl")):
        if voices and manifest.stem not in voices:
            continue
        rows += [json.loads(line) for line in manifest.read_text().splitlines()[skip:skip + per_voice]]
    if not rows:
        raise SystemExit(f"no held-out corpus in {corpus}: build it with "
                         "python -m training.corpus --out corpus-heldout --heldout 125")
    return rows
