"""`bench.incremental.measure`'s takes: each sentence ``seeds`` times, the same seeds word by word as whole."""

import numpy as np

from bench.incremental import SEED_STRIDE, measure
from tts import SAMPLE_RATE


def test_measure_speaks_each_sentence_with_the_same_seeds_both_ways_and_reports_wer_per_seed():
    spoken = []

    def speak(sentence, rate, lookahead, seed):
        spoken.append((rate is None, sentence, seed))
        audio = np.full(SAMPLE_RATE, seed, dtype=np.float32)  # a second of audio that says which seed it was
        return audio, [(0.1, SAMPLE_RATE // 2), (0.2, SAMPLE_RATE // 2)], None  # (audio, chunk arrivals, ready)

    def score(sentence, audio):
        return (0.1 if audio[0] < SEED_STRIDE else 0.3), None  # the second seed's takes do worse

    report = measure(speak, ["a b", "c d"], ["10"], [None], score, seeds=2)
    takes = [("a b", 0), ("c d", 1), ("a b", SEED_STRIDE), ("c d", SEED_STRIDE + 1)]
    assert spoken == [(True, *take) for take in takes] + [(False, *take) for take in takes]
    for block in (report["whole"], report["lookahead_default"]["10"]):
        assert block["wer_by_seed"] == [0.1, 0.3]
        assert block["wer"] == 0.2


def test_stalled_chunks_name_the_late_chunk_and_agree_with_the_stall_count():
    from bench.incremental import stalled_chunks, stalls

    frame = SAMPLE_RATE // 50  # 20 ms
    arrivals = [(0.10, 4 * frame), (0.21, 4 * frame), (0.25, 8 * frame)]  # 2nd: 30 ms after the 1st ran out
    late = stalled_chunks(arrivals)
    assert [(k, round(at, 3), round(gap, 3)) for k, at, gap in late] == [(1, 0.21, 0.03)]
    assert stalls(arrivals) == (1, late[0][2])
    assert stalled_chunks([(0.10, 4 * frame), (0.19, 4 * frame)]) == []  # 10 ms dry: under STALL_S
