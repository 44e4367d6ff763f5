"""Codec training losses: multi-scale log-mel L1 and a multi-scale STFT discriminator (hinge)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


def mel_filters(n_fft: int, n_mels: int, sample_rate: int) -> torch.Tensor:
    """(n_mels, n_fft//2+1) triangular HTK-mel filters."""

    def to_mel(hz):
        return 2595 * math.log10(1 + hz / 700)

    mels = torch.linspace(to_mel(0), to_mel(sample_rate / 2), n_mels + 2)
    hz = 700 * (10 ** (mels / 2595) - 1)
    bins = torch.linspace(0, sample_rate / 2, n_fft // 2 + 1)
    lower, center, upper = hz[:-2, None], hz[1:-1, None], hz[2:, None]
    up = (bins - lower) / (center - lower)
    down = (upper - bins) / (upper - center)
    return torch.clamp(torch.minimum(up, down), min=0)


class MultiScaleMel(nn.Module):
    """Mean L1 distance of log-mel spectrograms at windows 64..2048 samples (hop = window/4)."""

    def __init__(self, sample_rate: int = 24_000, windows=(64, 128, 256, 512, 1024, 2048), n_mels: int = 64):
        super().__init__()
        self.windows = windows
        for w in windows:
            self.register_buffer(f"fb{w}", mel_filters(w, min(n_mels, w // 4), sample_rate), persistent=False)
            self.register_buffer(f"win{w}", torch.hann_window(w), persistent=False)

    def log_mel(self, audio: torch.Tensor, w: int) -> torch.Tensor:  # (B, S) -> (B, M, T)
        spec = torch.stft(audio.float(), w, w // 4, window=getattr(self, f"win{w}"), return_complex=True).abs()
        return torch.log(getattr(self, f"fb{w}") @ spec + 1e-5)

    def forward(self, fake: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
        return sum(F.l1_loss(self.log_mel(fake, w), self.log_mel(real, w)) for w in self.windows) / len(self.windows)


class STFTDiscriminator(nn.Module):
    def __init__(self, n_fft: int, channels: int = 32):
        super().__init__()
        self.n_fft = n_fft
        self.register_buffer("window", torch.hann_window(n_fft), persistent=False)
        layers = [nn.Conv2d(2, channels, (3, 9), padding=(1, 4))]
        for dilation in (1, 2, 4):
            layers.append(
                nn.Conv2d(channels, channels, (3, 9), stride=(1, 2), dilation=(dilation, 1), padding=(dilation, 4))
            )
        layers.append(nn.Conv2d(channels, channels, (3, 3), padding=1))
        self.layers = nn.ModuleList(layers)
        self.head = nn.Conv2d(channels, 1, (3, 3), padding=1)

    def forward(self, audio: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        spec = torch.stft(audio.float(), self.n_fft, self.n_fft // 4, window=self.window, return_complex=True)
        x = torch.stack([spec.real, spec.imag], dim=1).transpose(2, 3)  # (B, 2, T, F)
        features = []
        for layer in self.layers:
            x = F.leaky_relu(layer(x), 0.2)
            features.append(x)
        return self.head(x), features


class MultiScaleSTFTDiscriminator(nn.Module):
    def __init__(self, ffts=(2048, 1024, 512, 256, 128)):
        super().__init__()
        self.discriminators = nn.ModuleList(STFTDiscriminator(n) for n in ffts)

    def forward(self, audio: torch.Tensor):
        return [d(audio) for d in self.discriminators]


def discriminator_loss(fake_out, real_out) -> torch.Tensor:
    return sum(F.relu(1 - r).mean() + F.relu(1 + f).mean() for (f, _), (r, _) in zip(fake_out, real_out)) / len(
        fake_out
    )


def generator_losses(fake_out, real_out) -> tuple[torch.Tensor, torch.Tensor]:
    adversarial = sum(F.relu(1 - f).mean() for f, _ in fake_out) / len(fake_out)
    matching = sum(
        F.l1_loss(ff, rf.detach()) / (rf.detach().abs().mean() + 1e-5)
        for (_, fake_feats), (_, real_feats) in zip(fake_out, real_out)
        for ff, rf in zip(fake_feats, real_feats)
    ) / (len(fake_out) * len(fake_out[0][1]))
    return adversarial, matching


class PeriodDiscriminator(nn.Module):
    """HiFi-GAN's period discriminator: the waveform folded into (T/p, p) and convolved along time only, so
    each of the p columns is judged as a sub-sampled signal (pitch periods, harmonics). Example: p 3, 24,000
    samples -> a (1, 8000, 3) image; kernels (5, 1) stride (3, 1) see every 3rd sample of one column."""

    def __init__(self, period: int, channels=(32, 64, 128, 256)):
        super().__init__()
        self.period = period
        layers, previous = [], 1
        for width in channels:
            layers.append(nn.Conv2d(previous, width, (5, 1), stride=(3, 1), padding=(2, 0)))
            previous = width
        layers.append(nn.Conv2d(previous, previous, (5, 1), padding=(2, 0)))
        self.layers = nn.ModuleList(layers)
        self.head = nn.Conv2d(previous, 1, (3, 1), padding=(1, 0))

    def forward(self, audio: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:  # (B, S)
        pad = -audio.shape[-1] % self.period
        x = F.pad(audio.float(), (0, pad), mode="reflect")
        x = x.reshape(x.shape[0], 1, -1, self.period)  # (B, 1, S/p, p)
        features = []
        for layer in self.layers:
            x = F.leaky_relu(layer(x), 0.1)
            features.append(x)
        return self.head(x), features


class MultiPeriodDiscriminator(nn.Module):
    def __init__(self, periods=(2, 3, 5, 7, 11)):
        super().__init__()
        self.discriminators = nn.ModuleList(PeriodDiscriminator(p) for p in periods)

    def forward(self, audio: torch.Tensor):
        return [d(audio) for d in self.discriminators]
