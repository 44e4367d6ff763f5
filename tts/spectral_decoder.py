"""A causal spectral decoder: codec latents at 50 Hz -> 24 kHz audio, by short-time spectra and overlap-add.

Vocos' design (ConvNeXt blocks at the frame rate, then an inverse-STFT head) made causal and streamable:
every convolution pads on the left only, and each 20 ms frame yields ``sub`` spectra of ``n_fft`` samples that
overlap-add at a hop of ``hop / sub`` samples. The work is matrix products at 50 Hz (no convolution at the
audio rate), so it is cheap on a CPU and batches well on a GPU.

The overlap-add makes the decoder hold back ``n_fft - hop / sub`` samples: the last ones a chunk's spectra
reach are finished only by the next chunk's. The decoder's output is therefore its input's audio delayed by
``delay`` samples (training aligns the target that way), and a chunk of T frames still gives T * hop samples.
Example, the base preset: hop 480, sub 4 -> a spectrum every 120 samples (5 ms), n_fft 480 -> each spans 4
such blocks, so 3 blocks (360 samples, 15 ms) are held back.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tts.decoder_state import DecoderState


@dataclass(frozen=True)
class SpectralConfig:
    dim: int = 384  # ConvNeXt width at the frame rate (512 measured no cheaper to run, but 28 MB of fp16 weights)
    hidden: int = 1152  # each block's pointwise expansion
    layers: int = 8
    kernel: int = 7  # causal depthwise kernel, in frames: 6 frames (120 ms) of history per block
    sub: int = 4  # spectra per 20 ms frame: one every hop / sub samples
    n_fft: int = 480  # samples per spectrum's window, a multiple of hop / sub


SPECTRAL_PRESETS = {"base": SpectralConfig(), "tiny": SpectralConfig(dim=16, hidden=32, layers=2)}


def _causal_conv(conv: nn.Conv1d, x: torch.Tensor, history: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``conv`` over ``x`` (B, C, T) after ``history`` (B, C, k-1) (zeros when None); returns the output and the
    new history. Example: kernel 7, a chunk of 4 frames -> 6 + 4 = 10 frames in, 4 out, the last 6 kept."""
    context = conv.kernel_size[0] - 1
    x = F.pad(x, (context, 0)) if history is None else torch.cat([history, x], dim=-1)
    return conv(x), x[..., x.shape[-1] - context :]


