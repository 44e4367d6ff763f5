"""Codec quality and speed on held-out teacher utterances. Prints one JSON object.

    python -m bench.codec            # 100 held-out utterances per voice
    python -m bench.codec --quick    # 3 per voice, under a minute
    python -m bench.codec --voices kumo
    python -m bench.codec --skip 100 # the utterances after the reported 100: for choosing between checkpoints
    python -m bench.codec --set modern --voices joe --out bench/results/codec_modern_joe.json
    python -m bench.codec --set modern --split dev   # the modern dev sentences, every shipped voice with a teacher

``--set modern``: the modern held-out sentences (``bench.modern``), each teacher's take cached on disk, scored
per sentence by DNSMOS (OVRL, SIG, BAK) and Whisper WER, teacher against round trip (``bench.modern.compare_decoder``,
which a new decoder can be handed directly); ``--out`` keeps the per-sentence rows.
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

from bench import modern
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
    parser.add_argument(
        "--set",
        choices=("corpus", "modern"),
        default="corpus",
        dest="text_set",
        help="the held-out corpus (corpus-heldout/), or the modern set (bench.modern)",
    )
    parser.add_argument("--split", choices=modern.SPLITS, default="test", help="--set modern: test (reported) or dev")
    parser.add_argument(
        "--out", type=Path, help="also write the JSON here (with --set modern: every sentence's scores)"
    )
    parser.add_argument("--per-voice", type=int, help="default: 100 corpus utterances, every modern sentence")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--voices",
        nargs="*",
        help="only these voices (default: all of the held-out corpus; joe, slt, rms and kumo of the modern set)",
    )
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
    cfg = {
        "decoder_rtf": rtf["streaming"][str(CHUNK_SCHEDULE[-1])],
        "decoder_rtf_detail": rtf,
        "frame_rate": codec.cfg.frame_rate,
        "codebooks": codec.cfg.codebooks,
        "codebook_size": codec.cfg.codebook_size,
        "threads": args.threads,
    }
    report = (
        {**modern_report(codec, args), **cfg} if args.text_set == "modern" else {**corpus_report(codec, args), **cfg}
    )
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    if args.text_set == "modern":  # the rows go to --out only: 200 sentences a voice would flood the terminal
        report = {
            **report,
            "voices": {v: {k: x for k, x in r.items() if k != "rows"} for v, r in report["voices"].items()},
        }
    print(json.dumps(report, indent=1))


def modern_report(codec, args) -> dict:
    """``compare_decoder`` of the shipped codec on the modern set: each voice's teacher against its round trip."""
    n = 3 if args.quick else args.per_voice
    voices = tuple(args.voices or modern.SHIPPED_TEACHERS)
    return {"set": "modern", **modern.compare_decoder(codec.decode, voices, args.split, n, codec.encode)}


def corpus_report(codec, args) -> dict:
    """WER of original and round trip, and log-mel distance, on the held-out corpus's utterances."""
    per_voice_n = 100 if args.per_voice is None else args.per_voice
    rows = heldout_rows(args.corpus, 3 if args.quick else per_voice_n, args.voices, args.skip)
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
    return {**everything, "utterances": len(rows), "per_voice": summary}


if __name__ == "__main__":
    main()
