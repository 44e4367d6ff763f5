"""Are never-parked rounds reproducible? Runs bench.parking's reference round R times on one engine and, per
stream that parts from round 0, says whether its units' timings (phoneme, start s, end s: `Stream._timings`)
differ too, in all and before the rest of its text came (equal timings: the text side and the durations agree,
so the AR step or the codec parted). ``--shared-capture``: the frame codec's graphs captured on the default
capture stream, as before they had one of their own (an A/B of that fix).
    python3 scripts/gpu/diag.py [--device cuda] [--streams 64] [--rounds 5] [--tiny] [--frame-codec] [--one-bucket]
        [--shared-capture]
"""

import argparse
import json
import sys

import numpy as np

sys.path.insert(0, ".")
import kernels  # noqa: E402
from bench.common import harvard  # noqa: E402
from bench.parking import finish_text, read_all, read_dry, speak  # noqa: E402
from streaming.engine import Engine, SamplingConfig  # noqa: E402
from streaming.parking import ParkingConfig  # noqa: E402


def one_round(engine, sentences):
    streams = [speak(engine, s, 100 + i, 4) for i, s in enumerate(sentences)]
    said = read_dry(streams)
    firsts = [list(s._timings) for s in streams]  # what was scheduled before the rest came
    for stream, sentence in zip(streams, sentences):
        finish_text(stream, sentence)
    audio = [np.concatenate(first + [read_all(s)]) for first, s in zip(said, streams)]
    return audio, [list(s._timings) for s in streams], firsts, [list(s._schedules) for s in streams]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--frame-codec", action="store_true")
    parser.add_argument("--one-bucket", action="store_true")
    parser.add_argument(
        "--shared-capture",
        action="store_true",
        help="the codec graphs captured on the default capture stream, as before the fix",
    )
    args = parser.parse_args()
    if args.tiny:
        from testkit import tiny_model_and_codec

        model, codec, voices = tiny_model_and_codec()
    else:
        from tts.voices import load_shipped

        model, codec, voices = load_shipped(device=args.device)
    cuda = args.device.startswith("cuda")
    engine = Engine(
        model.to(args.device),
        codec.to(args.device),
        voices,
        max_streams=args.streams,
        device=args.device,
        sampling=SamplingConfig(temperature=0.0),
        parking=ParkingConfig(park_after_s=0),
        step_factory=kernels.default_step_factory(args.device) if cuda else None,
        frame_codec=True if args.frame_codec else None,
    )
    if args.shared_capture:
        engine.codec_path.decoder.capture_stream = None
    if args.one_bucket:
        engine.table.bucket = lambda max_streams: max_streams if engine.table.live.any() else 0
    engine.warm_up()
    sentences = [s for s in harvard(64) if len(s.split()) >= 7][: args.streams]
    sentences = (sentences * args.streams)[: args.streams]
    rounds = [one_round(engine, sentences) for _ in range(args.rounds)]
    audio0, timings0, firsts0, schedules0 = rounds[0]
    report = []
    for r, (audio, timings, firsts, schedules) in enumerate(rounds[1:], 1):
        parted = []
        for i in range(len(sentences)):
            a, b = audio[i], audio0[i]
            n = min(len(a), len(b))
            bad = np.flatnonzero(np.abs(a[:n] - b[:n]) > 1e-4)
            if len(bad) or len(a) != len(b):
                t, t0 = timings[i], timings0[i]
                at = next((k for k, (x, y) in enumerate(zip(t, t0)) if x != y), None)
                parted.append(
                    {
                        "stream": i,
                        "first_bad": int(bad[0]) if len(bad) else None,
                        "lengths": [len(a), len(b)],
                        "timings_equal": t == t0,
                        "first_timing_diff": None if at is None else [at, t[at], t0[at]],
                        "before_rest_equal": firsts[i] == firsts0[i],
                        "schedules": [schedules[i][:3], schedules0[i][:3]],
                    }
                )
        report.append({"round": r, "parted": len(parted), "detail": parted[:6]})
    print(
        json.dumps(
            {
                "device": args.device,
                "streams": args.streams,
                "frame_codec": engine.frame_codec,
                "step": engine.step_kind,
                "one_bucket": args.one_bucket,
                "shared_capture": args.shared_capture,
                "rounds": report,
            },
            indent=1,
        )
    )
    engine.close()


if __name__ == "__main__":
    main()
