"""The modern held-out set: everyday English as users type it (bench/data/modern/, never in training text), its
teachers' audio cached on disk, and a decoder comparison on it.

    python -m bench.modern --voices joe            # speak (or find cached) every sentence of both splits
    python -m bench.modern --voices joe slt --split dev
    python -m bench.modern --voices joe --split test --n 60 --decoders voices training/checkpoints/spectral \
        --out bench/results/decoders_modern_joe.json   # the shipped decoder against a spectral decoder round

Teacher audio is spoken once per voice and sentence (``training.corpus.speak_teacher``), put in the corpus's
form (24 kHz, 0.1 s silence margins, -20 dBFS RMS: ``bench.quality.corpus_form``) and kept as 24-bit FLAC at
``CACHE/VOICE/ID.flac``; the teacher's own scores go beside it (``ID.json``), so a second run, or a new decoder
judged with ``compare_decoder``, re-speaks and re-scores nothing. Piper samples its durations and noise, so the
cached take *is* the reference: delete the folder to draw a new one. ``CACHE`` is ``TTS_MODERN_CACHE`` or
``cache/modern-teacher`` in the checkout (ignored by git).
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import soundfile as sf

from bench.common import ROOT, corpus_form, dnsmos
from training.corpus import MODERN_DIR, TEACHERS

SPLITS = ("test", "dev")
CATEGORIES = ("conversation", "assistant", "news", "instructions", "technical", "numbers", "names")
CACHE = Path(os.environ.get("TTS_MODERN_CACHE", ROOT / "cache" / "modern-teacher"))
SHIPPED_TEACHERS = ("joe", "slt", "rms", "kumo")  # the shipped voices that have a teacher


@dataclass(frozen=True)
class Sentence:
    id: str
    category: str
    source: str
    text: str


def sentences(split: str = "test") -> list[Sentence]:
    """The ``split`` set (``test``: reported, ``dev``: for choosing between checkpoints), in file order."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}: one of {SPLITS}")
    with (MODERN_DIR / f"{split}.tsv").open(newline="", encoding="utf-8") as f:
        return [Sentence(**row) for row in csv.DictReader(f, delimiter="\t", quoting=csv.QUOTE_NONE)]


def teacher_path(voice: str, sentence: Sentence, cache: Path = CACHE) -> Path:
    return cache / voice / f"{sentence.id}.flac"


def teacher_audio(voice: str, sentence: Sentence, cache: Path = CACHE) -> np.ndarray:
    """24 kHz float32 audio of ``sentence`` by ``voice``'s teacher in the corpus's form, spoken once and cached."""
    path = teacher_path(voice, sentence, cache)
    if path.exists():
        return sf.read(path, dtype="float32")[0]
    from training.corpus import speak_teacher
    from tts.text import normalize

    if voice not in TEACHERS:
        raise ValueError(f"{voice!r} has no teacher (one of {sorted(TEACHERS)})")
    audio, sr = speak_teacher(voice, normalize(sentence.text))[:2]  # the words our front end speaks, as in training
    audio = corpus_form(audio, sr)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(f".{os.getpid()}.partial.flac")
    sf.write(partial, audio, 24_000, format="FLAC", subtype="PCM_24")
    # Linked, not renamed: a run killed mid-write leaves no half file under the real name, and where another
    # run cached its own take meanwhile, that one stays (its scores may already lie beside it).
    with contextlib.suppress(FileExistsError):
        os.link(partial, path)
    partial.unlink()
    return sf.read(path, dtype="float32")[0]  # exactly what later runs read back


def clip_scores(text: str, audio: np.ndarray, sr: int = 24_000) -> dict:
    """DNSMOS P.835 OVRL/SIG/BAK (16 kHz, peak-normalised) and Whisper tiny.en WER of one clip."""
    from tts.asr import transcribe, wer

    heard = transcribe(audio, sr)
    return {**{k: round(v, 4) for k, v in dnsmos(audio, sr).items()}, "wer": round(wer(text, heard), 4), "heard": heard}


def teacher_scores(voice: str, sentence: Sentence, cache: Path = CACHE) -> dict:
    """``clip_scores`` of the cached teacher audio, computed once and kept beside it as ``ID.json``."""
    path = teacher_path(voice, sentence, cache).with_suffix(".json")
    if path.exists():
        return json.loads(path.read_text())
    scores = clip_scores(sentence.text, teacher_audio(voice, sentence, cache))
    partial = path.with_suffix(f".{os.getpid()}.partial")
    partial.write_text(json.dumps(scores) + "\n")
    partial.replace(path)
    return scores


def mean_scores(rows: list[dict]) -> dict:
    """Means of OVRL, SIG, BAK and WER over ``rows``; ``ovrl_sem`` is OVRL's standard error."""
    out = {k: round(float(np.mean([r[k] for r in rows])), 4) for k in ("ovrl", "sig", "bak", "wer")}
    ovrl = [r["ovrl"] for r in rows]
    out["ovrl_sem"] = round(float(np.std(ovrl, ddof=1) / np.sqrt(len(ovrl))), 4) if len(ovrl) > 1 else None
    return out


