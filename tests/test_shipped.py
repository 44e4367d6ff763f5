"""End-to-end on the shipped checkpoints: loading, codec round trip and speech judged by the ASR."""

import re
import tomllib
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import torch

from tts import SAMPLE_RATE
from tts.asr import transcribe, wer
from tts.model import MODEL_PRESETS
from tts.voices import VOICES_DIR, load_shipped, voice_presets

DATA = Path(__file__).parent / "data"
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def shipped():
    torch.set_flush_denormal(True)
    return load_shipped()


def test_every_voice_loads_with_its_preset(shipped):
    model, codec, presets = shipped
    assert len(presets) >= 4 and sum(p["default"] for p in presets.values()) == 1
    assert "joe" in presets
    indices = [p["index"] for p in presets.values()]
    assert len(set(indices)) == len(indices) and all(0 <= i < model.cfg.voices for i in indices)
    for preset in presets.values():
        assert preset["sample_rate"] == codec.cfg.sample_rate == SAMPLE_RATE
        assert preset["description"] and preset["teacher"]


def test_shipped_model_is_the_shipped_preset(shipped):
    assert shipped[0].cfg == MODEL_PRESETS["shipped"]


def test_shipped_weights_are_small():
    sizes = {p.name: p.stat().st_size for p in VOICES_DIR.glob("*.safetensors")}
    assert sum(v for k, v in sizes.items() if k.startswith("codec")) <= 20_000_000
    assert sum(v for k, v in sizes.items() if k.startswith("model")) <= 60_000_000


def test_codec_round_trip_is_still_understood(shipped):
    _, codec, _ = shipped
    audio, sr = sf.read(DATA / "heldout_joe.wav", dtype="float32")
    codes = codec.encode(torch.from_numpy(audio)[None])
    assert codes.shape[1] == codec.cfg.codebooks
    decoded = codec.decode(codes)[0].numpy()
    reference = (DATA / "heldout_joe.txt").read_text()
    assert wer(reference, transcribe(decoded, sr)) <= 0.2


def test_default_voice_speaks_a_sentence(shipped):
    from tts.api import synthesize

    text = "Please call me back after lunch tomorrow."
    audio = synthesize(text)
    assert audio.dtype == np.float32 and 1.0 < len(audio) / SAMPLE_RATE < 6.0
    assert wer(text, transcribe(audio, SAMPLE_RATE)) <= 0.25


def test_speech_starts_without_a_click(shipped):
    """From a zeroed state the decoder's first 5 ms were a click (peak 0.022); streams start after a silent lead-in."""
    from tts.api import synthesize

    audio = synthesize("Hello there.")
    assert np.abs(audio[:480]).max() < 0.002  # the first 20 ms: silence before the first phoneme


def test_voices_listed():
    assert set(voice_presets()) == {"joe", "slt", "rms", "kumo"}


def test_every_voice_has_a_licence_provenance_and_a_model_card_entry():
    """A voice cannot ship without saying what its weights are licensed under and what it learned from."""
    card = (ROOT / "docs" / "model-card.md").read_text()
    for name, preset in voice_presets().items():
        assert re.fullmatch(r"[A-Za-z0-9.+-]+(?: (?:AND|OR) [A-Za-z0-9.+-]+)*", preset["license"]), name  # SPDX
        provenance = preset["provenance"]
        assert provenance["teacher_source"] and provenance["teacher_license"] and provenance["text"], name
        assert provenance["hours"] > 0, name
        assert f"### `{name}`" in card, f"docs/model-card.md has no section for {name}"


def test_every_runtime_dependency_is_in_third_party():
    listed = (ROOT / "THIRD_PARTY.md").read_text().lower()
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["license"] == "Apache-2.0" and (ROOT / "LICENSE").exists()
    for requirement in project["dependencies"]:
        name = re.match(r"[A-Za-z0-9_.-]+", requirement).group(0).lower()
        assert f"| {name} " in listed or f"| **{name}** " in listed, f"THIRD_PARTY.md does not list {name}"
