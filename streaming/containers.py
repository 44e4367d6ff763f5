"""Audio chunks -> the bytes of a streamed format: raw PCM by numpy, containers (WAV, MP3, Ogg Opus, AAC, FLAC)
by PyAV (FFmpeg), chunk by chunk, so every format can be sent while it is being generated."""
from __future__ import annotations

import av
import numpy as np

from tts import SAMPLE_RATE

_CONTAINERS = {"wav": ("wav", "pcm_s16le", SAMPLE_RATE), "mp3": ("mp3", "libmp3lame", SAMPLE_RATE),
               "opus": ("ogg", "libopus", 48_000), "aac": ("adts", "aac", SAMPLE_RATE),
               "flac": ("flac", "flac", SAMPLE_RATE)}
MEDIA_TYPES = {"wav": "audio/wav", "pcm": "audio/pcm", "mp3": "audio/mpeg", "opus": "audio/ogg",
               "aac": "audio/aac", "flac": "audio/flac"}


class _Sink:
    """A write-only file for PyAV: what the muxer writes is taken out after every chunk."""

    def __init__(self):
        self._parts: list[bytes] = []

    def write(self, data) -> int:
        self._parts.append(bytes(data))
        return len(data)

    def take(self) -> bytes:
        data, self._parts = b"".join(self._parts), []
        return data


class Encoder:
    """float32 chunks -> bytes of one format, chunk by chunk. Raw PCM by numpy; containers by PyAV (FFmpeg),
    written to a non-seekable sink so every format streams (WAV gets FFmpeg's streaming header)."""

    def __init__(self, fmt: str, file=None):
        """``file``: a seekable binary file that containers are written into instead, so that the muxer can
        complete their headers at the end (WAV sizes, FLAC length); encode() then returns b"" for them."""
        self.fmt, self._sink, self._container = fmt, _Sink(), None
        if fmt in _CONTAINERS:
            muxer, codec, rate = _CONTAINERS[fmt]
            self._container = av.open(file or self._sink, mode="w", format=muxer)
            self._stream = self._container.add_stream(codec, rate=rate, layout="mono")

    def encode(self, audio: np.ndarray) -> bytes:
        if self.fmt in ("pcm_s16le", "pcm"):
            return np.round(np.clip(audio, -1.0, 1.0) * 32767).astype("<i2").tobytes()
        if self.fmt == "f32le":
            return np.asarray(audio, dtype="<f4").tobytes()
        frame = av.AudioFrame.from_ndarray(np.asarray(audio, dtype=np.float32)[None], format="flt", layout="mono")
        frame.sample_rate = SAMPLE_RATE
        return self._mux(frame)

    def finish(self) -> bytes:
        if self._container is None:
            return b""
        tail = self._mux(None)
        self.close()
        return tail + self._sink.take()

    def close(self) -> None:
        if self._container is not None:
            self._container.close()
            self._container = None

    def _mux(self, frame) -> bytes:
        for packet in self._stream.encode(frame):
            self._container.mux(packet)
        return self._sink.take()
