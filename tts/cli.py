"""Command line: ``tts say``, ``tts voices``, ``tts serve``, ``tts wyoming``.

tts say "Hello there."                       # plays on the sound device while it is generated
tts say "Hello there." -o hello.mp3          # format from the suffix: wav mp3 ogg opus flac aac pcm raw
echo "Hello." | tts say - -o - > hello.wav   # text from stdin, audio to stdout
tts say -i chapter1.txt -i chapter2.txt -o book.ogg --subtitles book.vtt
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from tts.rates import SAMPLE_RATE

EXIT_CODES = """exit codes:
  0    done
  1    internal error (a bug: please report it)
  2    bad input: empty or unspeakable text, unknown voice, bad speed, unknown format, bad flags
  3    a file could not be read or written
  4    no sound device or playback package (write a file with -o instead)
  5    the server could not be reached, or refused for lack of capacity
  130  interrupted (Ctrl-C): nothing partial is left behind"""
UTTERANCE_CHARS = 1500  # longer paragraphs are spoken as several utterances, split between sentences


class InputError(ValueError):
    """Text that cannot be read as asked (no text given, not UTF-8)."""


# ---- text in ----------------------------------------------------------------------------------------
def read_texts(text: str | None, files: list[str]) -> list[str]:
    """The positional text ("-": standard input), then each ``-i`` file, as UTF-8 strings."""
    if text is None and not files:
        raise InputError("no text: give it as an argument, '-' to read standard input, or -i FILE")
    texts = []
    if text is not None:
        texts.append(sys.stdin.buffer.read().decode("utf-8") if text == "-" else text)
    for name in files:
        try:
            texts.append(Path(name).read_bytes().decode("utf-8"))
        except UnicodeDecodeError:
            raise InputError(f"{name} is not UTF-8 text") from None
    return texts


def utterances(text: str, limit: int = UTTERANCE_CHARS) -> list[str]:
    """Paragraphs (ended by a blank line); a paragraph longer than ``limit`` characters is cut into runs of
    whole sentences of at most ``limit`` (a longer sentence stays whole). Sentences are the text front end's
    (`tts.normalize.split_sentences`: "Dr. Li" does not end one). Markup stays as written.
    Example, limit 30: "One. Two.\n\nA long first sentence. And more." ->
    ["One. Two.", "A long first sentence.", "And more."]"""
    from tts.normalize import split_sentences, tokenize

    tokens = tokenize(text)
    out, first = [], None  # first: the token the utterance being gathered starts at
    for start, stop, _ in split_sentences(tokens, final=True):
        if first is not None and tokens[stop - 1].end - tokens[first].start > limit:
            out.append(text[tokens[first].start : tokens[start - 1].end])
            first = None
        first = start if first is None else first
        if tokens[stop - 1].para_end or stop == len(tokens):
            out.append(text[tokens[first].start : tokens[stop - 1].end])
            first = None
    return out


# ---- audio out --------------------------------------------------------------------------------------
def local_chunks(parts: list[str], voice: str | None, speed: float, seed: int | None, lexicon=None) -> Iterator:
    """Chunks of each utterance from the in-process engine, ``None`` after each utterance."""
    from tts.api import synthesize_stream

    for i, text in enumerate(parts):
        yield from synthesize_stream(text, voice, speed, seed=None if seed is None else seed + i, lexicon=lexicon)
        yield None


async def _server_chunks(url: str, parts: list[str], voice: str | None, speed: float, lexicon=None):
    from tts.client import connect

    async with connect(url) as client:
        for text in parts:
            async for chunk in client.speak(text, voice, speed, lexicon=lexicon):
                yield chunk
            yield None


def server_chunks(url: str, parts: list[str], voice: str | None, speed: float, lexicon=None) -> Iterator:
    """The same from a running server over one WebSocket, driven one chunk at a time on a private loop."""
    loop, chunks = asyncio.new_event_loop(), _server_chunks(url, parts, voice, speed, lexicon)
    try:
        while True:
            try:
                yield loop.run_until_complete(anext(chunks))
            except StopAsyncIteration:
                return
    finally:
        with contextlib.suppress(RuntimeError):  # still running if Ctrl-C interrupted it: the loop closes anyway
            loop.run_until_complete(chunks.aclose())
        loop.close()


def open_sink(output: str | None, fmt: str | None):
    """Where the audio goes: the sound device (no ``output``), stdout ("-"), or a file."""
    from tts.output import Player, file_sink, stdout_sink

    if output is None:
        return Player(SAMPLE_RATE)
    return stdout_sink(fmt) if output == "-" else file_sink(output, fmt)


_interrupted = threading.Event()


def _interrupt(*_) -> None:
    """SIGINT/SIGTERM: KeyboardInterrupt, remembered, since one raised while a finalizer runs (garbage collection
    in the main thread) is printed and dropped by Python, and the command would then finish as if not stopped."""
    _interrupted.set()
    raise KeyboardInterrupt


def write_speech(source: Iterator, parts: list[str], write, quiet: bool) -> tuple[int, list[dict]]:
    """Send every chunk of ``source`` to ``write`` as it comes, with a progress bar over ``parts`` (two or
    more utterances, on a terminal). Returns the samples written and the words, each utterance's words
    moved to where its audio starts."""
    from tqdm import tqdm

    samples, offset, words, spoken = 0, 0.0, [], iter(parts)
    with tqdm(
        total=sum(map(len, parts)), unit="char", file=sys.stderr, disable=True if len(parts) < 2 or quiet else None
    ) as progress:  # None: off unless a terminal
        for chunk in source:
            if chunk is None:  # an utterance ended: the next one's clock starts where its audio ends
                offset = samples / SAMPLE_RATE
                progress.update(len(next(spoken)))
                continue
            write(chunk)
            samples += len(chunk)
            words += [
                {**w, "start": w["start"] + offset, "end": w["end"] + offset} for w in getattr(chunk, "words", ())
            ]
    return samples, words


def speakable_parts(texts) -> list[str]:
    """The utterances of ``texts``, checked before any audio or file is made: the whole text as every front end
    checks one (`tts.text.validate_text`: "?" alone is TextError "text has nothing speakable in it"), then its
    paragraphs with something to say (a "* * *" between sections is not an utterance of its own)."""
    from tts.text import has_speakable, validate_text

    texts = list(texts)
    validate_text("\n\n".join(texts), limit=sum(map(len, texts)) + 2 * len(texts))  # (length: per utterance)
    return [u for text in texts for u in utterances(text) if has_speakable(u)]


def cmd_say(args) -> int:
    from tts import subtitles
    from tts.output import format_for

    for signum in (signal.SIGTERM, signal.SIGINT):  # `kill` cleans up like Ctrl-C: no partial file
        signal.signal(signum, _interrupt)
    fmt = format_for(args.output, args.format) if args.output else None
    if args.subtitles:
        subtitles.subtitle_format(args.subtitles)
    if args.loudness is not None and (args.output is None or not -70 <= args.loudness <= 0):
        raise InputError("--loudness is for files (-o), a loudness from -70 to 0 LUFS (e.g. -16)")
    if args.server and (args.subtitles or args.seed is not None):
        raise InputError("--subtitles and --seed work with local synthesis only (drop --server)")
    lexicon = read_lexicon(args.lexicon)
    parts = speakable_parts(read_texts(args.text, args.input))
    source = (
        server_chunks(args.server, parts, args.voice, args.speed, lexicon)
        if args.server
        else local_chunks(parts, args.voice, args.speed, args.seed, lexicon)
    )
    if args.loudness is not None:
        from tts.loudness import normalized

        source = normalized(source, SAMPLE_RATE, args.loudness)
    started = time.perf_counter()
    with contextlib.closing(source), open_sink(args.output, fmt) as write:
        samples, words = write_speech(source, parts, write, args.quiet)
        if _interrupted.is_set():  # stopped, though the KeyboardInterrupt was lost: the file is discarded
            raise KeyboardInterrupt
    if args.subtitles:
        subtitles.write(args.subtitles, words)
    if not args.quiet:
        where = "played" if args.output is None else "wrote stdout" if args.output == "-" else f"wrote {args.output}"
        print(
            f"{where}: {samples / SAMPLE_RATE:.2f} s of audio in {time.perf_counter() - started:.2f} s", file=sys.stderr
        )
    return 0


def read_lexicon(path: str | None) -> dict[str, str] | None:
    """--lexicon FILE's entries, checked (a bad one fails here, naming it, before any audio)."""
    if path is None:
        return None
    from tts.lexicon import Lexicon, read_entries

    entries = read_entries(path)
    Lexicon.load(path)
    return entries


