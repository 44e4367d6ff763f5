"""A lean inference form of the one-frame decode step, run eagerly here and by ONNX Runtime in `kernels.ort`.

`tts.model.TTSModel` is written for training and clarity: per layer it runs ~40 small ops (separate q and
kv projections, rotary by chunk + cat, a mask per layer, cats of the ring onto the text keys, a ring
write by gather + where + index_put). At one token per slot those ops cost more than the arithmetic.
`LeanStep` computes the same function with the weights rearranged once:

* one (C, 3C) matmul gives q, k and v, with 1/sqrt(D) folded into q's rows; the rotary embedding of q
  and k together is x * cos + halves_swapped(x) * [-sin, sin] (a flip, no chunk or cat);
* the text/audio masks are built once per step as one additive bias shared by all layers;
* the ring is attended as it was before this step, plus the new key as one extra column, so the step is
  a pure function of its inputs: it returns the keys/values to write, and `write_rings` writes them
  after. That is what lets ONNX Runtime (`kernels.ort`) and AOTInductor (measured in `bench.steps`) run it.

Worked example of the audio columns (capacity 4, window 4): slot b at frame 6, active, ring positions
[4, 5, 2, 3]. Ring slot 6 % 4 = 2 holds frame 2, which this step overwrites: its column is hidden. Frames
3, 4, 5 are visible (age 3, 2, 1 < 4) and the new key (frame 6, age 0) is the extra column. That is
exactly what the reference sees after writing first: ring [4, 5, 6, 3]. An inactive slot hides the new
column and writes back the values it already held, so its ring is unchanged.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F
from torch import nn

from streaming.step_caches import StepCaches
from tts.model import TTSModel


class LeanStep(nn.Module):
    """The decode step as one pure function of (inputs, caches) -> (logits, what to write into the rings).

    Built from a trained `TTSModel`; holds re-laid-out copies of the weights the step uses (not the text
    encoder). Shapes are read from the caches, so any ring sizes work."""

    def __init__(self, model: TTSModel):
        super().__init__()
        cfg = self.cfg = model.cfg
        scale = cfg.head_dim**-0.5
        self.register_buffer("embed", model.audio_embed.weight.detach().clone())  # (K*(N+1), C)
        self.register_buffer("offset", model.codebook_offset.clone())  # (K,)
        half = cfg.head_dim // 2
        freq = cfg.rope_base ** (-torch.arange(half, dtype=torch.float32) / half)
        self.register_buffer("freq", freq)  # (D/2,): the same fp32 values as tts.model.rope_angles
        for i, block in enumerate(model.blocks):
            qkv = torch.cat([block.attn.wq.weight.detach() * scale, block.attn.wkv.weight.detach()])  # (3C, C)
            self.register_buffer(f"qkv{i}", qkv.t().contiguous())  # (C, 3C): (K, N) layout measured faster
            self.register_buffer(f"wo{i}", block.attn.wo.weight.detach().t().contiguous())
            self.register_buffer(f"fc1_{i}", block.mlp[0].weight.detach().t().contiguous())
            self.register_buffer(f"fc1b{i}", block.mlp[0].bias.detach().clone())
            self.register_buffer(f"fc2_{i}", block.mlp[2].weight.detach().t().contiguous())
            self.register_buffer(f"fc2b{i}", block.mlp[2].bias.detach().clone())
            for name, norm in (("ln1", block.attn_norm), ("ln2", block.mlp_norm)):
                self.register_buffer(f"{name}w{i}", norm.weight.detach().clone())
                self.register_buffer(f"{name}b{i}", norm.bias.detach().clone())
        self.register_buffer("lnw", model.norm.weight.detach().clone())
        self.register_buffer("lnb", model.norm.bias.detach().clone())
        self.register_buffer("head", model.heads.weight.detach().t().contiguous())  # (C, K*N)
        self.register_buffer("headb", model.heads.bias.detach().clone())

    def forward(self, tokens, frame, unit, active, text_pos, audio_pos, *kv):
        """tokens (B, K) long, frame (B,) long, unit (B,) long, active (B,) bool, text_pos (B, Tt) and
        audio_pos (B, Ta) long ring positions (-1 empty), then per layer six tensors (B, H, T, D): sink
        keys, sink values, text keys, text values, audio keys, audio values (the rings as they are).
        Returns logits (B, K, N), new_keys and new_values (L, B, H, D) and new_pos (B,) to store at ring slot
        ``frame % Ta`` (for inactive slots: what that slot already holds), and that slot index (B,).
        Example: Ta = 96, frame 1000 -> slot 40, which held frame 904 (now past the 96-frame window)."""
        cfg = self.cfg
        heads, dim, head_dim = cfg.heads, cfg.dim, cfg.head_dim  # batch sizes stay symbolic (-1): one export
        slot = frame % audio_pos.shape[1]  # (B,)
        angle = frame.float()[:, None] * self.freq  # (B, D/2)
        cos, sin = angle.cos(), angle.sin()
        cos = torch.cat([cos, cos], -1).repeat(1, 2 * heads)  # (B, 2*H*D): q's and k's heads, both halves
        sin = torch.cat([-sin, sin], -1).repeat(1, 2 * heads)  # the sign of rotate_half's first half
        sizes = [kv[0].shape[2], kv[2].shape[2], kv[4].shape[2], 1]  # sinks, text ring, audio ring, new key
        bias = self._bias(frame, unit, active, text_pos, audio_pos, slot, sizes[0])  # (B, 1, sum(sizes))
        at_slot = slot[:, None, None, None].expand(-1, heads, 1, head_dim)  # (B, H, 1, D)
        keep = active[:, None, None]
        x = F.embedding(tokens + self.offset, self.embed).sum(1)  # (B, C)
        new_keys, new_values = [], []
        for i in range(cfg.layers):
            sink_k, sink_v, text_k, text_v, audio_k, audio_v = kv[6 * i : 6 * i + 6]
            h = F.layer_norm(x, (dim,), getattr(self, f"ln1w{i}"), getattr(self, f"ln1b{i}"))
            qk, v = self.linear(h, f"qkv{i}").split([2 * dim, dim], dim=1)  # (B, 2C), (B, C)
            plain_q = qk[:, :dim].reshape(-1, heads, head_dim, 1)  # (B, H, D, 1), scored against the sinks
            # rotate_half per head is [-x2, x1]: flip the halves here, the signs are in ``sin``. Example, a
            # head of D=4 [a, b, c, d]: flipped [c, d, a, b] * [-s0, -s1, s0, s1] = [-c s0, -d s1, a s0, b s1]
            swapped = qk.view(-1, 2 * heads, 2, head_dim // 2).flip(2).reshape(-1, 2 * dim)
            q, k = torch.addcmul(qk * cos, swapped, sin).view(-1, 2, heads, head_dim).unbind(1)  # (B, H, D)
            v = v.reshape(-1, heads, head_dim)  # (B, H, D)
            # keys @ q, not q @ keys^T: a transposed ring would be copied every step (ONNX Runtime does)
            scores = (
                torch.cat(
                    [sink_k @ plain_q, text_k @ q[..., None], audio_k @ q[..., None], (q * k).sum(-1)[..., None, None]],
                    dim=2,
                )[..., 0]
                + bias
            )  # (B, H, sum(sizes))
            p_sink, p_text, p_audio, p_new = torch.softmax(scores, dim=-1)[:, :, None].split(sizes, dim=-1)
            out = p_sink @ sink_v + p_text @ text_v + p_audio @ audio_v + p_new * v[:, :, None]  # (B, H, 1, D)
            x = x + self.linear(out.reshape(-1, dim), f"wo{i}")
            h = F.layer_norm(x, (dim,), getattr(self, f"ln2w{i}"), getattr(self, f"ln2b{i}"))
            h = F.gelu(self.linear(h, f"fc1_{i}") + getattr(self, f"fc1b{i}"))
            x = x + (self.linear(h, f"fc2_{i}") + getattr(self, f"fc2b{i}"))
            new_keys.append(torch.where(keep, k, audio_k.gather(2, at_slot)[:, :, 0]))
            new_values.append(torch.where(keep, v, audio_v.gather(2, at_slot)[:, :, 0]))
        x = F.layer_norm(x, (dim,), self.lnw, self.lnb)
        logits = (self.linear(x, "head") + self.headb).view(-1, cfg.codebooks, cfg.codebook_size)
        new_pos = torch.where(active, frame, audio_pos.gather(1, slot[:, None])[:, 0])
        return logits, torch.stack(new_keys), torch.stack(new_values), new_pos, slot

    def linear(self, x: torch.Tensor, weight: str) -> torch.Tensor:
        """``x`` (B, C_in) times the weight buffer named ``weight`` (C_in, C_out). A plain matmul, bias added
        after (not addmm): the ONNX MatMul node whose weight `kernels.ort.quantize` turns into int8."""
        return x @ getattr(self, weight)

    def _bias(self, frame, unit, active, text_pos, audio_pos, slot, sinks):
        """Additive attention bias (B, 1, S + Tt + Ta + 1): 0 where visible, -inf elsewhere. Same rules
        as `streaming.masks`, plus: the audio slot this step overwrites is hidden and the new key is the
        last column (visible iff active). Example: see the module docstring."""
        cfg = self.cfg
        offset = text_pos - unit[:, None]
        text = (text_pos >= 0) & (offset >= -cfg.behind) & (offset <= cfg.ahead)  # (B, Tt)
        age = frame[:, None] - audio_pos
        columns = torch.arange(audio_pos.shape[1], device=frame.device)
        overwritten = active[:, None] & (columns == slot[:, None])
        audio = (audio_pos >= 0) & (age >= 0) & (age < cfg.window) & ~overwritten  # (B, Ta)
        sink = torch.ones_like(text[:, :1]).expand(-1, sinks)
        visible = torch.cat([sink, text, audio, active[:, None]], dim=1)
        zero = torch.zeros((), dtype=torch.float32, device=frame.device)
        return torch.where(visible, zero, float("-inf"))[:, None]


def ring_tensors(caches: StepCaches) -> list[torch.Tensor]:
    """The per-layer (sink k, sink v, text k, text v, audio k, audio v) tensors in `LeanStep`'s order."""
    flat = []
    for (sink_k, sink_v), text, audio in zip(caches.sinks, caches.text, caches.audio):
        flat += [sink_k, sink_v, text.keys, text.values, audio.keys, audio.values]
    return flat


