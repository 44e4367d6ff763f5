"""Train the spectral codec decoder (`tts.spectral_decoder`) on the frozen encoder's tokens (GPU), in rounds.

    python -m training.train_decoder --corpus /root/corpus --codec voices --minutes 18 --out runs/spectral
    python -m training.train_decoder --corpus /root/corpus --codec voices --init training/checkpoints/spectral \
        --minutes 20 --out runs/next

The encoder and codebooks of ``--codec`` stay frozen, so tokens keep their meaning and the AR model and every
voice stay as they are: only what turns tokens into sound learns. Each utterance is encoded whole (as the AR
model's training tokens were), and the decoder learns from crops of ``--seconds`` of frames after ``--warm``
frames whose output is not scored (a causal decoder's first frames have no history). Its target is the audio
delayed by the decoder's hold-back (`SpectralDecoder.delay`).

Losses: multi-scale log-mel L1 (x15) alone for the first ``--gan-after`` steps of a fresh decoder, then with a
multi-period (HiFi-GAN) and a multi-scale STFT discriminator (hinge) and feature matching (x2). A round that
resumes (``--init``) starts new discriminators, so they train alone for ``--d-warmup`` steps first. The saved
weights are the generator's exponential moving average. The corpus folder may grow while training runs (teacher
speech made on the same machine): a reader thread looks every ``--rescan`` minutes, and what it read joins
the training data within 100 steps.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import queue
import threading
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from training.data import is_heldout, load_audio, read_manifests
from training.losses import (
    MultiPeriodDiscriminator,
    MultiScaleMel,
    MultiScaleSTFTDiscriminator,
    discriminator_loss,
    generator_losses,
)
from training.train_codec import time_cosine
from tts.codec import Codec, load_codec, part_files, save_parts
from tts.spectral_decoder import SPECTRAL_PRESETS, SpectralConfig

ROUND_FILE = "spectral_decoder"  # a round's state: <ROUND_FILE>.safetensors, then -1, -2... (fp16, each < 15 MB)


def save_round(decoder, folder: Path, meta: dict) -> None:
    """The decoder's weights alone (fp16, split under `tts.codec.PART_BYTES`) with its config: what the next round
    resumes from and what a candidate is judged by. The encoder and codebooks are the shipped codec's."""
    metadata = {"spectral": json.dumps(dataclasses.asdict(decoder.cfg)), **{k: str(v) for k, v in meta.items()}}
    save_parts(decoder.state_dict(), folder, ROUND_FILE, metadata)