# ---- other commands ---------------------------------------------------------------------------------
def cmd_voices(args) -> int:
    from tts.voices import voice_presets

    presets = voice_presets()
    if args.json:  # what GET /v1/voices answers
        from serving.http_api import VOICE_KEYS
        from tts.voices import voice_aliases

        default = next((n for n, v in presets.items() if v.get("default")), next(iter(presets)))
        listed = [{k: v.get(k) for k in VOICE_KEYS} for v in presets.values()]
        print(
            json.dumps(
                {"default": default, "sample_rate": SAMPLE_RATE, "voices": listed, "aliases": voice_aliases()}, indent=2
            )
        )
        return 0
    name_width, teacher_width, license_width = (
        max(len(p.get(key, "")) for p in presets.values()) for key in ("name", "teacher", "license")
    )
    for name, preset in presets.items():
        mark = " (default)" if preset.get("default") else ""
        print(
            f"{name:{name_width}s}  {preset['teacher']:{teacher_width}s}  "
            f"{preset.get('license', ''):{license_width}s}  {preset['description']}{mark}"
        )
    return 0


def cmd_serve(args) -> int:
    """Loads the engine (about a second: its step and codec decoder run ONNX Runtime from the graphs shipped
    for the model, `kernels.weightless`; a model without them starts on the fastest step ready while a
    faster one is built in the background and swapped in), then listens."""
    if args.workers < 1 or (args.ray and args.workers > 1):
        raise InputError("--workers must be at least 1, and is not used with --ray (use --replicas)")
    if args.text_process:  # every engine of this server, the workers' too (they inherit the environment)
        os.environ["TTS_TEXT_PROCESS"] = "1"
    parking_environment(args)
    if args.ray:
        return serve_on_ray(args)
    import logging

    logging.basicConfig(level=logging.INFO, format="%(levelname)s:     %(message)s")  # uvicorn's look
    from server import serve
    from serving.limits import Limits, limits_from
    from tts.api import get_engine

    lexicon = read_lexicon(args.lexicon)
    if args.workers > 1:  # each worker loads its own engine (serving/workers.py): none here
        if args.wyoming_uri:
            raise InputError("--wyoming-uri is not served with --workers (run `tts wyoming` beside it)")
        serve(
            host=args.host,
            port=args.port,
            api_keys=args.api_key,
            allow_origins=args.allow_origin,
            compile=not args.no_compile,
            workers=args.workers,
            max_streams=args.max_streams,
            lexicon=lexicon,
            **limits_from(args),
        )
        return 0
    # streams waiting for text or for their reader are parked without a slot: open as many as connections
    engine = get_engine(max_streams=args.max_streams, compile=not args.no_compile, max_open=args.max_connections)
    with contextlib.ExitStack() as also:
        if args.wyoming_uri:  # one engine for both servers
            from serving.wyoming import WyomingServer

            also.enter_context(WyomingServer(engine, args.wyoming_uri, args.zeroconf, Limits(**limits_from(args))))
        serve(
            host=args.host,
            port=args.port,
            engine=engine,
            api_keys=args.api_key,
            allow_origins=args.allow_origin,
            lexicon=lexicon,
            **limits_from(args),
        )
    return 0


