"""Shipped voices: ``voices/voices.json`` names each voice and the checkpoints beside it."""
from __future__ import annotations

import json
import os
from pathlib import Path

VOICES_DIR = Path(os.environ.get("TTS_VOICES_DIR", Path(__file__).resolve().parent.parent / "voices"))


def voice_presets(folder: Path = VOICES_DIR) -> dict[str, dict]:
    """name -> preset (name, description, teacher, sample_rate, index, default, license, provenance)."""
    manifest = json.loads((folder / "voices.json").read_text())
    return {v["name"]: v for v in manifest["voices"]}


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
