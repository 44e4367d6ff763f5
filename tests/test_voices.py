"""Voice blending: spec parsing beside the voice table, the model's weighted voice rows, and blends
spoken by the engine."""

import copy

import numpy as np
import pytest
import torch

from streaming.engine import Engine, SamplingConfig, UnknownVoice
from testkit import tiny_model_and_codec
from tts.api import synthesize
from tts.model import MODEL_PRESETS, TTSModel
from tts.voices import blend_preset, voice_mix

PRESETS = {
    "joe": {"name": "joe", "index": 0, "pace": 0.8},
    "slt": {"name": "slt", "index": 1, "pace": 1.0},
    "kumo": {"name": "kumo", "index": 5, "pace": 0.9, "temperature": 0.5},
    "dusk": {"name": "dusk", "blend": "joe:0.5+slt:0.5", "pace": 0.85, "description": "a named blend"},
}


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return TTSModel(MODEL_PRESETS["tiny"]).eval()  # 5 voice rows


def one_hot(rows: list[int], voices: int) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(rows), voices).float()  # (B, V)


def test_one_hot_weights_equal_the_index_path_exactly(model):
    rows = [0, 3, 4]
    units = torch.randint(1, 20, (len(rows), 11))
    with torch.no_grad():
        by_index = model.text(units, torch.tensor(rows))
        by_weight = model.text(units, one_hot(rows, model.cfg.voices))
        prefix_index = model.voice_prefix(torch.tensor(rows))
        prefix_weight = model.voice_prefix(one_hot(rows, model.cfg.voices))
    for a, b in zip(by_index, by_weight):
        assert torch.equal(a, b)
    for a, b in zip(prefix_index, prefix_weight):  # keys, values
        assert torch.equal(a, b)


def test_a_blend_speaks_as_a_voice_whose_rows_are_the_mix(model):
    """0.6 joe + 0.4 row 2 gives what a model would give whose row 0 held the mixed rows."""
    weights = torch.tensor([[0.6, 0.0, 0.4, 0.0, 0.0]])  # (1, V)
    units = torch.randint(1, 20, (1, 9))
    mixed = copy.deepcopy(model)
    with torch.no_grad():
        for table in (mixed.text.voice.weight, mixed.sinks):
            table[0] = 0.6 * table[0] + 0.4 * table[2]
        blended, reference = model.text(units, weights), mixed.text(units, torch.tensor([0]))
        prefix, reference_prefix = model.voice_prefix(weights), mixed.voice_prefix(torch.tensor([0]))
        alone = model.text(units, torch.tensor([0]))
    for a, b in zip(blended, reference):
        assert torch.allclose(a, b, atol=1e-6)
    for a, b in zip(prefix, reference_prefix):  # keys, values
        assert torch.allclose(a, b, atol=1e-6)
    assert not torch.allclose(blended[0], alone[0], atol=1e-3)  # and it is not joe alone


def test_spec_parses_and_normalises():
    assert voice_mix("joe:0.6+kumo:0.4", PRESETS) == {0: 0.6, 5: 0.4}
    assert voice_mix(" kumo:0.4 + joe:0.6", PRESETS) == {0: 0.6, 5: 0.4}
    assert voice_mix("joe+slt+kumo", PRESETS) == {0: 0.3333, 1: 0.3333, 5: 0.3334}
    assert voice_mix("joe:0.33+slt:0.33+kumo:0.33", PRESETS) == {0: 0.3333, 1: 0.3333, 5: 0.3334}
    assert voice_mix("joe:3e-1+kumo:.7", PRESETS) == {0: 0.3, 5: 0.7}
    assert voice_mix("joe", PRESETS) == voice_mix("joe:1", PRESETS) == {0: 1.0}
    assert voice_mix("dusk", PRESETS) == {0: 0.5, 1: 0.5}
    assert voice_mix("dusk:0.5+kumo:0.5", PRESETS) == {0: 0.25, 1: 0.25, 5: 0.5}  # a named blend inside a spec


def test_blend_preset_names_the_mix_and_means_its_settings():
    blend = blend_preset("kumo:0.4+joe:0.6", PRESETS, temperature=0.7)
    assert blend["name"] == blend["blend"] == "joe:0.6+kumo:0.4"
    assert blend["mix"] == {0: 0.6, 5: 0.4}
    assert blend["pace"] == pytest.approx(0.6 * 0.8 + 0.4 * 0.9)
    assert blend["temperature"] == pytest.approx(0.6 * 0.7 + 0.4 * 0.5)  # joe has none: the engine's 0.7
    named = blend_preset("dusk", PRESETS, temperature=0.7)
    assert named["name"] == "dusk" and named["pace"] == 0.85 and named["mix"] == {0: 0.5, 1: 0.5}
    plain = blend_preset("joe:1", PRESETS, temperature=0.7)
    assert plain["name"] == "joe" and plain["mix"] == {0: 1.0} and "blend" not in plain


