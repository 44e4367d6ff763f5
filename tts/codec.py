"""A causal SEANet codec with residual vector quantisation, 24 kHz audio <-> 50 Hz frames of 8 tokens.

Every convolution pads on the left only, so the decoder can run chunk by chunk with carried state
(`DecoderState`) and give exactly the samples of an offline decode of the same frames.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tts.decoder_state import DecoderState
from tts.rates import SAMPLE_RATE
from tts.spectral_decoder import SPECTRAL_PRESETS, SpectralConfig, SpectralDecoder


@dataclass(frozen=True)
class CodecConfig:
    sample_rate: int = SAMPLE_RATE
    channels: int = 32  # decoder width; the decoder is what runs at serving time
    encoder_channels: int = 24  # the encoder only tokenises the corpus, so it is kept smaller
    dim: int = 128
    strides: tuple[int, ...] = (8, 6, 5, 2)  # decoder order; 8*6*5*2 = 480 samples = one 20 ms frame
    codebooks: int = 8
    codebook_size: int = 1024
    lstm: bool = True
    spectral: SpectralConfig | None = None  # the decoder: None = the SEANet `Decoder`, else a `SpectralDecoder`

    @property
    def hop(self) -> int:
        return int(torch.tensor(self.strides).prod())

    @property
    def frame_rate(self) -> float:
        return self.sample_rate / self.hop


CODEC_PRESETS = {
    "base": CodecConfig(),
    "tiny": CodecConfig(channels=4, encoder_channels=4, dim=16, codebook_size=32, codebooks=4),
    "tiny-spectral": CodecConfig(
        channels=4, encoder_channels=4, dim=16, codebook_size=32, codebooks=4, spectral=SPECTRAL_PRESETS["tiny"]
    ),
}
LEAD_IN_FRAMES = 10  # frames of silence a stream's decoder has heard before its first frame (200 ms)


class CausalConv1d(nn.Conv1d):
    """Conv1d padded on the left by ``(kernel-1)*dilation - (stride-1)``.

    Streaming keeps that many past input samples. Example: kernel 3, dilation 2 -> 4 samples of
    history; a chunk of 5 samples is convolved as 4 + 5 = 9 samples and gives 5 outputs.
    """

    @property
    def context(self) -> int:
        return (self.kernel_size[0] - 1) * self.dilation[0] - (self.stride[0] - 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, C, T)
        return super().forward(F.pad(x, (self.context, 0)))

    def step(self, x: torch.Tensor, history: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.cat([history, x], dim=-1)
        return super().forward(x), x[..., x.shape[-1] - self.context :]


class CausalConvTranspose1d(nn.ConvTranspose1d):
    """Transposed conv (kernel 2*stride) whose last ``kernel - stride`` samples are cut, as they still
    wait for the next frame's contribution.

    Streaming keeps that unfinished tail, without bias, and adds it to the next chunk. Example: stride 2,
    kernel 4, a chunk of 3 frames gives 8 samples: the first 6 are final (plus the previous tail on the
    first 2), the last 2 become the tail.
    """

    @property
    def tail(self) -> int:
        return self.kernel_size[0] - self.stride[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        return y[..., : y.shape[-1] - self.tail]

    def step(self, x: torch.Tensor, tail: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = super().forward(x)
        y = torch.cat([y[..., : self.tail] + tail, y[..., self.tail :]], dim=-1)
        cut = y.shape[-1] - self.tail
        return y[..., :cut], y[..., cut:] - self.bias[:, None]


class ResidualUnit(nn.Module):
    def __init__(self, channels: int, dilation: int):
        super().__init__()
        self.conv1 = CausalConv1d(channels, channels // 2, 3, dilation=dilation)
        self.conv2 = nn.Conv1d(channels // 2, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv2(F.elu(self.conv1(F.elu(x))))

    def step(self, x: torch.Tensor, history: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h, history = self.conv1.step(F.elu(x), history)
        return x + self.conv2(F.elu(h)), history


class SkipLSTM(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.lstm = nn.LSTM(dim, dim, batch_first=True)

    def forward(self, x: torch.Tensor, state=None):  # (B, C, T)
        y, state = self.lstm(x.transpose(1, 2), state)
        return (x + y.transpose(1, 2)).contiguous(), state


class Encoder(nn.Module):
    def __init__(self, cfg: CodecConfig):
        super().__init__()
        layers, ch = [CausalConv1d(1, cfg.encoder_channels, 7)], cfg.encoder_channels
        for stride in reversed(cfg.strides):
            layers += [ResidualUnit(ch, 1), ResidualUnit(ch, 3), nn.ELU(), CausalConv1d(ch, ch * 2, 2 * stride, stride)]
            ch *= 2
        self.convs = nn.Sequential(*layers)
        self.lstm = SkipLSTM(ch) if cfg.lstm else None
        self.out = CausalConv1d(ch, cfg.dim, 3)

    def forward(self, audio: torch.Tensor) -> torch.Tensor:  # (B, 1, T*hop) -> (B, D, T)
        x = self.convs(audio)
        if self.lstm is not None:
            x, _ = self.lstm(x)
        return self.out(F.elu(x))


class Decoder(nn.Module):
    def __init__(self, cfg: CodecConfig):
        super().__init__()
        ch = cfg.channels * 2 ** len(cfg.strides)
        self.inp = CausalConv1d(cfg.dim, ch, 7)
        self.lstm = SkipLSTM(ch) if cfg.lstm else None
        blocks = []
        for stride in cfg.strides:
            blocks.append(
                nn.ModuleList(
                    [
                        CausalConvTranspose1d(ch, ch // 2, 2 * stride, stride),
                        ResidualUnit(ch // 2, 1),
                        ResidualUnit(ch // 2, 3),
                    ]
                )
            )
            ch //= 2
        self.blocks = nn.ModuleList(blocks)
        self.out = CausalConv1d(ch, 1, 7)

    def forward(self, z: torch.Tensor) -> torch.Tensor:  # (B, D, T) -> (B, 1, T*hop)
        x = self.inp(z)
        if self.lstm is not None:
            x, _ = self.lstm(x)
        for up, res1, res3 in self.blocks:
            x = res3(res1(up(F.elu(x))))
        return self.out(F.elu(x))

    def init_state(self, batch: int, device=None, dtype=torch.float32) -> DecoderState:
        def zeros(ch, n):
            return torch.zeros(batch, ch, n, device=device, dtype=dtype)

        buffers = [zeros(self.inp.in_channels, self.inp.context)]
        for up, res1, res3 in self.blocks:
            buffers += [
                zeros(up.out_channels, up.tail),
                zeros(res1.conv1.in_channels, res1.conv1.context),
                zeros(res3.conv1.in_channels, res3.conv1.context),
            ]
        buffers.append(zeros(self.out.in_channels, self.out.context))
        lstm = None
        if self.lstm is not None:
            hidden = self.lstm.lstm.hidden_size
            lstm = (
                torch.zeros(1, batch, hidden, device=device, dtype=dtype),
                torch.zeros(1, batch, hidden, device=device, dtype=dtype),
            )
        return DecoderState(buffers, lstm)

    def step(self, z: torch.Tensor, state: DecoderState) -> torch.Tensor:
        """Decode a chunk of frames (B, D, t) into (B, 1, t*hop) samples, updating ``state`` in place."""
        buffers = iter(range(len(state.buffers)))
        i = next(buffers)
        x, state.buffers[i] = self.inp.step(z, state.buffers[i])
        if self.lstm is not None:
            x, state.lstm = self.lstm(x, state.lstm)
        for up, res1, res3 in self.blocks:
            i = next(buffers)
            x, state.buffers[i] = up.step(F.elu(x), state.buffers[i])
            i = next(buffers)
            x, state.buffers[i] = res1.step(x, state.buffers[i])
            i = next(buffers)
            x, state.buffers[i] = res3.step(x, state.buffers[i])
        i = next(buffers)
        y, state.buffers[i] = self.out.step(F.elu(x), state.buffers[i])
        return y


class ResidualVQ(nn.Module):
    """Residual vector quantiser. Training-time codebook updates (EMA, k-means init, dead-code restart)
    live in ``training/``; here codebooks are plain buffers used for lookup."""

    def __init__(self, cfg: CodecConfig):
        super().__init__()
        self.register_buffer("codebooks", torch.zeros(cfg.codebooks, cfg.codebook_size, cfg.dim))

    def encode(self, z: torch.Tensor, n_q: int | None = None) -> torch.Tensor:  # (B, D, T) -> (B, K, T)
        residual, codes = z.transpose(1, 2).float(), []
        for book in self.codebooks[:n_q]:  # book: (N, D)
            distance = residual.pow(2).sum(-1, keepdim=True) - 2 * residual @ book.T + book.pow(2).sum(-1)
            index = distance.argmin(-1)  # (B, T)
            residual = residual - book[index]
            codes.append(index)
        return torch.stack(codes, dim=1)

    def decode(self, codes: torch.Tensor) -> torch.Tensor:  # (B, K, T) -> (B, D, T)
        z = sum(self.codebooks[k][codes[:, k]] for k in range(codes.shape[1]))
        return z.transpose(1, 2)


class Codec(nn.Module):
    def __init__(self, cfg: CodecConfig):
        super().__init__()
        self.cfg = cfg
        self.encoder, self.quantizer = Encoder(cfg), ResidualVQ(cfg)
        self.decoder = SpectralDecoder(cfg.dim, cfg.hop, cfg.spectral) if cfg.spectral else Decoder(cfg)

    @torch.inference_mode()
    def encode(self, audio: torch.Tensor, n_q: int | None = None) -> torch.Tensor:
        """(B, samples) float audio at 24 kHz -> (B, K, T) int64 codes; audio is zero-padded to whole frames."""
        pad = -audio.shape[-1] % self.cfg.hop
        return self.quantizer.encode(self.encoder(F.pad(audio, (0, pad))[:, None]), n_q)

    @torch.inference_mode()
    def silence_codes(self, frames: int = LEAD_IN_FRAMES) -> torch.Tensor:
        """(1, K, frames): the codes of steady silence. The first frames of encoded silence differ (the
        encoder's own start), so the last of twice as many frames is repeated."""
        device = self.quantizer.codebooks.device
        return self.encode(torch.zeros(1, 2 * frames * self.cfg.hop, device=device))[..., -1:].repeat(1, 1, frames)

    @torch.no_grad()  # not inference mode: the engine updates this state in place
    def init_state(self, batch: int, device=None) -> DecoderState:
        """Decoder state for ``batch`` streams that have just heard ``LEAD_IN_FRAMES`` of silence. From zeros the
        decoder's first 5 ms are a click (peak 0.022 for the shipped codec, against 0.0001 after the lead-in)."""
        state = self.decoder.init_state(1, device)
        self.decoder.step(self.quantizer.decode(self.silence_codes().to(device)), state)
        return state.repeat(batch)

    def decode_step(self, codes: torch.Tensor, state: DecoderState) -> torch.Tensor:
        """The streaming form of `decode`: (B, K, t) codes of each stream's next t frames -> (B, t*hop) audio,
        continuing ``state`` (updated in place). Autograd is the caller's to turn off."""
        return self.decoder.step(self.quantizer.decode(codes), state)[:, 0]

    @torch.inference_mode()
    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """(B, K, T) codes -> (B, T*hop) audio, decoded after the same silent lead-in as `init_state`, so that a
        stream decoded chunk by chunk from `init_state` equals this. Example: T=4, hop 480, lead-in 10 ->
        14 frames decoded, the first 4,800 samples dropped, 1,920 returned."""
        lead_in = self.silence_codes().expand(codes.shape[0], -1, -1)
        audio = self.decoder(self.quantizer.decode(torch.cat([lead_in, codes], -1)))[:, 0]
        return audio[:, LEAD_IN_FRAMES * self.cfg.hop :]


CODEC_FILES = ("codec_encoder.safetensors", "codec_decoder.safetensors")  # then codec_decoder-1.safetensors, ...
PART_BYTES = 15_000_000  # each file under 16 MiB, the most a GPU machine's call brings back


def part_files(folder, stem: str) -> list:
    """The files `save_parts` wrote for ``stem``, in order: <stem>.safetensors, then <stem>-1, <stem>-2, ..."""
    from pathlib import Path

    parts = sorted(Path(folder).glob(f"{stem}-*.safetensors"), key=lambda p: int(p.stem.rsplit("-", 1)[1]))
    return [Path(folder) / f"{stem}.safetensors", *parts]


def save_parts(state: dict, folder, stem: str, metadata: dict) -> None:
    """``state`` as fp16 safetensors files of at most ``PART_BYTES`` each (tensors kept whole, in order):
    <stem>.safetensors, then <stem>-1, ... Example: 14.4 + 2.0 MB of tensors -> two files. Parts of an
    earlier, longer save are removed."""
    from pathlib import Path

    from safetensors.torch import save_file

    parts, size = [{}], 0
    for key, value in state.items():
        value = value.detach().half().contiguous().cpu()
        if size + value.nbytes > PART_BYTES and parts[-1]:
            parts.append({})
            size = 0
        parts[-1][key], size = value, size + value.nbytes
    for stale in part_files(folder, stem)[1:]:
        stale.unlink()
    for i, part in enumerate(parts):
        save_file(
            part,
            str(Path(folder) / (f"{stem}.safetensors" if i == 0 else f"{stem}-{i}.safetensors")),
            metadata=metadata,
        )


def decoder_files(folder) -> list:
    """The quantizer + decoder files of a saved codec, in order: codec_decoder.safetensors, then its parts -1, -2..."""
    return part_files(folder, CODEC_FILES[1].removesuffix(".safetensors"))


def save_codec(codec: Codec, folder, meta: dict | None = None) -> None:
    """fp16 safetensors: the encoder in one file, the quantizer and decoder in as many as keep each under
    ``PART_BYTES`` (the SEANet decoder fits one; the spectral decoder takes two)."""
    import json

    state = codec.state_dict()
    metadata = {"config": json.dumps(dataclasses.asdict(codec.cfg)), **(meta or {})}
    encoder = {k: v for k, v in state.items() if k.startswith("encoder.")}
    save_parts(encoder, folder, CODEC_FILES[0].removesuffix(".safetensors"), metadata)
    rest = {k: v for k, v in state.items() if not k.startswith("encoder.")}
    save_parts(rest, folder, CODEC_FILES[1].removesuffix(".safetensors"), metadata)


def config_from_json(cfg: dict) -> CodecConfig:
    """The `CodecConfig` that `dataclasses.asdict` wrote as JSON (lists back to tuples, the spectral part typed)."""
    spectral = cfg.get("spectral")
    return CodecConfig(
        **{**cfg, "strides": tuple(cfg["strides"]), "spectral": SpectralConfig(**spectral) if spectral else None}
    )


def load_codec(folder, device="cpu") -> Codec:
    """Load the codec written by `save_codec` from ``folder``."""
    import json
    from pathlib import Path

    from safetensors import safe_open
    from safetensors.torch import load_file

    with safe_open(str(Path(folder) / CODEC_FILES[1]), "pt") as f:
        cfg = json.loads(f.metadata()["config"])
    codec = Codec(config_from_json(cfg))
    state = {}
    for path in [Path(folder) / CODEC_FILES[0], *decoder_files(folder)]:
        state.update({k: v.float() for k, v in load_file(str(path)).items()})
    codec.load_state_dict(state)
    return codec.to(device).eval()
