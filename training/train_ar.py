"""Train the AR codec-frame model (GPU).

    python -m training.train_ar --corpus corpus --codec runs/codec/codec.safetensors --minutes 10 --out runs/ar

    python -m training.train_ar --tokens /root/tokens --init voices --minutes 18 --lr 5e-4 --out runs/ar

Encodes the corpus with the trained codec (cached in ``<out>/tokens.pt``), or reads tokens that
`training.tokens` encoded ahead of time, optionally starts from a trained model, then trains with teacher
forcing, the same selective masks the engine serves with, dropout and token noise, keeping the
checkpoint with the best held-out loss.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import random
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from training.data import is_heldout, read_manifests
from training.tokens import encode_audio, read_parts
from tts.alignment import teacher_forcing_batch
from tts.codec import load_codec
from tts.model import MODEL_PRESETS, TTSModel, load_model
from tts.text import SYMBOL_ID

VOICES = ["joe", "slt", "rms", "kal", "awb", "kumo"]  # a voice's index is its row in the voice tables


@torch.inference_mode()
def encode_corpus(corpus: Path, codec_path: Path, device: str, workers: int) -> list[dict]:
    rows = [r for r in read_manifests(corpus) if r["voice"] in VOICES]
    codes = encode_audio(load_codec(codec_path, device), corpus, rows, workers, device)
    for row, row_codes in zip(rows, codes):
        row["codes"] = row_codes.cpu()  # (K, n_frames) int16
        row["unit_ids"] = torch.tensor([SYMBOL_ID[u] for u in row["units"]])
        row["durations"] = torch.tensor(row["frames"])
        row["voice_id"] = VOICES.index(row["voice"])
    return rows


def batches(rows: list[dict], frames_per_batch: int, rng: random.Random | None = None) -> list[list[int]]:
    """Length-bucketed batches holding about ``frames_per_batch`` frames each, shuffled by ``rng`` if given."""
    order = sorted(range(len(rows)), key=lambda i: rows[i]["n_frames"] + (rng.random() * 40 if rng else 0))
    chunks, current, longest = [], [], 0
    for i in order:
        longest = max(longest, rows[i]["n_frames"])
        if current and longest * (len(current) + 1) > frames_per_batch:
            chunks.append(current)
            current, longest = [], rows[i]["n_frames"]
        current.append(i)
    if current:
        chunks.append(current)
    if rng:
        rng.shuffle(chunks)
    return chunks


def collate(rows: list[dict], idx: list[int], codebook_size: int) -> tuple[torch.Tensor, ...]:
    """CPU tensors of one teacher-forced batch; runs in DataLoader workers so the GPU never waits on it."""
    items = [(rows[i]["unit_ids"], rows[i]["durations"], rows[i]["codes"]) for i in idx]
    voice = torch.tensor([rows[i]["voice_id"] for i in idx])
    durations = torch.nn.utils.rnn.pad_sequence([rows[i]["durations"] for i in idx], batch_first=True)
    return (*teacher_forcing_batch(items, codebook_size), voice, durations)


class TrainBatches(IterableDataset):
    """Endless epochs of shuffled batches. Epoch e is shuffled by seed e in every worker, and worker w of n
    yields that epoch's batches w, w + n, ...: together they make each epoch exactly once, in order."""

    def __init__(self, rows: list[dict], frames_per_batch: int, codebook_size: int):
        self.rows, self.frames_per_batch, self.codebook_size = rows, frames_per_batch, codebook_size

    def __iter__(self):
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        for epoch in itertools.count():
            for i, idx in enumerate(batches(self.rows, self.frames_per_batch, random.Random(epoch))):
                if i % workers == worker:
                    yield collate(self.rows, idx, self.codebook_size)


def losses(model: TTSModel, batch: tuple[torch.Tensor, ...], device: str, noise: float):
    cfg = model.cfg
    units, starts, text_phoneme, inputs, targets, frame_pos, step_phoneme, voice, durations = (
        t.to(device, non_blocking=True) for t in batch
    )
    if noise > 0:
        flip = (torch.rand(inputs.shape, device=device) < noise) & (inputs < cfg.codebook_size)
        inputs = torch.where(flip, torch.randint_like(inputs, cfg.codebook_size), inputs)
    states, log_dur = model.text(units, voice)
    logits = model(
        inputs, frame_pos, step_phoneme, model.voice_prefix(voice), model.text_keys_values(states, starts), text_phoneme
    )
    token_loss = F.cross_entropy(logits.float().flatten(0, 2), targets.flatten(), ignore_index=-100)
    real = text_phoneme >= 0
    dur_loss = F.mse_loss(log_dur.float()[real], torch.log1p(durations.float())[real])
    return token_loss, dur_loss


