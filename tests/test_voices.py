"""Voice blending: spec parsing beside the voice table, and the model's weighted voice rows."""
import pytest
import torch

from tts.model import MODEL_PRESETS, TTSModel
from tts.voices import blend_preset, voice_mix

PRESETS = {"joe": {"name": "joe", "index": 0, "pace": 0.8}, "slt": {"name": "slt", "index": 1, "pace": 1.0},
           "kumo": {"name": "kumo", "index": 5, "pace": 0.9, "temperature": 0.5},
           "dusk": {"name": "dusk", "blend": "joe:0.5+slt:0.5", "pace": 0.85, "description": "a named blend"}}


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
    for (k1, v1), (k2, v2) in zip(prefix_index, prefix_weight):
        assert torch.equal(k1, k2) and torch.equal(v1, v2)


def test_a_blend_speaks_as_a_voice_whose_rows_are_the_mix(model):
    """0.6 joe + 0.4 row 2 gives what a model would give whose row 0 held the mixed rows."""
    import copy
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
    for (k1, v1), (k2, v2) in zip(prefix, reference_prefix):
        assert torch.allclose(k1, k2, atol=1e-6) and torch.allclose(v1, v2, atol=1e-6)
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


@pytest.mark.parametrize("spec, message", [
    ("bob", "unknown voice 'bob'"), ("", "unknown voice ''"), ("joe:0.5+bob:0.5", "unknown voice 'bob'"),
    ("joe:0.5+kumo:0.6", "sum to 1.1"), ("joe:0.2+kumo:0.2", "sum to 0.4"), ("joe:x+kumo:1", "not a number"),
    ("joe:nan+kumo:0.5", "positive"), ("joe:-1+kumo:2", "positive"), ("joe:inf+kumo:0", "positive"),
    ("joe:0.5+joe:0.5", "twice"), ("joe+kumo:1", "every voice a weight"), ("joe:0.5+", "unknown voice ''"),
    ("joe+" * 100 + "kumo", "unknown voice"), (None, "a voice is a name"), (3, "a voice is a name"),
])
def test_bad_specs_are_refused_with_a_reason(spec, message):
    with pytest.raises(ValueError, match=message):
        voice_mix(spec, PRESETS)
