"""Where `tts say` sends audio while it is generated: a file (written atomically), stdout, or the sound device.

Every sink is a context manager whose ``with`` gives ``write(chunk)`` for float32 mono chunks; leaving it normally
completes the output (renames the file into place, plays to the end); leaving it by an exception (an error,
Ctrl-C) discards it (removes the temporary file, stops the sound). Encoding goes through the server's
encoders (`tts.containers`), so a file holds exactly what `POST /v1/audio/speech` would send.
"""

from __future__ import annotations

import contextlib
import os
import queue
import sys
import tempfile
import threading
from pathlib import Path

import numpy as np

from tts.containers import AudioEncoder

FORMATS = {
    ".wav": "wav",
    ".mp3": "mp3",
    ".ogg": "opus",
    ".opus": "opus",
    ".flac": "flac",
    ".aac": "aac",
    ".pcm": "pcm",
    ".raw": "pcm",
}  # file suffix -> encoder format; pcm is 16-bit little-endian, headerless
PLAYBACK_BUFFER_S = 30.0  # audio generated ahead of the sound device, at most


class PlaybackError(RuntimeError):
    """No sound device, or no playback package, to play through."""


def format_for(path: str | Path, explicit: str | None = None) -> str:
    """The encoder format for an output path: ``explicit`` if given, else from the suffix.
    Example: "talk.ogg" -> "opus"; "-" (stdout) -> "wav"; "notes.txt" -> ValueError."""
    if explicit:
        if explicit not in set(FORMATS.values()):
            raise ValueError(f"unknown format {explicit!r}; choose one of {sorted(set(FORMATS.values()))}")
        return explicit
    if str(path) == "-":
        return "wav"
    suffix = Path(path).suffix.lower()
    if suffix not in FORMATS:
        raise ValueError(
            f"cannot tell the audio format of {str(path)!r} from its suffix; use one of "
            f"{', '.join(FORMATS)} or --format"
        )
    return FORMATS[suffix]


@contextlib.contextmanager
def atomic_file(path: str | Path, mode: str = "wb"):
    """A temporary file beside ``path``, renamed onto it when the block ends normally, removed otherwise:
    a reader of ``path`` never sees a partial file."""
    path = Path(path)
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".part")
    except OSError as err:  # name the file asked for, not the temporary one
        raise OSError(err.errno, err.strerror, str(path)) from None
    try:
        with os.fdopen(fd, mode, **({} if "b" in mode else {"encoding": "utf-8"})) as file:
            yield file
        os.replace(tmp, path)
    finally:
        Path(tmp).unlink(missing_ok=True)


@contextlib.contextmanager
def file_sink(path: str | Path, fmt: str):
    """``write(chunk)`` encodes into a file as chunks arrive; the file appears complete or not at all."""
    with atomic_file(path) as file, contextlib.closing(AudioEncoder(fmt, file=file)) as encoder:
        yield lambda chunk: file.write(encoder.encode(chunk))  # containers write the (seekable) file, so
        file.write(encoder.finish())  # their headers get completed; raw PCM comes back as bytes


@contextlib.contextmanager
def stdout_sink(fmt: str, out=None):
    """``write(chunk)`` streams the encoded audio to standard output as it is generated (``-o -``)."""
    out = out or sys.stdout.buffer

    def write(chunk: np.ndarray) -> None:
        out.write(encoder.encode(chunk))
        out.flush()

    with contextlib.closing(AudioEncoder(fmt)) as encoder:
        yield write
        out.write(encoder.finish())
        out.flush()


def open_device(sample_rate: int, instead: str = "tts say TEXT -o out.wav"):
    """The default sound device as a mono float32 `sounddevice.OutputStream` (not started); a `PlaybackError` that
    says why and how to write a file instead (``instead``) when the package, the PortAudio library or an output
    device is missing."""
    try:
        import sounddevice
    except ImportError:
        raise PlaybackError(
            f"playing needs the sounddevice package: pip install 'tts[audio]'; or write a file: {instead}"
        ) from None
    except OSError as err:  # the package is there but the PortAudio library is not
        raise PlaybackError(
            f"cannot play: {err} (install PortAudio, e.g. apt-get install libportaudio2); or write a file: {instead}"
        ) from None
    try:
        sounddevice.check_output_settings(samplerate=sample_rate, channels=1, dtype="float32")
        return sounddevice.OutputStream(samplerate=sample_rate, channels=1, dtype="float32")
    except (sounddevice.PortAudioError, ValueError) as err:  # PortAudio is there, no output device is
        raise PlaybackError(f"no sound device to play through ({err}); write a file instead: {instead}") from None


class Player:
    """Plays chunks on the default sound device while later ones are still being generated.

    A writer thread feeds the device (its ``write`` blocks at the device's pace); the generator stays at most
    PLAYBACK_BUFFER_S ahead of it, so a pause between utterances is covered by audio already waiting."""

    def __init__(self, sample_rate: int, buffer_s: float = PLAYBACK_BUFFER_S):
        self._device = open_device(sample_rate)
        self._queue: queue.Queue = queue.Queue(maxsize=max(1, int(buffer_s / 0.32)))  # chunks are <= 0.32 s
        self._error: Exception | None = None
        self._thread = threading.Thread(target=self._play, name="tts-player", daemon=True)

    def _play(self) -> None:
        try:
            while (chunk := self._queue.get()) is not None:  # not iter(get, None): arrays compare elementwise
                self._device.write(chunk[:, None])
        except Exception as err:  # the device went away: tell the generating side, stop taking audio
            self._error = err
            while self._queue.get() is not None:
                pass

    def write(self, chunk: np.ndarray) -> None:
        if self._error is not None:
            raise PlaybackError(f"playback failed: {self._error}")
        if len(chunk):
            self._queue.put(np.asarray(chunk, dtype=np.float32))

    def __enter__(self):
        self._device.start()
        self._thread.start()
        return self.write

    def __exit__(self, error_type, *_) -> None:
        if error_type is not None:  # stop now: drop what is queued, cut the sound
            while not self._queue.empty():
                self._queue.get_nowait()
            self._device.abort()
        self._queue.put(None)
        self._thread.join()
        self._device.stop()  # plays what the device still holds
        self._device.close()
        if error_type is None and self._error is not None:
            raise PlaybackError(f"playback failed: {self._error}")