def codec_with_round(codec_folder: Path, round_folder: Path, device: str = "cpu") -> Codec:
    """The codec of ``codec_folder`` (encoder, codebooks) with the spectral decoder saved by `save_round`."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    files = part_files(round_folder, ROUND_FILE)
    with safe_open(str(files[0]), "pt") as f:
        spectral = SpectralConfig(**json.loads(f.metadata()["spectral"]))
    frozen = load_codec(codec_folder, device)
    codec = Codec(dataclasses.replace(frozen.cfg, spectral=spectral)).to(device)
    codec.encoder.load_state_dict(frozen.encoder.state_dict())
    codec.quantizer.load_state_dict(frozen.quantizer.state_dict())
    state = {}
    for path in files:
        state.update({k: v.float() for k, v in load_file(str(path)).items()})
    codec.decoder.load_state_dict(state)
    return codec.eval()


class FrameData:
    """The training audio and its tokens on the GPU, utterances end to end, each a whole number of frames.

    Frame f of the concatenation is codes[f] (K,) and samples audio[f*hop : (f+1)*hop]. Example: utterances
    of 120 and 80 frames -> codes (200, K), audio 200*hop samples; utterance 2 starts at frame 120.
    """

    def __init__(self, codec: Codec, device: str):
        self.codec, self.device, self.hop = codec, device, codec.cfg.hop
        self.codes = torch.zeros(0, codec.cfg.codebooks, dtype=torch.int16, device=device)  # (F, K)
        self.audio = torch.zeros(0, dtype=torch.float16, device=device)  # (F * hop,)
        self.starts, self.lengths = [], []  # per utterance, in frames
        self.ids: set[str] = set()

    @torch.no_grad()
    def add(self, rows: list[dict], waves: list[np.ndarray], batch_seconds: float = 240.0) -> None:
        """Encode ``waves`` whole (fp32, no TF32: the tokens the AR model saw) and append them."""
        waves = [np.pad(w, (0, -len(w) % self.hop)) for w in waves]
        order = sorted(range(len(waves)), key=lambda i: len(waves[i]))
        codes, audio = [], []
        tf32, torch.backends.cudnn.allow_tf32 = torch.backends.cudnn.allow_tf32, False
        i = 0
        while i < len(order):
            longest = len(waves[order[min(i + 63, len(order) - 1)]])
            n = max(1, min(64, int(batch_seconds * 24_000 // longest)))
            group = order[i : i + n]
            i += n
            width = len(waves[group[-1]])
            batch = torch.zeros(len(group), width)
            for j, index in enumerate(group):
                batch[j, : len(waves[index])] = torch.from_numpy(waves[index])
            encoded = self.codec.encode(batch.to(self.device))  # (B, K, T); the causal encoder ignores right padding
            for j, index in enumerate(group):
                frames = len(waves[index]) // self.hop
                codes.append((index, encoded[j, :, :frames].T.to(torch.int16)))
                audio.append((index, torch.from_numpy(waves[index]).to(self.device, torch.float16)))
        torch.backends.cudnn.allow_tf32 = tf32
        codes.sort(key=lambda c: c[0])
        audio.sort(key=lambda a: a[0])
        lengths = [len(c) for _, c in codes]
        self.starts += (len(self.codes) + np.concatenate([[0], np.cumsum(lengths)[:-1]])).astype(int).tolist()
        self.lengths += lengths
        self.codes = torch.cat([self.codes, *[c for _, c in codes]])
        self.audio = torch.cat([self.audio, *[a for _, a in audio]])
        self.ids |= {r["id"] for r in rows}
        self._valid = None

    def hours(self) -> float:
        return len(self.audio) / 24_000 / 3600

    def crops(self, batch: int, warm: int, frames: int, delay: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``batch`` random crops: latents (B, D, warm + frames) and their target audio (B, frames * hop), the
        audio of the last ``frames`` frames delayed by ``delay`` samples. A crop lies inside one utterance."""
        width = warm + frames
        if self._valid is None:  # every frame a crop may start at, once per growth of the data
            self._valid = torch.cat(
                [torch.arange(s, s + n - width + 1) for s, n in zip(self.starts, self.lengths) if n >= width]
            ).to(self.device)
        start = self._valid[torch.randint(len(self._valid), (batch,), device=self.device)]  # (B,)
        frame_index = start[:, None] + torch.arange(width, device=self.device)  # (B, W)
        codes = self.codes[frame_index].long().permute(0, 2, 1)  # (B, K, W)
        first = (start + warm) * self.hop - delay  # >= hop - delay >= 0 inside the utterance
        sample_index = first[:, None] + torch.arange(frames * self.hop, device=self.device)
        return self.codec.quantizer.decode(codes), self.audio[sample_index].float()


class CorpusReader(threading.Thread):
    """Reads utterances that appear in the corpus folders into ``ready`` (rows, waves) batches, on a thread of
    its own: in round 1, loading in the training loop stopped training for about a minute per look (5 of 17
    minutes) while the teachers kept the machine's cores busy. Held-out utterances (the first ``max_heldout``)
    go to ``heldout`` for evaluation and never to training."""

    def __init__(self, corpora: list[Path], every_s: float, max_heldout: int, workers: int, batch: int = 400):
        super().__init__(daemon=True)
        self.corpora, self.every_s, self.max_heldout, self.workers, self.batch = (
            corpora,
            every_s,
            max_heldout,
            workers,
            batch,
        )
        self.ready: queue.Queue = queue.Queue()
        self.heldout: list[tuple[dict, np.ndarray]] = []
        self.seen: set[str] = set()
        self.first_pass = threading.Event()

    def run(self) -> None:
        while True:
            for corpus in self.corpora:
                self.read(corpus)
            self.first_pass.set()
            time.sleep(self.every_s)

    def read(self, corpus: Path) -> None:
        rows = [r for r in read_manifests(corpus) if r["id"] not in self.seen and (corpus / r["path"]).exists()]
        self.seen |= {r["id"] for r in rows}
        held = [r for r in rows if is_heldout(r["id"])][: max(0, self.max_heldout - len(self.heldout))]
        self.heldout += list(zip(held, load_audio(corpus, held, self.workers)))
        train = [r for r in rows if not is_heldout(r["id"])]
        for i in range(0, len(train), self.batch):
            part = train[i : i + self.batch]
            self.ready.put((part, load_audio(corpus, part, self.workers)))


