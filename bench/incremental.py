"""Speak while the text is still arriving: held-out sentences sent word by word, against the same sentences
sent whole. One JSON object.

    python -m bench.incremental                     # 50 Harvard sentences at 5, 10, 20 words/s and 1.2x speech
    python -m bench.incremental --lookahead 0 1 2   # one block per lookahead ("auto" waits for sentence ends)
    python -m bench.incremental --server            # through the real server on loopback, a WebSocket client
    python -m bench.incremental --serve             # the same through `tts serve` in its own process, as a user
                                                    # runs it (the --server one shares this process's lock)
    python -m bench.incremental --seeds 3           # each sentence 3 times each way: WER per seed and pooled
    python -m bench.incremental --units             # no model: units word by word against whole sentences
    python -m bench.incremental --simulate          # no timing noise: the engine's rules on a virtual clock
    python -m bench.incremental --stretch 1         # without elastic pacing (`Slots.pace`; also --simulate)
    python -m bench.incremental --pauses            # no text timing: silence a <break> gives, per length
    python -m bench.incremental --quick             # 8 sentences, 10 words/s, no DNSMOS
    python -m bench.incremental --no-hold           # streams without the start hold (a request's hold: false)
    python -m bench.incremental --stalls --n 20     # whose stalls: the text's (replayed on an idle engine) or the CPU's
    python -m bench.incremental --timeline --n 20 --rates 10 [--server]   # where the first audio's time goes,
                                                    # stage by stage (word sent -> ... -> heard), medians
    python -m bench.incremental --burst 64 128      # N streams start at once (tiny engine): the text front end's
                                                    # cost per stream

Words go out as an LLM client sends them, each with its trailing space ("The ", "birch ", ...), word i at
i / rate seconds; the last word is followed by `end`. Per rate: ``first_audio_ms`` from the first word sent to
the first audio chunk (p50/p99); ``stalls_per_min``: underruns of a player that starts at the first chunk
and plays every chunk as it comes (a chunk later than the audio before it ran out, by more than 20 ms), per
minute of audio; ``least_margin_ms`` (p5/p50 over the sentences): per sentence, the least headroom of that
player once speaking (when it reaches a chunk's first frame less when the chunk came: `least_margin`), what tells
a lucky stall-free run from a safe one; ``demo_player``: the same for the demo's player, which (re)starts once
100 ms of audio wait
(``first_sound_ms``: when it first sounds); ``wer`` (Whisper tiny.en, `tts.asr`) and ``dnsmos`` (speechmos OVRL) of
the audio, with the
same for the sentences sent whole. Each sentence is spoken with the same seed both ways, so word by word and
whole differ only where their units or holds differ. ``1.2x`` is 1.2 times the speaking rate of the whole
sentences (words per second of their audio), the slowest text the targets promise no stall for.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import threading
import time

import numpy as np
import soxr

from bench.common import harvard, percentiles
from streaming.textstream import engine_lookahead
from tts import SAMPLE_RATE
from tts.asr import transcribe, wer

STALL_S = 0.02
DEMO_PREBUFFER_S = 0.1  # the demo's player (demo/player-worklet.js PREBUFFER)


def words_of(sentence: str) -> list[str]:
    return [word + " " for word in sentence.split()]


class TextClock:
    """When the text thread has handed a stream what the engine's first step needs: units 0..`ahead` encoded,
    so ``ahead + 1`` units (`engine_lookahead`; without speculative encoding each with `text_lookahead` units of
    right context: ``text_lookahead + ahead + 1``), or fewer, once closed by a flush or the end. Wraps the engine's
    text worker's hand-off; `since` reads the latest. The
    first chunk (2 frames) needs the steps through its 2nd frame (the delay pattern: step 8), whose unit's
    lookahead asks for a few units more (about 14), so ``engine_ms`` includes any wait for those."""

    def __init__(self, engine):
        self.needed = engine_lookahead(engine.cfg, engine.speculative)[0]
        self.units: dict = {}
        self.ready_at: float | None = None
        self._deliver, engine.text_worker.deliver = engine.text_worker.deliver, self

    def __call__(self, stream, news) -> None:
        if isinstance(news, tuple) and self.units.get(stream, 0) < self.needed:
            units, closed, ended = news[:3]
            self.units[stream] = self.units.get(stream, 0) + len(units)
            if self.units[stream] >= self.needed or (closed or ended) and self.units[stream]:
                self.units[stream], self.ready_at = self.needed, time.perf_counter()
        self._deliver(stream, news)

    def since(self, started: float) -> float | None:
        """Seconds from ``started`` to the last stream's text being ready (None: no clock reading since)."""
        ready, self.ready_at = self.ready_at, None
        return None if ready is None else ready - started


def speak_engine(
    engine, sentence: str, rate: float | None, lookahead, seed: int, clock: TextClock | None = None, hold: bool = True
):
    """Audio of ``sentence`` pushed word by word at ``rate`` words/s (None: whole), (seconds since the first
    word, samples) per chunk, and the seconds until the engine had its first step's units (with a clock).
    ``hold=False``: without the start hold (a request's ``hold: false``)."""
    stream = engine.open(seed=seed, lookahead_words=lookahead)
    if not hold:
        stream.text.hold_off()
    pieces = words_of(sentence) if rate else [sentence]
    started = time.perf_counter()

    def feed():
        for i, piece in enumerate(pieces):
            delay = started + (i / rate if rate else 0) - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            stream.push_text(piece)
        stream.end()

    feeder = threading.Thread(target=feed, daemon=True)
    feeder.start()
    chunks, arrivals = [], []
    while (chunk := stream.read(timeout=60)) is not None:
        arrivals.append((time.perf_counter() - started, len(chunk)))
        chunks.append(chunk)
    feeder.join()
    return np.concatenate(chunks), arrivals, clock and clock.since(started)


