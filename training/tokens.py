"""Encode the corpus into codec tokens once, in a compact file that travels to the GPU machine.

    python -m training.tokens --corpus corpus --codec voices --out upload/tokens --part-mb 20

Training the AR model needs only the tokens, the phoneme units and their durations, not the audio: 20 hours
of 8 x 10-bit codes at 50 Hz pack into about 36 MB, against about 250 MB of Opus audio. Codes are bit-packed
(10 bits each for a 1024-entry codebook) and written per voice in parts of at most ``--part-mb``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open

from training.data import load_audio, read_manifests
from tts.codec import Codec, load_codec
from tts.text import SYMBOL_ID


def pack_bits(values: np.ndarray, bits: int) -> np.ndarray:
    """Little-endian bit packing. Example: bits=10, values [1, 1023] -> 20 bits 1000000000 1111111111 -> 3 bytes."""
    as_bits = (values.astype(np.uint32)[:, None] >> np.arange(bits, dtype=np.uint32)) & 1  # (N, bits)
    return np.packbits(as_bits.astype(np.uint8).ravel(), bitorder="little")


def unpack_bits(packed: np.ndarray, bits: int, count: int) -> np.ndarray:
    as_bits = np.unpackbits(packed, bitorder="little")[: count * bits].reshape(count, bits).astype(np.uint32)
    return (as_bits << np.arange(bits, dtype=np.uint32)).sum(1).astype(np.int16)


def encode_audio(codec: Codec, corpus: Path, rows: list[dict], workers: int, device="cpu") -> list[torch.Tensor]:
    """(K, n_frames) int16 codes of each row's stored audio, on ``device``. The codec pads audio to whole frames,
    so codes are cut to the manifest's frame count, the count the row's unit durations add up to."""
    waves = load_audio(corpus, rows, workers)
    return [
        codec.encode(torch.from_numpy(wave).to(device)[None])[0][:, : row["n_frames"]].to(torch.int16)
        for row, wave in zip(rows, waves)
    ]


@torch.inference_mode()
def encode_rows(
    corpus: Path,
    rows: list[dict],
    codec_folder: Path,
    cache: Path,
    workers: int,
    shard: tuple[int, int] = (0, 1),
    device: str = "cpu",
) -> list[np.ndarray] | None:
    """(K, n_frames) int16 codes of every row, encoded in fp32 on ``device`` from the stored audio.

    Each utterance's codes are kept in ``cache/<id>.npy``, so a growing corpus only encodes what is new.
    ``shard`` (i, n): encode only every n-th missing utterance from the i-th, and return None (parallel runs)."""
    codec = load_codec(codec_folder, device)
    cache.mkdir(parents=True, exist_ok=True)
    todo = [r for r in rows if not (cache / f"{r['id']}.npy").exists()][shard[0] :: shard[1]]
    per_chunk = 64 if device == "cpu" else 1024  # bounded memory; a GPU round spends less on starting reader pools
    for start in range(0, len(todo), per_chunk):
        chunk = todo[start : start + per_chunk]
        for row, coded in zip(chunk, encode_audio(codec, corpus, chunk, workers, device)):
            np.save(cache / f"{row['id']}.npy.tmp.npy", coded.cpu().numpy())
            (cache / f"{row['id']}.npy.tmp.npy").rename(cache / f"{row['id']}.npy")
        print(f"{start + len(chunk)}/{len(todo)}", flush=True)
    if shard[1] > 1:
        return None
    return [np.load(cache / f"{r['id']}.npy") for r in rows]


def write_parts(rows: list[dict], codes: list[np.ndarray], out: Path, stem: str, bits: int, part_bytes: int) -> None:
    """One ``.npz`` per part: packed codes, frame counts, unit ids and durations, with ids and voices in JSON."""
    frames_per_part = max(1, int(part_bytes * 8 / bits / codes[0].shape[0]))
    part, begin = 0, 0
    while begin < len(rows):
        end, frames = begin, 0
        while end < len(rows) and (end == begin or frames + codes[end].shape[1] <= frames_per_part):
            frames += codes[end].shape[1]
            end += 1
        block = np.concatenate(codes[begin:end], axis=1)  # (K, frames)
        units = [np.array([SYMBOL_ID[u] for u in r["units"]], np.int16) for r in rows[begin:end]]
        np.savez(
            out / f"{stem}-{part:02d}.npz",
            codes=pack_bits(block.ravel(), bits),
            shape=np.array(block.shape),
            n_frames=np.array([c.shape[1] for c in codes[begin:end]]),
            unit_count=np.array([len(u) for u in units]),
            unit_ids=np.concatenate(units),
            durations=np.concatenate([r["frames"] for r in rows[begin:end]]).astype(np.int16),
            meta=np.array(json.dumps([{k: r[k] for k in ("id", "voice", "duration")} for r in rows[begin:end]])),
        )
        part, begin = part + 1, end


def read_parts(folder: Path, bits: int = 10) -> list[dict]:
    """Rows for `training.train_ar`: id, voice, duration, n_frames, codes (K, T), unit_ids (N,), durations (N,)."""
    rows = []
    for path in sorted(folder.glob("*.npz")):
        data = np.load(path)
        books, total = (int(x) for x in data["shape"])
        block = unpack_bits(data["codes"], bits, books * total).reshape(books, total)
        frame_ends, unit_ends = np.cumsum(data["n_frames"]), np.cumsum(data["unit_count"])
        for i, meta in enumerate(json.loads(str(data["meta"]))):
            f0, u0 = (frame_ends[i - 1] if i else 0), (unit_ends[i - 1] if i else 0)
            rows.append(
                {
                    **meta,
                    "n_frames": int(data["n_frames"][i]),
                    "codes": torch.from_numpy(block[:, f0 : frame_ends[i]].copy()),
                    "unit_ids": torch.from_numpy(data["unit_ids"][u0 : unit_ends[i]].astype(np.int64)),
                    "durations": torch.from_numpy(data["durations"][u0 : unit_ends[i]].astype(np.int64)),
                }
            )
    return rows


def codec_fingerprint(codec_folder: Path) -> str:
    """Names the encoder and codebooks that made a cache's codes, so a retrained encoder never reuses them
    (a decoder fine-tune keeps the name: its tokens are the same)."""
    digest = hashlib.sha256((codec_folder / "codec_encoder.safetensors").read_bytes())
    with safe_open(codec_folder / "codec_decoder.safetensors", "pt") as weights:  # the codebooks live there
        digest.update(weights.get_tensor("quantizer.codebooks").numpy().tobytes())
    return digest.hexdigest()[:12]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--corpus", type=Path, default=Path("corpus"))
    parser.add_argument("--codec", type=Path, default=Path("voices"))
    parser.add_argument("--out", type=Path, default=Path("upload/tokens"))
    parser.add_argument("--voices", nargs="+", default=None)
    parser.add_argument("--part-mb", type=float, default=20)
    parser.add_argument(
        "--cache", type=Path, default=Path("cache/tokens"), help="per-codec folders of per-utterance codes"
    )
    parser.add_argument("--shard", default="0/1", help="i/n: encode every n-th missing utterance only, write nothing")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--device", default="cpu", help="cuda on the GPU machine: the codec is fp32 either way")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(args.workers)
    torch.backends.cudnn.allow_tf32 = False  # fp32 convolutions, as on the CPU: codes sit near RVQ boundaries
    bits = math.ceil(math.log2(load_codec(args.codec).cfg.codebook_size))
    cache = args.cache / codec_fingerprint(args.codec)
    for manifest in sorted(args.corpus.glob("*.jsonl")):
        voice = manifest.stem
        if args.voices and voice not in args.voices:
            continue
        rows = read_manifests(args.corpus, [voice])
        shard = tuple(int(x) for x in args.shard.split("/"))
        codes = encode_rows(args.corpus, rows, args.codec, cache / voice, args.workers, shard, args.device)
        if codes is None:
            continue
        write_parts(rows, codes, args.out, voice, bits, int(args.part_mb * 1e6))


if __name__ == "__main__":
    main()
