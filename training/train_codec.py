"""Train the codec on the teacher corpus (GPU).

    python -m training.train_codec --corpus corpus --minutes 9 --out runs/codec
    python -m training.train_codec --corpus corpus --minutes 15 --init voices --decoder-only --gan-after 0 --lr 2e-4 \\
        --out runs/codec

    python -m training.train_codec --corpus corpus --minutes 9 --init voices --keep-codebooks --gan-after 0 --lr 1e-4 \\
        --out runs/codec
    python -m training.train_codec --corpus corpus --minutes 15 --init voices --keep-codebooks --gan-after 0 \\
        --lr 1.5e-4 --decay-to 0.1 --out runs/codec

The second form fine-tunes only the decoder of a trained codec: the encoder and codebooks stay frozen, so the
tokens an AR model was trained on keep their meaning, and the decoder always sees all codebooks, as in serving.
The third trains the encoder too, against the frozen codebooks (straight-through, with commitment loss): each
token keeps its codeword, but the encoder learns to pick codewords that keep more of the speech, so tokens
change where it finds better ones and an AR model trained on the old ones needs a short continuation.
The fourth does so with both learning rates falling along a half cosine to a tenth by the end of the run.

Multi-scale log-mel L1 alone for the first ``--gan-after`` fraction of the time, then with a
multi-scale STFT discriminator (hinge) and feature matching. Writes fp16 safetensors checkpoints of the
trained weights' exponential moving average (``--ema``).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from pathlib import Path

import numpy as np
import torch
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from training.data import is_heldout, load_audio, read_manifests
from training.losses import MultiScaleMel, MultiScaleSTFTDiscriminator, discriminator_loss, generator_losses
from training.quantizer import EMAQuantizerTrainer
from tts.codec import CODEC_PRESETS, Codec, load_codec, save_codec


def crops(audio: torch.Tensor, starts: torch.Tensor, ends: torch.Tensor, batch: int, length: int) -> torch.Tensor:
    """Random ``length``-sample windows from the concatenated corpus, each inside one utterance."""
    pick = torch.randint(len(starts), (batch,), device=audio.device)
    room = (ends[pick] - starts[pick] - length).clamp(min=1)
    offset = starts[pick] + (torch.rand(batch, device=audio.device) * room).long()
    index = offset[:, None] + torch.arange(length, device=audio.device)
    return audio[index.clamp(max=len(audio) - 1)].float()


def time_cosine(progress: float, floor: float) -> float:
    """Learning-rate factor along a half cosine from 1 at the start of the time budget to ``floor`` at its end.

    With ``floor`` 0.1: progress 0 -> 1.0, 0.5 -> 0.55, 1 -> 0.1. The runs are budgeted in minutes, not
    steps, so progress is the fraction of the time spent.
    """
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--corpus", type=Path, default=Path("corpus"))
    parser.add_argument("--out", type=Path, default=Path("runs/codec"))
    parser.add_argument("--preset", default="base")
    parser.add_argument("--minutes", type=float, default=9.0)
    parser.add_argument("--gan-after", type=float, default=0.45)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=0.96)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--init", type=Path, default=None, help="start from the codec in this folder")
    parser.add_argument("--decoder-only", action="store_true", help="freeze the encoder and codebooks")
    parser.add_argument("--keep-codebooks", action="store_true", help="train encoder and decoder, freeze the codebooks")
    parser.add_argument(
        "--ema", type=float, default=0.999, help="decay of the trained weights' average that is saved; 0: off"
    )
    parser.add_argument(
        "--decay-to",
        type=float,
        default=1.0,
        help="both learning rates at the end of the time budget, as a fraction of the start (1: constant)",
    )
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    random.seed(0)
    args.out.mkdir(parents=True, exist_ok=True)
    rows = [r for r in read_manifests(args.corpus) if not is_heldout(r["id"])]
    waves = load_audio(args.corpus, rows, args.workers)
    lengths = torch.tensor([len(w) for w in waves])
    ends = lengths.cumsum(0).to(device)
    starts = ends - lengths.to(device)
    audio = torch.from_numpy(np.concatenate(waves)).to(device, torch.float16)
    print(f"{len(rows)} utterances, {len(audio) / 24000 / 3600:.2f} h", flush=True)

    cfg = CODEC_PRESETS[args.preset]
    codec = load_codec(args.init, device).train() if args.init else Codec(cfg).to(device)
    cfg = codec.cfg
    all_codebooks = args.decoder_only or args.keep_codebooks  # as in serving: the AR model predicts all of them
    vq = EMAQuantizerTrainer(codec.quantizer, frozen=all_codebooks)
    mel = MultiScaleMel(cfg.sample_rate).to(device)
    disc = MultiScaleSTFTDiscriminator().to(device)
    trained = ["decoder"] if args.decoder_only else ["encoder", "decoder"]
    params = [p for name in trained for p in getattr(codec, name).parameters()]
    opt_g = torch.optim.AdamW(params, args.lr, betas=(0.5, 0.9))
    opt_d = torch.optim.AdamW(disc.parameters(), 3e-4, betas=(0.5, 0.9))
    averages = (
        {
            name: AveragedModel(getattr(codec, name), multi_avg_fn=get_ema_multi_avg_fn(args.ema), use_buffers=True)
            for name in trained
        }
        if args.ema
        else {}
    )

    def save(meta: dict) -> None:
        """Checkpoint with the averaged weights: GAN training jitters from step to step, the average does not."""
        live = {name: getattr(codec, name) for name in averages}
        for name, average in averages.items():
            setattr(codec, name, average.module)
        save_codec(codec, args.out, meta)
        for name, module in live.items():
            setattr(codec, name, module)

    length = int(args.seconds * cfg.sample_rate) // cfg.hop * cfg.hop
    budget, start, step, log = args.minutes * 60, time.time(), 0, []
    autocast = torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda")
    while (elapsed := time.time() - start) < budget:
        gan = elapsed > args.gan_after * budget
        for opt in (opt_g, opt_d):
            for group in opt.param_groups:
                group["lr"] = opt.defaults["lr"] * time_cosine(elapsed / budget, args.decay_to)
        real = crops(audio, starts, ends, args.batch, length)
        n_q = cfg.codebooks if all_codebooks or random.random() < 0.5 else random.randint(1, cfg.codebooks)
        with autocast, torch.set_grad_enabled(not args.decoder_only):
            z = codec.encoder(real[:, None])
        zq, commit = vq(z, n_q)
        with autocast:
            fake = codec.decoder(zq.to(z.dtype))[:, 0].float()
        loss_mel = mel(fake, real)
        loss = 15 * loss_mel + commit
        if gan:
            with autocast:
                fake_out, real_out = disc(fake), disc(real)
            adversarial, matching = generator_losses(fake_out, real_out)
            loss = loss + adversarial + 2 * matching
        opt_g.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 10.0)
        opt_g.step()
        if gan:
            with autocast:
                d_loss = discriminator_loss(disc(fake.detach()), disc(real))
            opt_d.zero_grad(set_to_none=True)
            d_loss.backward()
            opt_d.step()
        for name, average in averages.items():
            average.update_parameters(getattr(codec, name))
        step += 1
        if step % 200 == 0:
            entry = {
                "step": step,
                "min": round((time.time() - start) / 60, 2),
                "mel": round(loss_mel.item(), 4),
                "commit": round(commit.item(), 4),
                "gan": gan,
            }
            log.append(entry)
            print(json.dumps(entry), flush=True)
        if step % 2000 == 0:
            save({"steps": str(step)})
    save({"steps": str(step), "minutes": str(args.minutes), "ema": str(args.ema)})
    (args.out / "codec_log.json").write_text(json.dumps(log))
    print("done", step, flush=True)


if __name__ == "__main__":
    main()