def speak_server(
    url: str,
    sentence: str,
    rate: float | None,
    clock: TextClock | None = None,
    starts: list | None = None,
    seed: int | None = None,
):
    """The same through the WebSocket protocol with the project's client (default lookahead); ``starts`` gets
    when the first word was sent (perf_counter), the moment the chunks' times count from."""
    from tts.client import connect

    async def pieces():
        for i, piece in enumerate(words_of(sentence) if rate else [sentence]):
            delay = started + (i / rate if rate else 0) - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            yield piece

    async def run():
        chunks, arrivals = [], []
        async with connect(url) as client:
            nonlocal started
            started = time.perf_counter()
            if starts is not None:
                starts.append(started)
            async for chunk in client.speak(pieces(), seed=seed):
                arrivals.append((time.perf_counter() - started, len(chunk)))
                chunks.append(chunk)
        return np.concatenate(chunks), arrivals

    started = time.perf_counter()
    audio, arrivals = asyncio.run(run())
    return audio, arrivals, clock and clock.since(started)


def play(arrivals: list, prebuffer_s: float = 0.0) -> tuple[float, int, float]:
    """A player fed these (seconds, samples) chunks: (when it first sounds, underruns, seconds of silence they
    add). It starts, and after running dry restarts, once ``prebuffer_s`` of audio wait or the last chunk came;
    it ran dry when a chunk comes more than STALL_S after the audio before it ran out. prebuffer_s 0 starts at
    the first chunk; 0.1 is the demo's AudioWorklet (`demo/player-worklet.js`: PREBUFFER, 100 ms)."""
    first, count, silent, play_end, queued, dry_at = None, 0, 0.0, None, 0.0, None
    for k, (at, samples) in enumerate(arrivals):
        seconds = samples / SAMPLE_RATE
        if play_end is not None and at > play_end + STALL_S:
            count, dry_at, play_end, queued = count + 1, play_end, None, 0.0
        if play_end is not None:
            play_end = max(play_end, at) + seconds
            continue
        queued += seconds
        if queued >= prebuffer_s - 1e-9 or k == len(arrivals) - 1:
            first = at if first is None else first
            silent, dry_at, play_end = silent + (at - dry_at if dry_at is not None else 0.0), None, at + queued
    return first, count, silent


def stalls(arrivals: list) -> tuple[int, float]:
    """Underruns of a player that starts at the first chunk: (count, seconds of silence they add)."""
    return play(arrivals)[1:]


def stalled_chunks(arrivals: list) -> list[tuple[int, float, float]]:
    """Where a player that starts at the first chunk ran dry (`stalls`): (chunk index, seconds since the first
    word when the chunk came, seconds of silence before it) per stall. Example, chunks of 80 / 80 ms coming at
    0.10 / 0.21 s: the player runs dry at 0.18, the 2nd chunk is 30 ms late -> [(1, 0.21, 0.03)]."""
    out, play_end = [], None
    for k, (at, samples) in enumerate(arrivals):
        if play_end is not None and at > play_end + STALL_S:
            out.append((k, at, at - play_end))
        play_end = max(at, play_end or at) + samples / SAMPLE_RATE
    return out


def least_margin(arrivals: list) -> float | None:
    """Seconds of headroom a player that starts at the first chunk had once speaking: the least, over every later
    chunk, of (when it reaches the chunk's first frame - when the chunk came); negative: that late (a stall once
    below -STALL_S), and the player restarts when it comes. None for a single chunk. What tells a lucky stall-free
    run from a safe one. Example, chunks of 40 / 80 / 160 ms coming at 0.10 / 0.13 / 0.25 s: the player reaches
    the 2nd chunk at 0.14 (margin 10 ms) and the 3rd at 0.22, 30 ms before it comes: -0.03."""
    least, play_end = None, None
    for at, samples in arrivals:
        if play_end is not None:
            least = play_end - at if least is None else min(least, play_end - at)
        play_end = max(at, play_end or at) + samples / SAMPLE_RATE
    return least


def margin_percentiles(runs: list) -> dict:
    """p5 and p50 in ms of `least_margin` over the streams of ``runs`` (each a list of chunk arrivals) that had
    more than one chunk."""
    margins = [1000 * m for m in map(least_margin, runs) if m is not None]
    return {"p5": round(float(np.percentile(margins, 5)), 1), "p50": round(float(np.percentile(margins, 50)), 1)}


def dnsmos(audio: np.ndarray) -> float:
    from speechmos import dnsmos as model

    audio16 = soxr.resample(audio.astype(np.float32), SAMPLE_RATE, 16_000)
    return float(model.run(np.clip(audio16 / max(np.abs(audio16).max(), 1e-6), -1, 1), 16_000)["ovrl_mos"])


class Scorer:
    """WER and DNSMOS per clip; a clip equal to one already scored reuses its scores."""

    def __init__(self, with_dnsmos: bool):
        self.with_dnsmos, self.seen = with_dnsmos, []

    def __call__(self, sentence: str, audio: np.ndarray) -> tuple[float, float | None]:
        for text, clip, scores in self.seen:
            if text == sentence and len(clip) == len(audio) and np.allclose(clip, audio, atol=1e-4):
                return scores
        scores = (wer(sentence, transcribe(audio, SAMPLE_RATE)), dnsmos(audio) if self.with_dnsmos else None)
        self.seen.append((sentence, audio, scores))
        return scores


SEED_STRIDE = 1000  # --seeds: sentence k's j-th take is seeded k + j * SEED_STRIDE (j = 0: the one-seed run's)


