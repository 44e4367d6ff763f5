"""The spectral decoder's own arithmetic: the inverse-DFT bases, the overlap-add, and its hold-back."""

import torch

from tts.codec import CODEC_PRESETS, Codec
from tts.spectral_decoder import SpectralConfig, SpectralDecoder, inverse_dft_bases


def test_bases_are_the_windowed_inverse_real_dft():
    n_fft = 480
    spectrum = torch.randn(3, n_fft // 2 + 1, dtype=torch.complex64)
    spectrum[:, 0] = spectrum[:, 0].real  # a real signal's DC and Nyquist bins are real
    spectrum[:, -1] = spectrum[:, -1].real
    cos, sin = inverse_dft_bases(n_fft)
    window = torch.hann_window(n_fft, periodic=True)
    expected = torch.fft.irfft(spectrum, n_fft) * window / 1.5
    torch.testing.assert_close(spectrum.real @ cos + spectrum.imag @ sin, expected, atol=1e-5, rtol=1e-4)


def test_short_time_spectra_resynthesise_the_signal():
    """A signal's Hann-windowed spectra (hop 120, n_fft 480) turned back by the bases and the overlap-add give
    the signal again, once the 3 earlier frames of a block exist: the head's output is a true inverse STFT."""
    decoder = SpectralDecoder(16, 480, SpectralConfig(dim=8, hidden=8, layers=1))
    signal = torch.randn(120 * 20)
    spectra = torch.stft(signal, 480, 120, window=torch.hann_window(480), center=False, return_complex=True)  # (F, S)
    cos, sin = inverse_dft_bases(480)
    frames = (spectra.real.T @ cos + spectra.imag.T @ sin)[None]  # (1, S, n_fft)
    audio, _ = decoder.overlap_add(frames, None)
    blocks = frames.shape[1]
    torch.testing.assert_close(audio[0, 0, 3 * 120 : blocks * 120], signal[3 * 120 : blocks * 120], atol=1e-5, rtol=0)


def test_overlap_add_in_chunks_equals_whole():
    decoder = SpectralDecoder(16, 480, SpectralConfig(dim=8, hidden=8, layers=1))
    frames = torch.randn(2, 10, 480)
    whole, _ = decoder.overlap_add(frames, None)
    first, earlier = decoder.overlap_add(frames[:, :3], None)
    second, _ = decoder.overlap_add(frames[:, 3:], earlier)
    assert torch.equal(torch.cat([first, second], -1), whole)


def test_hold_back_and_lengths():
    codec = Codec(CODEC_PRESETS["tiny-spectral"]).eval()
    assert codec.decoder.delay == 360  # n_fft 480 - one block of 120
    codes = torch.randint(0, codec.cfg.codebook_size, (1, codec.cfg.codebooks, 5))
    assert codec.decode(codes).shape == (1, 5 * codec.cfg.hop)


def test_a_hop_that_does_not_tile_the_window_is_refused():
    try:
        SpectralDecoder(16, 480, SpectralConfig(sub=7))
    except ValueError as err:
        assert "480" in str(err)
    else:
        raise AssertionError("expected a ValueError")
