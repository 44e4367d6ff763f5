"""GPU smoke of the engine as merged: greedy CPU vs GPU audio of one sentence; 6 greedy streams on 4 slots
(starting 0.1 s apart, so slots are freed and taken again) against each alone on a 4-slot engine; the numeric
settings that decide batch invariance. Run from the repository root on the device machine:
    python3 scripts/gpu/smoke.py
"""

import sys
import threading
import time

import numpy as np
import torch

sys.path.insert(0, ".")
import kernels  # noqa: E402
from bench.common import harvard  # noqa: E402
from streaming.engine import Engine, SamplingConfig  # noqa: E402
from tts.api import synthesize  # noqa: E402
from tts.voices import load_shipped  # noqa: E402

GREEDY = SamplingConfig(temperature=0.0)


def diff(a, b):
    return float(np.abs(a - b).max()) if len(a) == len(b) else f"length {len(a)} vs {len(b)}"


def main(device="cuda"):
    print(
        "torch",
        torch.__version__,
        torch.cuda.get_device_name() if device == "cuda" else device,
        "cudnn",
        torch.backends.cudnn.version(),
    )
    print(
        "matmul allow_tf32",
        torch.backends.cuda.matmul.allow_tf32,
        "cudnn allow_tf32",
        torch.backends.cudnn.allow_tf32,
        "float32_matmul_precision",
        torch.get_float32_matmul_precision(),
    )
    sentences = harvard(8)
    cpu = load_shipped(device="cpu")
    gpu = load_shipped(device=device)
    started = time.perf_counter()
    engine = Engine(
        *gpu,
        max_streams=4,
        max_open=6,
        device=device,
        sampling=GREEDY,
        step_factory=kernels.default_step_factory(device) if device == "cuda" else None,
    )
    engine.warm_up()
    first = synthesize(sentences[0], engine=engine, seed=1)
    print(
        "first cuda utterance s",
        round(time.perf_counter() - started, 2),
        "kind",
        engine.step_kind,
        "max_streams",
        engine.max_streams,
        "audio s",
        round(len(first) / engine.sample_rate, 2),
    )
    on_cpu = Engine(*cpu, max_streams=1, device="cpu", sampling=GREEDY)
    print("greedy cpu vs gpu: max diff", diff(synthesize(sentences[0], engine=on_cpu, seed=1), first))
    on_cpu.close()
    alone = [synthesize(s, engine=engine, seed=10 + i) for i, s in enumerate(sentences[:6])]
    results = {}

    def speak(i):
        time.sleep(0.1 * i)
        results[i] = synthesize(sentences[i], engine=engine, seed=10 + i)

    threads = [threading.Thread(target=speak, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    print("greedy, 6 streams on 4 slots vs alone:", [diff(results[i], alone[i]) for i in range(6)])
    stats = engine.stats()
    print(
        "stats",
        {k: stats[k] for k in ("parks", "restores", "slot_waits", "step_kind", "tick_ms", "step_ms", "codec_ms")},
    )
    engine.close()


if __name__ == "__main__":
    main(*sys.argv[1:])  # "cpu": a rehearsal here
