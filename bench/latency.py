"""Engine latency, flatness, baselines and concurrency on the shipped default voice. One JSON object.

    python -m bench.latency            # full run, includes 600 s of continuous speech
    python -m bench.latency --quick    # about a minute: no 600 s run, one baseline repeat, 1 and 4 streams
    python -m bench.latency --step compiled   # the TorchInductor step instead of the default (ONNX Runtime)
    python -m bench.latency --step eager      # the plain eager step
    python -m bench.latency --codec torch     # the torch codec decoder instead of the default (ONNX Runtime)
    python -m bench.latency --device cuda --streams 64 128 256 512 1024 --arrival-rate 25   # the GPU load table

Step times are AR step + sampling per frame tick, after warm-up; on the CPU the engine's step is the one
every user path gets (ONNX Runtime) unless ``--step`` says otherwise, and so is the codec decoder
(ONNX Runtime, `kernels.ort_codec`) unless ``--codec torch``. Baselines run eagerly, batch 1, on the same weights:
``ring`` is our step through
the ring caches, ``no_cache`` recomputes the whole prefix for every step, ``concat_cache`` grows a
concatenated KV cache and attends to everything (what a default dynamic cache does). The speed-ups compare
the baselines with ``ring``, measured the same way in the same run.

On a GPU (``--device cuda``) the report is the load table instead: one engine, and for each load N streams
(a) all starting in the same instant and (b) arriving as a Poisson process at ``--arrival-rate`` a second;
per load: real-time or not, whole-tick, AR step and codec call p50/p99, time to first audio p50/p99, and
GPU memory per stream; the tick's parts (`Engine.tick_phases`), the parts of the slowest 1 % of ticks, the
tick once every stream has had its first audio (past the start burst), and the garbage collections. ``--profile DIR``
adds a torch-profiler trace of ticks at the largest real-time load.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import random
import shutil
import sys
import threading
import time
from pathlib import Path

import numpy as np
import psutil
import torch

import kernels
from bench.common import harvard, percentiles
from streaming.engine import TICK_PHASES, Engine
from streaming.step_caches import StepCaches, decode_step
from tts.api import synthesize, synthesize_stream
from tts.model import TTSModel
from tts.voices import load_shipped

TEN_WORDS = "The quick brown fox jumps over the lazy dog near the river."
PARAGRAPH = " ".join(harvard(8))


def rss_mb() -> float:
    return psutil.Process().memory_info().rss / 2**20


def ttfa(engine: Engine, repeats: int) -> dict:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        stream = synthesize_stream(TEN_WORDS, engine=engine)
        next(stream)
        times.append((time.perf_counter() - start) * 1000)
        stream.close()
        wait_idle(engine)
    return percentiles(times)


def wait_idle(engine: Engine, seconds: float = 10.0) -> None:
    """A cancelled stream frees its slot at the engine's next tick; wait for that before opening another."""
    deadline = time.monotonic() + seconds
    while engine.active_streams and time.monotonic() < deadline:
        time.sleep(0.001)


def steady_state(engine: Engine) -> tuple[dict, float]:
    engine.step_ms.clear()
    engine.tick_ms.clear()
    start = time.perf_counter()
    audio = synthesize(PARAGRAPH, engine=engine)
    rtf = (time.perf_counter() - start) / (len(audio) / engine.sample_rate)
    return percentiles(list(engine.step_ms)), rtf


def flatness(engine: Engine, marks_s: list[int]) -> list[dict]:
    """Speak continuously; at each mark report the step time over the last 250 steps and the RSS."""
    sentences = iter(harvard(720) * 4)
    stream = engine.open()
    stop = threading.Event()

    engine.step_ms.clear()
    rows, produced, marks = [], 0, list(marks_s)

    def feed():  # text ahead of the speech by a few sentences; speech runs at about 15 characters a second
        pushed = 0
        while not stop.wait(0.02):
            if pushed < 25 * produced / engine.sample_rate + 400:
                sentence = next(sentences) + " "
                stream.push_text(sentence)
                pushed += len(sentence)

    feeder = threading.Thread(target=feed, daemon=True)
    feeder.start()
    while marks:
        chunk = stream.read(timeout=60)
        produced += len(chunk)
        if produced / engine.sample_rate >= marks[0]:
            recent = list(engine.step_ms)[-250:]
            rows.append(
                {
                    "audio_s": marks.pop(0),
                    "step_ms": percentiles(recent),
                    "rss_mb": round(rss_mb(), 1),
                    "kv_bytes_per_stream": engine.caches.nbytes // engine.max_streams,
                }
            )
    stop.set()
    stream.cancel()
    wait_idle(engine)
    return rows


