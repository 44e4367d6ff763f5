"""Every path a user touches, measured the way a user meets it: a fresh process, default flags. One JSON object.

    python -m bench.paths                  # api, cli, server; 20 sentences for the API's steady state
    python -m bench.paths --quick          # 8 sentences, one CLI run per cache state
    python -m bench.paths --only server    # one path (api, cli, server)

Each path runs in a subprocess of this checkout's code, first with empty compile/export caches (a fresh
install: ``TTS_CACHE_DIR``, ``TORCHINDUCTOR_CACHE_DIR`` and ``XDG_CACHE_HOME`` in a new temporary folder;
the weightless graphs in kernels/graphs/ ship with the code, as they do with an install), then where it
matters again with the caches that first run left (every later start).

* ``api``: ``synthesize_stream()`` with the default engine. ``first_chunk_s``: from the call to the first
  chunk, the model load included; ``process_to_first_chunk_s`` adds starting Python and importing;
  ``timeline``: import, load, first chunk and when each final step was in use, in seconds since launch. Then
  after that first call, each of ``sentences`` Harvard sentences is spoken on its own: ``rtf`` is the total
  wall time over the total audio (``cpu_s_per_audio_s``: the process's CPU seconds per second of audio, both
  its busy threads together: an idle 2-core machine's RTF lies between half this and this),
  ``first_chunk_ms`` the p50/p99 of call-to-first-chunk, ``step_kinds`` the
  decode step the engine ran after each sentence (the faster one is swapped in when its build ends).
* ``cli_file``: ``tts say SENTENCE -o out.wav`` (as ``python -m tts.cli``), the wall time of the whole process.
* ``cli_play``: ``tts say SENTENCE`` to the sound device (ALSA's default pointed at a file): process start to
  the first audio handed to the device, and to the end (skipped, saying why, without PortAudio).
* ``server``: ``tts serve`` from process start to the first ``/health`` and ``/v1/voices`` answers and to
  the first audio byte of a first ``POST /v1/audio/speech``; ``timeline`` lists what the server printed,
  stamped with seconds since its start, until the final step is in use (or ``--swap-wait`` s pass).

On a shared machine wall times stretch with the load (``load_avg_*``); the ``*cpu_s`` figures, CPU seconds
the process itself used up to that point (all its threads), stretch much less and estimate what an idle
machine would take.

Targets (issue 22, 2 cores): API RTF <= 0.25, first chunk p50 <= 80 ms from the second call, first call
<= 3 s; server to /v1/voices <= 5 s, to first audio <= 10 s.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from bench.common import ROOT, free_port  # nothing here imports torch: the API row times that itself

SENTENCE = "The quick brown fox jumps over the lazy dog near the river."
CACHE_VARS = ("TTS_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR", "XDG_CACHE_HOME")


def child_env(cache: Path) -> dict:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.update({name: str(cache / name.lower()) for name in CACHE_VARS})
    return env


# ---- the API, inside a fresh process ----------------------------------------------------------------
class Timeline(logging.Handler):
    """What the ``tts`` logger says (engine ready, step and codec decoder in use), stamped with seconds
    since the process was launched."""

    def __init__(self, launched: float):
        super().__init__()
        self.launched, self.lines = launched, []

    def emit(self, record) -> None:
        self.lines.append(f"{time.time() - self.launched:7.2f} s  {record.getMessage()}")

    def mark(self, what: str) -> None:
        self.lines.append(f"{time.time() - self.launched:7.2f} s  {what}")


def api_child(sentences: int, launched: float) -> dict:
    """Runs in the child: import, one first call, then ``sentences`` calls one after another."""
    timeline = Timeline(launched)
    logging.getLogger("tts").addHandler(timeline)
    logging.getLogger("tts").setLevel(logging.INFO)
    row, imported = {}, time.time()
    timeline.mark("python started, importing tts.api")
    from tts.api import get_engine, synthesize_stream

    imported = time.time() - imported
    timeline.mark("imported; first call (loads the engine)")

    def speak(text: str, cpu: bool = False) -> tuple[float, float, float]:
        start = time.perf_counter()
        first, samples = None, 0
        for chunk in synthesize_stream(text):
            if first is None and cpu:
                row["process_cpu_to_first_chunk_s"] = round(time.process_time(), 3)  # all threads, since start
                timeline.mark(f"first chunk (step {get_engine().step_kind})")
            first = first or time.perf_counter() - start
            samples += len(chunk)
        return first, time.perf_counter() - start, samples / chunk.sample_rate

    called = time.time()
    first, wall, audio = speak(SENTENCE, cpu=True)
    from bench.common import harvard, percentiles

    row.update(
        import_s=round(imported, 3),
        first_chunk_s=round(first, 3),
        process_to_first_chunk_s=round(called + first - launched, 3),
        first_call_rtf=round(wall / audio, 3),
        step_kinds=[get_engine().step_kind],
    )
    firsts, walls, audios, cpu = [], [], [], time.process_time()
    for text in harvard(sentences):
        first, wall, audio = speak(text)
        firsts.append(first * 1000)
        walls.append(wall)
        audios.append(audio)
        row["step_kinds"].append(get_engine().step_kind)
    row.update(
        sentences=sentences,
        rtf=round(sum(walls) / sum(audios), 3),
        first_chunk_ms=percentiles(firsts),
        cpu_s_per_audio_s=round((time.process_time() - cpu) / sum(audios), 3),
        audio_s=round(sum(audios), 2),
        timeline=timeline.lines,
    )
    return row


def api(cache: Path, sentences: int) -> dict:
    launched = time.time()
    done = subprocess.run(
        [sys.executable, "-m", "bench.paths", "--api-child", str(sentences), str(launched)],
        cwd=ROOT,
        env=child_env(cache),
        capture_output=True,
        text=True,
        timeout=1800,
    )
    if done.returncode:
        raise RuntimeError(f"api child failed: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


# ---- the CLI --------------------------------------------------------------------------------------------
def children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def process_cpu_s(pid: int) -> float:
    """CPU seconds (all threads) a running process has used: /proc/PID/stat's utime + stime."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cli_file(cache: Path, out: Path) -> dict:
    cpu = children_cpu_s()
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "tts.cli", "say", SENTENCE, "-o", str(out), "-q"],
        cwd=ROOT,
        env=child_env(cache),
        capture_output=True,
        text=True,
        timeout=600,
    )
    wall = time.perf_counter() - start
    if done.returncode:
        raise RuntimeError(f"tts say failed ({done.returncode}): {done.stderr[-2000:]}")
    import soundfile

    return {
        "wall_s": round(wall, 3),
        "cpu_s": round(children_cpu_s() - cpu, 3),
        "audio_s": round(soundfile.info(out).duration, 3),
    }


