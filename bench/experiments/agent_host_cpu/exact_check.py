"""Audio of a fixed set of seeded streams on the tiny engine, as one SHA-256 per stream: run it on two commits
and compare (the host-side changes must not move a sample). Streams outnumber slots (they wait), some readers
are slow (their streams pause on backpressure, park after a short grace and are restored), both codec paths.

    python bench/results/agent_host_cpu/exact_check.py > hashes.json
"""
import hashlib
import json
import sys
import threading
import time

sys.path.insert(0, ".")
import numpy as np  # noqa: E402

from testkit import tiny_model_and_codec  # noqa: E402
from streaming.engine import Engine  # noqa: E402
from streaming.parking import ParkingConfig  # noqa: E402

TEXTS = ["The birch canoe slid on the smooth planks.", "Glue the sheet to the dark blue background.",
         "It's easy to tell the depth of a well. These days a chicken leg is a rare dish.",
         "Rice is often served in round bowls.", "The juice of lemons makes fine punch.",
         "The box was thrown beside the parked truck. The hogs were fed chopped corn and garbage."]


def run(frame_codec: bool, pieces: bool) -> dict:
    model, codec, voices = tiny_model_and_codec()
    engine = Engine(model, codec, voices, max_streams=3, frame_codec=frame_codec, max_open=12,
                    parking=ParkingConfig(park_after_s=0.05), max_queued_seconds=0.3)
    out = {}

    def speak(i):
        stream = engine.open(voice=list(voices)[i % len(voices)], seed=100 + i, wait_s=60)
        text = TEXTS[i % len(TEXTS)]
        if pieces:  # all pieces before the stream's first take: same units as whole, in pieces (elastic pacing)
            for word in text.split():
                stream.push_text(word + " ")
        else:
            stream.push_text(text)
        stream.end()
        chunks = []
        while (chunk := stream.read(timeout=60)) is not None:
            chunks.append(chunk)
            if i % 3 == 0:
                time.sleep(0.15)  # a slow reader: backpressure, pause, park, restore
        audio = np.concatenate(chunks)
        out[i] = hashlib.sha256(audio.tobytes()).hexdigest()[:16] + f" {len(audio)}"
    threads = [threading.Thread(target=speak, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stats = engine.stats()
    engine.close()
    return {"streams": dict(sorted(out.items())), "parks": stats["parks"], "restores": stats["restores"]}


if __name__ == "__main__":
    print(json.dumps({f"frame_codec={fc}": run(fc, False) for fc in (False, True)}, indent=1))
