"""Autoregressive codec-frame transformer with a voice prefix and phoneme-aligned local text attention.

One step per 20 ms frame; all K codebooks of a frame come out of one step by a delay pattern
(`tts.delay`). Each step's attention is split into a position-free part over the voice/sink prefix and a
rotary part over text slots and recent audio, masked by `tts.masks`. Sampling and I/O live elsewhere.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tts.masks import audio_mask, text_mask
from tts.text import SYMBOLS


@dataclass(frozen=True)
class ModelConfig:
    dim: int = 256
    layers: int = 6
    heads: int = 4
    voices: int = 5
    sinks: int = 4  # voice prefix length
    codebooks: int = 8
    codebook_size: int = 1024
    text_layers: int = 3
    text_kernel: int = 5
    behind: int = 3  # text window, in phonemes, around the aligned phoneme
    ahead: int = 4
    window: int = 96  # audio frames each step may attend to (1.92 s)
    text_slots: int = 16  # text ring capacity; must exceed behind + ahead
    dropout: float = 0.1
    rope_base: float = 10_000.0
    n_symbols: int = len(SYMBOLS)

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads

    @property
    def text_lookahead(self) -> int:
        """Phonemes of right context the text encoder reads (kernel 5, 3 layers: 2 * 3 = 6)."""
        return self.text_layers * (self.text_kernel // 2)


MODEL_PRESETS = {
    "base": ModelConfig(),  # the first rounds' model, and `train_ar --preset`'s default
    "shipped": ModelConfig(layers=8, voices=6),  # base after train_ar.deepen(every=3) and a sixth voice
    "tiny": ModelConfig(dim=32, layers=2, heads=2, codebooks=4, codebook_size=32, window=8, text_slots=10, dropout=0.0),
}


def rope_angles(positions: torch.Tensor, head_dim: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin (B, 1, T, D/2) of the rotary angles at integer positions (B, T): positions are data,
    not aranges. Computed once per forward and shared by every layer."""
    half = head_dim // 2
    freq = base ** (-torch.arange(half, device=positions.device, dtype=torch.float32) / half)
    angle = positions.float()[:, None, :, None] * freq
    return angle.cos(), angle.sin()


