"""Engine latency, flatness, baselines and concurrency on the shipped default voice. One JSON object.

    python -m bench.latency            # full run, includes 600 s of continuous speech
    python -m bench.latency --quick    # about a minute: no 600 s run, one baseline repeat, 1 and 4 streams
    python -m bench.latency --device cuda
    python -m bench.latency --no-compile   # the eager CPU step (TTS_NO_COMPILE=1 does the same)

Step times are AR step + sampling per frame tick, after warm-up; on the CPU the engine's step is compiled
unless ``--no-compile``. Baselines run eagerly, batch 1, on the same weights: ``ring`` is our step through
the ring caches, ``no_cache`` recomputes the whole prefix for every step, ``concat_cache`` grows a
concatenated KV cache and attends to everything (what a default dynamic cache does). The speed-ups compare
the baselines with ``ring``, measured the same way in the same run.
"""
from __future__ import annotations

import argparse
import json
import threading
import time
from pathlib import Path

import numpy as np
import psutil
import torch

from bench.common import harvard, percentiles
from streaming.decode import StepCaches, decode_step
from streaming.engine import Engine
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
            rows.append({"audio_s": marks.pop(0), "step_ms": percentiles(recent), "rss_mb": round(rss_mb(), 1),
                         "kv_bytes_per_stream": engine.caches.nbytes // engine.max_streams})
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
    memory = {"ring": caches.nbytes if kind == "ring" else 0, "concat_cache": kv,
              "no_cache": cfg.heads * (frames + 1) ** 2 * 4}[kind]
    return {"step_ms": round(float(np.median(times)), 3), "memory_bytes": memory}


def concurrency(model, codec, presets, device: str, counts: list[int], compile: bool,
                jitter_s: float = 0.2) -> list[dict]:
    """N streams at once on an engine of N slots; a stream is real-time if no chunk arrives after its
    playback deadline (first chunk's arrival + the audio before it + a ``jitter_s`` buffer)."""
    rows = []
    for n in counts:
        engine = Engine(model, codec, presets, max_streams=n, device=device, compile=compile)
        engine.sync_timing = device.startswith("cuda")
        synthesize(TEN_WORDS, engine=engine)  # warm-up
        late, ttfas = [0] * n, [0.0] * n
        engine.step_ms.clear()

        def run(i):
            start = time.perf_counter()
            first, played = None, 0
            for chunk in synthesize_stream(PARAGRAPH, engine=engine):
                now = time.perf_counter()
                if first is None:
                    first, ttfas[i] = now, (now - start) * 1000
                elif now > first + jitter_s + played / engine.sample_rate:
                    late[i] += 1
                played += len(chunk)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        rows.append({"streams": n, "late_chunks": sum(late), "realtime": not any(late),
                     "ttfa_ms": percentiles(ttfas), "step_ms": percentiles(list(engine.step_ms))})
    return rows


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
    parser.add_argument("--streams", type=int, nargs="*", help="loads to try (default 1 2 4 6 8; --quick: 1 4)")
    parser.add_argument("--slots", type=int, default=1,
                        help="engine slots for the single-stream figures (1: batch 1; see concurrency for more)")
    parser.add_argument("--no-compile", action="store_true", help="eager CPU step instead of the compiled one")
    parser.add_argument("--plot", type=Path, default=Path(__file__).parent / "step_vs_length.png")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.set_flush_denormal(True)
    model, codec, presets = load_shipped(device=args.device)
    compile = not args.no_compile and args.device == "cpu"
    engine = Engine(model, codec, presets, max_streams=args.slots, device=args.device, compile=compile)
    engine.sync_timing = args.device.startswith("cuda")
    frame_ms = 1000 / codec.cfg.frame_rate
    synthesize(TEN_WORDS, engine=engine)  # warm-up
    step, rtf = steady_state(engine)
    result = {"device": args.device, "step": engine.step_kind, "threads": args.threads, "slots": args.slots,
              "frame_ms": frame_ms,
              "step_ms_p50": step["p50"], "step_ms_p99": step["p99"],
              "step_p50_fraction_of_frame": round(step["p50"] / frame_ms, 3), "rtf": round(rtf, 3)}
    first = ttfa(engine, 5 if args.quick else 20)
    result.update(ttfa_ms_p50=first["p50"], ttfa_ms_p99=first["p99"])
    marks = [10, 20] if args.quick else [10, 60, 600]
    result["flatness"] = flatness(engine, marks)
    lengths = [10, 60] if args.quick else [5, 10, 20, 40, 60]
    baselines = {kind: {s: baseline_step_ms(model, int(s * codec.cfg.frame_rate), kind, args.device,
                                                 repeats=1 if args.quick else 3)
                        for s in lengths} for kind in ("ring", "no_cache", "concat_cache")}
    ring = baselines["ring"][60]["step_ms"]
    result["baselines"] = {kind: {f"{s}s": v for s, v in rows.items()} for kind, rows in baselines.items()}
    result["speedup_vs_no_cache_60s"] = round(baselines["no_cache"][60]["step_ms"] / ring, 2)
    result["speedup_vs_concat_cache_60s"] = round(baselines["concat_cache"][60]["step_ms"] / ring, 2)
    load = concurrency(model, codec, presets, args.device, args.streams or ([1, 4] if args.quick else [1, 2, 4, 6, 8]),
                       compile)
    result["concurrency"] = load
    passing = [row for row in load if row["realtime"]]
    result["streams_realtime"] = max((row["streams"] for row in passing), default=0)
    result["step_ms_p99_at_that_load"] = passing[-1]["step_ms"]["p99"] if passing else None
    if not args.quick:
        plot({"ring cache (ours)": [(s, v["step_ms"]) for s, v in baselines["ring"].items()],
              "no cache": [(s, v["step_ms"]) for s, v in baselines["no_cache"].items()],
              "concatenated cache": [(s, v["step_ms"]) for s, v in baselines["concat_cache"].items()]}, args.plot)
        result["plot"] = str(args.plot)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