def measure(speak, sentences: list[str], rates: list, lookaheads: list, score: Scorer, seeds: int = 1) -> dict:
    """Whole sentences once (the lookahead does not matter when all the text is there), then each lookahead
    at each rate; each sentence ``seeds`` times, with the same seeds both ways (`SEED_STRIDE`). Why more than
    one: a sentence's WER depends on its sampled audio, so a run's WER carries its seeds' luck;
    ``wer_by_seed`` shows how much, the pooled ``wer`` averages it out.
    Example, 2 sentences, seeds 2: takes (s0, 0), (s1, 1), (s0, 1000), (s1, 1001)."""
    takes = [(s, k + j * SEED_STRIDE) for j in range(seeds) for k, s in enumerate(sentences)]
    texts = [s for s, _ in takes]
    whole = [speak(s, None, None, seed) for s, seed in takes]
    whole_scores = [score(s, audio) for s, (audio, *_) in zip(texts, whole)]
    speech_rate = sum(len(s.split()) for s in texts) / sum(len(a) / SAMPLE_RATE for a, *_ in whole)
    report = {
        "sentences": len(sentences),
        "seeds": seeds,
        "speaking_rate_wps": round(speech_rate, 2),
        "whole": summary([a for a, *_ in whole], whole_scores, whole, seeds),
    }
    for lookahead in lookaheads:
        block = report.setdefault(f"lookahead_{'default' if lookahead is None else lookahead}", {})
        for rate in rates:
            wps = 1.2 * speech_rate if rate == "1.2x" else float(rate)
            runs = [speak(s, wps, lookahead, seed) for s, seed in takes]
            scores = [score(s, audio) for s, (audio, *_) in zip(texts, runs)]
            block[str(rate)] = {"words_per_s": round(wps, 2), **summary([a for a, *_ in runs], scores, runs, seeds)}
            print(f"lookahead {lookahead}, {rate}: {block[str(rate)]}", file=sys.stderr, flush=True)
    return report


def summary(audios: list, scores: list, runs: list | None, seeds: int = 1) -> dict:
    """WER (and per seed, ``seeds`` > 1: the scores are seed after seed, `measure`), DNSMOS, and of the runs: first
    audio after the first word, split (with a text clock) into ``text_ready_ms`` (the engine has its first
    step's units: `TextClock`) and ``engine_ms`` (from then to the first chunk: prefill, the steps of the first
    frames through the delay pattern, codec); stalls."""
    out = {"wer": round(float(np.mean([w for w, _ in scores])), 4)}
    if seeds > 1:
        per_seed = np.array([w for w, _ in scores]).reshape(seeds, -1)  # (seeds, sentences)
        out["wer_by_seed"] = [round(float(w), 4) for w in per_seed.mean(1)]
    if scores[0][1] is not None:
        out["dnsmos"] = round(float(np.mean([d for _, d in scores])), 3)
    if runs:
        minutes = sum(len(a) for a in audios) / SAMPLE_RATE / 60
        counted = [stalls(arrivals) for _, arrivals, _ in runs]
        out["first_audio_ms"] = percentiles([arrivals[0][0] * 1000 for _, arrivals, _ in runs])
        if all(ready is not None for *_, ready in runs):
            out["text_ready_ms"] = percentiles([ready * 1000 for *_, ready in runs])
            out["engine_ms"] = percentiles([(arrivals[0][0] - ready) * 1000 for _, arrivals, ready in runs])
        out["stalls_per_min"] = round(sum(c for c, _ in counted) / minutes, 2)
        out["least_margin_ms"] = margin_percentiles([arrivals for _, arrivals, _ in runs])
        out["stall_seconds"] = round(sum(s for _, s in counted), 3)
        out["stalls"] = [
            {"take": i, "chunk": k, "at_ms": round(at * 1000, 1), "silent_ms": round(gap * 1000, 1)}
            for i, (_, arrivals, _) in enumerate(runs)
            for k, at, gap in stalled_chunks(arrivals)
        ]
        demo = [play(arrivals, DEMO_PREBUFFER_S) for _, arrivals, _ in runs]
        out["demo_player"] = {
            "first_sound_ms": percentiles([first * 1000 for first, _, _ in demo]),
            "stalls_per_min": round(sum(c for _, c, _ in demo) / minutes, 2),
        }
    return out


def serve_report(sentences: list[str], rates: list, with_dnsmos: bool, seeds: int = 1) -> dict:
    """`measure` through `tts serve` in a child process with its default flags, as a user runs it (and as issue 29
    measured it): the server's interpreter lock is not this process's. Counted once its fastest step is swapped in
    and it spoke one sentence. No text clock (the server's marks are in its own process): first audio after the
    first word, stalls, WER and DNSMOS."""
    from bench.common import ServeProcess

    with ServeProcess() as server:
        server.wait()
        swapped = server.wait_for_log("step in use:", 300)
        speak_server(server.ws_url, sentences[0], 10)  # warm-up, not counted
        report = {
            "sentences": "harvard",
            "path": "tts serve (child process)",
            "step_swapped_in": swapped,
            "load_avg_1min_start": round(os.getloadavg()[0], 2),
        }
        report.update(
            measure(
                lambda s, r, _, k: speak_server(server.ws_url, s, r, seed=k),
                sentences,
                rates,
                [None],
                Scorer(with_dnsmos),
                seeds,
            )
        )
        engine = server.health()["engine"]  # parks, restores and tick times over the run
        report["server_engine"] = {
            k: engine[k]
            for k in (
                "parks",
                "restores",
                "tick_ms",
                "step_ms",
                "codec_ms",
                "slowest_ticks_ms",
                "step_kind",
                "start_latency_ms",
                "units_spoken_speculative",
                "confirmed_units",
            )
        }
        report["server_tracebacks"] = server.tracebacks()
    return report


