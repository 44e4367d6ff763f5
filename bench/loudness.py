"""Each shipped voice's loudness gain (``gain_db`` in voices/voices.json): measured so that every voice comes
out at about -16 LUFS (ITU-R BS.1770 integrated loudness, pyloudnorm's meter) with its true peak at or below
-1 dBTP. One JSON object: per voice, the loudness and true peak before (no gain) and after (the gain), on the
sentences the gain was fitted on and on held-out ones.

    nice python -m bench.loudness --fit 30 --check 30            # the table (pip install "tts[loudness]")
    nice python -m bench.loudness --fit 30 --check 30 --write    # and store the gains in voices/voices.json

Harvard sentences 0..fit-1 fit the gains, the next ``check`` ones are held out; each voice speaks them seeded
(seed = the sentence's number), joined into one signal per voice (the meter's gating drops the pauses).
"""
from __future__ import annotations

import argparse
import json

import numpy as np
import torch

from bench.common import harvard
from tts import SAMPLE_RATE
from tts.api import get_engine, synthesize
from tts.loudness import PEAK_DBTP, TARGET_LUFS, gain, gain_to, integrated_lufs, true_peak_dbtp
from tts.voices import VOICES_DIR


def spoken(engine, voice: str, texts: list[str], first: int) -> np.ndarray:
    """The voice's speech of ``texts`` without its gain (the engine applies the stored one: undone here)."""
    undo = 1 / gain(engine.voice_preset(voice).get("gain_db", 0.0))
    return np.concatenate([synthesize(t, voice=voice, engine=engine, seed=first + i) for i, t in enumerate(texts)]) * undo


def measure(audio: np.ndarray, db: float) -> dict:
    scaled = audio * gain(db)
    return {"lufs": round(integrated_lufs(scaled, SAMPLE_RATE), 2), "true_peak_dbtp": round(true_peak_dbtp(scaled, SAMPLE_RATE), 2)}


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
        fit, check = spoken(engine, voice, texts[:args.fit], 0), spoken(engine, voice, texts[args.fit:], args.fit)
        db = round(gain_to(fit, SAMPLE_RATE, TARGET_LUFS, PEAK_DBTP), 2)
        table[voice] = {"gain_db": db, "fit_before": measure(fit, 0.0), "fit_after": measure(fit, db),
                        "heldout_before": measure(check, 0.0), "heldout_after": measure(check, db)}
    after = [row["heldout_after"]["lufs"] for row in table.values()]
    before = [row["heldout_before"]["lufs"] for row in table.values()]
    print(json.dumps({"voices": table, "heldout_spread_lu_before": round(max(before) - min(before), 2),
                      "heldout_spread_lu_after": round(max(after) - min(after), 2),
                      "sentences": {"fit": args.fit, "check": args.check}}, indent=2))
    if args.write:
        path = VOICES_DIR / "voices.json"
        data = json.loads(path.read_text())
        for preset in data["voices"]:
            if preset["name"] in table:
                preset["gain_db"] = table[preset["name"]]["gain_db"]
        path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()