def cli_play(cache: Path, tmp: Path) -> dict:
    """``tts say SENTENCE`` to the sound device: ALSA's default device is pointed at a file (HOME/.asoundrc),
    so the first sound is the first audio PortAudio hands over. Needs the PortAudio library."""
    played = tmp / "played.raw"
    played.unlink(missing_ok=True)
    (tmp / ".asoundrc").write_text(f'pcm.!default {{ type file; slave.pcm "null"; file "{played}"; format "raw" }}\n')
    start = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-m", "tts.cli", "say", SENTENCE, "-q"],
        cwd=ROOT,
        env={**child_env(cache), "HOME": str(tmp)},
        stderr=subprocess.PIPE,
        text=True,
    )
    first = None
    while proc.poll() is None and first is None:
        if played.exists() and played.stat().st_size:
            first = time.perf_counter() - start
        time.sleep(0.01)
    stderr = proc.communicate(timeout=600)[1]
    if proc.returncode:
        return {"skipped": stderr.strip().splitlines()[-1]}
    return {
        "first_sound_s": round(first, 3) if first else None,
        "wall_s": round(time.perf_counter() - start, 3),
        "audio_s": round(played.stat().st_size / 4 / 24_000, 3),
    }


# ---- the server -----------------------------------------------------------------------------------------
def first_ok(url: str, started: float, deadline_s: float) -> float:
    """Seconds from ``started`` until ``url`` answers 200 (polled every 20 ms)."""
    while time.perf_counter() - started < deadline_s:
        try:
            with urllib.request.urlopen(url, timeout=1) as response:
                if response.status == 200:
                    return time.perf_counter() - started
        except OSError:
            time.sleep(0.02)
    raise TimeoutError(f"{url} did not answer within {deadline_s} s")