def units_report(sentences: list[str], lookaheads: list, rates: list[float]) -> dict:
    """Without the model: units taken word by word against the whole sentence's, the cost of a take, and
    ``text_ready_ms``: when (after the first word, at each rate) the units the engine needs for its first
    step are there (the first step reads `ahead` units past the first, encoded speculatively: ahead + 1 units,
    `engine_lookahead`)."""
    from rapidfuzz.distance import Levenshtein

    from streaming.textstream import TextStream
    from tts.model import MODEL_PRESETS
    from tts.text import SYMBOLS, text_to_sentences

    cfg = MODEL_PRESETS["shipped"]
    needed = engine_lookahead(cfg)[0]
    report = {"units_for_first_step": needed}
    for lookahead in lookaheads:
        same = edits = total = takes = 0
        ready_at = []  # words that had arrived when the first step's units were there
        started = time.perf_counter()
        for sentence in sentences:
            stream, ids, ready = TextStream(lookahead_words=lookahead), [], None
            for k, piece in enumerate(words_of(sentence)):
                stream.push(piece)
                ids += stream.take()[0]
                takes += 1
                ready = k if ready is None and len(ids) >= needed else ready
            stream.end()
            ids += stream.take()[0]
            ready_at.append(len(words_of(sentence)) - 1 if ready is None else ready)
            got = "".join(SYMBOLS[i] for i in ids)
            whole = "".join(u for s in text_to_sentences(sentence) for u in s)
            same, edits, total = same + (got == whole), edits + Levenshtein.distance(got, whole), total + len(whole)
        report[str(lookahead)] = {
            "identical_sentences": same,
            "sentences": len(sentences),
            "unit_edit_rate": round(edits / total, 5),
            "take_ms": round(1000 * (time.perf_counter() - started) / takes, 3),
            "text_ready_ms": {str(r): percentiles([1000 * k / r for k in ready_at]) for r in rates},
        }
    return report


def burst_report(counts: list[int], sentences: int, shipped: bool) -> dict:
    """N streams opened in the same instant on an engine of N slots, each given ``sentences`` Harvard
    sentences at once and ended (as `bench.latency`'s GPU table starts its loads), each read to its end by a
    thread of its own. Per stream, from its start: ``first_units_ms``, when the text thread hands the engine
    its first units (`Stream.take_text` returned some), and ``first_audio_ms``, its first chunk; p50/p99/max;
    and the CPU time of the text threads per stream (the figure least moved by other load on the machine).
    The tiny random engine by default: the AR step costs little, so what shows is the text front end's cost per
    stream and how the text thread shares the interpreter with the engine's."""
    text = " ".join(harvard(sentences))
    report = {
        "engine": "shipped" if shipped else "tiny_random",
        "sentences": sentences,
        "chars": len(text),
        "cpu_cores": os.cpu_count(),
        "loads": [],
    }
    for n in counts:
        engine = _burst_engine(n, shipped)
        speak_engine(engine, text, None, None, 0)  # warm-up: the step, the phonemiser, the word cache
        first_units: dict = {}
        deliver = engine.text_worker.deliver

        def timed(stream, news):
            if isinstance(news, tuple) and news[0] and stream not in first_units:
                first_units[stream] = time.perf_counter()
            deliver(stream, news)

        engine.text_worker.deliver = timed
        starts, first_audio, streams = [0.0] * n, [0.0] * n, [None] * n
        gate = threading.Barrier(n)

        def run(i):
            gate.wait()
            starts[i] = time.perf_counter()
            streams[i] = stream = engine.open(wait_s=10)  # unseeded, as bench.latency's streams
            stream.push_text(text)
            stream.end()
            while stream.read(timeout=120) is not None:
                first_audio[i] = first_audio[i] or time.perf_counter()

        load = os.getloadavg()[0]
        text_threads = [t for t in threading.enumerate() if t.name.startswith("tts-text")]
        text_cpu = _cpu_seconds(text_threads)
        threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        text_cpu = _cpu_seconds(text_threads) - text_cpu
        units_ms = [1000 * (first_units[s] - t0) for s, t0 in zip(streams, starts)]
        audio_ms = [1000 * (t1 - t0) for t0, t1 in zip(starts, first_audio)]
        row = {
            "streams": n,
            "load_avg_1min": round(load, 2),
            "text_threads": len(text_threads),
            "text_thread_cpu_ms_per_stream": round(1000 * text_cpu / n, 3),
            "first_units_ms": {**percentiles(units_ms), "max": round(max(units_ms), 3)},
            "first_audio_ms": {**percentiles(audio_ms), "max": round(max(audio_ms), 3)},
        }
        print(json.dumps(row), file=sys.stderr, flush=True)
        report["loads"].append(row)
        engine.close()
    return report


def _cpu_seconds(threads: list[threading.Thread]) -> float:
    """CPU seconds (user + system) these threads of this process have used (Linux; 0 elsewhere): what the
    text threads cost whatever else loads the machine."""
    total = 0.0
    for thread in threads:
        try:
            fields = open(f"/proc/self/task/{thread.native_id}/stat").read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime
        except (OSError, IndexError, ValueError):
            pass
    return total


def _burst_engine(n: int, shipped: bool):
    if not shipped:
        from testkit import tiny_random

        return tiny_random(max_streams=n)
    import kernels
    from streaming.engine import Engine
    from tts.voices import load_shipped

    model, codec, presets = load_shipped()
    return Engine(model, codec, presets, max_streams=n, step_factory=kernels.default_step_factory("cpu", True))