@torch.no_grad()
def heldout_losses(model: TTSModel, held_batches: list, device: str, autocast) -> tuple[float, float]:
    model.eval()
    with autocast:
        held = [losses(model, batch, device, 0.0) for batch in held_batches]
    return sum(h[0].item() for h in held) / len(held), sum(h[1].item() for h in held) / len(held)


def deepen(model: TTSModel, every: int) -> TTSModel:
    """A deeper model that computes exactly what ``model`` computes: after every ``every`` blocks it inserts a
    copy of the block just passed whose residual outputs (attention ``wo``, the MLP's last linear) are zero, so
    the copy starts as the identity and training grows it from there (as LLaMA Pro expands a model).

    Worked example, 6 blocks, every=3: old blocks 0 1 2 3 4 5 -> new 0 1 2 2' 3 4 5 5' (8 blocks), where 2'
    and 5' are the zeroed copies; old block 3 is new block 4."""
    mapping = [b for i in range(model.cfg.layers) for b in ([i, i] if (i + 1) % every == 0 else [i])]  # new -> old
    grown = TTSModel(dataclasses.replace(model.cfg, layers=len(mapping))).to(next(model.parameters()).device)
    old_state = model.state_dict()
    state = {k: v for k, v in old_state.items() if not k.startswith("blocks.")}
    for new, source in enumerate(mapping):
        block = {k.split(".", 2)[2]: v.clone() for k, v in old_state.items() if k.startswith(f"blocks.{source}.")}
        if new and mapping[new - 1] == source:
            for name in ("attn.wo.weight", "mlp.2.weight", "mlp.2.bias"):
                block[name].zero_()
        state.update({f"blocks.{new}.{k}": v for k, v in block.items()})
    grown.load_state_dict(state)
    return grown


def grow_voices(model: TTSModel, voices: int) -> TTSModel:
    """The same model with ``voices`` rows in its voice tables (the duration predictor's voice embedding and
    the sink prefix). Old rows keep their index; each new row starts as the mean of the old ones, the
    "average voice", so a new teacher fine-tunes from speech rather than from noise. 5 rows grown to 6:
    rows 0-4 unchanged, row 5 = mean(rows 0-4)."""
    grown = TTSModel(dataclasses.replace(model.cfg, voices=voices)).to(next(model.parameters()).device)
    state = model.state_dict()
    for name in ("text.voice.weight", "sinks"):
        old = state[name]  # (V, D) or (V, S, D)
        state[name] = torch.cat([old, old.mean(0, keepdim=True).expand(voices - len(old), *old.shape[1:])])
    grown.load_state_dict(state)
    return grown


