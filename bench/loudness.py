"""Each shipped voice's loudness gain (``gain_db`` in voices/voices.json): measured so that every voice comes
out at about -16 LUFS (ITU-R BS.1770 integrated loudness, pyloudnorm's meter) with its true peak at or below
-1 dBTP (the gain, then `tts.loudness.limited`). One JSON object: per voice, the loudness and true peak before
(as the model makes it) and after (the gain and the limiter), on the sentences the gain was fitted on and on
held-out ones.

    nice python -m bench.loudness --fit 30 --check 30            # the table (pip install "tts[loudness]")
    nice python -m bench.loudness --fit 30 --check 30 --write    # and store the gains in voices/voices.json

Harvard sentences 0..fit-1 fit the gains, the next ``check`` ones are held out; each voice speaks them seeded
(seed = the sentence's number), joined into one signal per voice (the meter's gating drops the pauses).
"""

from __future__ import annotations

import argparse
import json
import re

import numpy as np
import torch

from bench.common import harvard
from tts import SAMPLE_RATE
from tts.api import get_engine, synthesize
from tts.loudness import CEILING_DBFS, KNEE_DB, TARGET_LUFS, gain, gain_to, integrated_lufs, level, true_peak_dbtp
from tts.voices import VOICES_DIR


def spoken(engine, voice: str, texts: list[str], first: int) -> np.ndarray:
    """The voice's speech of ``texts`` as the model makes it (its stored gain and the limiter off)."""
    stored = engine.voices[voice].pop("gain_db", None)
    try:
        return np.concatenate([synthesize(t, voice=voice, engine=engine, seed=first + i) for i, t in enumerate(texts)])
    finally:
        if stored is not None:
            engine.voices[voice]["gain_db"] = stored


def measure(audio: np.ndarray, db: float | None) -> dict:
    """Loudness and true peak of the raw audio (None) or of the voice's output at gain ``db`` (`level`)."""
    out = audio if db is None else level(audio, db)
    share = float(np.mean(np.abs(audio * gain(db or 0.0)) > gain(CEILING_DBFS - KNEE_DB)))
    return {
        "lufs": round(integrated_lufs(out, SAMPLE_RATE), 2),
        "true_peak_dbtp": round(true_peak_dbtp(out, SAMPLE_RATE), 2),
        "limited_samples_pct": round(100 * share, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--fit", type=int, default=30)
    parser.add_argument("--check", type=int, default=30)
    parser.add_argument("--write", action="store_true", help="store the gains in voices/voices.json")
    args = parser.parse_args()
    torch.set_flush_denormal(True)
    engine = get_engine()
    texts = harvard(args.fit + args.check)
    table = {}
    for voice in engine.voices:
        fit, check = spoken(engine, voice, texts[: args.fit], 0), spoken(engine, voice, texts[args.fit :], args.fit)
        db = round(gain_to(fit, SAMPLE_RATE, TARGET_LUFS), 2)
        table[voice] = {
            "gain_db": db,
            "fit_before": measure(fit, None),
            "fit_after": measure(fit, db),
            "heldout_before": measure(check, None),
            "heldout_after": measure(check, db),
        }
    after = [row["heldout_after"]["lufs"] for row in table.values()]
    before = [row["heldout_before"]["lufs"] for row in table.values()]
    print(
        json.dumps(
            {
                "voices": table,
                "heldout_spread_lu_before": round(max(before) - min(before), 2),
                "heldout_spread_lu_after": round(max(after) - min(after), 2),
                "sentences": {"fit": args.fit, "check": args.check},
            },
            indent=2,
        )
    )
    if args.write:
        write_gains({voice: row["gain_db"] for voice, row in table.items()})


def write_gains(gains: dict[str, float]) -> None:
    """Each voice's ``gain_db`` into voices/voices.json, beside its ``pace`` (the file's layout kept)."""
    path = VOICES_DIR / "voices.json"
    text = path.read_text()
    for voice, db in gains.items():
        block = re.search(
            rf'"name": "{re.escape(voice)}",.*?\n(\s*)"pace": [\d.]+,\n(?:\s*"gain_db": [-\d.]+,\n)?', text, re.S
        )
        pace = block.group(0)[: block.group(0).index('"pace"')] + re.search(r'"pace": [\d.]+,\n', block.group(0)).group(
            0
        )
        text = text[: block.start()] + pace + f'{block.group(1)}"gain_db": {db},\n' + text[block.end() :]
    json.loads(text)  # still JSON
    path.write_text(text)


if __name__ == "__main__":
    main()
