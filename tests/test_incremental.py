"""Incremental decoding through the rings equals the full masked forward (teacher forcing)."""

import shutil

import pytest
import torch

from kernels.compiled import CompiledStep
from streaming.step_caches import TEXT_RING, StepCaches, decode_step
from tts.alignment import teacher_forcing_batch
from tts.model import MODEL_PRESETS, TTSModel


def _random_utterance(cfg, n_units=5 * TEXT_RING + 20, seed=0):
    g = torch.Generator().manual_seed(seed)
    units = torch.randint(4, cfg.n_symbols, (n_units,), generator=g)
    durations = torch.randint(0, 4, (n_units,), generator=g)
    durations[0] = 1
    codes = torch.randint(0, cfg.codebook_size, (cfg.codebooks, int(durations.sum())), generator=g)
    return units, durations, codes


def _incremental_logits(model, units, durations, voice, inputs, step_phoneme, starts, batch=1, slot=0, compiled=False):
    """Step through the rings as the engine does: units are written ahead, several per write, as far as the
    text ring allows (`Slots.encode_limit`), while the mask keeps each step to units p-behind..p+ahead."""
    cfg = model.cfg
    caches = StepCaches.empty(cfg, batch)
    step = CompiledStep(model, caches, batch, "cpu") if compiled else decode_step
    caches.start(torch.tensor([slot]), model.voice_prefix(voice))
    states, _ = model.text(units[None], voice)
    text_kv = model.text_keys_values(states, starts)
    ring = caches.text[0].capacity
    written, out = 0, []
    active = torch.zeros(batch, dtype=torch.bool)
    active[slot] = True
    for s in range(inputs.shape[-1]):
        p = int(step_phoneme[0, s])
        upto = min(p + ring - cfg.behind, len(units))
        if upto - written >= 3 or upto == len(units) > written:  # batches of several units, as a prefill writes
            width = upto - written
            positions = torch.arange(written, written + width).expand(batch, -1)
            keep = torch.zeros(batch, width, dtype=torch.bool)
            keep[slot] = True
            kv = tuple(t[:, :, :, written:upto].expand(-1, batch, -1, -1, -1) for t in text_kv)  # (L, M, H, T, D)
            caches.write_text(kv, positions, keep)
            written = upto
        assert written > min(p + cfg.ahead, len(units) - 1)  # every unit the step may see is in the ring
        tokens = inputs[0, :, s].expand(batch, -1)
        frame = torch.full((batch,), s)
        phoneme = torch.full((batch,), p)
        out.append(step(model, caches, tokens, frame, phoneme, active)[slot])
    return torch.stack(out, dim=1)  # (K, S, N)


@pytest.mark.parametrize(
    "compiled",
    [
        False,
        pytest.param(True, marks=pytest.mark.skipif(not shutil.which("g++"), reason="inductor needs a C++ compiler")),
    ],
)
def test_incremental_equals_full_forward_beyond_ring_capacity(compiled):
    torch.manual_seed(0)
    cfg = MODEL_PRESETS["tiny"]
    model = TTSModel(cfg).eval()
    units, durations, codes = _random_utterance(cfg)
    assert codes.shape[1] > 5 * cfg.window and len(units) > 5 * TEXT_RING
    u, starts, text_phoneme, inputs, _, frame_pos, step_phoneme = teacher_forcing_batch(
        [(units, durations, codes)], cfg.codebook_size
    )
    voice = torch.tensor([1])
    with torch.no_grad():
        states, _ = model.text(u, voice)
        full = model(
            inputs,
            frame_pos,
            step_phoneme,
            model.voice_prefix(voice),
            model.text_keys_values(states, starts),
            text_phoneme,
        )[0]
        incremental = _incremental_logits(
            model, units, durations, voice, inputs, step_phoneme, starts, compiled=compiled
        )
    torch.testing.assert_close(incremental, full, atol=1e-4, rtol=1e-4)


def test_other_slots_do_not_disturb_a_stream():
    torch.manual_seed(0)
    cfg = MODEL_PRESETS["tiny"]
    model = TTSModel(cfg).eval()
    units, durations, codes = _random_utterance(cfg, 60, seed=1)
    _, starts, _, inputs, _, _, step_phoneme = teacher_forcing_batch([(units, durations, codes)], cfg.codebook_size)
    voice = torch.tensor([2])
    with torch.no_grad():
        alone = _incremental_logits(model, units, durations, voice, inputs, step_phoneme, starts, batch=1, slot=0)
        shared = _incremental_logits(model, units, durations, voice, inputs, step_phoneme, starts, batch=3, slot=1)
    torch.testing.assert_close(shared, alone, atol=1e-5, rtol=1e-5)
