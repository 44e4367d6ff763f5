"""Issue 48 door 3: the same seed alone and beside other streams, through `tts serve` (a child process on the
shipped voices, as a user runs it), compared byte for byte. docs/protocol.md (Seeds) says where this is exact:
the eager step (`--no-compile`), which this runs; the default ONNX Runtime step is measured there, not promised."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx2 as httpx
import pytest

from bench.common import ServeProcess

TEXT = "The same seed gives the same audio, whatever else the server is doing."
OTHER = "Another client speaks at the same time, with words of its own and no seed."


@pytest.fixture(scope="module")
def eager_server():
    if not any(Path(__file__).resolve().parent.parent.joinpath("voices").glob("model*.safetensors")):
        pytest.skip("no shipped voice weights")
    with ServeProcess("--no-compile", "--max-streams", "4").wait() as server:
        yield server


async def speak(http, text: str, seed: int | None) -> bytes:
    body = {"input": text, "response_format": "pcm", **({} if seed is None else {"seed": seed})}
    response = await http.post("/v1/audio/speech", json=body)
    assert response.status_code == 200, response.text
    return response.content


def test_a_seed_gives_the_same_bytes_alone_and_beside_other_streams(eager_server):
    async def go():
        async with httpx.AsyncClient(base_url=eager_server.url, timeout=300) as http:
            alone = [await speak(http, TEXT, 42) for _ in range(2)]
            beside = await asyncio.gather(speak(http, TEXT, 42), *(speak(http, OTHER, None) for _ in range(3)))
        return alone, beside[0]

    alone, beside = asyncio.run(go())
    assert len(alone[0]) > 24_000 and alone[0] == alone[1] == beside
