"""Shared helpers for the benchmarks: timing percentiles, log-mel distance, DNSMOS, held-out data."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
HARVARD = Path(os.environ.get("TTS_HARVARD", ROOT.parent / "shared" / "eval" / "harvard-sentences.txt"))


def percentiles(values_ms: list[float]) -> dict:
    values = np.asarray(values_ms)
    return {"p50": round(float(np.percentile(values, 50)), 3), "p99": round(float(np.percentile(values, 99)), 3)}


def log_mel_l1(a: np.ndarray, b: np.ndarray, sample_rate: int = 24_000) -> float:
    """Mean |log-mel(a) - log-mel(b)| (80 mels, 1024-sample window, 256 hop) over the common length."""
    import torch  # here, not at the top: bench.paths imports this module and must not load torch itself

    from training.losses import mel_filters

    n = min(len(a), len(b))
    window, filters = torch.hann_window(1024), mel_filters(1024, 80, sample_rate)

    def mel(x):
        spec = torch.stft(torch.from_numpy(x[:n]).float(), 1024, 256, window=window, return_complex=True).abs()
        return torch.log(filters @ spec + 1e-5)

    return float((mel(a) - mel(b)).abs().mean())


def corpus_form(audio: np.ndarray, sr: int) -> np.ndarray:
    """24 kHz, silence trimmed to 0.1 s margins, -20 dBFS RMS: the form of every corpus utterance."""
    from training.corpus import finish_audio

    return finish_audio(audio, sr, np.array([len(audio) / sr]))[0]


def dnsmos(audio: np.ndarray, sr: int = 24_000) -> dict[str, float]:
    """P.835 OVRL/SIG/BAK and P.808 MOS of one clip, resampled to 16 kHz and peak-normalised."""
    import soxr
    from speechmos import dnsmos as model

    audio16 = soxr.resample(audio.astype(np.float32), sr, 16_000)
    scores = model.run(np.clip(audio16 / max(np.abs(audio16).max(), 1e-6), -1, 1), 16_000)
    return {key: float(scores[f"{key}_mos"]) for key in ("ovrl", "sig", "bak", "p808")}


def harvard(n: int) -> list[str]:
    lines = [line.strip() for line in HARVARD.read_text().splitlines() if line.strip()]
    return lines[:n]


def heldout_rows(corpus: Path, per_voice: int, voices: list[str] | None = None, skip: int = 0) -> list[dict]:
    """``per_voice`` utterances of each voice's manifest (every voice in ``corpus``, or ``voices``), after its
    first ``skip``. Example: per_voice=100, skip=0 gives lines 0-99 (the reported set); per_voice=100, skip=100
    gives lines 100-199 where a manifest has them (a validation set for choosing between checkpoints)."""
    rows = []
    for manifest in sorted(corpus.glob("*.jsonl")):
        if voices and manifest.stem not in voices:
            continue
        rows += [json.loads(line) for line in manifest.read_text().splitlines()[skip : skip + per_voice]]
    if not rows:
        raise SystemExit(
            f"no held-out corpus in {corpus}: build it with "
            "python -m training.corpus --out corpus-heldout --heldout 125"
        )
    return rows


def free_port() -> int:
    """A loopback port free now (the OS picks it; a race with another process binding it is possible, not likely)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class ServeProcess:
    """`python -m tts.cli serve` with ``flags`` in a child process on a free loopback port, as a user runs it; its
    log goes to a file."""

    def __init__(self, *flags: str):
        self.port = free_port()
        self.url, self.ws_url = f"http://127.0.0.1:{self.port}", f"ws://127.0.0.1:{self.port}/v1/stream"
        self.log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
        self.child = subprocess.Popen(
            [sys.executable, "-m", "tts.cli", "serve", "--port", str(self.port), *flags],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
        )

    def wait(self, seconds: float = 600) -> ServeProcess:
        """Until ``/health`` answers; SystemExit with the log's tail if the child ends or the time runs out."""
        import httpx2 as httpx

        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and self.child.poll() is None:
            try:
                httpx.get(self.url + "/health", timeout=2)
                return self
            except httpx.HTTPError:
                time.sleep(0.3)
        raise SystemExit(f"the server did not come up: {self.log_text()[-2000:]}")

    def wait_for_log(self, text: str, seconds: float) -> bool:
        """Whether ``text`` appeared in the log within ``seconds`` (e.g. the faster step swapped in)."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and self.child.poll() is None:
            if text in self.log_text():
                return True
            time.sleep(0.2)
        return text in self.log_text()

    def log_text(self) -> str:
        return Path(self.log.name).read_text()

    def health(self) -> dict:
        import httpx2 as httpx

        return httpx.get(self.url + "/health", timeout=10).json()

    def tracebacks(self) -> int:
        return self.log_text().count("Traceback")

    def stop(self) -> None:
        self.child.terminate()
        self.child.wait(timeout=30)
        os.unlink(self.log.name)

    def __enter__(self) -> ServeProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