class ConvNeXtBlock(nn.Module):
    """Causal depthwise conv -> LayerNorm -> pointwise MLP (GELU), scaled, as a residual."""

    def __init__(self, dim: int, hidden: int, kernel: int, layers: int):
        super().__init__()
        self.dw = nn.Conv1d(dim, dim, kernel, groups=dim)
        self.norm = nn.LayerNorm(dim)
        self.up, self.down = nn.Linear(dim, hidden), nn.Linear(hidden, dim)
        self.scale = nn.Parameter(torch.full((dim,), 1.0 / layers))

    def step(self, x: torch.Tensor, history: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        h, history = _causal_conv(self.dw, x, history)  # (B, C, T)
        h = self.down(F.gelu(self.up(self.norm(h.transpose(1, 2)))))  # (B, T, C)
        return x + (self.scale * h).transpose(1, 2), history


def inverse_dft_bases(n_fft: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(F, n_fft) bases with F = n_fft/2 + 1 such that ``re @ cos + im @ sin`` is the windowed inverse real DFT,
    scaled for overlap-add at a hop of n_fft/4: a periodic Hann window's squares sum to 1.5 there, so spectra
    taken with that window (analysis) and turned back with it (synthesis) give the signal again.

    A matrix product rather than ``torch.fft.irfft``: it exports to ONNX as one MatMul and runs batched on a GPU.
    """
    k = torch.arange(n_fft // 2 + 1, dtype=torch.float64)[:, None]
    n = torch.arange(n_fft, dtype=torch.float64)[None]
    weight = torch.full_like(k, 2.0)
    weight[0] = 1.0
    weight[-1] = 1.0  # the DC and Nyquist bins appear once in a real signal's spectrum
    window = torch.hann_window(n_fft, periodic=True, dtype=torch.float64)
    angle = 2 * math.pi * k * n / n_fft
    scale = weight / n_fft * window / 1.5
    return (scale * torch.cos(angle)).float(), (-scale * torch.sin(angle)).float()


class SpectralDecoder(nn.Module):
    """(B, D, T) codec latents -> (B, 1, T * hop) audio delayed by ``delay`` samples.

    Streams with `init_state` / `step` exactly as `forward` decodes whole: the state is each conv's history
    and the last ``n_fft / block - 1`` spectra's samples (their overlap with what comes next).
    """

    lstm = None  # the codec's state layout has buffers only (no LSTM state), as `tts.codec.DecoderState` allows

    def __init__(self, latent_dim: int, hop: int, cfg: SpectralConfig):
        super().__init__()
        if hop % cfg.sub or cfg.n_fft % (hop // cfg.sub):
            raise ValueError(f"hop {hop} must split into {cfg.sub} blocks that tile n_fft {cfg.n_fft}")
        self.cfg, self.hop = cfg, hop
        self.block = hop // cfg.sub  # samples between spectra
        self.overlap = cfg.n_fft // self.block - 1  # earlier spectra that reach into a block
        self.delay = cfg.n_fft - self.block
        self.inp = nn.Conv1d(latent_dim, cfg.dim, cfg.kernel)
        self.norm = nn.LayerNorm(cfg.dim)
        self.blocks = nn.ModuleList(
            ConvNeXtBlock(cfg.dim, cfg.hidden, cfg.kernel, cfg.layers) for _ in range(cfg.layers)
        )
        self.out_norm = nn.LayerNorm(cfg.dim)
        self.bins = cfg.n_fft // 2 + 1
        self.head = nn.Linear(cfg.dim, cfg.sub * 2 * self.bins)
        cos, sin = inverse_dft_bases(cfg.n_fft)
        self.register_buffer("cos_basis", cos, persistent=False)
        self.register_buffer("sin_basis", sin, persistent=False)

    def spectra_to_samples(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, C) features -> (B, T * sub, n_fft) windowed frames of samples (before overlap-add)."""
        B, T, _ = x.shape
        spec = self.head(x).reshape(B, T * self.cfg.sub, 2, self.bins)
        magnitude = torch.exp(spec[:, :, 0].clamp(max=6.0))  # log-magnitude, capped as Vocos does (e^6 ~ 400)
        phase = spec[:, :, 1]
        return (magnitude * torch.cos(phase)) @ self.cos_basis + (magnitude * torch.sin(phase)) @ self.sin_basis

    def overlap_add(self, frames: torch.Tensor, earlier: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Overlap-add (B, S, n_fft) frames after ``earlier`` (B, overlap, n_fft), the last frames before them
        (zeros when None), into (B, S * block) finished samples; returns them and the new ``earlier``.

        Frame s spans blocks s .. s + overlap, so block j sums piece k of frame j - k for k = 0 .. overlap.
        Example, n_fft 480, block 120 (overlap 3): block 10 = frame 10's piece 0 + frame 9's piece 1 + frame
        8's piece 2 + frame 7's piece 3; frames 8-10's later pieces wait, as ``earlier``, for the next chunk.
        """
        B, S, _ = frames.shape
        if earlier is None:
            earlier = frames.new_zeros(B, self.overlap, self.cfg.n_fft)
        padded = torch.cat([earlier, frames], dim=1).reshape(B, self.overlap + S, self.overlap + 1, self.block)
        out = padded[:, self.overlap :, 0]
        for k in range(1, self.overlap + 1):
            out = out + padded[:, self.overlap - k : self.overlap - k + S, k]
        return out.reshape(B, 1, S * self.block), padded[:, S:].reshape(B, self.overlap, self.cfg.n_fft)

    def _run(self, z: torch.Tensor, buffers: list[torch.Tensor] | None) -> tuple[torch.Tensor, list[torch.Tensor]]:
        state = iter(buffers) if buffers is not None else None

        def carried():
            return next(state) if state is not None else None

        x, new = _causal_conv(self.inp, z, carried())
        kept = [new]
        x = self.norm(x.transpose(1, 2)).transpose(1, 2)
        for block in self.blocks:
            x, new = block.step(x, carried())
            kept.append(new)
        frames = self.spectra_to_samples(self.out_norm(x.transpose(1, 2)))
        audio, earlier = self.overlap_add(frames, carried())
        kept.append(earlier)
        return audio, kept

    def forward(self, z: torch.Tensor) -> torch.Tensor:  # (B, D, T) -> (B, 1, T*hop)
        return self._run(z, None)[0]

    def init_state(self, batch: int, device=None, dtype=torch.float32) -> DecoderState:
        shapes = [(self.inp.in_channels, self.inp.kernel_size[0] - 1)]
        shapes += [(self.cfg.dim, block.dw.kernel_size[0] - 1) for block in self.blocks]
        shapes.append((self.overlap, self.cfg.n_fft))
        return DecoderState([torch.zeros(batch, c, n, device=device, dtype=dtype) for c, n in shapes], None)

    def step(self, z: torch.Tensor, state: DecoderState) -> torch.Tensor:
        """Decode a chunk of frames (B, D, t) into (B, 1, t*hop) samples, updating ``state`` in place."""
        audio, state.buffers[:] = self._run(z, state.buffers)
        return audio