@torch.inference_mode()
def baseline_step_ms(model: TTSModel, frames: int, kind: str, device: str, repeats: int = 3) -> dict:
    """Time of producing step ``frames``, batch 1, eager, with no cache, with a concatenated cache of ``frames``
    entries, or with our ring caches (``ring``: the same step as the engine's, so the ratios compare like with like)."""
    cfg = model.cfg
    voice = torch.tensor([0], device=device)
    prefix = model.voice_prefix(voice)
    units = torch.randint(4, cfg.n_symbols, (1, frames // 3 + 8), device=device)
    states, _ = model.text(units, voice)
    starts = (torch.arange(units.shape[1], device=device) * 3)[None]
    text_kv, text_phoneme = model.text_keys_values(states, starts), torch.arange(units.shape[1], device=device)[None]
    everything = 1 << 30
    if kind == "ring":
        caches = StepCaches.empty(cfg, 1, device)
        for ring in caches.audio[:1] + caches.text[:1]:  # full rings: every slot holds a visible position
            ring.positions.copy_(torch.arange(frames - ring.capacity, frames, device=device)[None])
        tokens = torch.randint(0, cfg.codebook_size, (1, cfg.codebooks), device=device)
        frame, active = torch.tensor([frames], device=device), torch.ones(1, dtype=torch.bool, device=device)

        def run():
            return decode_step(model, caches, tokens, frame, frame // 3, active)
    elif kind == "no_cache":
        tokens = torch.randint(0, cfg.codebook_size, (1, cfg.codebooks, frames + 1), device=device)
        pos = torch.arange(frames + 1, device=device)[None]

        def run():
            return model(tokens, pos, pos // 3, prefix, text_kv, text_phoneme)
    else:
        keys = [torch.randn(1, cfg.heads, frames, cfg.head_dim, device=device) for _ in range(cfg.layers)]
        values = [torch.randn_like(k) for k in keys]
        key_pos = torch.arange(frames, device=device)[None]
        tokens = torch.randint(0, cfg.codebook_size, (1, cfg.codebooks, 1), device=device)
        pos = torch.tensor([[frames]], device=device)

        def run():
            def grow(i, k, v, p):
                return torch.cat([keys[i], k], 2), torch.cat([values[i], v], 2), torch.cat([key_pos, p], 1)

            return model(tokens, pos, pos // 3, prefix, text_kv, text_phoneme, grow, window=everything)

    run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1000)
    kv = cfg.layers * 2 * cfg.heads * frames * cfg.head_dim * 4
    memory = {
        "ring": caches.nbytes if kind == "ring" else 0,
        "concat_cache": kv,
        "no_cache": cfg.heads * (frames + 1) ** 2 * 4,
    }[kind]
    return {"step_ms": round(float(np.median(times)), 3), "memory_bytes": memory}


def cpu_step_factory(model, device: str, step: str):
    """The CPU step of ``--step``: "default", what every user path gets (`kernels.default_step_factory`: ONNX
    Runtime, built now if the disk cache lacks it, and waited for); "compiled", TorchInductor; "eager", the
    plain `decode_step` (None)."""
    if step == "eager":
        return None
    if step == "compiled":
        return kernels.default_step_factory(device, compile=True)
    factory = kernels.default_step_factory(device)
    factory(model, StepCaches.empty(model.cfg, 1), 1, device)  # starts the export when it is not cached
    return factory.faster.result(timeout=900) or factory


def cpu_codec_step(codec, device: str, choice: str):
    """The codec decode step of ``--codec``: "default", what every user path gets (`kernels.auto.faster_codec_step`:
    ONNX Runtime, built now if the disk cache lacks it, and waited for; None if it cannot be had); "torch", None."""
    from kernels.auto import faster_codec_step

    return faster_codec_step(codec, device).result(timeout=900) if choice == "default" else None


def concurrency(
    model, codec, presets, device: str, counts: list[int], factory, codec_step=None, jitter_s: float = 0.2
) -> list[dict]:
    """N streams at once on an engine of N slots; a stream is real-time if no chunk arrives after its
    playback deadline (first chunk's arrival + the audio before it + a ``jitter_s`` buffer)."""
    rows = []
    for n in counts:
        engine = Engine(model, codec, presets, max_streams=n, device=device, step_factory=factory)
        engine.set_codec_step(codec_step)
        engine.warm_up()  # every bucket's step built (compiled) before the clock starts
        synthesize(TEN_WORDS, engine=engine)
        rows.append({"streams": n, **load(engine, PARAGRAPH, [0.0] * n, jitter_s)})
        engine.close()
    return rows


def load(engine: Engine, text: str, starts_s: list[float], jitter_s: float = 0.2) -> dict:
    """Streams speaking ``text``, stream i opened ``starts_s[i]`` seconds after the first, each read as it is
    decoded by a thread of its own; lateness as in `concurrency`. Tick, step and codec times over the run."""
    n = len(starts_s)
    late, ttfas, first_tick = [0] * n, [0.0] * n, [0] * n
    for figures in (engine.step_ms, engine.tick_ms, engine.codec_ms, engine.tick_phases, GC_PAUSES):
        figures.clear()
    origin = time.perf_counter() + 0.05

    def run(i):
        time.sleep(max(0.0, origin + starts_s[i] - time.perf_counter()))
        start = time.perf_counter()
        first, played = None, 0
        for chunk in synthesize_stream(text, engine=engine):
            now = time.perf_counter()
            if first is None:
                first, ttfas[i], first_tick[i] = now, (now - start) * 1000, len(engine.tick_ms)
            elif now > first + jitter_s + played / engine.sample_rate:
                late[i] += 1
            played += len(chunk)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {
        "late_chunks": sum(late),
        "realtime": not any(late),
        "ttfa_ms": percentiles(ttfas),
        "tick_ms": percentiles(list(engine.tick_ms)),
        "step_ms": percentiles(list(engine.step_ms)),
        "codec_ms": percentiles([ms for ms, _ in engine.codec_ms]),
        "tick_ms_once_all_spoke": percentiles(list(engine.tick_ms)[max(first_tick) :]),
        **tick_parts(engine),
    }


PHASES = TICK_PHASES  # `Engine.tick_phases`
GC_PAUSES: list = []  # (generation, ms) of the collections during a load (`watch_gc`)


def tick_parts(engine: Engine) -> dict:
    """What a tick's time goes to (`Engine.tick_phases`): p50/p99 of each part, the mean parts of the ticks
    slower than the p99 tick (what makes the p99), and the garbage collections during the load."""
    phases = np.array(engine.tick_phases) * 1000  # (ticks, 4) ms
    ticks = np.array(engine.tick_ms)
    if not len(phases) or len(phases) != len(ticks):
        return {}
    slow = ticks >= np.percentile(ticks, 99)
    pauses = list(GC_PAUSES)
    return {
        "phases_ms": {name: percentiles(list(phases[:, i])) for i, name in enumerate(PHASES)},
        "slowest_1pct_ticks_ms": {
            "ticks": int(slow.sum()),
            "tick": round(float(ticks[slow].mean()), 3),
            **{name: round(float(phases[slow, i].mean()), 3) for i, name in enumerate(PHASES)},
        },
        "gc": {
            f"gen{g}": {
                "count": sum(1 for gen, _ in pauses if gen == g),
                "max_ms": round(max([ms for gen, ms in pauses if gen == g], default=0.0), 3),
            }
            for g in (0, 1, 2)
        },
    }


def watch_gc() -> None:
    """Time every garbage collection into GC_PAUSES."""
    import gc

    started = {}

    def callback(phase, info):
        if phase == "start":
            started["at"] = time.perf_counter()
        elif "at" in started:
            GC_PAUSES.append((info["generation"], (time.perf_counter() - started.pop("at")) * 1000))

    gc.callbacks.append(callback)


def gpu_table(
    model,
    codec,
    presets,
    device: str,
    counts: list[int],
    rate: float,
    text: str,
    profile: Path | None,
    poisson_max: int | None = None,
) -> dict:
    """The load table on one engine of max(counts) slots (a load of N steps a bucket of N slots). Poisson
    arrivals run for loads up to ``poisson_max``: at ``rate`` a second they hold about rate x utterance length
    streams at once whatever N is, so larger N only makes the run longer."""
    watch_gc()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    engine = Engine(
        model, codec, presets, max_streams=max(counts), device=device, step_factory=kernels.default_step_factory(device)
    )
    warm = time.perf_counter()
    engine.warm_up()  # every bucket's graphs
    load(engine, TEN_WORDS, [i * 0.002 for i in range(max(counts))])
    result = {
        "device": torch.cuda.get_device_name(),
        "step": engine.step_kind,
        "max_streams": engine.max_streams,
        "warm_up_s": round(time.perf_counter() - warm, 1),
        "arrival_rate_per_s": rate,
        "text_audio_s": round(len(synthesize(text, engine=engine)) / engine.sample_rate, 2),
        "gpu_bytes_per_stream": (torch.cuda.memory_allocated() - before) // engine.max_streams,
        "kv_bytes_per_stream": engine.caches.nbytes // engine.max_streams,
        "loads": [],
    }
    rng = random.Random(0)
    for n in counts:
        poisson, t = [], 0.0
        for _ in range(n):
            poisson.append(t)
            t += rng.expovariate(rate)
        row = {"streams": n, "at_once": load(engine, text, [0.0] * n)}
        if poisson_max is None or n <= poisson_max:
            row["poisson"] = load(engine, text, poisson)
        row["realtime"] = all(row[kind]["realtime"] for kind in ("at_once", "poisson") if kind in row)
        result["loads"].append(row)
        print(json.dumps(row), flush=True)
    result["peak_gpu_bytes"] = torch.cuda.max_memory_allocated() - before
    passing = [row["streams"] for row in result["loads"] if row["realtime"]]
    result["streams_realtime"] = max(passing, default=0)
    if profile and passing:
        result["profile"] = profile_ticks(engine, text, max(passing), profile)
    engine.close()
    return result


def profile_ticks(engine: Engine, text: str, n: int, folder: Path) -> str:
    """A torch-profiler trace of about 0.4 s of ticks, three seconds into a load of ``n`` streams starting at
    once (past the start: steady speech): chrome trace (gzipped), and the ops by GPU and by CPU time."""
    from torch.profiler import ProfilerActivity, profile

    folder.mkdir(parents=True, exist_ok=True)
    runner = threading.Thread(target=load, args=(engine, text, [0.0] * n))
    runner.start()
    time.sleep(3.0)
    ticks = len(engine.tick_ms)
    try:  # the engine's own thread too, not only this one
        every_thread = {"experimental_config": torch._C._profiler._ExperimentalConfig(profile_all_threads=True)}
    except (AttributeError, TypeError):
        every_thread = {}
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], **every_thread) as prof:
        time.sleep(0.4)
    ticks = len(engine.tick_ms) - ticks
    runner.join()
    trace = folder / f"tick_trace_{n}.json"
    prof.export_chrome_trace(str(trace))
    with open(trace, "rb") as raw, gzip.open(f"{trace}.gz", "wb") as packed:
        shutil.copyfileobj(raw, packed)
    trace.unlink()
    averages = prof.key_averages()
    (folder / f"tick_ops_{n}.txt").write_text(
        f"{ticks} ticks profiled\n"
        + averages.table(sort_by="cuda_time_total", row_limit=40)
        + "\n"
        + averages.table(sort_by="self_cpu_time_total", row_limit=40)
    )
    return f"{trace}.gz"


def plot(rows: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6))
    for name, series in rows.items():
        ax.plot([s for s, _ in series], [ms for _, ms in series], marker="o", label=name)
    ax.set_xlabel("audio generated so far (s)")
    ax.set_ylabel("ms per AR step")
    ax.set_yscale("log")
    ax.axhline(20, color="grey", linestyle=":", label="frame duration (20 ms)")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--streams",
        type=int,
        nargs="*",
        help="loads to try (default 1 2 4 6 8; --quick: 1 4; cuda: 64 128 256 512 1024)",
    )
    parser.add_argument(
        "--slots",
        type=int,
        default=1,
        help="engine slots for the single-stream figures (1: batch 1; see concurrency for more)",
    )
    parser.add_argument(
        "--step",
        choices=["default", "compiled", "eager"],
        default="default",
        help="CPU step: the default paths' (ONNX Runtime), TorchInductor's, or plain eager",
    )
    parser.add_argument(
        "--codec",
        choices=["default", "torch"],
        default="default",
        help="CPU codec decoder: the default paths' (ONNX Runtime) or the torch decoder",
    )
    parser.add_argument("--arrival-rate", type=float, default=25.0, help="cuda: Poisson arrivals a second")
    parser.add_argument("--poisson-max", type=int, help="cuda: Poisson arrivals only for loads up to this")
    parser.add_argument("--sentences", type=int, default=8, help="Harvard sentences each stream speaks")
    parser.add_argument("--profile", type=Path, help="cuda: write a profiler trace of the largest real-time load")
    parser.add_argument(
        "--switch-interval",
        type=float,
        help="Python's thread switch interval in seconds (sys.setswitchinterval; default 0.005)",
    )
    parser.add_argument("--plot", type=Path, default=Path(__file__).parent / "step_vs_length.png")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.switch_interval:
        sys.setswitchinterval(args.switch_interval)
    torch.set_flush_denormal(True)
    model, codec, presets = load_shipped(device=args.device)
    if args.device.startswith("cuda"):
        text = " ".join(harvard(args.sentences))
        print(
            json.dumps(
                gpu_table(
                    model,
                    codec,
                    presets,
                    args.device,
                    args.streams or [64, 128, 256, 512, 1024],
                    args.arrival_rate,
                    text,
                    args.profile,
                    args.poisson_max,
                ),
                indent=1,
            )
        )
        return
    factory = cpu_step_factory(model, args.device, args.step)
    engine = Engine(model, codec, presets, max_streams=args.slots, device=args.device, step_factory=factory)
    codec_step = cpu_codec_step(codec, args.device, args.codec)  # after the engine split the cores: the
    engine.set_codec_step(codec_step)  # session takes one intra-op thread per torch thread, as the worker's share
    frame_ms = 1000 / codec.cfg.frame_rate
    engine.warm_up()
    synthesize(TEN_WORDS, engine=engine)  # warm-up
    step, rtf = steady_state(engine)
    result = {
        "device": args.device,
        "step": engine.step_kind,
        "codec": getattr(codec_step, "kind", "torch"),
        "threads": args.threads,
        "slots": args.slots,
        "load_avg_1min": round(os.getloadavg()[0], 2),
        "frame_ms": frame_ms,
        "step_ms_p50": step["p50"],
        "step_ms_p99": step["p99"],
        "tick_ms": percentiles(list(engine.tick_ms)),
        "step_p50_fraction_of_frame": round(step["p50"] / frame_ms, 3),
        "rtf": round(rtf, 3),
    }
    first = ttfa(engine, 5 if args.quick else 20)
    result.update(ttfa_ms_p50=first["p50"], ttfa_ms_p99=first["p99"])
    marks = [10, 20] if args.quick else [10, 60, 600]
    result["flatness"] = flatness(engine, marks)
    lengths = [10, 60] if args.quick else [5, 10, 20, 40, 60]
    baselines = {
        kind: {
            s: baseline_step_ms(model, int(s * codec.cfg.frame_rate), kind, args.device, repeats=1 if args.quick else 3)
            for s in lengths
        }
        for kind in ("ring", "no_cache", "concat_cache")
    }
    ring = baselines["ring"][60]["step_ms"]
    result["baselines"] = {kind: {f"{s}s": v for s, v in rows.items()} for kind, rows in baselines.items()}
    result["speedup_vs_no_cache_60s"] = round(baselines["no_cache"][60]["step_ms"] / ring, 2)
    result["speedup_vs_concat_cache_60s"] = round(baselines["concat_cache"][60]["step_ms"] / ring, 2)
    load_rows = concurrency(
        model,
        codec,
        presets,
        args.device,
        args.streams or ([1, 4] if args.quick else [1, 2, 4, 6, 8]),
        factory,
        codec_step,
    )
    result["concurrency"] = load_rows
    result["load_avg_1min_end"] = round(os.getloadavg()[0], 2)
    passing = [row for row in load_rows if row["realtime"]]
    result["streams_realtime"] = max((row["streams"] for row in passing), default=0)
    result["step_ms_p99_at_that_load"] = passing[-1]["step_ms"]["p99"] if passing else None
    if not args.quick:
        plot(
            {
                "ring cache (ours)": [(s, v["step_ms"]) for s, v in baselines["ring"].items()],
                "no cache": [(s, v["step_ms"]) for s, v in baselines["no_cache"].items()],
                "concatenated cache": [(s, v["step_ms"]) for s, v in baselines["concat_cache"].items()],
            },
            args.plot,
        )
        result["plot"] = str(args.plot)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
