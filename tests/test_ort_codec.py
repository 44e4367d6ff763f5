"""The codec decoder run by ONNX Runtime decodes what the torch decoder decodes: chunked equals offline,
state carried across calls, rows reset, sub-batches; it is built in the background, loaded from the disk
cache, swapped into a live engine, and falls back to the torch decoder when it cannot be had."""

import threading
import time

import numpy as np
import pytest
import torch
from test_kernels import one_thread  # noqa: F401 (an autouse fixture: one thread, as the codec worker's)

from kernels import auto, ort, ort_codec
from tts.codec import CODEC_PRESETS, Codec

needs_ort = pytest.mark.skipif(not ort.available(), reason="onnxruntime/onnx not installed or TTS_NO_ORT set")
pytestmark = needs_ort


@pytest.fixture(scope="module")
def codec():
    torch.manual_seed(0)
    codec = Codec(CODEC_PRESETS["tiny"]).eval()  # LSTM included, as the shipped codec
    codec.quantizer.codebooks.normal_()
    return codec


@pytest.fixture(scope="module")
def step(codec, tmp_path_factory):
    path = tmp_path_factory.mktemp("onnx") / "codec.onnx"
    ort_codec.export(codec, path)
    return ort_codec.OrtCodecStep(path, lstm=True)


def random_codes(codec, batch, frames, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, codec.cfg.codebook_size, (batch, codec.cfg.codebooks, frames), generator=g)


@pytest.mark.parametrize("chunk", [1, 2, 3, 7, 16])
def test_chunked_decode_equals_offline(codec, step, chunk):
    """One export serves every chunk length (dynamic time axis), the state carried from call to call."""
    codes = random_codes(codec, 2, 37)
    state = codec.init_state(2)
    parts = [step(codes[..., t : t + chunk], state) for t in range(0, 37, chunk)]
    assert (torch.cat(parts, -1) - codec.decode(codes)).abs().max() <= 1e-4


@pytest.mark.parametrize("batch", [1, 3, 8])
def test_every_batch_size_equals_the_torch_decoder(codec, step, batch):
    codes = random_codes(codec, batch, 24, seed=batch)
    want, got = codec.init_state(batch), codec.init_state(batch)
    with torch.no_grad():
        for t in (0, 4, 12, 16):  # chunks of 4, 8, 4, 8 frames: the state carries over
            end = t + (4 if t in (0, 12) else 8)
            audio = step(codes[..., t:end], got)
            torch.testing.assert_close(audio, codec.decode_step(codes[..., t:end], want), atol=1e-4, rtol=0)
    for a, b in zip(want.buffers + list(want.lstm), got.buffers + list(got.lstm)):
        torch.testing.assert_close(b, a, atol=1e-4, rtol=0)


def test_reset_rows_and_sub_batches_continue_their_own_streams(codec, step):
    """The worker's pattern: select some rows, step them, write them back; reset a row for a new stream."""
    codes = random_codes(codec, 3, 14, seed=5)
    hop = codec.cfg.hop
    state = codec.init_state(3)
    step(codes[..., :4], state)
    index = torch.tensor([2, 0])
    sub = state.select(index)
    step(codes[index, :, 4:6], sub)
    state.write(index, sub)  # rows 2 and 0 are 2 frames ahead of row 1
    state.reset(torch.tensor([False, True, False]))  # row 1 starts a new stream
    last = step(codes[..., 6:14], state)
    offline = codec.decode(codes)
    assert (last[[2, 0]] - offline[[2, 0], 6 * hop :]).abs().max() <= 1e-4
    assert (last[1] - codec.decode(codes[1:2, :, 6:14])[0]).abs().max() <= 1e-4


def test_a_fixed_shape_call_repeats_bit_for_bit(codec, step):
    """A seeded stream decoded in a call of its own gets the same floats whatever else is running."""
    codes = random_codes(codec, 1, 16, seed=3)
    first = step(codes, codec.init_state(1))
    step(random_codes(codec, 4, 8, seed=4), codec.init_state(4))  # other shapes in between
    assert torch.equal(first, step(codes, codec.init_state(1)))


def test_builds_in_background_then_loads_from_disk(codec, cache_dir):
    started = time.perf_counter()
    faster = auto.faster_codec_step(codec)
    assert time.perf_counter() - started < 2  # no build wait
    step = faster.result(timeout=300)
    assert step.kind == "onnxruntime"
    assert list(cache_dir.glob("codec-*.onnx")) and not list(cache_dir.glob("*.tmp"))
    codes = random_codes(codec, 2, 8)
    assert (step(codes, codec.init_state(2)) - codec.decode(codes)).abs().max() <= 1e-4

    ort._sessions.clear()  # a new process: the export is on disk, so the fast decoder comes at once
    again = auto.faster_codec_step(codec)
    assert again.done() and again.result().kind == "onnxruntime"


def test_corrupted_cache_file_is_rebuilt(codec, cache_dir, step):
    path = ort_codec.onnx_path(codec)
    path.parent.mkdir(parents=True)
    path.write_bytes(b"not an onnx file")
    ort._sessions.pop(path, None)
    with pytest.warns(UserWarning, match="does not load"):
        faster = auto.faster_codec_step(codec)
    assert faster.result(timeout=300) is not None and path.stat().st_size > 1000


def test_failed_build_warns_and_resolves_to_none(codec, cache_dir, monkeypatch):
    def broken(module, path, runner, *more):
        raise RuntimeError("no exporter here")

    monkeypatch.setattr(ort, "export_in_background_process", broken)
    with pytest.warns(UserWarning, match="staying on the torch decoder"):
        assert auto.faster_codec_step(codec).result(timeout=60) is None


def test_kill_switch_and_gpu_mean_no_onnxruntime(codec, cache_dir, monkeypatch):
    assert auto.faster_codec_step(codec, "cuda").result(timeout=0) is None
    monkeypatch.setenv("TTS_NO_ORT", "1")
    assert auto.faster_codec_step(codec).result(timeout=0) is None
    assert not cache_dir.exists()


def speak(engine, text, seed):
    from tts.api import synthesize

    return synthesize(text, engine=engine, seed=seed)


def test_engine_with_onnxruntime_decoder_speaks_as_with_torch(codec, step):
    """Same seed, same tokens: the audio through ONNX Runtime equals the torch decoder's within 1e-4, also
    when the decoder is swapped in while streams are speaking."""
    from testkit import tiny_random

    text = "The same words, spoken once with each decoder, and once more while the decoder changes."
    reference = tiny_random(max_streams=2)
    want = [speak(reference, text, seed) for seed in (11, 12)]
    reference.close()

    engine = tiny_random(max_streams=2)
    assert all(torch.equal(a, b) for a, b in zip(codec.state_dict().values(), engine.codec.state_dict().values()))
    engine.set_codec_step(step)
    got = speak(engine, text, 11)
    assert len(got) == len(want[0]) and np.abs(got - want[0]).max() <= 1e-4

    engine.set_codec_step(None)  # back to torch, then ONNX Runtime again mid-stream
    results = {}
    speaker = threading.Thread(target=lambda: results.update(audio=speak(engine, text, 12)))
    speaker.start()
    time.sleep(0.2)
    engine.set_codec_step(step)
    speaker.join(timeout=60)
    engine.close()
    assert len(results["audio"]) == len(want[1]) and np.abs(results["audio"] - want[1]).max() <= 1e-4
