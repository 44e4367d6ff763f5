"""The compact token files that carry the corpus to the GPU machine read back exactly."""

import numpy as np
import torch

from training.tokens import codec_fingerprint, pack_bits, read_parts, unpack_bits, write_parts
from tts.codec import CODEC_PRESETS, Codec, save_codec
from tts.text import SYMBOLS


def test_bit_packing_round_trips():
    values = np.random.default_rng(0).integers(0, 1024, 10_007)
    packed = pack_bits(values, 10)
    assert len(packed) == (10_007 * 10 + 7) // 8
    assert np.array_equal(unpack_bits(packed, 10, len(values)), values)


def test_parts_round_trip(tmp_path):
    rng = np.random.default_rng(1)
    rows, codes = [], []
    for i in range(7):
        frames = rng.integers(1, 5, size=rng.integers(3, 9))
        rows.append(
            {
                "id": f"joe-{i:06d}",
                "voice": "joe",
                "duration": frames.sum() / 50,
                "units": [SYMBOLS[u] for u in rng.integers(4, len(SYMBOLS), len(frames))],
                "frames": frames.tolist(),
            }
        )
        codes.append(rng.integers(0, 1024, (8, frames.sum())).astype(np.int16))
    write_parts(rows, codes, tmp_path, "joe", 10, part_bytes=60)  # tiny parts: several files
    assert len(list(tmp_path.glob("joe-*.npz"))) > 1
    back = read_parts(tmp_path)
    assert [b["id"] for b in back] == [r["id"] for r in rows]
    for row, code, got in zip(rows, codes, back):
        assert np.array_equal(got["codes"].numpy(), code)
        assert got["durations"].tolist() == row["frames"] and got["n_frames"] == code.shape[1]
        assert [SYMBOLS[u] for u in got["unit_ids"].tolist()] == row["units"]


def test_a_retrained_encoder_gets_its_own_token_cache(tmp_path):
    """Cached codes are valid only for the encoder and codebooks that made them; a decoder fine-tune keeps them."""
    torch.manual_seed(0)
    codec = Codec(CODEC_PRESETS["tiny"])

    def fingerprint(name: str) -> str:
        (tmp_path / name).mkdir()
        save_codec(codec, tmp_path / name)
        return codec_fingerprint(tmp_path / name)

    first = fingerprint("a")
    with torch.no_grad():
        next(codec.decoder.parameters()).add_(1e-2)
        assert fingerprint("decoder_tuned") == first
        next(codec.encoder.parameters()).add_(1e-2)
        encoder_tuned = fingerprint("encoder_tuned")
        codec.quantizer.codebooks.add_(1e-2)
        assert len({first, encoder_tuned, fingerprint("codebooks_changed")}) == 3
