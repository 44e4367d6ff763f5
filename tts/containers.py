"""Audio chunks -> the bytes of a streamed format at a chosen sample rate: resampled by soxr (a streaming
resampler, so chunk by chunk equals the whole), raw PCM by numpy, containers (WAV, MP3, Ogg Opus, AAC, FLAC)
and G.711 mu-law by PyAV (FFmpeg), chunk by chunk, so every format can be sent while it is being generated."""

from __future__ import annotations

import numpy as np
import soxr

from tts.rates import SAMPLE_RATE

ULAW_RATE = 8_000  # telephony: G.711 mu-law is 8 kHz by definition
OPUS_RATE = 48_000  # Ogg Opus always decodes at 48 kHz, whatever was encoded
# format -> (FFmpeg muxer, codec); `None` for the raw formats numpy writes
_CONTAINERS = {
    "wav": ("wav", "pcm_s16le"),
    "mp3": ("mp3", "libmp3lame"),
    "opus": ("ogg", "libopus"),
    "aac": ("adts", "aac"),
    "flac": ("flac", "flac"),
    "ulaw_8000": ("mulaw", "pcm_mulaw"),
}
MEDIA_TYPES = {
    "wav": "audio/wav",
    "pcm": "audio/pcm",
    "mp3": "audio/mpeg",
    "opus": "audio/ogg",
    "aac": "audio/aac",
    "flac": "audio/flac",
}


def output_rate(fmt: str, requested: int = SAMPLE_RATE) -> int:
    """The sample rate a format is sent at: what was asked, except where the format fixes it
    (``opus`` 48 kHz, ``ulaw_8000`` 8 kHz)."""
    return {"opus": OPUS_RATE, "ulaw_8000": ULAW_RATE}.get(fmt, requested)


def _av():
    """PyAV, imported when a container is first encoded: raw PCM needs none of FFmpeg, and a machine serving
    only PCM (a benchmark host without the ~36 MB wheel) need not have it."""
    import av

    return av


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


class AudioEncoder:
    """float32 chunks at SAMPLE_RATE -> bytes of one format at ``rate``, chunk by chunk. Raw PCM by numpy;
    containers by PyAV (FFmpeg), written to a non-seekable sink so every format streams (WAV gets FFmpeg's
    streaming header). Opus is fed at 48 kHz, mu-law at 8 kHz, whatever ``rate`` says."""

    def __init__(self, fmt: str, rate: int = SAMPLE_RATE, file=None):
        """``file``: a seekable binary file that containers are written into instead, so that the muxer can
        complete their headers at the end (WAV sizes, FLAC length); encode() then returns b"" for them."""
        self.fmt, self.rate = fmt, output_rate(fmt, rate)
        self._sink, self._container = _Sink(), None
        self._resampler = (
            soxr.ResampleStream(SAMPLE_RATE, self.rate, 1, dtype="float32") if self.rate != SAMPLE_RATE else None
        )
        if fmt in _CONTAINERS:
            muxer, codec = _CONTAINERS[fmt]
            self._container = _av().open(file or self._sink, mode="w", format=muxer)
            self._stream = self._container.add_stream(codec, rate=self.rate, layout="mono")

    def encode(self, audio: np.ndarray) -> bytes:
        return self._write(self._resample(np.asarray(audio, dtype=np.float32), last=False))

    def finish(self) -> bytes:
        """The rest: the resampler's tail and the container's trailer. The encoder is closed afterwards."""
        data = self._write(self._resample(np.zeros(0, dtype=np.float32), last=True))
        if self._container is not None:
            data += self._mux(None)
            self.close()
            data += self._sink.take()
        return data

    def close(self) -> None:
        if self._container is not None:
            self._container.close()
            self._container = None

    def _resample(self, audio: np.ndarray, last: bool) -> np.ndarray:
        if self._resampler is None:
            return audio
        return self._resampler.resample_chunk(audio, last=last)

    def _write(self, audio: np.ndarray) -> bytes:
        if self.fmt in ("pcm_s16le", "pcm"):
            return np.round(np.clip(audio, -1.0, 1.0) * 32767).astype("<i2").tobytes()
        if self.fmt == "f32le":
            return audio.astype("<f4").tobytes()
        if not len(audio):
            return b""
        frame = _av().AudioFrame.from_ndarray(np.clip(audio, -1.0, 1.0)[None], format="flt", layout="mono")
        frame.sample_rate = self.rate
        return self._mux(frame)

    def _mux(self, frame) -> bytes:
        for packet in self._stream.encode(frame):
            self._container.mux(packet)
        return self._sink.take()