def compare_decoder(
    decode: Callable,
    voices: tuple[str, ...] = ("joe",),
    split: str = "test",
    n: int | None = None,
    encode: Callable | None = None,
    cache: Path = CACHE,
) -> dict:
    """Teacher against its round trip through ``encode`` then ``decode``, per sentence and on average, per voice.

    ``decode(codes) -> audio``: codes [batch 1, codebooks, frames] (int64, 50 Hz) -> 24 kHz audio, any shape
    that flattens to [samples] (a tensor on any device, or an array). ``encode`` (audio [1, samples] float32
    tensor -> codes) is the shipped codec's by default, so a new decoder is judged on today's tokens. Example,
    today's decoder::

        from tts.codec import load_codec; from tts.voices import VOICES_DIR
        codec = load_codec(VOICES_DIR)
        report = compare_decoder(codec.decode)
        report["voices"]["joe"]["roundtrip"]["ovrl"], report["voices"]["joe"]["rows"][0]

    Returns ``{"split", "sentences", "voices": {voice: {"teacher": means, "roundtrip": means, "gap_ovrl",
    "gap_sig", "gap_wer", "rows": [{"id", "category", "teacher": scores, "roundtrip": scores + mel_l1}]}}}``.
    """
    import torch

    from bench.common import log_mel_l1

    if encode is None:
        from tts.codec import load_codec
        from tts.voices import VOICES_DIR

        encode = load_codec(VOICES_DIR).encode
    chosen = sentences(split)[:n]
    report = {"split": split, "sentences": len(chosen), "voices": {}}
    for voice in voices:
        rows = []
        for sentence in chosen:
            audio = teacher_audio(voice, sentence, cache)
            with torch.inference_mode():
                decoded = decode(encode(torch.from_numpy(audio)[None]))
            if isinstance(decoded, torch.Tensor):  # a decoder may run on the GPU, in half precision
                decoded = decoded.detach().float().cpu().numpy()
            decoded = np.asarray(decoded, dtype=np.float32).reshape(-1)[: len(audio)]
            rows.append(
                {
                    "id": sentence.id,
                    "category": sentence.category,
                    "teacher": teacher_scores(voice, sentence, cache),
                    "roundtrip": {
                        **clip_scores(sentence.text, decoded),
                        "mel_l1": round(log_mel_l1(audio, decoded), 4),
                    },
                }
            )
        teacher, roundtrip = (mean_scores([r[part] for r in rows]) for part in ("teacher", "roundtrip"))
        roundtrip["mel_l1"] = round(float(np.mean([r["roundtrip"]["mel_l1"] for r in rows])), 4)
        report["voices"][voice] = {
            "teacher": teacher,
            "roundtrip": roundtrip,
            **{f"gap_{k}": round(roundtrip[k] - teacher[k], 4) for k in ("ovrl", "sig", "wer")},
            "rows": rows,
        }
    return report


def load_decoder(folder: Path):
    """The codec to judge: a codec folder (``voices``), or a spectral decoder round's folder
    (``training/checkpoints/spectral``) on the shipped encoder and codebooks."""
    from training.train_decoder import ROUND_FILE, codec_with_round
    from tts.codec import load_codec
    from tts.voices import VOICES_DIR

    if (folder / f"{ROUND_FILE}.safetensors").exists():
        return codec_with_round(VOICES_DIR, folder)
    return load_codec(folder)


def compare_decoders(folders: list[Path], voices: tuple[str, ...], split: str, n: int | None, cache: Path) -> dict:
    """`compare_decoder` for each folder's decoder on the same sentences, without the per-sentence rows."""
    report = {}
    for folder in folders:
        result = compare_decoder(load_decoder(folder).decode, voices, split, n, cache=cache)
        report[str(folder)] = {v: {k: x for k, x in r.items() if k != "rows"} for v, r in result["voices"].items()}
        print(json.dumps({str(folder): report[str(folder)]}), flush=True)
    return {"split": split, "sentences": n, "decoders": report}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--voices", nargs="+", default=list(SHIPPED_TEACHERS))
    parser.add_argument("--split", choices=SPLITS, nargs="+", default=list(SPLITS))
    parser.add_argument("--scores", action="store_true", help="also score each teacher clip (DNSMOS, Whisper)")
    parser.add_argument("--cache", type=Path, default=CACHE)
    parser.add_argument(
        "--decoders",
        nargs="+",
        type=Path,
        default=None,
        help="instead: judge these decoders' round trips (codec or spectral-round folders)",
    )
    parser.add_argument("--n", type=int, default=None, help="with --decoders: the first N sentences of the split")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.decoders:
        report = compare_decoders(args.decoders, tuple(args.voices), args.split[0], args.n, args.cache)
        if args.out:
            args.out.write_text(json.dumps(report, indent=1))
        return
    for voice in args.voices:
        for split in args.split:
            for sentence in sentences(split):
                teacher_audio(voice, sentence, args.cache)
                if args.scores:
                    teacher_scores(voice, sentence, args.cache)
            print(json.dumps({"voice": voice, "split": split, "cached": str(args.cache / voice)}), flush=True)


if __name__ == "__main__":
    main()
