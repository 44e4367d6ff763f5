"""Codec: shapes, determinism, and chunked streaming decode equal to the offline decode."""

import pytest
import torch

from tts.codec import CODEC_PRESETS, Codec, load_codec, save_codec


@pytest.fixture(scope="module", params=["tiny", "tiny-spectral"])
def codec(request):
    """Each test runs on both decoders: the SEANet `Decoder` and the `SpectralDecoder`."""
    torch.manual_seed(0)
    codec = Codec(CODEC_PRESETS[request.param]).eval()
    codec.quantizer.codebooks.normal_()
    return codec


def test_encode_decode_shapes_and_dtypes(codec):
    cfg = codec.cfg
    audio = torch.randn(2, cfg.hop * 10 + 7)  # not a whole number of frames: padded up
    codes = codec.encode(audio)
    assert codes.shape == (2, cfg.codebooks, 11) and codes.dtype == torch.long
    assert int(codes.min()) >= 0 and int(codes.max()) < cfg.codebook_size
    out = codec.decode(codes)
    assert out.shape == (2, 11 * cfg.hop) and out.dtype == torch.float32


def test_deterministic(codec):
    audio = torch.randn(1, codec.cfg.hop * 6)
    assert torch.equal(codec.encode(audio), codec.encode(audio))
    codes = codec.encode(audio)
    assert torch.equal(codec.decode(codes), codec.decode(codes))


@pytest.mark.parametrize("chunk", [1, 3, 7])
def test_streaming_decode_equals_offline(codec, chunk):
    codes = torch.randint(0, codec.cfg.codebook_size, (2, codec.cfg.codebooks, 23))
    offline = codec.decode(codes)
    latents = codec.quantizer.decode(codes)
    state = codec.init_state(2)
    with torch.inference_mode():
        parts = [codec.decoder.step(latents[..., t : t + chunk], state)[:, 0] for t in range(0, 23, chunk)]
    assert (torch.cat(parts, -1) - offline).abs().max() <= 1e-4


def test_reset_one_stream_leaves_the_other(codec):
    codes = torch.randint(0, codec.cfg.codebook_size, (2, codec.cfg.codebooks, 8))
    latents = codec.quantizer.decode(codes)
    state = codec.init_state(2)
    with torch.inference_mode():
        codec.decoder.step(latents[..., :4], state)
        state.reset(torch.tensor([True, False]))
        second = codec.decoder.step(latents[..., 4:], state)[:, 0]
    fresh = codec.decode(codes[:1, :, 4:])
    torch.testing.assert_close(second[0], fresh[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(second[1], codec.decode(codes)[1, 4 * codec.cfg.hop :], atol=1e-5, rtol=1e-5)


def test_sub_batch_decode_through_select_and_write(codec):
    """Decoding streams 2 and 0 of three through select/write continues each one's own state."""
    codes = torch.randint(0, codec.cfg.codebook_size, (3, codec.cfg.codebooks, 8))
    latents = codec.quantizer.decode(codes)
    state = codec.init_state(3)
    index = torch.tensor([2, 0])
    with torch.inference_mode():
        codec.decoder.step(latents[..., :4], state)
        sub = state.select(index)
        codec.decoder.step(latents[index, :, 4:6], sub)
        state.write(index, sub)
        last = codec.decoder.step(latents[..., 6:], state)[:, 0]
    hop = codec.cfg.hop
    torch.testing.assert_close(last[[2, 0]], codec.decode(codes[[2, 0]])[:, 6 * hop :], atol=1e-5, rtol=1e-5)


def test_save_and_load_round_trip(codec, tmp_path):
    save_codec(codec, tmp_path)
    loaded = load_codec(tmp_path)
    codes = torch.randint(0, codec.cfg.codebook_size, (1, codec.cfg.codebooks, 5))
    torch.testing.assert_close(loaded.decode(codes), codec.half().float().decode(codes), atol=1e-3, rtol=1e-3)


def test_frozen_quantizer_keeps_codebooks_and_passes_gradient(codec):
    from training.quantizer import EMAQuantizerTrainer

    books = codec.quantizer.codebooks.clone()
    z = torch.randn(2, codec.cfg.dim, 7, requires_grad=True)  # (B, D, T)
    zq, commit = EMAQuantizerTrainer(codec.quantizer, frozen=True)(z, codec.cfg.codebooks)
    assert torch.equal(codec.quantizer.codebooks, books)
    torch.testing.assert_close(zq, codec.quantizer.decode(codec.quantizer.encode(z.detach())))
    (zq.sum() + commit).backward()
    assert z.grad is not None and z.grad.abs().sum() > 0
