#!/usr/bin/env bash
# Fine-tuning rounds on one GPU, into /root/runs:
#   1. the codec decoder, with the encoder and codebooks frozen (tokens keep their meaning), on the audio
#      packed by `training.pack --hours-per-voice` in /root/dec;
#   2. then the AR model, continued from the shipped one on the corpus's tokens (`training.tokens`) in
#      /root/tokens, once that folder holds a READY file (the tokens can still be uploading during step 1).
# One after the other, not at once: the codec's GAN keeps the GPU busy and the AR model's small steps
# queue behind it (2 AR steps a second instead of 12 in round 2). DEC_MIN=0 skips step 1.
# Run detached so it outlives one device call:
#   DEC_MIN=7 AR_MIN=16 setsid nohup bash training/gpu_finetune.sh > /root/runs.log 2>&1 &
# AR_ARGS passes more train_ar options, e.g. AR_ARGS="--deepen-every 3" (round 5: 6 -> 8 blocks).
set -euo pipefail
export PYTHONPATH=/tmp/site:${PWD} PYTHONUNBUFFERED=1
mkdir -p /root/runs
if [ "${DEC_MIN:-7}" != 0 ]; then
    python3 -m training.train_codec --corpus /root/dec --init voices --decoder-only --gan-after 0 \
        --lr "${DEC_LR:-1e-4}" --minutes "${DEC_MIN:-7}" --out /root/runs/codec --workers 8 > /root/runs/codec.log 2>&1
fi
echo CODEC_DONE
until [ -e /root/tokens/READY ]; do sleep 5; done
python3 -m training.train_ar --tokens /root/tokens --init voices --lr "${AR_LR:-5e-4}" --minutes "${AR_MIN:-16}" \
    --frames-per-batch "${AR_BATCH:-40000}" --workers 12 --out /root/runs/ar ${AR_ARGS:-} > /root/runs/ar.log 2>&1
echo PIPELINE_DONE
