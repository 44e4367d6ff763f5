#!/usr/bin/env bash
# The A/B sequence of NOTES.md, alternating 29df7bd's engine code ("before": its streaming/ and tts/model.py
# checked out into the worktree for the run, then put back) and this branch's ("after"). Run from the worktree.
set -u
HERE=bench/results/agent_host_cpu
BASE=29df7bd
before() { git checkout "$BASE" -- streaming tts/model.py && "$HERE/run_ab.sh" "$@"; git checkout HEAD -- streaming tts/model.py; }
after() { "$HERE/run_ab.sh" "$@"; }
TINY="--tiny --clients 128 --slots 16 --minutes 0.5"
for k in ${RUNS:-1 2}; do
  before "before_tiny128c16s_$k" $TINY
  after "after_tiny128c16s_$k" $TINY
  after "after_tp_tiny128c16s_$k" $TINY --text-process
  before "before_fc_tiny128c16s_$k" $TINY --frame-codec
  after "after_fc_tiny128c16s_$k" $TINY --frame-codec
done
