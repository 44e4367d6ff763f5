"""CUDA graphs that the engine replays at the same time on two streams must not share a cuBLAS workspace
(PyTorch keys it by the stream a graph was captured on): the frame codec's graphs, replayed on the codec
stream while the next tick's graph runs, are captured on a stream of their own. GPU only (skipped elsewhere)."""

import threading

import numpy as np
import pytest
import torch

import kernels
from streaming.codec_worker import FrameCodec
from streaming.engine import Engine, SamplingConfig
from testkit import tiny_model_and_codec
from tts.api import synthesize

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@cuda
def test_the_codec_graphs_are_captured_apart_from_the_tick_graphs():
    with torch.cuda.graph(torch.cuda.CUDAGraph()):  # a graph captured the default way, as the tick graphs are
        torch.ones(1, device="cuda").add_(1)
    default = torch.cuda.graphs.graph.default_capture_stream
    _, codec, _ = tiny_model_and_codec()
    frames = FrameCodec(codec.cuda(), 4, "cuda")
    frames.prepare(4)
    assert frames.capture_stream is not None
    assert frames.capture_stream.cuda_stream != default.cuda_stream


@cuda
def test_a_gpu_engine_with_graphs_speaks_as_its_streams_do_alone():
    """Greedy streams on a GPU engine whose tick and codec graphs overlap: each as it speaks alone (within
    float rounding of the batch it is decoded in)."""
    model, codec, voices = tiny_model_and_codec()
    greedy = SamplingConfig(temperature=0.0)
    engine = Engine(
        model.cuda(),
        codec.cuda(),
        voices,
        max_streams=8,
        device="cuda",
        sampling=greedy,
        step_factory=kernels.default_step_factory("cuda"),
    )
    engine.warm_up()
    text = "The quick brown fox jumps over the lazy dog near the river bank."
    alone = synthesize(text, engine=engine, seed=1)
    results = {}
    threads = [
        threading.Thread(target=lambda i=i: results.__setitem__(i, synthesize(text, engine=engine, seed=1)))
        for i in range(8)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    engine.close()
    for i in range(8):
        np.testing.assert_allclose(results[i], alone, atol=1e-4)
