"""Shipped voices: ``voices/voices.json`` names each voice and the checkpoints beside it."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

VOICES_DIR = Path(os.environ.get("TTS_VOICES_DIR", Path(__file__).resolve().parent.parent / "voices"))


def voice_presets(folder: Path = VOICES_DIR) -> dict[str, dict]:
    """name -> preset (name, description, teacher, sample_rate, index, default, license, provenance)."""
    manifest = json.loads((folder / "voices.json").read_text())
    return {v["name"]: v for v in manifest["voices"]}


MAX_SPEC_CHARS = 200  # a blend spec longer than this is refused before it is parsed
WEIGHT_SLACK = 0.01  # blend weights may sum to 0.99-1.01 (thirds written 0.33) and are then scaled to sum to 1


def voice_mix(voice: str, presets: dict[str, dict]) -> dict[int, float]:
    """Rows of the model's voice tables and their weights for a voice name, a blend preset (a ``blend`` key
    holding a spec) or a blend spec ``name:weight+name:weight+...``. Weights are positive
    and sum to 1 (within ``WEIGHT_SLACK``; scaled to sum to exactly 1); ``joe+kumo`` weighs its voices equally.
    Raises ValueError saying what is wrong. With joe at row 0 and kumo at row 5:

    >>> voice_mix("joe:0.6+kumo:0.4", {"joe": {"index": 0}, "kumo": {"index": 5}})
    {0: 0.6, 5: 0.4}
    >>> voice_mix("joe+kumo", {"joe": {"index": 0}, "kumo": {"index": 5}})
    {0: 0.5, 5: 0.5}
    """
    if not isinstance(voice, str):
        raise ValueError(f"a voice is a name or a blend such as 'joe:0.6+kumo:0.4', not {voice!r}")
    if voice in presets:
        if "blend" in presets[voice]:
            return voice_mix(presets[voice]["blend"], {n: p for n, p in presets.items() if "blend" not in p})
        return {presets[voice]["index"]: 1.0}
    if not {"+", ":"} & set(voice) or len(voice) > MAX_SPEC_CHARS:
        raise ValueError(
            f"unknown voice {voice[:40]!r}; choose one of {sorted(presets)} or blend them, e.g. 'joe:0.6+kumo:0.4'"
        )
    names, weights = [], []
    for part in voice.split("+"):
        name, _, weight = part.strip().partition(":")
        if name.strip() not in presets:
            raise ValueError(f"unknown voice {name.strip()!r} in blend {voice!r}; choose from {sorted(presets)}")
        names.append(name.strip())
        weights.append(_weight(weight, voice) if weight else None)
    if len(set(names)) < len(names):
        raise ValueError(f"blend {voice!r} names a voice twice")
    if None in weights:
        if any(w is not None for w in weights):
            raise ValueError(f"blend {voice!r}: give every voice a weight, or none for equal weights")
        weights = [1 / len(names)] * len(names)
    if abs(sum(weights) - 1) > WEIGHT_SLACK + 1e-9:
        raise ValueError(f"blend {voice!r}: weights sum to {sum(weights):g}; they must sum to 1")
    mix: dict[int, float] = {}
    for name, weight in zip(names, weights):
        for row, share in voice_mix(name, presets).items():
            mix[row] = mix.get(row, 0.0) + share * weight / sum(weights)
    return _rounded(mix)


def _rounded(mix: dict[int, float]) -> dict[int, float]:
    """Weights to 4 decimals, the last taking the remainder, so that a blend's name says exactly what it mixes.
    Example: thirds {0: 1/3, 1: 1/3, 5: 1/3} -> {0: 0.3333, 1: 0.3333, 5: 0.3334}."""
    rows = sorted(row for row in mix if round(mix[row], 4) > 0)
    rounded = {row: round(mix[row], 4) for row in rows[:-1]}
    return rounded | {rows[-1]: round(1.0 - sum(rounded.values()), 4)}


def blend_preset(voice: str, presets: dict[str, dict], temperature: float) -> dict:
    """The preset a stream speaks with: the named preset, or for a blend spec one made up of its voices'
    (pace, temperature and loudness gain_db are their weighted means; ``temperature`` stands in for a voice
    without one), with
    ``mix`` (row -> weight) and ``name``, the spec normalised (voices in row order, weights to 4 decimals):
    "kumo:0.4+joe:0.6" and "joe:0.6+kumo:0.4" are both named "joe:0.6+kumo:0.4"; "joe:1" is "joe"."""
    mix = voice_mix(voice, presets)
    named = {p["index"]: n for n, p in presets.items() if "index" in p}
    parts = [(presets[named[row]], weight) for row, weight in mix.items()]
    name = (
        "+".join(f"{named[row]}:{weight:g}" for row, weight in mix.items()) if len(mix) > 1 else named[next(iter(mix))]
    )
    mixed = {
        "name": name,
        **({"blend": name} if len(mix) > 1 else {}),
        "pace": round(sum(w * p.get("pace", 1.0) for p, w in parts), 4),
        "temperature": round(sum(w * p.get("temperature", temperature) for p, w in parts), 4),
        "gain_db": round(sum(w * p.get("gain_db", 0.0) for p, w in parts), 2),
    }
    return {**mixed, **presets.get(voice, presets.get(name, {})), "mix": mix}


def _weight(text: str, spec: str) -> float:
    try:
        weight = float(text)
    except ValueError:
        raise ValueError(f"blend {spec!r}: weight {text!r} is not a number") from None
    if not (math.isfinite(weight) and weight > 0):
        raise ValueError(f"blend {spec!r}: weight {text!r} must be a positive number")
    return weight


def attribution(preset: dict) -> str:
    """What a voice learned from and the licence of its weights, for listings (``tts voices``, Wyoming's info).

    >>> attribution({"teacher": "flite rms", "license": "Apache-2.0"})
    'learned from flite rms; weights Apache-2.0'
    """
    return f"learned from {preset.get('teacher', 'unknown')}; weights {preset.get('license', 'unknown licence')}"


def load_shipped(folder: Path = VOICES_DIR, device: str = "cpu"):
    """(model, codec, presets) from the shipped safetensors files; nothing is downloaded."""
    from tts.codec import load_codec
    from tts.model import load_model

    model, _ = load_model(folder, device)
    codec = load_codec(folder, device)
    return model, codec, voice_presets(folder)


def voice_aliases(folder: Path = VOICES_DIR) -> dict[str, str]:
    """OpenAI voice name -> shipped voice name (voices.json "aliases"), so OpenAI clients' voices work as is."""
    return dict(json.loads((folder / "voices.json").read_text()).get("aliases", {}))
