"""Pack the corpus for the GPU machine (needs Debian's opus-tools): re-encode audio as 28 kbit/s Ogg/Opus in parts of
at most
``--part-mb`` MB (each device call carries at most 64 MiB), manifests in part 0.

    python -m training.pack --corpus corpus --out upload
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
from multiprocessing import Pool
from pathlib import Path

from training.data import is_heldout


def _transcode(job: tuple[str, str]) -> int:
    """opus-tools at encoder complexity 0: ten times faster than libsndfile's encoder, same bitrate."""
    src, dst = job
    if not Path(dst).exists():
        wav, tmp = dst + ".tmp.wav", dst + ".tmp.opus"
        subprocess.run(["opusdec", "--quiet", "--rate", "24000", src, wav], check=True)
        subprocess.run(["opusenc", "--quiet", "--comp", "0", "--speech", "--bitrate", "28", wav, tmp], check=True)
        os.unlink(wav)
        os.rename(tmp, dst)
    return Path(dst).stat().st_size


def first_hours(lines: list[str], hours: float) -> list[str]:
    """The first training (not held-out) manifest lines adding up to ``hours`` of audio."""
    kept, seconds = [], 0.0
    for line in lines:
        row = json.loads(line)
        if seconds < hours * 3600 and not is_heldout(row["id"]):
            kept.append(line)
            seconds += row["duration"]
    return kept


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--corpus", type=Path, default=Path("corpus"))
    parser.add_argument("--out", type=Path, default=Path("upload"))
    parser.add_argument("--part-mb", type=float, default=52)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument(
        "--hours-per-voice",
        type=float,
        default=0,
        help="pack only each voice's first training utterances up to this many hours (0: all)",
    )
    args = parser.parse_args()
    staging = args.out / "all"
    jobs, manifests = [], {}
    for manifest in sorted(args.corpus.glob("*.jsonl")):
        (staging / manifest.stem).mkdir(parents=True, exist_ok=True)
        manifests[manifest.name] = manifest.read_text().splitlines()  # a snapshot: the corpus may still grow
        if args.hours_per_voice:
            manifests[manifest.name] = first_hours(manifests[manifest.name], args.hours_per_voice)
        for line in manifests[manifest.name]:
            path = json.loads(line)["path"]
            jobs.append((str(args.corpus / path), str(staging / path)))
    with Pool(args.workers) as pool:
        sizes = pool.map(_transcode, jobs, chunksize=32)
    for old in args.out.glob("part*"):
        shutil.rmtree(old)
    part, used = 0, 0.0
    for (_, dst), size in zip(jobs, sizes):
        if used + size > args.part_mb * 1e6:
            part, used = part + 1, 0.0
        target = args.out / f"part{part}" / Path(dst).parent.name / Path(dst).name
        target.parent.mkdir(parents=True, exist_ok=True)
        os.link(dst, target)  # the staging copy stays, so a re-run only transcodes new files
        used += size
    for name, lines in manifests.items():
        (args.out / "part0" / name).write_text("\n".join(lines) + "\n")
    print(f"{len(jobs)} files in {part + 1} parts")


if __name__ == "__main__":
    main()