def write_rings(caches: StepCaches, new_keys, new_values, new_pos, slot) -> None:
    """Store what `LeanStep` returned into the audio rings at ring slot ``slot`` (B,) of every batch row."""
    rows = torch.arange(slot.shape[0], device=slot.device)
    for layer, ring in enumerate(caches.audio):
        ring.keys[rows, :, slot] = new_keys[layer]
        ring.values[rows, :, slot] = new_values[layer]
    for positions in {id(r.positions): r.positions for r in caches.audio}.values():  # usually one shared tensor
        positions[rows, slot] = new_pos


_prepared: weakref.WeakKeyDictionary[TTSModel, weakref.ref] = weakref.WeakKeyDictionary()


def lean_module(model: TTSModel) -> LeanStep:
    """The `LeanStep` of ``model``: steps for several batch sizes share one, and it is freed (42 MB for
    the shipped model) once no step uses it, e.g. after the engine has swapped in ONNX Runtime."""
    module = _prepared[model]() if model in _prepared else None
    if module is None:
        module = LeanStep(model).eval()
        _prepared[model] = weakref.ref(module)
    return module


class EagerLeanStep:
    """`LeanStep` run by eager PyTorch: no compile, no build; about half the ops of `decode_step`."""

    kind = "lean"

    def __init__(self, model: TTSModel, caches: StepCaches, batch: int, device):
        self.module = lean_module(model)

    def __call__(self, model, caches, tokens, frame, unit, active) -> torch.Tensor:
        audio = caches.audio[0]
        logits, keys, values, pos, slot = self.module(
            tokens, frame, unit, active, caches.text[0].positions, audio.positions, *ring_tensors(caches)
        )
        write_rings(caches, keys, values, pos, slot)
        return logits


def lean_factory(model, caches, batch, device):
    return EagerLeanStep(model, caches, batch, device)
