"""Pack the corpus for the GPU machine: re-encode audio as ~32 kbit/s Ogg/Opus in parts of at most
``--part-mb`` MB (each device call carries at most 64 MiB), manifests in part 0.

    python -m training.pack --corpus corpus --out upload
"""
from __future__ import annotations

import argparse
import shutil
from multiprocessing import Pool
from pathlib import Path

import soundfile as sf


def _transcode(job: tuple[str, str]) -> int:
    src, dst = job
    if not Path(dst).exists():
        audio, sr = sf.read(src, dtype="float32")
        tmp = dst + ".tmp.opus"
        sf.write(tmp, audio, sr, format="OGG", subtype="OPUS", compression_level=0.9)
        Path(tmp).rename(dst)
    return Path(dst).stat().st_size


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--corpus", type=Path, default=Path("corpus"))
    parser.add_argument("--out", type=Path, default=Path("upload"))
    parser.add_argument("--part-mb", type=float, default=52)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    staging = args.out / "all"
    jobs = []
    for manifest in sorted(args.corpus.glob("*.jsonl")):
        (staging / manifest.stem).mkdir(parents=True, exist_ok=True)
        jobs += [(str(p), str(staging / manifest.stem / p.name)) for p in sorted((args.corpus / manifest.stem).glob("*.opus"))
                 if not p.name.endswith(".tmp.opus")]
    with Pool(args.workers) as pool:
        sizes = pool.map(_transcode, jobs, chunksize=32)
    part, used = 0, 0.0
    for (_, dst), size in zip(jobs, sizes):
        if used + size > args.part_mb * 1e6:
            part, used = part + 1, 0.0
        target = args.out / f"part{part}" / Path(dst).parent.name / Path(dst).name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(dst, target)
        used += size
    for manifest in sorted(args.corpus.glob("*.jsonl")):
        shutil.copy(manifest, args.out / "part0" / manifest.name)
    shutil.rmtree(staging)
    print(f"{len(jobs)} files in {part + 1} parts")


if __name__ == "__main__":
    main()
