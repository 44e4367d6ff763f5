#!/usr/bin/env bash
# Runs on the GPU machine, detached with setsid: codec, then AR model, into /root/runs.
#   CODEC_MIN=8 AR_MIN=9 setsid nohup bash training/gpu_pipeline.sh > /root/runs/log 2>&1 &
set -euo pipefail
export PYTHONPATH=/tmp/site:${PWD}
mkdir -p /root/runs
python3 -m training.train_codec --corpus /root/corpus --minutes "${CODEC_MIN:-8}" --out /root/runs/codec --workers 16
python3 -m training.train_ar --corpus /root/corpus --codec /root/runs/codec --minutes "${AR_MIN:-9}" \
    --out /root/runs/ar --workers 16
echo PIPELINE_DONE
