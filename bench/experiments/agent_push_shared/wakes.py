"""Count the engine threads' wake-ups of the server's event loop (`LoopWaker.wake`) and the calls they cost the
loop (`LoopWaker._run`: one per batch) while N agent clients (bench.agent's, in this process) talk to a real
server on the tiny engine (16 slots) for 20 s. One JSON line.

    TTS_HARVARD=/work/shared/eval/harvard-sentences.txt PYTHONPATH=. python bench/results/agent_push_shared/wakes.py 64
"""
import json
import sys

from bench import agent
from server import ServerThread
from streaming.stream import LoopWaker
from testkit import tiny_random


def main(n: int) -> None:
    calls = {"wakes": 0, "loop_calls": 0}
    wake, run = LoopWaker.wake, LoopWaker._run

    def counted_wake(self, future):
        calls["wakes"] += 1
        return wake(self, future)

    def counted_run(self):
        calls["loop_calls"] += 1
        return run(self)

    LoopWaker.wake, LoopWaker._run = counted_wake, counted_run
    engine, room = tiny_random(max_streams=16, max_open=4 * n), 4 * n
    with ServerThread(engine, max_connections=room, max_connections_per_client=room, max_streams_per_client=room,
                      max_queue=room) as server:
        results, _ = agent.clients(server.ws_url, list(range(n)), seconds=20.0, ahead_s=2.0, grace_s=0.0)
    engine.close()
    audio_s = sum(t["audio_s"] for per in results.values() for t in per if "error" not in t)
    print(json.dumps({"clients": n, "audio_s": round(audio_s, 1), **calls,
                      "wakes_per_loop_call": round(calls["wakes"] / max(1, calls["loop_calls"]), 2)}))


if __name__ == "__main__":
    main(int(sys.argv[1]))
