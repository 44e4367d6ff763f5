"""The codec decoder's streaming step run by ONNX Runtime: the CPU codec worker's decoder.

`Codec.decode_step(codes, state)` (codes -> latents -> `Decoder.step`) is exported to ONNX with the
decoder state as explicit inputs and outputs and the batch and time axes dynamic, so one file serves every
chunk length (2, 4, 8, 16 frames and a stream's shorter last chunk) and every number of streams.

Measured (``python -m bench.steps --codec-only``, one thread, CPU time per call): eager PyTorch dispatches
the decoder's ~60 small ops (convs, transposed convs, pads and cats of the carried history, an LSTM) at
tens of microseconds each, so small calls cost it 2-4x what they cost ONNX Runtime (a 2-frame chunk of one
stream: 15.9 against 4.3 ms); at 8 streams x 16 frames both are bound by the convolutions' arithmetic and
ONNX Runtime is 1.2-1.3x faster (1.0 against 1.3 ms per frame of one stream). ONNX Runtime's own Elu op
computes exp one value at a time (27 % of the decoder's time), so ELU is exported as vectorised ops
(`vectorised_elu`). Tried in eager and dropped:
oneDNN off (`torch.backends.mkldnn`: 2-3x slower at batch 2-8), inference mode instead of no_grad (no
change), a frozen TorchScript trace (within 10 % of eager); channels-last has no 1-D form and the loaded
codec has no weight norm to fuse.

State layout, inputs and outputs alike: the `DecoderState` buffers in order (conv histories and
transposed-conv tails, each (B, C, N)), then the LSTM's h and c (each (1, B, H)). Example, shipped codec:
14 buffers + 2 LSTM tensors, so the graph has 17 inputs (codes first) and 17 outputs (audio first).

Cache, export and session: as the AR step's (`kernels.ort`), in the same directory, as
``codec-<key>.onnx``, the key hashing the codec's weights and config, `tts.codec`'s and this file's
source, and the torch and onnxruntime versions. Kill switch: TTS_NO_ORT=1 (`kernels.auto` then keeps
the torch decoder).
"""

from __future__ import annotations

import inspect
import sys
import warnings
from pathlib import Path

import numpy as np
import torch
from torch import nn

import kernels.ort as ort
import tts.codec
from tts.codec import Codec, DecoderState

OPSET = 17


class CodecStep(nn.Module):
    """`Codec.decode_step` as a pure function: (codes (B, K, T), *state) -> (audio (B, T*hop), *new state)."""

    def __init__(self, codec: Codec):
        super().__init__()
        self.codec = codec

    def forward(self, codes: torch.Tensor, *state: torch.Tensor) -> tuple[torch.Tensor, ...]:
        carried = split_state(list(state), self.codec.decoder.lstm is not None)
        audio = self.codec.decode_step(codes, carried)
        return (audio, *flat_state(carried))


def flat_state(state: DecoderState) -> list[torch.Tensor]:
    """The state's tensors in the graph's order: buffers, then the LSTM's (h, c) if any."""
    return [*state.buffers, *(state.lstm or ())]


def split_state(tensors: list[torch.Tensor], lstm: bool) -> DecoderState:
    """The inverse of `flat_state` (the last two tensors are the LSTM's h and c when ``lstm``)."""
    return DecoderState(tensors[:-2], (tensors[-2], tensors[-1])) if lstm else DecoderState(tensors, None)


def onnx_path(codec: Codec) -> Path:
    """Where the export of ``codec``'s decode step lives (see the module's docstring for the key)."""
    return ort.cached_path(
        "codec",
        codec,
        repr(codec.cfg),
        inspect.getsource(tts.codec),
        inspect.getsource(sys.modules[__name__]),
        *ort.versions(),
    )


def export(codec: Codec, path: Path) -> None:
    """Write ``codec``'s `CodecStep` as ONNX to ``path`` atomically, batch and time axes dynamic."""
    batch, frames = 2, 4
    state = codec.decoder.init_state(batch)  # zeros: only the shapes matter
    codes = torch.zeros(batch, codec.cfg.codebooks, frames, dtype=torch.long)
    tensors = flat_state(state)
    names = [f"state{i}" for i in range(len(tensors))]
    lstm = codec.decoder.lstm is not None
    axes = {name: {1 if lstm and i >= len(tensors) - 2 else 0: "batch"} for i, name in enumerate(names)}
    axes.update({f"new_{name}": axis for name, axis in axes.items()})
    axes.update(codes={0: "batch", 2: "frames"}, audio={0: "batch", 1: "samples"})

    def write(tmp: str) -> None:
        torch.onnx.register_custom_op_symbolic("aten::elu", vectorised_elu, OPSET)
        try:
            with warnings.catch_warnings(), torch.no_grad():
                warnings.simplefilter("ignore")  # the tracer's notes on shapes read as Python numbers
                torch.onnx.export(
                    CodecStep(codec).eval(),
                    (codes, *tensors),
                    tmp,
                    dynamo=False,
                    input_names=["codes", *names],
                    output_names=["audio"] + [f"new_{n}" for n in names],
                    dynamic_axes=axes,
                    opset_version=OPSET,
                )
        finally:
            torch.onnx.unregister_custom_op_symbolic("aten::elu", OPSET)

    ort.write_atomically(path, write)


def vectorised_elu(g, x, alpha, scale, input_scale):
    """ELU (alpha 1, as `tts.codec` uses it) as max(x, exp(min(x, 0)) - 1): for x > 0, exp(0) - 1 = 0 < x;
    for x <= 0, exp(x) - 1 >= x. ONNX Runtime's own Elu op computes exp element by element and was 27 % of
    the decoder's time; these four ops run vectorised and took 60 % of its time (2M values, one thread)."""
    zero = g.op("Constant", value_t=torch.tensor(0.0))
    one = g.op("Constant", value_t=torch.tensor(1.0))
    return g.op("Max", x, g.op("Sub", g.op("Exp", g.op("Min", x, zero)), one))


def load(codec: Codec) -> Path | None:
    """The cached export of ``codec``'s decode step if one exists and loads (a broken file is deleted)."""
    return ort.load_file(onnx_path(codec))


class OrtCodecStep:
    """``step(codes (M, K, T), state) -> audio (M, T*hop)``, updating ``state`` (a `DecoderState` of M
    streams) in place, as `Codec.decode_step` does: the callable `Engine.set_codec_step` takes."""

    kind = "onnxruntime"

    def __init__(self, source, lstm: bool):
        """``source``: the export's path, or an ONNX Runtime session of it (`kernels.weightless`)."""
        self.session = ort.session(source) if isinstance(source, Path) else source
        self.lstm = lstm
        self.names = [node.name for node in self.session.get_inputs()]

    def __call__(self, codes: torch.Tensor, state: DecoderState) -> torch.Tensor:
        tensors = [codes, *flat_state(state)]
        feeds = {name: np.ascontiguousarray(t.numpy()) for name, t in zip(self.names, tensors)}
        audio, *new = (torch.from_numpy(out) for out in self.session.run(None, feeds))
        stepped = split_state(new, self.lstm)
        state.buffers[:], state.lstm = stepped.buffers, stepped.lstm
        return audio


if __name__ == "__main__":  # the background export: python -m kernels.ort_codec CODEC.pt OUT.onnx
    ort.export_child(export)
