"""Decode-step implementations side by side on the shipped model. One JSON object.

    python -m bench.steps                  # every kind, batch 1 2 4 8, one thread (the engine's share of 2 cores)
    python -m bench.steps --quick          # fewer steps, no inductor compile
    python -m bench.steps --threads 4      # more intra-op threads, where the machine has the cores
    python -m bench.steps --codec-only     # only the codec rows (below)
    python -m bench.steps --quality 40     # int8 step against fp32: WER and DNSMOS on 40 sentences (`quality`)

For each kind and batch size: step time p50/p99 (wall clock and the thread's CPU time, which is less
disturbed by other processes on a shared machine) after warm-up, with full rings and every slot active;
kinds are interleaved in rounds so that load from other processes falls on all of them alike. Build
times are taken in fresh processes: ``cold`` with an empty cache directory, ``warm`` with the one the
cold build left, and ``rss_mb`` is what the build added to the process. ``max_abs_logit_diff`` compares
each kind's logits with the eager ``decode_step``'s on the same inputs.

Codec rows (``codec_ms``): the CPU codec worker's decode call (`Codec.decode_step`, codes to audio with the
decoder state carried) for each chunk length the engine hands it (`CHUNK_SCHEDULE`'s) and batch size, torch
(eager) and onnxruntime (`kernels.ort_codec`), interleaved the same way: per call p50/p99 and the thread's
CPU time, and ``frame_ms_p50`` = call p50 / (batch x chunk), the decoder's cost per frame of one stream
(real time for N streams on the codec's one core needs N x frame_ms below the 20 ms frame;
``frame_cpu_ms_p50`` the same from CPU time, less disturbed by other processes).
``max_abs_audio_diff`` compares onnxruntime's chunked audio with the torch decoder's.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch

from streaming.slots import CHUNK_SCHEDULE

KINDS = (
    "eager",
    "lean",
    "onnxruntime",
    "onnxruntime-int8",
    "compiled",
)  # also "aot_inductor", on request: minutes to build


def aot_inductor_factory(model):
    """`LeanStep` compiled ahead of time by AOTInductor, one package per batch size, cached beside the ONNX
    steps. Benchmark only: here it was slower than ONNX Runtime and took minutes per batch size to build."""
    from kernels import ort
    from kernels.lean import lean_module, ring_tensors, write_rings

    def make(model, caches, batch, device):
        path = ort.cache_dir() / f"aot-b{batch}-{ort.onnx_path(model).stem}.pt2"
        args = (
            *step_inputs(model.cfg, batch, 0),
            caches.text[0].positions,
            caches.audio[0].positions,
            *ring_tensors(caches),
        )
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            program = torch.export.export(lean_module(model), args, strict=False)
            torch._inductor.aoti_compile_and_package(program, package_path=str(path))
        runner = torch._inductor.aoti_load_package(str(path))

        def step(model, caches, tokens, frame, unit, active):
            logits, *writes = runner(
                tokens, frame, unit, active, caches.text[0].positions, caches.audio[0].positions, *ring_tensors(caches)
            )
            write_rings(caches, *writes)
            return logits

        return step

    return make


def factory(kind: str, model):
    """A step factory for ``kind``, built (and, for onnxruntime, exported) now."""
    from streaming.step_caches import decode_step

    if kind == "eager":
        return lambda model, caches, batch, device: decode_step
    if kind == "lean":
        from kernels.lean import lean_factory

        return lean_factory
    if kind.startswith("onnxruntime"):
        return ort_factory(model, kind.endswith("int8"))
    if kind == "compiled":
        from kernels.compiled import CompiledStep

        return CompiledStep
    if kind == "aot_inductor":
        return aot_inductor_factory(model)
    raise ValueError(kind)


def ort_factory(model, int8: bool):
    """The ONNX Runtime step factory, fp32 or int8, exported (and quantised) now if not cached. The
    quantiser runs in a child process as in `kernels.auto` (importing it sets INFO logging)."""
    from kernels import ort

    path = ort.load(model, int8)
    if path is None:
        path = ort.onnx_path(model, int8)
        fp32 = ort.onnx_path(model)
        if int8:
            ort.export_in_background_process(model, fp32, "kernels.ort", path)
        else:
            ort.export(model, fp32)
    return ort.factory(path)


def full_caches(cfg, batch: int, seed: int = 0):
    """Caches as in steady speech: every ring slot holds a visible position, keys and values random."""
    from streaming.step_caches import StepCaches

    caches = StepCaches.empty(cfg, batch)
    g = torch.Generator().manual_seed(seed)
    for tensor in [t for pair in caches.sinks for t in pair] + [
        t for r in caches.text + caches.audio for t in (r.keys, r.values)
    ]:
        tensor.copy_(torch.randn(tensor.shape, generator=g) * 0.5)
    caches.audio[0].positions.copy_(torch.arange(1000 - caches.audio[0].capacity, 1000).expand(batch, -1))
    caches.text[0].positions.copy_(torch.arange(330, 330 + caches.text[0].capacity).expand(batch, -1))
    return caches


def step_inputs(cfg, batch: int, frame: int):
    tokens = torch.randint(0, cfg.codebook_size, (batch, cfg.codebooks), generator=torch.Generator().manual_seed(1))
    frames = torch.full((batch,), frame)
    return tokens, frames, frames // 3, torch.ones(batch, dtype=torch.bool)


def time_steps(model, kinds: dict, batch: int, rounds: int, per_round: int) -> dict:
    """Interleaved rounds of ``per_round`` steps per kind (after 20 warm-up steps each)."""
    cfg = model.cfg
    state = {kind: [full_caches(cfg, batch), 1000] for kind in kinds}
    steps = {kind: make(model, state[kind][0], batch, "cpu") for kind, make in kinds.items()}
    wall = {kind: [] for kind in kinds}
    cpu = {kind: [] for kind in kinds}
    for round_ in range(rounds + 1):
        for kind, step in steps.items():
            caches, frame = state[kind]
            for i in range(per_round if round_ else 20):
                inputs = step_inputs(cfg, batch, frame + i)
                start_wall, start_cpu = time.perf_counter(), time.thread_time()
                step(model, caches, *inputs)
                if round_:
                    cpu[kind].append((time.thread_time() - start_cpu) * 1000)
                    wall[kind].append((time.perf_counter() - start_wall) * 1000)
            state[kind][1] = frame + per_round
    summary = {}
    for kind in kinds:
        w, c = np.asarray(wall[kind]), np.asarray(cpu[kind])
        summary[kind] = {
            "p50": round(float(np.percentile(w, 50)), 3),
            "p99": round(float(np.percentile(w, 99)), 3),
            "cpu_p50": round(float(np.percentile(c, 50)), 3),
            "cpu_p99": round(float(np.percentile(c, 99)), 3),
        }
    return summary


def logit_diff(model, kinds: dict, batch: int = 2, steps: int = 30) -> dict:
    from streaming.step_caches import decode_step

    cfg = model.cfg
    out = {}
    for kind, make in kinds.items():
        caches, ref = full_caches(cfg, batch), full_caches(cfg, batch)
        step, worst = make(model, caches, batch, "cpu"), 0.0
        for i in range(steps):
            inputs = step_inputs(cfg, batch, 1000 + i)
            want = decode_step(model, ref, *inputs)
            worst = max(worst, float((step(model, caches, *inputs) - want).abs().max()))
        out[kind] = worst
    return out


def codec_steps(codec, batches: list[int], chunks: list[int], rounds: int, per_round: int) -> dict:
    """Decode-call times of the torch decoder and ONNX Runtime's (exported now if not cached), interleaved
    in rounds as `time_steps`; random codes, the state carried across calls as in speech."""
    from kernels import ort_codec

    path = ort_codec.load(codec)
    if path is None:
        path = ort_codec.onnx_path(codec)
        ort_codec.export(codec, path)
    steps = {"torch": codec.decode_step, "onnxruntime": ort_codec.OrtCodecStep(path, codec.decoder.lstm is not None)}
    g = torch.Generator().manual_seed(0)
    result = {kind: {} for kind in steps}
    for chunk in chunks:
        for batch in batches:
            codes = torch.randint(0, codec.cfg.codebook_size, (batch, codec.cfg.codebooks, chunk), generator=g)
            states = {kind: codec.init_state(batch) for kind in steps}
            wall = {kind: [] for kind in steps}
            cpu = {kind: [] for kind in steps}
            for round_ in range(rounds + 1):
                for kind, step in steps.items():
                    for _ in range(per_round if round_ else 5):
                        start_wall, start_cpu = time.perf_counter(), time.thread_time()
                        step(codes, states[kind])
                        if round_:
                            cpu[kind].append((time.thread_time() - start_cpu) * 1000)
                            wall[kind].append((time.perf_counter() - start_wall) * 1000)
            for kind in steps:
                p50 = float(np.percentile(wall[kind], 50))
                result[kind].setdefault(str(chunk), {})[str(batch)] = {
                    "p50": round(p50, 3),
                    "p99": round(float(np.percentile(wall[kind], 99)), 3),
                    "cpu_p50": round(float(np.percentile(cpu[kind], 50)), 3),
                    "frame_ms_p50": round(p50 / (batch * chunk), 3),
                    "frame_cpu_ms_p50": round(float(np.percentile(cpu[kind], 50)) / (batch * chunk), 3),
                }
    return {"codec_ms": result, "max_abs_audio_diff": codec_audio_diff(codec, steps["onnxruntime"])}


def codec_audio_diff(codec, step, frames: int = 40, chunk: int = 4) -> float:
    """The largest difference between ``step``'s chunked decode of 2 streams and the torch decoder's."""
    codes = torch.randint(
        0, codec.cfg.codebook_size, (2, codec.cfg.codebooks, frames), generator=torch.Generator().manual_seed(1)
    )
    want, got = codec.init_state(2), codec.init_state(2)
    worst = 0.0
    for t in range(0, frames, chunk):
        part = codes[..., t : t + chunk]
        worst = max(worst, float((step(part, got) - codec.decode_step(part, want)).abs().max()))
    return worst


def build_in_fresh_process(kind: str, cache: str, threads: int) -> dict:
    env = dict(os.environ, TTS_CACHE_DIR=cache, TORCHINDUCTOR_CACHE_DIR=os.path.join(cache, "inductor"))
    done = subprocess.run(
        [sys.executable, "-m", "bench.steps", "--build-only", kind, "--threads", str(threads)],
        env=env,
        capture_output=True,
        text=True,
    )
    if done.returncode:
        return {"error": done.stderr.strip().splitlines()[-1:]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def build_only(kind: str) -> None:
    """Load the model, then time building ``kind``'s step for batch 1 (what a process pays before its first step)."""
    import psutil

    from tts.model import load_model
    from tts.voices import VOICES_DIR

    model, _ = load_model(VOICES_DIR)
    rss = psutil.Process().memory_info().rss
    start = time.perf_counter()
    make = factory(kind, model)
    step = make(model, full_caches(model.cfg, 1), 1, "cpu")  # held: the lean step's weights live as long as it
    print(
        json.dumps(
            {
                "build_s": round(time.perf_counter() - start, 2),
                "rss_mb": round((psutil.Process().memory_info().rss - rss) / 2**20, 1),
            }
        )
    )
    del step


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--batches", type=int, nargs="*", default=[1, 2, 4, 8])
    parser.add_argument("--kinds", nargs="*", default=None, help=f"default: {' '.join(KINDS)} (--quick: no compiled)")
    parser.add_argument(
        "--chunks", type=int, nargs="*", default=sorted(set(CHUNK_SCHEDULE)), help="codec chunk lengths (frames)"
    )
    parser.add_argument("--codec-only", action="store_true", help="only the codec decoder rows")
    parser.add_argument("--quality", type=int, metavar="N", help="only the int8-against-fp32 quality rows, N sentences")
    parser.add_argument(
        "--skip", type=int, default=100, help="--quality: Harvard sentences to skip (bench.wer uses the first 100)"
    )
    parser.add_argument("--build-only", help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.set_flush_denormal(True)
    torch.set_grad_enabled(False)
    if args.build_only:
        return build_only(args.build_only)
    if args.quality:
        return print(json.dumps(quality(args.quality, args.skip), indent=1))
    rounds, per_round = (3, 50) if args.quick else (6, 100)
    if args.codec_only:
        return print(json.dumps(codec_report(args, rounds, per_round // 5), indent=1))
    kinds = args.kinds or [k for k in KINDS if not (args.quick and k == "compiled")]
    builds = {}
    with tempfile.TemporaryDirectory() as cache:
        for kind in kinds:
            builds[kind] = {
                "cold": build_in_fresh_process(kind, cache, args.threads),
                "warm": build_in_fresh_process(kind, cache, args.threads),
            }
    from tts.model import load_model
    from tts.voices import VOICES_DIR

    model, _ = load_model(VOICES_DIR)
    made = {kind: factory(kind, model) for kind in kinds}
    load_before = os.getloadavg()[0]
    timings = {str(b): time_steps(model, made, b, rounds, per_round) for b in args.batches}
    result = {
        "threads": args.threads,
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "load_avg_1min": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        "step_ms": {kind: {b: timings[b][kind] for b in timings} for kind in kinds},
        "build": builds,
        "max_abs_logit_diff": logit_diff(model, made),
    }
    result["codec"] = codec_report(args, rounds, per_round // 5)
    try:
        import onnxruntime

        result["onnxruntime"] = onnxruntime.__version__
    except ImportError:
        pass
    print(json.dumps(result, indent=1))


def quality(n: int, skip: int) -> dict:
    """The int8 step against the fp32 one on the shipped model, in one run: ``n`` Harvard sentences from
    ``skip`` on (every voice in turn), each spoken with a fixed seed by an engine on the fp32 step, on the
    int8 step, and on the fp32 step with other seeds (``fp32_reseeded``: how far two samplings of the same
    step differ, the yardstick a gap is judged against). Whisper tiny.en WER and DNSMOS OVRL per sentence
    (`bench.quality`'s trim and normalisation); ``*_minus_fp32``: paired mean differences with their
    standard errors. Largest logit difference from fp32 over 100 steps of steady speech, too."""
    from bench.common import corpus_form, dnsmos, harvard
    from kernels.auto import faster_codec_step
    from streaming.engine import Engine
    from tts import SAMPLE_RATE
    from tts.api import synthesize
    from tts.asr import transcribe, wer
    from tts.voices import load_shipped

    model, codec, presets = load_shipped()
    texts, voices = harvard(skip + n)[skip:], list(presets)
    codec_step = faster_codec_step(codec).result(timeout=900)
    runs = {"fp32": (False, 0), "int8": (True, 0), "fp32_reseeded": (False, 100_000)}
    rows = {}
    for name, (int8, seeds) in runs.items():
        engine = Engine(model, codec, presets, max_streams=1, step_factory=ort_factory(model, int8))
        engine.set_codec_step(codec_step)
        rows[name] = []
        for i, text in enumerate(texts):
            audio = synthesize(text, voice=voices[i % len(voices)], engine=engine, seed=seeds + i)
            rows[name].append(
                {
                    "wer": wer(text, transcribe(audio, SAMPLE_RATE)),
                    "ovrl": dnsmos(corpus_form(audio, SAMPLE_RATE))["ovrl"],
                }
            )
        engine.close()
    report = {
        "sentences": n,
        "skip": skip,
        "voices": voices,
        "logit_diff_int8": logit_diff(model, {"int8": ort_factory(model, True)}, steps=100)["int8"],
    }
    for name in runs:
        report[name] = {key: round(float(np.mean([r[key] for r in rows[name]])), 4) for key in ("wer", "ovrl")}
    for name in ("int8", "fp32_reseeded"):
        for key in ("wer", "ovrl"):
            gaps = np.array([a[key] - b[key] for a, b in zip(rows[name], rows["fp32"])])
            report[f"{name}_minus_fp32_{key}"] = {
                "mean": round(float(gaps.mean()), 4),
                "sem": round(float(gaps.std(ddof=1) / np.sqrt(len(gaps))), 4),
            }
    return report


def codec_report(args, rounds: int, per_round: int) -> dict:
    """The codec rows on the shipped codec, with the machine's load before and after."""
    from tts.codec import load_codec
    from tts.voices import VOICES_DIR

    codec = load_codec(VOICES_DIR)
    load_before = os.getloadavg()[0]
    rows = codec_steps(codec, args.batches, args.chunks, rounds, max(per_round, 5))
    return {"threads": args.threads, "load_avg_1min": [round(load_before, 2), round(os.getloadavg()[0], 2)], **rows}


if __name__ == "__main__":
    main()