def first_audio(url: str, started: float) -> tuple[float, float]:
    """(seconds from ``started`` to the first body byte, to the last) of one speech request."""
    body = json.dumps({"model": "tts", "input": SENTENCE, "response_format": "pcm"}).encode()
    request = urllib.request.Request(url, body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        response.read(1)
        first = time.perf_counter() - started
        response.read()
    return first, time.perf_counter() - started


def server(cache: Path, swap_wait_s: float) -> dict:
    port = free_port()
    started = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-m", "tts.cli", "serve", "--port", str(port)],
        cwd=ROOT,
        env=child_env(cache),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    timeline = []

    def read_log():
        for line in proc.stderr:
            timeline.append((round(time.perf_counter() - started, 2), line.strip()))

    reader = threading.Thread(target=read_log, daemon=True)
    reader.start()
    base = f"http://127.0.0.1:{port}"
    try:
        row = {
            "health_s": round(first_ok(f"{base}/health", started, 300), 3),
            "voices_s": round(first_ok(f"{base}/v1/voices", started, 300), 3),
        }
        row["voices_cpu_s"] = process_cpu_s(proc.pid)
        first, last = first_audio(f"{base}/v1/audio/speech", started)
        row.update(
            first_audio_s=round(first, 3),
            first_audio_cpu_s=process_cpu_s(proc.pid),
            first_request_done_s=round(last, 3),
        )
        deadline = time.perf_counter() + swap_wait_s
        while time.perf_counter() < deadline and not any("step in use:" in line for _, line in timeline):
            time.sleep(0.1)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        reader.join(timeout=5)
    row["timeline"] = [f"{t:7.2f} s  {line}" for t, line in timeline]
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--only", nargs="*", choices=["api", "cli", "server"], default=["api", "cli", "server"])
    parser.add_argument("--sentences", type=int, help="API sentences after the first call (default 20; --quick 8)")
    parser.add_argument(
        "--swap-wait",
        type=float,
        default=120.0,
        help="seconds the server row waits for the faster step after its first answer",
    )
    parser.add_argument("--api-child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.api_child:
        print(json.dumps(api_child(int(args.api_child[0]), float(args.api_child[1]))))
        return
    sentences = args.sentences or (8 if args.quick else 20)
    result = {"cpu_cores": os.cpu_count(), "load_avg_at_start": [round(x, 2) for x in os.getloadavg()]}
    with tempfile.TemporaryDirectory(prefix="tts-paths-") as tmp:
        tmp = Path(tmp)
        if "api" in args.only:
            result["api"] = {"empty_cache": api(tmp / "api", sentences), "warm_cache": api(tmp / "api", sentences)}
        if "cli" in args.only:
            runs = 1 if args.quick else 2
            result["cli_file"] = {
                "empty_cache": cli_file(tmp / "cli", tmp / "out.wav"),
                "warm_cache": [cli_file(tmp / "cli", tmp / "out.wav") for _ in range(runs)],
            }
            result["cli_play"] = cli_play(tmp / "cli", tmp)
        if "server" in args.only:
            result["server"] = {
                "empty_cache": server(tmp / "server", args.swap_wait),
                "warm_cache": server(tmp / "server", args.swap_wait),
            }
    result["load_avg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