def simulate_report(
    sentences: list[str], rates: list, hold: bool = True, speculative: bool = True, stretch: float | None = None
) -> dict:
    """Without timing noise: the text front end driven on a virtual clock (word i at i / rate, `end` after the
    last) and the engine's rules for when it may step, each unit's frames from the shipped model's durations
    (default voice), fixed costs for the work (SIM_COSTS_S: a first prefill, an AR step, a codec call; about
    the idle slower 2-core machine) and a player that starts at the first chunk. Per rate: first audio and
    stalls as the timed run reports them, and ``stall_free_start_ms``: the earliest start of the player that
    never runs dry. Rules: units are encoded as they arrive (``speculative``, `Engine._prefill`; else once
    ``text_lookahead`` more arrived, all once the text ended), a step at unit p needs units to p + ahead encoded
    (`Slots.plan`), each unit's frames are its final ones (a speculative unit's may differ a little) at elastic pacing's
    factor (`Slots.pace`, up to ``stretch``; 1: none), frame f completes at step f + K - 1, chunks
    go out by the engine's schedule (`Slots.choose_schedules`: INCREMENTAL_CHUNKS for text in pieces that the
    start hold let go at once). On the idle machine (last session, 20 sentences, this front end then) it gave
    5 / 10 / 20 words/s and 1.2x: 460 / 260 / 160 / 587 ms p50 and 34.6 / 8.4 / 0 / 44.2 stalls a minute,
    against 451 / 254 / 145 / 581 ms and 37.0 / 9.6 / 0 / 44.2 measured."""
    from streaming.slots import CHUNK_SCHEDULE, INCREMENTAL_CHUNKS, PACE_STRETCH
    from streaming.textstream import TextStream
    from tts.voices import load_shipped

    stretch = PACE_STRETCH if stretch is None else stretch
    model, _, presets = load_shipped()
    cfg, frames = model.cfg, _durations(model, presets)
    clock = [0.0]

    class Virtual(TextStream):
        clock = staticmethod(lambda: clock[0])

    def chunks(sentence, rate):
        text, units, arrived = Virtual(hold_start=cfg if hold else False), [], []  # (seconds, units so far, ended)
        text.set_engine_lookahead(*engine_lookahead(cfg, speculative), stretch)
        text.start_latency_s = sim_start_latency(cfg)  # what the engine measures (`StartLatency`)
        for i, piece in enumerate(words_of(sentence)):
            clock[0] = i / rate
            text.push(piece)
            units += text.take()[0]
            arrived.append((clock[0], len(units), False))
            if (at := text.release_at()) is not None:  # the text thread takes again then (`TextWorker`)
                clock[0] = at
                units += text.take()[0]
                arrived.append((clock[0], len(units), False))
        text.end()
        units += text.take()[0]
        arrived.append((clock[0], len(units), True))
        schedule = INCREMENTAL_CHUNKS if text.released_at_once else CHUNK_SCHEDULE
        return _simulated_chunks(arrived, frames(units), cfg, schedule, speculative, stretch)

    whole = [chunks(s, 1e9) for s in sentences]
    speech_rate = sum(len(s.split()) for s in sentences) / sum(n for c in whole for _, n in c) * SAMPLE_RATE
    report = {"speaking_rate_wps": round(speech_rate, 2)}
    for rate in rates:
        wps = 1.2 * speech_rate if rate == "1.2x" else float(rate)
        runs = [chunks(s, wps) for s in sentences]
        minutes = sum(n for c in runs for _, n in c) / SAMPLE_RATE / 60
        start = [
            max(at - played for (at, _), played in zip(c, np.cumsum([0] + [n for _, n in c[:-1]]) / SAMPLE_RATE))
            for c in runs
        ]
        report[str(rate)] = {
            "words_per_s": round(wps, 2),
            "first_audio_ms": percentiles([c[0][0] * 1000 for c in runs]),
            "stalls_per_min": round(sum(stalls(c)[0] for c in runs) / minutes, 2),
            "least_margin_ms": margin_percentiles(runs),
            "stall_free_start_ms": percentiles([1000 * t for t in start]),
        }
        demo = [play(c, DEMO_PREBUFFER_S) for c in runs]
        report[str(rate)]["demo_player"] = {
            "first_sound_ms": percentiles([first * 1000 for first, _, _ in demo]),
            "stalls_per_min": round(sum(n for _, n, _ in demo) / minutes, 2),
        }
    return report


SIM_COSTS_S = (0.02, 0.006, 0.008)  # a first prefill, an AR step, a codec call


def sim_start_latency(cfg) -> float:
    """The simulated engine's start latency (what `StartLatency` measures on a real one: held starts, whose first
    chunk is CHUNK_SCHEDULE's): the first prefill's tick, the steps to the first chunk's last frame completed, a
    codec call. Example, the shipped shapes (8 codebooks) and chunks (4, ...): 0.02 + (4 + 7) * 0.006 + 0.008 =
    0.094 s."""
    from streaming.slots import CHUNK_SCHEDULE

    first_cost, step_cost, codec_cost = SIM_COSTS_S
    return first_cost + (CHUNK_SCHEDULE[0] + cfg.codebooks - 1) * step_cost + codec_cost


def _durations(model, presets):
    """units -> frames of each before rounding (the model's durations, default voice, speed 1; `predicted_frames`
    rounds them): what `_simulated_chunks` needs."""
    import torch

    from tts.alignment import unrounded_frames
    from tts.voices import blend_preset

    preset = blend_preset(next(n for n, p in presets.items() if p.get("default")), presets, 0.7)
    weights = torch.zeros(1, model.cfg.voices)
    for row, weight in preset["mix"].items():
        weights[0, row] = weight

    def frames(units: list[int]) -> list[float]:
        with torch.no_grad():
            log_durations = model.text(torch.tensor([units]), weights)[1][0]
        return unrounded_frames(log_durations, preset["pace"]).tolist()

    return frames