def parking_environment(args) -> None:
    """--park-dir / --park-max-bytes for every engine of this server, the workers' too (`ParkingConfig` reads
    TTS_PARK_DIR and TTS_PARK_MAX_BYTES)."""
    if args.park_dir is not None:
        os.environ["TTS_PARK_DIR"] = args.park_dir
    if args.park_max_bytes is not None:
        os.environ["TTS_PARK_MAX_BYTES"] = str(args.park_max_bytes)


def serve_on_ray(args) -> int:
    """`tts serve --ray`: the same server on Ray Serve, one engine per replica (serving/ray_serve.py)."""
    if args.wyoming_uri:
        raise InputError("--wyoming-uri is not served with --ray (run `tts wyoming` beside it)")
    import logging

    logging.basicConfig(level=logging.INFO, format="%(levelname)s:     %(message)s")
    from server import create_app
    from serving import ray_serve
    from serving.limits import Limits, limits_from
    from tts.api import get_engine

    autoscale = args.max_replicas is not None
    scale = ray_serve.ScaleConfig(
        replicas=args.replicas,
        autoscale=autoscale,
        min_replicas=args.replicas,
        max_replicas=args.max_replicas or args.replicas,
        target_streams=args.target_streams,
        num_cpus=args.replica_cpus,
    )
    app = ray_serve.application(
        get_engine,
        create_app,
        scale,
        {"max_streams": args.max_streams, "compile": not args.no_compile, "max_open": args.max_connections},
        {"limits": Limits(**limits_from(args)), "api_keys": args.api_key, "allow_origins": args.allow_origin},
    )
    ray_serve.run(app, args.host, args.port, args.ray_address)
    return 0


