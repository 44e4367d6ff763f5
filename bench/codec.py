"""Codec quality and speed on held-out teacher utterances. Prints one JSON object.

python -m bench.codec            # 100 held-out utterances per voice
python -m bench.codec --quick    # 3 per voice, under a minute
python -m bench.codec --voices kumo
python -m bench.codec --skip 100 # the utterances after the reported 100: for choosing between checkpoints
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np
import soundfile as sf
import torch

from bench.common import ROOT, heldout_rows, log_mel_l1
from streaming.slots import CHUNK_SCHEDULE
from tts.asr import transcribe, wer
from tts.codec import load_codec
from tts.voices import VOICES_DIR


def decoder_rtf(codec, seconds: float = 10.0, chunks: tuple[int, ...] = (CHUNK_SCHEDULE[-1], 8)) -> dict:
    """Real-time factor of the decoder on this machine's threads, offline and streaming in chunks of each
    size in ``chunks`` (the first is the engine's steady-state chunk), the median of three runs after a warm-up."""
    frames = int(seconds * codec.cfg.frame_rate)
    codes = torch.randint(0, codec.cfg.codebook_size, (1, codec.cfg.codebooks, frames))
    latents = codec.quantizer.decode(codes)

    def streamed(chunk: int) -> None:
        state = codec.decoder.init_state(1)
        for t in range(0, frames, chunk):
            codec.decoder.step(latents[..., t : t + chunk], state)

    def rtf(run) -> float:
        times = []
        for _ in range(3):
            start = time.perf_counter()
            run()
            times.append(time.perf_counter() - start)
        return round(statistics.median(times) / seconds, 4)

    with torch.inference_mode():
        codec.decoder(latents[..., :50])
        return {
            "offline": rtf(lambda: codec.decoder(latents)),
            "streaming": {str(chunk): rtf(lambda: streamed(chunk)) for chunk in chunks},
        }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--corpus", type=Path, default=ROOT / "corpus-heldout")
    parser.add_argument("--per-voice", type=int, default=100)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--voices", nargs="*", help="only these voices of the held-out corpus (default: all)")
    parser.add_argument(
        "--skip",
        type=int,
        default=0,
        help="leave out each voice's first N utterances: a "
        "validation split, so a checkpoint is chosen without looking at the reported ones",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.set_flush_denormal(True)
    codec = load_codec(VOICES_DIR)
    # Timed first: once Whisper has run, CTranslate2's idle worker threads share the 2 cores and slowed
    # the decoder by a third here, which the server, holding no ASR model, never sees.
    rtf = decoder_rtf(codec)
    rows = heldout_rows(args.corpus, 3 if args.quick else args.per_voice, args.voices, args.skip)
    per_voice: dict[str, dict] = {}
    for row in rows:
        audio, sr = sf.read(args.corpus / row["path"], dtype="float32")
        codes = codec.encode(torch.from_numpy(audio)[None])
        decoded = codec.decode(codes)[0].numpy()[: len(audio)]
        stats = per_voice.setdefault(row["voice"], {"wer_original": [], "wer_roundtrip": [], "mel_l1": []})
        stats["wer_original"].append(wer(row["text"], transcribe(audio, sr)))
        stats["wer_roundtrip"].append(wer(row["text"], transcribe(decoded, sr)))
        stats["mel_l1"].append(log_mel_l1(audio, decoded))
    summary = {
        v: {k: round(float(np.mean(x)), 4) for k, x in s.items()} | {"utterances": len(s["mel_l1"])}
        for v, s in per_voice.items()
    }
    everything = {
        k: round(float(np.mean([x for s in per_voice.values() for x in s[k]])), 4)
        for k in ("wer_original", "wer_roundtrip", "mel_l1")
    }
    steady = rtf["streaming"][str(CHUNK_SCHEDULE[-1])]
    print(
        json.dumps(
            {
                **everything,
                "decoder_rtf": steady,
                "decoder_rtf_detail": rtf,
                "frame_rate": codec.cfg.frame_rate,
                "codebooks": codec.cfg.codebooks,
                "codebook_size": codec.cfg.codebook_size,
                "threads": args.threads,
                "utterances": len(rows),
                "per_voice": summary,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