def stalls_report(engine, sentences: list[str], rates: list, hold: bool = True) -> dict:
    """Whose stalls: each timed run's units, as and when the text thread handed them on, replayed on the
    simulated idle engine (`_simulated_chunks`, SIM_COSTS_S). A stall that happens there too is the text's (it
    came too late for a player that started at the first chunk: the start hold's or the text's own share); one
    that does not is the engine's (its CPU: load, a slow tick). Per rate: ``stalls_per_min`` as the timed run
    counts them, ``text_stalls_per_min`` (at most the real count, per run), ``engine_stalls_per_min``."""
    from streaming.slots import CHUNK_SCHEDULE, INCREMENTAL_CHUNKS

    frames = _durations(engine.model, engine.voices)
    whole = [speak_engine(engine, s, None, None, k)[0] for k, s in enumerate(sentences)]
    speech_rate = sum(len(s.split()) for s in sentences) / sum(len(a) / SAMPLE_RATE for a in whole)
    handed: list = []  # (seconds, units so far, ended, unit ids) of the run under way
    at_once = [False]  # the run's stream outran its start hold (`TextStream.released_at_once`)
    deliver = engine.text_worker.deliver

    def spy(stream, news):
        if isinstance(news, tuple):
            at_once[0] = stream.text.released_at_once
            total = (handed[-1][1] if handed else 0) + len(news[0])
            handed.append((time.perf_counter(), total, bool(news[2]), list(news[0])))
        deliver(stream, news)

    engine.text_worker.deliver = spy
    report = {}
    try:
        for rate in rates:
            wps = 1.2 * speech_rate if rate == "1.2x" else float(rate)
            real = text = minutes = 0.0
            for k, sentence in enumerate(sentences):
                handed.clear()
                started = time.perf_counter()
                audio, arrivals, _ = speak_engine(engine, sentence, wps, None, k, hold=hold)
                units = [u for *_, ids in handed for u in ids]
                replay = [(at - started, n, ended) for at, n, ended, _ in handed]
                replay[-1] = (*replay[-1][:2], True)
                schedule = INCREMENTAL_CHUNKS if at_once[0] else CHUNK_SCHEDULE
                simulated = _simulated_chunks(
                    replay, frames(units), engine.model.cfg, schedule, engine.speculative, engine.slots.stretch_max
                )
                count = stalls(arrivals)[0]
                real, text = real + count, text + min(count, stalls(simulated)[0])
                minutes += len(audio) / SAMPLE_RATE / 60
            report[str(rate)] = {
                "words_per_s": round(wps, 2),
                "stalls_per_min": round(real / minutes, 2),
                "text_stalls_per_min": round(text / minutes, 2),
                "engine_stalls_per_min": round((real - text) / minutes, 2),
            }
            print(f"{rate}: {report[str(rate)]}", file=sys.stderr, flush=True)
    finally:
        engine.text_worker.deliver = deliver
    return report


def _simulated_chunks(
    arrived: list, raw: list[float], cfg, schedule: tuple, speculative: bool = True, stretch: float = 1.0
) -> list:
    """(seconds, samples) of each chunk, given when units arrived (seconds, units so far, ended) and each unit's
    frames before rounding (``raw``, `_durations`). Elastic pacing (`Slots.pace`, up to ``stretch``): each
    tick's text (the arrivals before its step) gives the units encoded and not yet started or confirmed their
    frames at the factor of then, from the lead of the units received over the aligned unit of the last step,
    while the text is open and came in more than one piece (the factor kept while it came in one)."""
    from streaming.slots import pace_factor

    first_cost, step_cost, codec_cost = SIM_COSTS_S
    raw, total, books, look = np.asarray(raw, dtype=float), len(raw), cfg.codebooks, cfg.text_lookahead
    durations = np.zeros(total, dtype=np.int64)
    state = {"k": -1, "confirmed": 0, "encoded": 0, "factor": stretch, "ended": False}

    def prefill(step: int, unit: int, upto: int) -> None:  # the text of arrivals up to ``upto``, in one tick
        state["k"] = upto
        at, received, ended = arrived[upto]
        ended = state["ended"] = ended and received == total
        encoded = received if ended or speculative else max(0, received - look)
        if ended or arrived[0][0] < at:  # ended, or in pieces: the factor of now (`Slots.pace`)
            state["factor"] = 1.0 if ended else min(state["factor"], pace_factor(received - unit, stretch))
        factor = state["factor"] if arrived[0][0] < at else 1.0
        starts = np.cumsum(durations) - durations
        for u in range(state["confirmed"], encoded):
            if u >= state["encoded"] or starts[u] >= step:  # started units keep their frames
                durations[u] = round(raw[u] * factor)
        state["encoded"] = max(state["encoded"], encoded)
        state["confirmed"] = max(state["confirmed"], received if ended else received - look)

    def ready(step: int) -> tuple[bool, int]:
        encoded = state["encoded"]
        ends = np.cumsum(durations[:encoded])
        known = int(ends[-1]) if encoded else 0
        if state["ended"] and state["encoded"] == total:
            return step < known + books - 1, -1
        frame = min(step, known - 1)
        owners = [u for u in range(encoded) if ends[u] - durations[u] <= frame and durations[u] > 0]
        return bool(known and step < known and owners and owners[-1] + cfg.ahead < encoded), (owners or [0])[-1]

    steps, last, unit, step = [], None, 0, 0
    prefill(0, 0, 0)
    while True:
        base = arrived[state["k"]][0] + first_cost if last is None else last
        upto = state["k"]
        while upto + 1 < len(arrived) and arrived[upto + 1][0] <= base + step_cost:
            upto += 1  # text that came before this step could run
        if upto > state["k"]:
            prefill(step, unit, upto)
        while not (go := ready(step))[0] and state["k"] + 1 < len(arrived):
            prefill(step, unit, state["k"] + 1)
        if not go[0]:
            break
        unit = max(unit, go[1])
        at = arrived[state["k"]][0]
        last = max(at, (at + first_cost if last is None else last) + step_cost)
        steps.append(last)
        step += 1
    ends = np.cumsum(durations)
    out, begin, size, free = [], 0, iter(schedule), 0.0
    while begin < ends[-1]:
        stop = min(int(ends[-1]), begin + next(size, schedule[-1]))
        free = max(free, steps[stop - 1 + books - 1]) + codec_cost
        out.append((free, (stop - begin) * 480))
        begin = stop
    return out