def rotate(x: torch.Tensor, angles: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Rotary embedding of x (B, H, T, D) with angles from `rope_angles`."""
    cos, sin = (a.to(x.dtype) for a in angles)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


def voice_rows(table: torch.Tensor, voice: torch.Tensor) -> torch.Tensor:
    """Rows of a per-voice table (V, ...) for a batch: ``voice`` holds row indices (B,), or mixing weights
    (B, V) for blended voices (the weighted sum of rows). Example: rows r0, r1, r2 and weights
    [[0.6, 0, 0.4], [0, 1, 0]] give [0.6 r0 + 0.4 r2, r1]; a one-hot weight row gives its row exactly."""
    if voice.is_floating_point():
        return torch.tensordot(voice.to(table.dtype), table, dims=1)  # (B, V) x (V, ...) -> (B, ...)
    return table[voice]


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.wq = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wkv = nn.Linear(cfg.dim, 2 * cfg.dim, bias=False)
        self.wo = nn.Linear(cfg.dim, cfg.dim, bias=False)

    def split(self, x: torch.Tensor) -> torch.Tensor:  # (..., T, H*D) -> (..., H, T, D)
        return x.unflatten(-1, (self.cfg.heads, self.cfg.head_dim)).transpose(-3, -2)

    def keys_values(self, x: torch.Tensor, angles: tuple[torch.Tensor, torch.Tensor] | None):
        """Keys (rotated by ``angles`` unless None) and values, each (B, H, T, D), of x (B, T, C)."""
        return self.heads_of(self.wkv(x), angles)

    def heads_of(self, kv: torch.Tensor, angles: tuple[torch.Tensor, torch.Tensor] | None):
        """Projected keys|values (..., T, 2C) -> keys (rotated by ``angles`` unless None), values (..., H, T, D).
        Elementwise past the projection, so several layers' stacked (L, B, T, 2C) go through at once with
        the same numbers (`TTSModel.text_keys_values`)."""
        k, v = map(self.split, kv.chunk(2, dim=-1))
        return (k if angles is None else rotate(k, angles)), v

    def attend(self, x, angles, sink_kv, context_kv, context_mask):
        """x (B, T, C) queries with rotary ``angles``. ``sink_kv``: prefix keys/values, scored without
        rotation and always visible. ``context_kv``: rotated keys/values with ``context_mask`` (B, T, Tk)."""
        q = self.split(self.wq(x))
        scale = 1 / math.sqrt(self.cfg.head_dim)
        sink_scores = q @ sink_kv[0].transpose(-1, -2)  # (B, H, T, S)
        context_scores = rotate(q, angles) @ context_kv[0].transpose(-1, -2)
        context_scores = context_scores.masked_fill(~context_mask[:, None], float("-inf"))
        weights = torch.softmax(torch.cat([sink_scores, context_scores], dim=-1) * scale, dim=-1)
        weights = F.dropout(weights, self.cfg.dropout, self.training)
        values = torch.cat([sink_kv[1], context_kv[1]], dim=2)
        return self.wo((weights @ values).transpose(1, 2).flatten(2))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attn_norm, self.mlp_norm = nn.LayerNorm(cfg.dim), nn.LayerNorm(cfg.dim)
        self.attn = Attention(cfg)
        self.mlp = nn.Sequential(nn.Linear(cfg.dim, 4 * cfg.dim), nn.GELU(), nn.Linear(4 * cfg.dim, cfg.dim))
        self.drop = nn.Dropout(cfg.dropout)


class TextEncoder(nn.Module):
    """Phoneme units + voice -> per-unit states and log-durations. Convolutions only, so each unit sees
    ``text_lookahead`` units either side and text can be encoded as it arrives."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed = nn.Embedding(cfg.n_symbols, cfg.dim, padding_idx=0)
        self.voice = nn.Embedding(cfg.voices, cfg.dim)
        self.convs = nn.ModuleList(
            nn.Conv1d(cfg.dim, cfg.dim, cfg.text_kernel, padding=cfg.text_kernel // 2) for _ in range(cfg.text_layers)
        )
        self.norms = nn.ModuleList(nn.LayerNorm(cfg.dim) for _ in range(cfg.text_layers))
        self.duration = nn.Sequential(nn.Linear(cfg.dim, cfg.dim), nn.GELU(), nn.Linear(cfg.dim, 1))
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, units: torch.Tensor, voice: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """units (B, N), voice (B,) row indices or (B, V) blend weights -> states (B, N, C), log(1 + frames) (B, N)."""
        pad = (units == 0)[..., None]
        x = (self.embed(units) + voice_rows(self.voice.weight, voice)[:, None]).masked_fill(pad, 0)
        for conv, norm in zip(self.convs, self.norms):
            x = x + self.drop(F.gelu(conv(norm(x).masked_fill(pad, 0).transpose(1, 2)).transpose(1, 2)))
            x = x.masked_fill(pad, 0)
        return x, self.duration(x).squeeze(-1)


class TTSModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.text = TextEncoder(cfg)
        self.sinks = nn.Parameter(torch.randn(cfg.voices, cfg.sinks, cfg.dim) * 0.02)
        self.audio_embed = nn.Embedding(cfg.codebooks * (cfg.codebook_size + 1), cfg.dim)
        self.register_buffer("codebook_offset", torch.arange(cfg.codebooks) * (cfg.codebook_size + 1), persistent=False)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.norm = nn.LayerNorm(cfg.dim)
        self.heads = nn.Linear(cfg.dim, cfg.codebooks * cfg.codebook_size)

    def embed_audio(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens (B, K, T), each in [0, codebook_size] (codebook_size = not yet known) -> (B, T, C)."""
        return self.audio_embed(tokens + self.codebook_offset[:, None]).sum(1)

    def logits(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, C) -> (B, K, T, N)
        return self.heads(self.norm(x)).unflatten(-1, (self.cfg.codebooks, self.cfg.codebook_size)).transpose(1, 2)

    def voice_prefix(self, voice: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys, values (L, B, H, S, D) of the voice prefix, which attends only to itself.
        They depend on the voice alone, so the engine computes them once per voice and caches them.
        ``voice``: row indices (B,) or blend weights (B, V), as in `TextEncoder.forward`."""
        x, prefix = voice_rows(self.sinks, voice), []
        no_context = torch.zeros(x.shape[0], self.cfg.heads, 0, self.cfg.head_dim, device=x.device, dtype=x.dtype)
        zero_pos = rope_angles(
            torch.zeros(x.shape[:2], dtype=torch.long, device=x.device), self.cfg.head_dim, self.cfg.rope_base
        )
        empty_mask = torch.zeros(x.shape[0], x.shape[1], 0, dtype=torch.bool, device=x.device)
        for block in self.blocks:
            h = block.attn_norm(x)
            kv = block.attn.keys_values(h, None)
            prefix.append(kv)
            x = x + block.drop(block.attn.attend(h, zero_pos, kv, (no_context, no_context), empty_mask))
            x = x + block.drop(block.mlp(block.mlp_norm(x)))
        return tuple(torch.stack(part) for part in zip(*prefix))

    def text_keys_values(self, states: torch.Tensor, start_frames: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys, values (L, B, H, N, D) of text states (B, N, C), rotated at each unit's first frame (B, N).
        Each layer's norm and projection as in `Attention.keys_values`; the head split and the rotation once
        for all layers: a fixed number of calls whatever the depth, which is what an engine thread pays for
        on a busy interpreter (`streaming.engine`)."""
        angles = rope_angles(start_frames, self.cfg.head_dim, self.cfg.rope_base)  # (B, 1, N, D/2) each
        kv = torch.stack([block.attn.wkv(block.attn_norm(states)) for block in self.blocks])  # (L, B, N, 2C)
        return self.blocks[0].attn.heads_of(kv, angles)  # every layer splits heads alike

    def forward(self, tokens, frame_pos, phoneme, prefix, text_kv, text_phoneme, audio_kv_fn=None, window=None):
        """Run the transformer over audio steps. tokens (B, K, T) are the step inputs, frame_pos (B, T) their
        frame positions, phoneme (B, T) each step's aligned unit. ``prefix``/``text_kv`` are (keys, values),
        each indexed by layer: (L, B, H, S or N, D) stacks (`voice_prefix`, `text_keys_values`) or lists of
        their layers' views (`streaming.step_caches.decode_step`); ``text_phoneme`` (B, N) the unit index of each
        text slot (-1 empty).
        ``audio_kv_fn(layer, k, v, frame_pos)`` returns (keys, values, key positions) for the audio part;
        by default the steps attend to themselves (teacher forcing). ``window`` overrides the audio window
        (benchmarks of attend-to-everything baselines). Returns logits (B, K, T, N)."""
        x = self.embed_audio(tokens)
        angles = rope_angles(frame_pos, self.cfg.head_dim, self.cfg.rope_base)
        t_mask = text_mask(phoneme, text_phoneme, self.cfg.behind, self.cfg.ahead)
        mask, mask_pos = None, None
        for i, block in enumerate(self.blocks):
            h = block.attn_norm(x)
            k, v = block.attn.keys_values(h, angles)
            if audio_kv_fn is None:
                keys, values, key_pos = k, v, frame_pos
            else:
                keys, values, key_pos = audio_kv_fn(i, k, v, frame_pos)
            if key_pos is not mask_pos:  # layers share one positions tensor, so usually built once
                mask = torch.cat([t_mask, audio_mask(frame_pos, key_pos, window or self.cfg.window)], dim=-1)
                mask_pos = key_pos
            context = (torch.cat([text_kv[0][i], keys], 2), torch.cat([text_kv[1][i], values], 2))
            x = x + block.drop(block.attn.attend(h, angles, (prefix[0][i], prefix[1][i]), context, mask))
            x = x + block.drop(block.mlp(block.mlp_norm(x)))
        return self.logits(x)


def load_model(folder, device="cpu") -> tuple[TTSModel, dict]:
    """Load an AR checkpoint: the shards ``model-*.safetensors`` in ``folder`` (config in their metadata)."""
    import json
    from pathlib import Path

    from safetensors import safe_open
    from safetensors.torch import load_file

    shards = sorted(Path(folder).glob("model-*.safetensors"))
    if not shards:
        raise FileNotFoundError(f"no model-*.safetensors in {folder}")
    with safe_open(str(shards[0]), "pt") as f:
        meta = f.metadata()
    model = TTSModel(ModelConfig(**json.loads(meta["config"])))
    state = {}
    for shard in shards:
        state.update({k: v.float() for k, v in load_file(str(shard)).items()})
    model.load_state_dict(state)
    return model.to(device).eval(), meta
