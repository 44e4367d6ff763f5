#!/usr/bin/env bash
# The whole GPU part of the recipe: codec, then AR model, into /root/runs. Run detached so it outlives
# one device call:   CODEC_MIN=7 AR_MIN=11 setsid nohup bash training/gpu_pipeline.sh > /root/runs.log 2>&1 &
set -euo pipefail
export PYTHONPATH=/tmp/site:${PWD} PYTHONUNBUFFERED=1
CORPUS=${CORPUS:-/root/corpus}
mkdir -p /root/runs
python3 -m training.train_codec --corpus "$CORPUS" --minutes "${CODEC_MIN:-7}" --out /root/runs/codec --workers 16
python3 -m training.train_ar --corpus "$CORPUS" --codec /root/runs/codec --minutes "${AR_MIN:-11}" \
    --frames-per-batch "${AR_BATCH:-40000}" --out /root/runs/ar --workers 16
echo PIPELINE_DONE
