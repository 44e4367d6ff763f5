#!/usr/bin/env bash
# Round 2 (NOTES.md): the brief's tiny command twice each way, alternating, then the shipped engine once each way.
set -u
HERE=bench/results/agent_host_cpu
BASE=29df7bd
before() { git checkout "$BASE" -- streaming tts/model.py && "$HERE/run_ab.sh" "$@"; git checkout HEAD -- streaming tts/model.py; }
after() { "$HERE/run_ab.sh" "$@"; }
TINY="--tiny --clients 128 --slots 16 --minutes 0.5"
before before_tiny128c16s_2 $TINY
after after_tiny128c16s_2 $TINY
before before_tiny128c16s_3 $TINY
after after_tiny128c16s_3 $TINY
before before_shipped32c8s_1 --clients 32 --slots 8 --minutes 0.5
after after_shipped32c8s_1 --clients 32 --slots 8 --minutes 0.5
after after_tp_shipped32c8s_1 --clients 32 --slots 8 --minutes 0.5 --text-process
