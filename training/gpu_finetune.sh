#!/usr/bin/env bash
# Second-round GPU recipe, both jobs at once on one GPU, into /root/runs:
#   - the codec decoder fine-tuned with the encoder and codebooks frozen (tokens keep their meaning), on
#     the audio packed by `training.pack --hours-per-voice` in /root/dec;
#   - the AR model continued from the shipped one on the grown corpus's tokens (`training.tokens`) in /root/tokens.
# The two share the GPU badly (the codec's GAN keeps it busy and the AR model's small steps queue behind:
# 2 AR steps a second instead of 12), so the codec stops first and the AR model finishes alone.
# Run detached so it outlives one device call:
#   DEC_MIN=10 AR_MIN=16 setsid nohup bash training/gpu_finetune.sh > /root/runs.log 2>&1 &
set -euo pipefail
export PYTHONPATH=/tmp/site:${PWD} PYTHONUNBUFFERED=1
mkdir -p /root/runs
python3 -m training.train_codec --corpus /root/dec --init voices --decoder-only --gan-after 0 --lr "${DEC_LR:-2e-4}" \
    --minutes "${DEC_MIN:-10}" --out /root/runs/codec --workers 8 > /root/runs/codec.log 2>&1 &
python3 -m training.train_ar --tokens /root/tokens --init voices --lr "${AR_LR:-5e-4}" --minutes "${AR_MIN:-16}" \
    --frames-per-batch "${AR_BATCH:-40000}" --out /root/runs/ar > /root/runs/ar.log 2>&1 &
wait
echo PIPELINE_DONE