@pytest.mark.parametrize(
    "spec, message",
    [
        ("bob", "unknown voice 'bob'"),
        ("", "unknown voice ''"),
        ("joe:0.5+bob:0.5", "unknown voice 'bob'"),
        ("joe:0.5+kumo:0.6", "sum to 1.1"),
        ("joe:0.2+kumo:0.2", "sum to 0.4"),
        ("joe:x+kumo:1", "not a number"),
        ("joe:nan+kumo:0.5", "positive"),
        ("joe:-1+kumo:2", "positive"),
        ("joe:inf+kumo:0", "positive"),
        ("joe:0.5+joe:0.5", "twice"),
        ("joe+kumo:1", "every voice a weight"),
        ("joe:0.5+", "unknown voice ''"),
        ("joe+" * 100 + "kumo", "unknown voice"),
        (None, "a voice is a name"),
        (3, "a voice is a name"),
    ],
)
def test_bad_specs_are_refused_with_a_reason(spec, message):
    with pytest.raises(ValueError, match=message):
        voice_mix(spec, PRESETS)


GREEDY = SamplingConfig(temperature=0.0)
TEXT = "Hello there. How are you today?"


@pytest.fixture(scope="module")
def engine():
    model, codec, voices = tiny_model_and_codec()
    voices = {**voices, "dusk": {"name": "dusk", "blend": "joe:0.5+rms:0.5", "description": "a named blend"}}
    return Engine(model, codec, voices, max_streams=3, sampling=GREEDY)


def row_holding(model: TTSModel, weights: torch.Tensor, row: int) -> TTSModel:
    """A copy of ``model`` whose voice row ``row`` holds the mix ``weights`` (V,) of its rows."""
    mixed = copy.deepcopy(model)
    with torch.no_grad():
        for table in (mixed.text.voice.weight, mixed.sinks):
            table[row] = torch.tensordot(weights, table.clone(), dims=1)
    return mixed


def test_the_engine_speaks_a_blend_as_a_voice_whose_rows_are_the_mix(engine):
    blended = synthesize(TEXT, voice="joe:0.6+rms:0.4", engine=engine)
    weights = torch.tensor([0.6, 0.0, 0.4, 0.0, 0.0])
    reference_engine = Engine(
        row_holding(engine.model, weights, 0), engine.codec, engine.voices, max_streams=1, sampling=GREEDY
    )
    reference = synthesize(TEXT, voice="joe", engine=reference_engine)
    reference_engine.close()
    assert len(blended) == len(reference)
    np.testing.assert_allclose(blended, reference, atol=1e-4)
    for voice in ("joe", "rms"):
        alone = synthesize(TEXT, voice=voice, engine=engine)
        assert len(alone) != len(blended) or not np.allclose(alone, blended, atol=1e-3)


def test_blends_and_voices_share_a_batch(engine):
    """A blend beside shipped voices in one batch: each stream sounds as it does alone."""
    voices = ["dusk", "joe:0.5+rms:0.5", "slt"]
    alone = [synthesize(TEXT, voice=v, engine=engine) for v in voices]
    streams = [engine.open(v, seed=0) for v in voices]
    for stream in streams:
        stream.push_text(TEXT)
        stream.end()
    together = []
    for stream in streams:
        chunks = []
        while (chunk := stream.read(timeout=60)) is not None:
            chunks.append(chunk)
        together.append(np.concatenate(chunks))
    for a, b in zip(alone, together):
        np.testing.assert_allclose(a, b, atol=1e-5)
    np.testing.assert_allclose(alone[0], alone[1], atol=1e-5)  # the named blend is its spec
    assert [s.voice for s in streams] == ["dusk", "joe:0.5+rms:0.5", "slt"]


def test_the_engine_names_a_blend_by_its_normalised_spec_and_computes_its_prefix_once(engine, monkeypatch):
    calls = []
    real = engine.model.voice_prefix
    monkeypatch.setattr(engine.model, "voice_prefix", lambda voice: calls.append(voice.tolist()) or real(voice))
    stream = engine.open("rms:0.25+joe:0.75")
    stream.cancel()
    assert stream.voice == "joe:0.75+rms:0.25"
    for spelling in ("joe:0.75+rms:0.25", "rms:0.25 + joe:0.75", "joe:0.75+rms:0.25"):
        synthesize("Hi.", voice=spelling, engine=engine)
    assert calls == [[[0.75, 0.0, 0.25, 0.0, 0.0]]]


@pytest.mark.parametrize("voice", ["bob", "", "joe:0.7+rms:0.7", "joe:0.5+bob:0.5", "joe:abc+rms:1"])
def test_the_engine_refuses_a_bad_blend_with_unknown_voice(engine, voice):
    with pytest.raises(UnknownVoice):
        engine.open(voice)
