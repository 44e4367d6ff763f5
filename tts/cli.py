"""Command line: ``tts say``, ``tts voices``, ``tts serve``."""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import numpy as np


def write_wav(path: Path, audio: np.ndarray, sample_rate: int) -> None:
    """Write a 16-bit mono WAV atomically: a temp file in the same folder, then rename."""
    import soundfile as sf

    path = Path(path)
    fd, tmp = tempfile.mkstemp(suffix=".wav", dir=path.parent or ".")
    os.close(fd)
    try:
        sf.write(tmp, audio, sample_rate, subtype="PCM_16")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def play(audio: np.ndarray, sample_rate: int) -> bool:
    try:
        import sounddevice
        sounddevice.play(audio, sample_rate)
        sounddevice.wait()
        return True
    except Exception:  # no sounddevice package, no PortAudio, or no output device
        return False


def cmd_say(args) -> int:
    if args.server:
        from tts.client import say_via_server
        say_via_server(args.server, args.text, voice=args.voice, out=args.output, speed=args.speed)
        return 0
    from tts import SAMPLE_RATE
    from tts.api import synthesize
    audio = synthesize(args.text, voice=args.voice, speed=args.speed)
    if args.output:
        write_wav(args.output, audio, SAMPLE_RATE)
        print(f"wrote {args.output} ({len(audio) / SAMPLE_RATE:.2f} s)", file=sys.stderr)
    elif not play(audio, SAMPLE_RATE):
        print("no sound device here; write a file instead: tts say \"...\" -o out.wav", file=sys.stderr)
        return 2
    return 0


def cmd_voices(_args) -> int:
    from tts.voices import voice_presets
    presets = voice_presets()
    name_width, teacher_width = (max(len(p[key]) for p in presets.values()) for key in ("name", "teacher"))
    for name, preset in presets.items():
        mark = " (default)" if preset.get("default") else ""
        print(f"{name:{name_width}s}  {preset['teacher']:{teacher_width}s}  {preset['description']}{mark}")
    return 0


def cmd_serve(args) -> int:
    from server import serve
    serve(host=args.host, port=args.port, compile=not args.no_compile)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tts", description="Streaming text-to-speech.")
    sub = parser.add_subparsers(dest="command", required=True)
    say = sub.add_parser("say", help="speak text to a WAV file or the sound device")
    say.add_argument("text")
    say.add_argument("--voice", default=None, help="voice name (see `tts voices`); default: the default voice")
    say.add_argument("--speed", type=float, default=1.0,
                     help="speaking rate, 0.25 to 4.0, times the voice's pace (voices.json)")
    say.add_argument("-o", "--output", type=Path, help="write a 24 kHz mono WAV here")
    say.add_argument("--server", help="stream from a running server, e.g. ws://127.0.0.1:8000")
    say.set_defaults(run=cmd_say)
    sub.add_parser("voices", help="list the voices").set_defaults(run=cmd_voices)
    serve = sub.add_parser("serve", help="run the WebSocket/HTTP server")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--no-compile", action="store_true",
                       help="skip compiling the decode step at start-up (starts seconds sooner, steps slower)")
    serve.set_defaults(run=cmd_serve)
    args = parser.parse_args(argv)
    from streaming.engine import EngineError
    from tts.client import ClientError
    from tts.text import TextError
    try:
        return args.run(args)
    except (TextError, EngineError, ClientError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
