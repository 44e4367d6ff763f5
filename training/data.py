"""Corpus manifests and audio, loaded once into memory."""

from __future__ import annotations

import hashlib
import json
from multiprocessing import Pool
from pathlib import Path

import numpy as np
import soundfile as sf


def is_heldout(uid: str, percent: int = 3) -> bool:
    """A fixed ~3 % of utterances, chosen by a hash of the id, that no training step sees."""
    return int(hashlib.md5(uid.encode()).hexdigest(), 16) % 100 < percent


def read_manifests(corpus: Path, voices: list[str] | None = None) -> list[dict]:
    rows = []
    for manifest in sorted(corpus.glob("*.jsonl")):
        if voices is None or manifest.stem in voices:
            rows += [json.loads(line) for line in manifest.open() if line.strip()]
    return rows


def _read(path: str) -> np.ndarray:
    return sf.read(path, dtype="float32")[0]


def load_audio(corpus: Path, rows: list[dict], workers: int = 8) -> list[np.ndarray]:
    with Pool(workers) as pool:
        return pool.map(_read, [str(corpus / r["path"]) for r in rows], chunksize=16)
