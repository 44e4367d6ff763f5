"""The engine thread's host work per tick, counted rather than timed: torch calls per tick, by phase, under
agent-like text. One JSON object.

    python -m bench.host_ops                         # 64 streams, 16 slots, 20 s, tiny engine, frame codec
    python -m bench.host_ops --streams 32 --slots 32 --seconds 10

Why count: every torch call made from Python lets go of the interpreter lock and takes it back, and in a
server process the event loop and the text thread hold it most of the time, so each call can cost the engine
thread a switch interval (0.5 ms on a GPU) of waiting, whatever the call computes. The number of torch calls
per tick is therefore what a tick costs under a busy interpreter; unlike a time, it does not depend on the
machine's load (it does on the text's timing, which is drawn from fixed seeds here, and on how the ticks fall).

The tiny random-weight engine with the frame codec (`FrameCodec`: every completed frame decoded in the tick
and chunks assembled on the host, the shape a GPU server runs) steps ``--streams`` streams on ``--slots``
slots (more streams than slots: they wait and park, as agents do). Each stream is fed like an LLM by a
driver thread (`bench.agent`'s draws: 2-4 Harvard sentences, a word at a time at 10-30 tokens a second,
1-5 s pauses between sentences, flushed) and read at once by a reader thread. Per tick phase (`events`:
events, slot grants, parking and the batched device updates including the text encoder; `launch`: the step;
`collect`: handing out audio), the torch calls counted by a `TorchFunctionMode` on the engine thread, per
tick and in all, and the events handled (the inbox's messages).
"""

from __future__ import annotations

import argparse
import json
import random
import threading
import time
from collections import Counter

from torch.overrides import TorchFunctionMode

from bench.agent import TOKENS_PER_WORD, _sentences
from bench.common import percentiles


class _Count(TorchFunctionMode):
    def __init__(self, counter: Counter, key: str):
        super().__init__()
        self.counter, self.key = counter, key

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.counter[self.key] += 1
        return func(*args, **(kwargs or {}))


def instrument(engine, counter: Counter) -> None:
    """Count the torch calls of each tick phase (and its wall time) on the engine thread."""
    for name, key in (("_handle_events", "events"), ("_launch", "launch"), ("_collect", "collect")):
        inner = getattr(engine, name)

        def counted(*args, _inner=inner, _key=key, **kwargs):
            with _Count(counter, _key):
                return _inner(*args, **kwargs)

        setattr(engine, name, counted)
    prefill = engine._prefill

    def prefilled(chosen):
        counter["prefills"] += 1
        counter["prefill_rows"] += len(chosen)
        return prefill(chosen)

    engine._prefill = prefilled

    class Inbox(type(engine._inbox)):
        def popleft(self):
            counter["inbox_events"] += 1
            return super().popleft()

    engine._inbox = Inbox(engine._inbox)


def feed(stream, seed: int, sentences: list[str], stop: threading.Event) -> None:
    rng = random.Random(seed)
    time.sleep(rng.uniform(0, 2))
    turn = rng.sample(sentences, rng.randint(2, 4))
    for k, sentence in enumerate(turn):
        if k and stop.wait(rng.uniform(1, 5)):
            return
        delay = TOKENS_PER_WORD / rng.uniform(10, 30)
        for word in sentence.split():
            stream.push_text(word + " ")
            if stop.wait(delay):
                return
        stream.flush()
    stream.end()


def read(stream, stop: threading.Event, got: list) -> None:
    while not stop.is_set():
        try:
            chunk = stream.read(timeout=0.2)
        except TimeoutError:
            continue
        except Exception:
            return
        if chunk is None:
            return
        got.append(len(chunk))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.host_ops", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--slots", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--park-after-s", type=float, default=None)
    parser.add_argument("--shipped", action="store_true", help="the shipped model's weights and shapes (8 layers)")
    args = parser.parse_args(argv)
    from streaming.engine import Engine
    from streaming.parking import ParkingConfig
    from testkit import tiny_model_and_codec

    if args.shipped:
        from tts.voices import load_shipped

        model, codec, voices = load_shipped(device="cpu")
    else:
        model, codec, voices = tiny_model_and_codec()
    parking = ParkingConfig()
    if args.park_after_s is not None:
        parking.park_after_s = args.park_after_s
    engine = Engine(
        model, codec, voices, max_streams=args.slots, frame_codec=True, max_open=args.streams, parking=parking
    )
    counter: Counter = Counter()
    sentences, stop, threads, got = _sentences(), threading.Event(), [], []
    warm = engine.open(seed=0)
    warm.push_text("Warm up the engine.")
    warm.end()
    while warm.read(timeout=30) is not None:
        pass
    engine.tick_ms.clear()
    instrument(engine, counter)
    ticks_before = engine._ticks
    started = time.perf_counter()
    for i in range(args.streams):
        stream = engine.open(seed=i + 1, wait_s=5)
        threads += [
            threading.Thread(target=feed, args=(stream, i, sentences, stop), daemon=True),
            threading.Thread(target=read, args=(stream, stop, got), daemon=True),
        ]
    for thread in threads:
        thread.start()
    time.sleep(args.seconds)
    stop.set()
    ticks = engine._ticks - ticks_before
    run_s = time.perf_counter() - started
    for thread in threads:
        thread.join(timeout=2)
    stats = engine.stats()
    engine.close()
    audio_s = sum(got) / engine.sample_rate
    print(
        json.dumps(
            {
                "model": "shipped" if args.shipped else "tiny",
                "streams": args.streams,
                "slots": args.slots,
                "seconds": args.seconds,
                "ticks": ticks,
                "audio_s": round(audio_s, 1),
                "inbox_events": counter["inbox_events"],
                "prefills": counter["prefills"],
                "prefill_rows": counter["prefill_rows"],
                "torch_calls": {key: counter[key] for key in ("events", "launch", "collect")},
                "torch_calls_per_tick": {
                    key: round(counter[key] / max(ticks, 1), 1) for key in ("events", "launch", "collect")
                },
                "torch_calls_per_audio_s": round(
                    sum(counter[k] for k in ("events", "launch", "collect")) / max(audio_s, 1e-9), 1
                ),
                "tick_ms": percentiles(engine.tick_ms.values()) if len(engine.tick_ms) else None,
                "parks": stats["parks"],
                "restores": stats["restores"],
                "run_s": round(run_s, 1),
                "load_avg_1m": round(__import__("os").getloadavg()[0], 2),
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