@torch.no_grad()
def heldout_mel(decoder, codec: Codec, heldout: list, mel: MultiScaleMel, delay: int, device: str) -> float:
    """Mean multi-scale log-mel L1 of whole held-out utterances decoded from their tokens, against the audio
    delayed by ``delay`` samples (0 for a decoder that holds nothing back)."""
    losses = []
    for _, wave in heldout:
        wave = torch.from_numpy(np.pad(wave, (0, -len(wave) % codec.cfg.hop))).to(device)
        codes = codec.encode(wave[None])
        audio = decoder(codec.quantizer.decode(codes))[:, 0]
        target = F.pad(wave, (delay, 0))[: audio.shape[-1]]
        losses.append(mel(audio, target[None]).item())
    return round(float(np.mean(losses)), 4) if losses else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--corpus", type=Path, nargs="+", required=True)
    parser.add_argument("--codec", type=Path, default=Path("voices"), help="the frozen encoder and codebooks")
    parser.add_argument("--init", type=Path, default=None, help="resume the spectral decoder saved in this folder")
    parser.add_argument("--preset", default="base")
    parser.add_argument("--out", type=Path, default=Path("runs/spectral"))
    parser.add_argument("--minutes", type=float, default=18.0)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=1.0)
    parser.add_argument("--warm", type=int, default=8, help="frames decoded before each crop, not scored")
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--decay-to", type=float, default=0.1)
    parser.add_argument("--gan-after", type=int, default=1500, help="steps of mel loss alone (fresh decoder)")
    parser.add_argument("--d-warmup", type=int, default=300, help="steps of discriminators alone (resumed decoder)")
    parser.add_argument("--ema", type=float, default=0.999)
    parser.add_argument("--rescan", type=float, default=2.0, help="minutes between looks for new corpus audio")
    parser.add_argument("--min-hours", type=float, default=0.3, help="wait for this much audio before training")
    parser.add_argument("--heldout", type=int, default=24)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    device = args.device
    torch.manual_seed(0)
    torch.backends.cuda.matmul.allow_tf32 = True
    args.out.mkdir(parents=True, exist_ok=True)

    frozen = load_codec(args.codec, device)
    if args.init:
        codec = codec_with_round(args.codec, args.init, device)
    else:
        codec = Codec(dataclasses.replace(frozen.cfg, spectral=SPECTRAL_PRESETS[args.preset])).to(device)
        codec.encoder.load_state_dict(frozen.encoder.state_dict())
        codec.quantizer.load_state_dict(frozen.quantizer.state_dict())
    codec.encoder.eval().requires_grad_(False)
    decoder = codec.decoder.train()
    delay = decoder.delay
    data, log, t0 = FrameData(codec, device), [], time.time()
    reader = CorpusReader(args.corpus, args.rescan * 60, args.heldout, args.workers)
    reader.start()

    def take_new() -> None:
        """Encode and add what the reader has read since the last call (GPU work, a few seconds an hour)."""
        added = 0
        while not reader.ready.empty():
            rows, waves = reader.ready.get()
            data.add(rows, waves)
            added += len(rows)
        if added:
            entry = {
                "min": round((time.time() - t0) / 60, 2),
                "added": added,
                "hours": round(data.hours(), 3),
                "heldout": len(reader.heldout),
            }
            log.append(entry)
            print(json.dumps(entry), flush=True)

    reader.first_pass.wait()
    take_new()
    while data.hours() < args.min_hours:
        time.sleep(10)
        take_new()
    heldout = reader.heldout
    mel = MultiScaleMel(codec.cfg.sample_rate).to(device)
    baseline = heldout_mel(frozen.decoder, frozen, heldout, mel, 0, device)
    print(json.dumps({"baseline_heldout_mel": baseline}), flush=True)
    mpd, stft = MultiPeriodDiscriminator().to(device), MultiScaleSTFTDiscriminator().to(device)
    d_params = [*mpd.parameters(), *stft.parameters()]
    opt_g = torch.optim.AdamW(decoder.parameters(), args.lr, betas=(0.8, 0.99))
    opt_d = torch.optim.AdamW(d_params, args.lr, betas=(0.8, 0.99))
    average = AveragedModel(decoder, multi_avg_fn=get_ema_multi_avg_fn(args.ema), use_buffers=True)
    autocast = torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda")
    frames = int(args.seconds * codec.cfg.frame_rate)
    gan_from = args.d_warmup if args.init else args.gan_after

    def save(meta: dict) -> None:
        save_round(average.module, args.out, meta)

    def judge(fake, real):
        return [*mpd(fake), *stft(fake)], [*mpd(real), *stft(real)]

    budget, start, step = args.minutes * 60, time.time(), 0
    while (elapsed := time.time() - start) < budget:
        if step % 100 == 0:
            take_new()
        scale = time_cosine(elapsed / budget, args.decay_to) * min(1.0, (step + 1) / 200)  # 200-step warm-up
        for opt in (opt_g, opt_d):
            for group in opt.param_groups:
                group["lr"] = args.lr * scale
        latents, real = data.crops(args.batch, args.warm, frames, delay)
        gan, g_frozen = step >= gan_from, args.init is not None and step < args.d_warmup
        with torch.set_grad_enabled(not g_frozen):
            fake = decoder(latents)[:, 0, args.warm * codec.cfg.hop :]
        if gan:
            with autocast:
                d_fake, d_real = judge(fake.detach(), real)
            d_loss = discriminator_loss(d_fake, d_real)
            opt_d.zero_grad(set_to_none=True)
            d_loss.backward()
            torch.nn.utils.clip_grad_norm_(d_params, 10.0)
            opt_d.step()
        entry = {}
        if not g_frozen:
            loss_mel = mel(fake, real)
            loss = 15 * loss_mel
            if gan:
                with autocast:
                    g_fake, g_real = judge(fake, real)
                adversarial, matching = generator_losses(g_fake, g_real)
                loss = loss + adversarial + 2 * matching
                entry = {"adv": adversarial.item(), "fm": matching.item(), "d": d_loss.item()}
            opt_g.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(decoder.parameters(), 10.0)
            opt_g.step()
            average.update_parameters(decoder)
            entry["mel"] = loss_mel.item()
        step += 1
        if step % 250 == 0:
            entry = {
                "step": step,
                "min": round((time.time() - t0) / 60, 2),
                "lr": round(args.lr * scale, 7),
                **{k: round(v, 4) for k, v in entry.items()},
            }
            if step % 1000 == 0:
                average.module.eval()
                entry["heldout_mel"] = heldout_mel(average.module, codec, heldout, mel, delay, device)
                average.module.train()
            log.append(entry)
            print(json.dumps(entry), flush=True)
        if step % 2000 == 0:
            save({"steps": step})
            (args.out / "decoder_log.json").write_text(json.dumps(log))
    average.module.eval()
    final = heldout_mel(average.module, codec, heldout, mel, delay, device)
    save({"steps": step, "minutes": args.minutes, "heldout_mel": final, "baseline_heldout_mel": baseline})
    log.append({"step": step, "final_heldout_mel": final, "baseline_heldout_mel": baseline, "hours": data.hours()})
    (args.out / "decoder_log.json").write_text(json.dumps(log))
    print("done", json.dumps(log[-1]), flush=True)


if __name__ == "__main__":
    main()