class Timeline:
    """When each hand-off of a stream's start first happened, by spying on public methods (nothing in the engine
    changes): the text arriving (`TextStream.push`), read into units and the hold (`TextStream.marks`), handed to
    the engine (the text worker's hand-off), the engine's first tick with it (the stream's "prefill" mark: the
    tick that encoded its first units; `Stream.schedule` hears only of confirmed units, later with speculation), its
    first chunk due (`CodecWorker.decode`), decoded (`Stream.deliver`).
    The reader's side (a read, or bytes on the client's socket) the bench adds."""

    STAGES = ("pushed", "read", "enough", "released", "handed", "first_tick", "chunk_due", "delivered")

    def __init__(self, engine):
        self.engine, self.marks = engine, {}
        self._open, engine.open = engine.open, self._opened
        self._handed, engine.text_worker.deliver = engine.text_worker.deliver, self._hand
        self._decode, engine.codec_path.worker.decode = engine.codec_path.worker.decode, self._decoding

    def close(self) -> None:
        del self.engine.open, self.engine.codec_path.worker.decode
        self.engine.text_worker.deliver = self._handed

    def _opened(self, *args, **kwargs):
        stream = self._open(*args, **kwargs)
        marks = self.marks[stream] = {}
        push, deliver = stream.text.push, stream.deliver

        def pushed(text):
            marks.setdefault("pushed", time.perf_counter())
            push(text)

        def delivered(chunk):
            marks.setdefault("delivered", time.perf_counter())
            deliver(chunk)

        stream.text.push, stream.deliver = pushed, delivered
        return stream

    def _hand(self, stream, news) -> None:
        if isinstance(news, tuple) and news[0] and stream in self.marks:
            self.marks[stream].setdefault("handed", time.perf_counter())
        self._handed(stream, news)

    def _decoding(self, rows, streams, codes, lengths, *args, **kwargs) -> None:
        for stream in streams:
            if stream in self.marks:
                self.marks[stream].setdefault("chunk_due", time.perf_counter())
        self._decode(rows, streams, codes, lengths, *args, **kwargs)

    def row(self, started: float, heard: float) -> dict:
        """The last stream's stages in ms after ``started`` (the first word sent), and ``heard`` (the reader)."""
        stream, marks = self.marks.popitem()
        marks |= stream.text.marks
        if "prefill" in stream.marks:
            marks["first_tick"] = stream.marks["prefill"]
        return {k: round(1000 * (marks[k] - started), 2) for k in self.STAGES if k in marks} | {
            "heard": round(1000 * (heard - started), 2)
        }


def timeline_report(engine, sentences: list[str], rate: float, server_url: str | None = None) -> dict:
    """Per stage of the start (`Timeline.STAGES`, then ``heard``: read by the caller, or on the client's socket
    with ``server_url``), ms after the first word was sent at ``rate`` words/s: median and p90 over the
    sentences, and the median of each stage's increment over the one before (the breakdown). Also the words
    sent by the time the units were released, and the engine's step and tick times meanwhile."""
    timeline = Timeline(engine)
    rows, words_by_release = [], []
    engine.step_ms.clear(), engine.tick_ms.clear()
    try:
        for k, sentence in enumerate(sentences):
            started = time.perf_counter()
            if server_url:
                starts = []
                _, arrivals, _ = speak_server(server_url, sentence, rate, starts=starts)
                started = starts[0]
            else:
                _, arrivals, _ = speak_engine(engine, sentence, rate, None, k)
            rows.append(timeline.row(started, started + arrivals[0][0]))
            if "released" in rows[-1]:
                words_by_release.append(1 + int(rows[-1]["released"] / 1000 * rate + 1e-9))
    finally:
        timeline.close()
    stages = [s for s in (*Timeline.STAGES, "heard") if all(s in r for r in rows)]
    report = {
        "words_per_s": rate,
        "sentences": len(rows),
        "path": "server" if server_url else "engine",
        "ms_after_first_word": {
            s: {
                "p50": round(float(np.median([r[s] for r in rows])), 1),
                "p90": round(float(np.percentile([r[s] for r in rows], 90)), 1),
            }
            for s in stages
        },
        "step_kind": engine.step_kind,
        "load_avg_1min": round(os.getloadavg()[0], 2),
        "step_ms_p50": round(float(np.nanmedian(engine.step_ms.values())), 2),
        "tick_ms_p50": round(float(np.nanmedian(engine.tick_ms.values())), 2),
        "codec_ms_p50": round(float(np.nanmedian(engine.codec_ms.values()[:, 0])), 2),
    }
    report["breakdown_p50_ms"] = {
        f"{a}->{b}": round(float(np.median([r[b] - r[a] for r in rows])), 1) for a, b in zip(stages, stages[1:])
    }
    if words_by_release:
        report["words_sent_by_release_p50"] = float(np.median(words_by_release))
    return report