def cmd_wyoming(args) -> int:
    from serving.limits import Limits, limits_from
    from serving.wyoming import WyomingServer
    from tts.api import get_engine

    engine = get_engine(compile=not args.no_compile)
    with WyomingServer(engine, args.uri, args.zeroconf, Limits(**limits_from(args))):
        print(f"Wyoming server on {args.uri}; Ctrl-C stops it", file=sys.stderr)
        try:
            threading.Event().wait()
        except KeyboardInterrupt:
            pass
    return 0


def serve_parser(sub) -> None:
    from serving.limits import add_arguments

    serve = sub.add_parser(
        "serve",
        help="run the WebSocket/HTTP server",
        epilog=EXIT_CODES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument(
        "--max-streams",
        type=int,
        metavar="INT",
        help="utterances the engine speaks at once (its slots; default 8); more wait in the queue",
    )
    serve.add_argument(
        "--lexicon",
        metavar="FILE",
        help="server-wide pronunciations: JSON or TSV of word -> /IPA/ or respelling; a request's own entries win "
        "(docs/agents.md)",
    )
    serve.add_argument(
        "--api-key",
        action="append",
        metavar="KEY",
        default=[k for k in os.environ.get("TTS_API_KEYS", "").split(",") if k],
        help="require this key on every /v1 endpoint (repeatable; or TTS_API_KEYS=k1,k2, "
        "which keeps keys out of the process list)",
    )
    serve.add_argument(
        "--allow-origin",
        action="append",
        default=[],
        metavar="ORIGIN",
        help="a browser origin, besides the server's own, that may use the API and gets CORS "
        "headers (repeatable; '*' allows any)",
    )
    serve.add_argument(
        "--workers",
        type=int,
        default=1,
        metavar="INT",
        help="server processes behind the one port, each with its own engine of --max-streams / "
        "INT slots and its share of --max-connections and --max-queue (default 1; "
        "docs/scale-out.md)",
    )
    serve.add_argument(
        "--text-process",
        action="store_true",
        help="each engine reads its sentences (espeak) in a process of its own, so that phonemising "
        "does not hold the interpreter lock its ticks need (TTS_TEXT_PROCESS=1 does the same)",
    )
    serve.add_argument(
        "--no-compile",
        action="store_true",
        help="run the plain eager decode step, no faster one (TTS_NO_COMPILE=1 does the same)",
    )
    serve.add_argument(
        "--park-dir",
        metavar="DIR",
        help="where streams parked for a while (waiting for text, their reader or a resume) spill "
        "their state: a fresh tts-parked-* directory under DIR, removed at exit (default: "
        "TTS_PARK_DIR, else the temp dir, $TMPDIR or /tmp)",
    )
    serve.add_argument(
        "--park-max-bytes",
        type=int,
        metavar="INT",
        help="the most spilled state on disk; past it parked streams stay in memory (default: "
        "TTS_PARK_MAX_BYTES, else 4 GiB)",
    )
    serve.add_argument("--wyoming-uri", help="also serve Home Assistant's Wyoming protocol, e.g. tcp://0.0.0.0:10200")
    serve.add_argument(
        "--zeroconf",
        nargs="?",
        const="",
        metavar="NAME",
        help="announce the Wyoming server on the local network (mDNS), optionally under NAME",
    )
    ray = serve.add_argument_group("Ray Serve (pip install 'tts[ray]'; docs/scale-out.md)")
    ray.add_argument(
        "--ray",
        action="store_true",
        help="serve from engine replicas on Ray Serve (a local Ray cluster is started unless --ray-address names one)",
    )
    ray.add_argument(
        "--replicas",
        type=int,
        default=2,
        metavar="N",
        help="engine replicas (default 2); with --max-replicas, the fewest the autoscaler keeps",
    )
    ray.add_argument(
        "--max-replicas",
        type=int,
        metavar="N",
        help="autoscale on active streams between --replicas and this many replicas",
    )
    ray.add_argument(
        "--target-streams",
        type=float,
        default=6.0,
        metavar="F",
        help="active streams per replica the autoscaler aims at (default 6)",
    )
    ray.add_argument(
        "--replica-cpus",
        type=float,
        metavar="F",
        help="CPU cores per replica (default: the machine's cores shared evenly)",
    )
    ray.add_argument("--ray-address", metavar="ADDR", help="an existing Ray cluster, e.g. auto or ray://HOST:10001")
    add_arguments(serve)  # the server's limits, one flag each: --max-connections, --queue-timeout-s, ...
    serve.set_defaults(run=cmd_serve)


def wyoming_parser(sub) -> None:
    wyoming = sub.add_parser("wyoming", help="run a Wyoming server for Home Assistant")
    wyoming.add_argument("--uri", default="tcp://0.0.0.0:10200", help="tcp://HOST:PORT or unix://PATH")
    wyoming.add_argument(
        "--zeroconf",
        nargs="?",
        const="",
        metavar="NAME",
        help="announce the server on the local network (mDNS), optionally under NAME",
    )
    wyoming.add_argument(
        "--no-compile",
        action="store_true",
        help="run the plain eager decode step, no faster one (TTS_NO_COMPILE=1 does the same)",
    )
    from serving.limits import add_arguments

    add_arguments(wyoming)  # the server's limits hold on Wyoming too (streaming/wyoming.py)
    wyoming.set_defaults(run=cmd_wyoming)


# ---- parsing and errors -----------------------------------------------------------------------------
def parser() -> argparse.ArgumentParser:
    root = argparse.ArgumentParser(
        prog="tts",
        description="Streaming text-to-speech.",
        epilog=EXIT_CODES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = root.add_subparsers(dest="command", required=True)
    say = sub.add_parser(
        "say",
        help="speak text to the sound device, a file or stdout",
        epilog=EXIT_CODES,
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    say.add_argument("text", nargs="?", help="the text; '-' reads standard input")
    say.add_argument(
        "-i",
        "--input",
        action="append",
        default=[],
        metavar="FILE",
        help="read text from FILE (UTF-8; repeatable); long texts are spoken paragraph by paragraph",
    )
    say.add_argument(
        "-o",
        "--output",
        help="write audio here, the format from the suffix; '-' is stdout (WAV unless --format); without -o, play it",
    )
    say.add_argument(
        "--format",
        choices=["wav", "mp3", "opus", "flac", "aac", "pcm"],
        help="the output format, whatever the suffix (pcm: 16-bit little-endian, 24 kHz mono)",
    )
    say.add_argument("--voice", default=None, help="voice name (see `tts voices`); default: the default voice")
    say.add_argument(
        "--speed", type=float, default=1.0, help="speaking rate, 0.25 to 4.0, times the voice's pace (voices.json)"
    )
    say.add_argument("--seed", type=int, help="repeatable speech: the same seed and text give the same audio")
    say.add_argument("--subtitles", metavar="FILE", help="also write subtitles from word timings (.srt or .vtt)")
    say.add_argument("--server", help="stream from a running server, e.g. ws://127.0.0.1:8000")
    say.add_argument(
        "--loudness",
        type=float,
        metavar="LUFS",
        help="bring the file to this integrated loudness "
        "(ITU-R BS.1770), true peak at most -1 dBTP, e.g. -16 (needs pip install \"tts[loudness]\")",
    )
    say.add_argument(
        "--lexicon",
        metavar="FILE",
        help="pronunciations: JSON or TSV of word -> /IPA/ or respelling (docs/agents.md, tts/lexicon.py)",
    )
    say.add_argument("-q", "--quiet", action="store_true", help="no progress bar and no summary")
    say.set_defaults(run=cmd_say)
    voices = sub.add_parser("voices", help="list the voices")
    voices.add_argument("--json", action="store_true", help="as JSON, the same as GET /v1/voices")
    voices.set_defaults(run=cmd_voices)
    serve_parser(sub)
    wyoming_parser(sub)
    return root


def exit_code(err: Exception) -> int | None:
    """The documented exit code of a failure (EXIT_CODES); None for a bug."""
    from tts.client import ClientError, ServerError
    from tts.output import PlaybackError

    if isinstance(err, ServerError):
        return 5 if err.code == "server_full" else 2
    if isinstance(err, ClientError):
        return 5
    if isinstance(err, PlaybackError):
        return 4
    if isinstance(err, ValueError):  # TextError, UnknownVoice, InputError, a bad speed or format
        return 2
    if isinstance(err, OSError):
        return 3
    if "streaming.engine" in sys.modules:  # only loaded (with torch) by commands that use the engine
        from streaming.engine import EngineError

        return 1 if isinstance(err, EngineError) else None
    return None


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return args.run(args)
    except KeyboardInterrupt:  # the outputs are already discarded (their with-blocks have unwound)
        print("interrupted", file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(130)  # not a normal exit: the engine's daemon threads may be inside a native op, and
        # interpreter shutdown under them aborts the process (SIGABRT) instead of exiting 130
    except Exception as err:
        code = exit_code(err)
        if code is None:
            raise
        named = isinstance(err, OSError) and err.filename and err.strerror
        print(f"error: {f'{err.filename}: {err.strerror}' if named else err}", file=sys.stderr)
        return code


if __name__ == "__main__":
    sys.exit(main())