def export(model: TTSModel, folder: Path, meta: dict, shard_bytes: int = 15_000_000) -> None:
    """fp16 safetensors in shards ``model-00.safetensors``, ... of at most ``shard_bytes`` each."""
    metadata = {
        "config": json.dumps(model.cfg.__dict__),
        "voices": json.dumps(VOICES),
        **{k: str(v) for k, v in meta.items()},
    }
    shards, size = [{}], 0
    for name, tensor in model.state_dict().items():
        tensor = tensor.detach().half().contiguous().cpu()
        if size and size + tensor.numel() * 2 > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += tensor.numel() * 2
    for old in folder.glob("model-*.safetensors"):
        old.unlink()
    for i, shard in enumerate(shards):
        save_file(shard, str(folder / f"model-{i:02d}.safetensors"), metadata=metadata)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--corpus", type=Path, default=Path("corpus"))
    parser.add_argument("--codec", type=Path, default=None, help="folder holding the codec files")
    parser.add_argument(
        "--tokens", type=Path, default=None, help="folder of `training.tokens` parts, instead of encoding"
    )
    parser.add_argument("--init", type=Path, default=None, help="start from the model in this folder")
    parser.add_argument("--out", type=Path, default=Path("runs/ar"))
    parser.add_argument("--preset", default="base")
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--frames-per-batch", type=int, default=24_000)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--noise", type=float, default=0.05)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument(
        "--deepen-every",
        type=int,
        default=0,
        help="grow the --init model: an identity-initialised copy after every N blocks",
    )
    args = parser.parse_args()
    if args.tokens is None and args.codec is None:
        parser.error("give --tokens (pre-encoded parts) or --codec (to encode the corpus here)")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    args.out.mkdir(parents=True, exist_ok=True)
    token_file = args.out / "tokens.pt"
    if args.tokens:
        rows = [r for r in read_parts(args.tokens) if r["voice"] in VOICES]
        for row in rows:
            row["voice_id"] = VOICES.index(row["voice"])
    elif token_file.exists():
        rows = torch.load(token_file)
    else:
        rows = encode_corpus(args.corpus, args.codec, device, args.workers)
        torch.save(rows, token_file)
    train = [r for r in rows if not is_heldout(r["id"])]
    heldout = [r for r in rows if is_heldout(r["id"])]
    hours = {v: round(sum(r["duration"] for r in train if r["voice"] == v) / 3600, 2) for v in VOICES}
    print(
        json.dumps({"train_utterances": len(train), "heldout_utterances": len(heldout), "train_hours": hours}),
        flush=True,
    )
    model = load_model(args.init, device)[0].train() if args.init else TTSModel(MODEL_PRESETS[args.preset]).to(device)
    if model.cfg.voices < len(VOICES):
        model = grow_voices(model, len(VOICES)).train()
    if args.deepen_every:
        model = deepen(model, args.deepen_every).train()
    print(f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f} M parameters", flush=True)
    opt = torch.optim.AdamW(model.parameters(), args.lr, betas=(0.9, 0.95), weight_decay=0.05)
    autocast = torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda")
    budget, start, step, best, log = args.minutes * 60, time.time(), 0, float("inf"), []
    codebook_size = model.cfg.codebook_size
    heldout_batches = [collate(heldout, idx, codebook_size) for idx in batches(heldout, args.frames_per_batch)]
    train_batches = DataLoader(
        TrainBatches(train, args.frames_per_batch, codebook_size),
        batch_size=None,
        num_workers=args.workers,
        pin_memory=device == "cuda",
        prefetch_factor=4 if args.workers else None,
    )

    def checkpoint(step, lr, token_loss, dur_loss, best) -> float:
        """Log held-out beside training losses; keep the checkpoint with the best held-out loss."""
        held_token, held_dur = heldout_losses(model, heldout_batches, device, autocast)
        entry = {
            "step": step,
            "min": round((time.time() - start) / 60, 2),
            "lr": round(lr, 6),
            "train_token": round(token_loss.item(), 4),
            "train_dur": round(dur_loss.item(), 4),
            "heldout_token": round(held_token, 4),
            "heldout_dur": round(held_dur, 4),
        }
        log.append(entry)
        print(json.dumps(entry), flush=True)
        if held_token + held_dur < best:
            export(model, args.out, {"steps": step, "heldout": json.dumps(entry), "train_hours": json.dumps(hours)})
            return held_token + held_dur
        return best

    if args.init:  # the starting model on this round's held-out set: the baseline the run must beat
        held_token, held_dur = heldout_losses(model, heldout_batches, device, autocast)
        print(
            json.dumps({"step": 0, "heldout_token": round(held_token, 4), "heldout_dur": round(held_dur, 4)}),
            flush=True,
        )
    for batch in train_batches:
        elapsed = (time.time() - start) / budget
        if elapsed >= 1:
            break
        lr = args.lr * min(1.0, (step + 1) / 300) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * elapsed)))
        for group in opt.param_groups:
            group["lr"] = lr
        model.train()
        with autocast:
            token_loss, dur_loss = losses(model, batch, device, args.noise)
        opt.zero_grad(set_to_none=True)
        (token_loss + dur_loss).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        if step % 250 == 0:
            best = checkpoint(step, lr, token_loss, dur_loss, best)
    if not log or log[-1]["step"] != step:
        best = checkpoint(step, lr, token_loss, dur_loss, best)
    (args.out / "ar_log.json").write_text(json.dumps(log))
    print("done", step, "best", best, flush=True)


if __name__ == "__main__":
    main()
