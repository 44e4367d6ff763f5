"""Average the weights of models of the same shape (a "model soup"), as the AR model shipped from rounds 6 and 9.

    python -m training.soup runs/round6 runs/round9 --out voices
    python -m training.soup runs/codec10 runs/codec11 --files codec_decoder.safetensors --out runs/soup

The second averages only the codec's decoders: the encoder, and with it every token, stays as it was.

Each folder holds ``model-*.safetensors`` shards as `training.train_ar.export` writes them (or the files that
``--files`` matches). Tensors are matched by name across shards, averaged in fp32 with equal weights and written
back in fp16 in the first folder's shard layout, with its config and voice list and the sources as metadata.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from safetensors import safe_open
from safetensors.torch import save_file


def read_shards(folder: Path, files: str = "model-*.safetensors") -> list[tuple[str, dict, dict]]:
    """(file name, metadata, {tensor name: tensor}) of each shard, in order."""
    shards = []
    for path in sorted(folder.glob(files)):
        with safe_open(str(path), "pt") as f:
            shards.append((path.name, f.metadata(), {k: f.get_tensor(k) for k in f.keys()}))
    if not shards:
        raise FileNotFoundError(f"no {files} in {folder}")
    return shards


def soup(folders: list[Path], out: Path, files: str = "model-*.safetensors") -> None:
    models = [read_shards(folder, files) for folder in folders]
    merged = [{k: v for _, _, tensors in model for k, v in tensors.items()} for model in models]
    if any(m.keys() != merged[0].keys() or any(m[k].shape != merged[0][k].shape for k in m) for m in merged):
        raise ValueError("the models differ in their tensors or shapes")
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob(files):  # all read already, also when out is one of the sources
        old.unlink()
    for name, metadata, tensors in models[0]:
        averaged = {k: (sum(m[k].float() for m in merged) / len(merged)).half() for k in tensors}
        kept = {
            k: metadata[k] for k in ("config", "voices") if k in metadata
        }  # one run's steps and losses would mislead
        save_file(averaged, str(out / name), metadata={**kept, "soup": json.dumps([f.name for f in folders])})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("models", type=Path, nargs="+", help="folders of model-*.safetensors shards")
    parser.add_argument("--files", default="model-*.safetensors", help="which files of each folder to average")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    soup(args.models, args.out, args.files)


if __name__ == "__main__":
    main()
