"""Torch calls made by the engine thread per call of its event-side functions, counted by a `TorchFunctionMode`
(each torch call lets go of the interpreter lock and takes it back: what a tick pays for on a busy interpreter).
A fixed, load-free scenario: 8 seeded streams on 3 slots of the frame-codec engine, whole texts, two slow readers
(their streams pause, park and are restored). SHIPPED=1: the shipped model's shapes (8 layers) instead of the
tiny one's (2). One JSON object: per function, its calls and torch calls per call.

    PYTHONPATH=. python bench/results/agent_host_cpu/count_calls.py
"""
import collections
import json
import os
import sys
import threading
import time

from torch.overrides import TorchFunctionMode

sys.path.insert(0, ".")
from testkit import tiny_model_and_codec  # noqa: E402
from streaming.engine import Engine  # noqa: E402
from streaming.parking import ParkingConfig  # noqa: E402

NAMES = ("_handle_events", "_apply", "_prefill", "_start_caches", "_park_rows", "_restore_rows", "_launch", "_collect")


class Count(TorchFunctionMode):
    def __init__(self, counter, key):
        super().__init__()
        self.counter, self.key = counter, key

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.counter[self.key] += 1
        return func(*args, **(kwargs or {}))


def main():
    if os.environ.get("SHIPPED"):
        from tts.voices import load_shipped
        model, codec, voices = load_shipped(device="cpu")
    else:
        model, codec, voices = tiny_model_and_codec()
    engine = Engine(model, codec, voices, max_streams=3, frame_codec=True, max_open=8,
                    parking=ParkingConfig(park_after_s=0.05), max_queued_seconds=0.3)
    calls, torch_calls = collections.Counter(), collections.Counter()
    for name in NAMES:
        inner = getattr(engine, name)

        def counted(*args, _inner=inner, _name=name, **kwargs):
            calls[_name] += 1
            with Count(torch_calls, _name):
                return _inner(*args, **kwargs)
        setattr(engine, name, counted)

    def speak(i):
        stream = engine.open(seed=i, wait_s=60)
        stream.push_text("The birch canoe slid on the smooth planks. Glue the sheet to the dark blue background.")
        stream.end()
        while stream.read(timeout=60) is not None:
            if i % 3 == 0:
                time.sleep(0.3)
    threads = [threading.Thread(target=speak, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    engine.close()
    print(json.dumps({"model": "shipped" if os.environ.get("SHIPPED") else "tiny",
                      **{name: {"calls": calls[name], "torch_calls_per_call": round(torch_calls[name] / calls[name], 1)
                                if calls[name] else None} for name in NAMES}}, indent=1))


if __name__ == "__main__":
    main()
