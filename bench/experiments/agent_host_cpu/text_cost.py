"""The text thread's cost per take: 60 Harvard sentences pushed a word at a time, a take after each word; TP=1 reads
them in a `ProcessReader`. `TTS_HARVARD=... PYTHONPATH=. [TP=1] python bench/results/agent_host_cpu/text_cost.py`"""
import time, sys, os
from bench.agent import _sentences
from streaming.textstream import TextStream
from streaming.sentence_reader import ProcessReader
from tts.text import _espeak
_espeak()
reader = ProcessReader() if os.environ.get("TP") else None
if reader: reader._ready.wait(30)
sents = _sentences()[:60]
takes = 0; words = 0
cpu0 = time.thread_time(); t0 = time.perf_counter()
for k in range(0, 60, 3):
    ts = TextStream(hold_start=True)
    if reader: ts.reader = reader
    ts.hold_off()
    for s in sents[k:k+3]:
        for w in s.split():
            ts.push(w + " "); words += 1
            ts.take(); takes += 1
        ts.flush(); ts.take(); takes += 1
    ts.end(); ts.take()
dt = time.perf_counter() - t0; cpu = time.thread_time() - cpu0
print(f"TP={bool(reader)} {takes} takes: wall {dt*1000/takes:.3f} ms, this thread's CPU {cpu*1000/takes:.3f} ms per take")
if reader: reader.close()
