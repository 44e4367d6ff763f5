"""The AR trainer's batches: every utterance once per epoch, within the frame budget, and DataLoader
workers together yield exactly the single-process epoch, in order; a deepened model starts as the original;
the codec trainer's learning-rate schedule."""

import dataclasses
import itertools
import random

import torch
from torch.utils.data import DataLoader

from training.train_ar import TrainBatches, batches, collate, deepen, grow_voices, losses
from tts.model import MODEL_PRESETS, TTSModel


def make_rows(count: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for i in range(count):
        durations = torch.tensor([rng.randint(1, 6) for _ in range(rng.randint(2, 12))])
        frames = int(durations.sum())
        rows.append(
            {
                "id": f"joe-{i:06d}",
                "unit_ids": torch.randint(4, 40, (len(durations),)),
                "durations": durations,
                "n_frames": frames,
                "voice_id": i % 5,
                "codes": torch.randint(0, 1024, (8, frames), dtype=torch.int16),
            }
        )
    return rows


def test_batches_cover_each_row_once_within_budget():
    rows = make_rows(60)
    chunks = batches(rows, 150, random.Random(3))
    assert sorted(i for chunk in chunks for i in chunk) == list(range(60))
    for chunk in chunks:
        assert len(chunk) == 1 or max(rows[i]["n_frames"] for i in chunk) * len(chunk) <= 150
    assert chunks == batches(rows, 150, random.Random(3))  # seeded: the same epoch in every worker
    assert chunks != batches(rows, 150, random.Random(4))


def test_workers_split_each_epoch_exactly():
    rows = make_rows(40)
    epoch = [collate(rows, idx, 1024) for idx in batches(rows, 120, random.Random(0))]
    loader = DataLoader(TrainBatches(rows, 120, 1024), batch_size=None, num_workers=2)
    got = list(itertools.islice(loader, len(epoch)))
    for ours, theirs in zip(got, epoch):
        assert all(torch.equal(a, b) for a, b in zip(ours, theirs))


def test_deepened_model_computes_what_the_original_did():
    cfg = dataclasses.replace(
        MODEL_PRESETS["tiny"], layers=3, codebooks=8, codebook_size=1024, window=96, text_slots=16
    )
    torch.manual_seed(0)
    model = TTSModel(cfg).eval()
    batch = collate(make_rows(4), [0, 1, 2, 3], 1024)
    grown = deepen(model, every=2).eval()
    assert grown.cfg.layers == 4
    assert torch.equal(grown.blocks[2].attn.wq.weight, model.blocks[1].attn.wq.weight)  # the copy of block 1
    assert torch.equal(grown.blocks[3].attn.wq.weight, model.blocks[2].attn.wq.weight)
    with torch.no_grad():
        ours, theirs = losses(grown, batch, "cpu", 0.0), losses(model, batch, "cpu", 0.0)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(ours, theirs))


def test_grown_voice_tables_keep_old_voices_and_start_new_ones_at_their_mean():
    cfg = dataclasses.replace(
        MODEL_PRESETS["tiny"], codebooks=8, codebook_size=1024, window=96, text_slots=16, voices=4
    )
    torch.manual_seed(0)
    model = TTSModel(cfg).eval()
    grown = grow_voices(model, 6).eval()
    assert grown.cfg.voices == 6 and grown.sinks.shape[0] == 6
    assert torch.equal(grown.sinks[:4], model.sinks) and torch.equal(
        grown.text.voice.weight[:4], model.text.voice.weight
    )
    assert torch.allclose(grown.sinks[5], model.sinks.mean(0))
    batch = collate(make_rows(4), [0, 1, 2, 3], 1024)  # voices 0-3 only: the old rows compute what they did
    with torch.no_grad():
        ours, theirs = losses(grown, batch, "cpu", 0.0), losses(model, batch, "cpu", 0.0)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(ours, theirs))


def test_soup_is_the_mean_of_the_models(tmp_path):
    from training.soup import soup
    from training.train_ar import export
    from tts.model import load_model

    models = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        models.append(TTSModel(MODEL_PRESETS["tiny"]))
        (tmp_path / f"m{seed}").mkdir()
        export(models[-1], tmp_path / f"m{seed}", {}, shard_bytes=4_000)  # several shards
    assert len(list((tmp_path / "m0").glob("model-*.safetensors"))) > 1
    soup([tmp_path / "m0", tmp_path / "m1"], tmp_path / "out")
    averaged = load_model(tmp_path / "out", "cpu")[0].state_dict()
    for name, first in models[0].state_dict().items():
        mean = (first.half().float() + models[1].state_dict()[name].half().float()) / 2
        torch.testing.assert_close(averaged[name].float(), mean.half().float())


def test_decoder_soup_keeps_the_encoder_and_codebooks(tmp_path):
    """Averaging only the codec files that --files names leaves every token the encoder makes unchanged."""
    from training.soup import soup
    from tts.codec import CODEC_PRESETS, Codec, load_codec, save_codec

    codecs = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        codecs.append(Codec(CODEC_PRESETS["tiny"]))
        codecs[-1].quantizer.load_state_dict(codecs[0].quantizer.state_dict())  # frozen codebooks, shared
        (tmp_path / f"c{seed}").mkdir()
        save_codec(codecs[-1], tmp_path / f"c{seed}")
    soup([tmp_path / "c0", tmp_path / "c1"], tmp_path / "c1", files="codec_decoder.safetensors")
    souped = load_codec(tmp_path / "c1").state_dict()
    for name, tensor in codecs[1].state_dict().items():
        if name.startswith("decoder."):
            mean = (codecs[0].state_dict()[name].half().float() + tensor.half().float()) / 2
            torch.testing.assert_close(souped[name].float(), mean.half().float())
        else:
            torch.testing.assert_close(souped[name].float(), tensor.half().float(), atol=0, rtol=0)


def test_codec_learning_rate_falls_along_a_half_cosine_to_its_floor():
    from training.train_codec import time_cosine

    factors = [time_cosine(p / 10, 0.1) for p in range(11)]
    assert factors[0] == 1.0 and abs(factors[5] - 0.55) < 1e-12 and abs(factors[10] - 0.1) < 1e-12
    assert all(a > b for a, b in zip(factors, factors[1:]))
    assert time_cosine(1.3, 0.1) == factors[10]  # a step that starts after the budget keeps the floor
    assert time_cosine(0.7, 1.0) == 1.0  # floor 1: constant, as before --decay-to