def pauses_report(engine, lengths_ms: list[int]) -> dict:
    """For <break time=...> between two words: the longest silence inside the utterance (20 ms frames
    40 dB under the peak) and the ASR's WER against the words (no babble in the pause), 3 seeds each."""
    report = {}
    words = "Take the left road and then stop."
    for ms in [0, *lengths_ms]:
        text = words.replace("road ", f'road <break time="{ms}ms"/> ') if ms else words
        gaps, wers = [], []
        for seed in range(3):
            audio, *_ = speak_engine(engine, text, None, None, seed)
            frames = audio[: len(audio) // 480 * 480].reshape(-1, 480)
            quiet = 20 * np.log10(np.sqrt((frames**2).mean(1)) + 1e-9) < 20 * np.log10(np.abs(audio).max()) - 40
            run = best = 0
            for q in quiet[5:-5]:  # inside the utterance
                run = run + 1 if q else 0
                best = max(best, run)
            gaps.append(best * 20)
            wers.append(round(wer(words, transcribe(audio, SAMPLE_RATE)), 3))
        report[str(ms)] = {"longest_silence_ms": gaps, "wer": wers}
    return report


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=50)
    parser.add_argument("--seeds", type=int, default=1, help="takes of each sentence, each way (`measure`)")
    parser.add_argument("--rates", nargs="+", default=["5", "10", "20", "1.2x"])
    parser.add_argument("--lookahead", nargs="+", default=[None], help="words; 'auto'; default: the engine's")
    parser.add_argument("--server", action="store_true", help="through the real server on loopback")
    parser.add_argument(
        "--serve", action="store_true", help="through `tts serve` in a child process (default flags), as a user runs it"
    )
    parser.add_argument("--units", action="store_true", help="no model: units word by word against whole")
    parser.add_argument("--pauses", action="store_true", help="silence a <break> gives, per length")
    parser.add_argument("--burst", type=int, nargs="+", help="N streams starting at once, per N (no model quality)")
    parser.add_argument("--sentences", type=int, default=4, help="--burst: Harvard sentences each stream speaks")
    parser.add_argument("--shipped", action="store_true", help="--burst: the shipped model, not the tiny one")
    parser.add_argument("--simulate", action="store_true", help="no timing: the engine's rules on a virtual clock")
    parser.add_argument("--no-dnsmos", action="store_true")
    parser.add_argument("--stalls", action="store_true", help="whose stalls: the text's or the engine's")
    parser.add_argument("--no-hold", action="store_true", help="no start hold (the engine path, --simulate, --stalls)")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument(
        "--no-speculative",
        action="store_true",
        help="encode units only once their right context is there (the engine before issue 29)",
    )
    parser.add_argument(
        "--stretch",
        type=float,
        help="elastic pacing's most (`Slots.pace`; 1: none; default: streaming.slots.PACE_STRETCH)",
    )
    parser.add_argument("--timeline", action="store_true", help="where the first audio's time goes, stage by stage")
    parser.add_argument(
        "--greedy",
        action="store_true",
        help="greedy decoding (no sampling's luck in the WER; the engine path, not --serve)",
    )
    args = parser.parse_args()
    lookaheads = [None if a in (None, "default") else a if a == "auto" else int(a) for a in args.lookahead]
    if args.quick:
        args.n, args.rates, args.no_dnsmos = 8, ["10"], True
    if args.burst:
        print(json.dumps(burst_report(args.burst, args.sentences, args.shipped), indent=1))
        return
    sentences = harvard(args.n)
    if args.simulate:
        print(
            json.dumps(
                simulate_report(sentences, args.rates, not args.no_hold, not args.no_speculative, args.stretch),
                indent=1,
            )
        )
        return
    if args.units:
        rates = [float(r) for r in args.rates if r != "1.2x"]
        print(
            json.dumps(
                units_report(
                    harvard(max(args.n, 200)), lookaheads if lookaheads != [None] else [0, 1, 2, "auto"], rates
                ),
                indent=1,
            )
        )
        return
    if args.serve:
        print(json.dumps(serve_report(sentences, args.rates, not args.no_dnsmos, args.seeds), indent=1))
        return
    from tts.api import get_engine

    engine = get_engine(compile=True)  # as `tts serve` runs it
    engine.speculative = not args.no_speculative
    if args.stretch is not None:
        engine.slots.stretch_max = args.stretch
    if args.greedy:
        from streaming.engine import SamplingConfig

        engine.sampling = SamplingConfig(temperature=0.0)
    if args.pauses:
        print(json.dumps(pauses_report(engine, [250, 500, 1000, 2000]), indent=1))
        return
    if args.stalls:
        speak_engine(engine, sentences[0], 10, None, 0)  # warm-up, not counted
        print(json.dumps(stalls_report(engine, sentences, args.rates, not args.no_hold), indent=1))
        return
    speak_engine(engine, sentences[0], 10, None, 0)  # warm-up, not counted
    if args.timeline:
        rates = [float(r) for r in args.rates if r != "1.2x"]
        if args.server:
            from server import ServerThread

            with ServerThread(engine) as server:
                report = [timeline_report(engine, sentences, r, server.ws_url) for r in rates]
        else:
            report = [timeline_report(engine, sentences, r) for r in rates]
        print(json.dumps(report, indent=1))
        return
    score = Scorer(not args.no_dnsmos)
    clock = TextClock(engine)
    report = {
        "sentences": "harvard",
        "path": "server" if args.server else "engine",
        "hold": not args.no_hold,
        "speculative": engine.speculative,
        "stretch": engine.slots.stretch_max,
        "greedy": args.greedy,
        "load_avg_1min_start": round(os.getloadavg()[0], 2),
    }
    if args.server:
        from server import ServerThread

        with ServerThread(engine) as server:
            report.update(
                measure(
                    lambda s, r, _, k: speak_server(server.ws_url, s, r, clock, seed=k),
                    sentences,
                    args.rates,
                    [None],
                    score,
                    args.seeds,
                )
            )
    else:
        hold = not args.no_hold
        report.update(
            measure(
                lambda s, r, lookahead, k: speak_engine(engine, s, r, lookahead, k, clock, hold),
                sentences,
                args.rates,
                lookaheads,
                score,
                args.seeds,
            )
        )
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
