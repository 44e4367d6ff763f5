#!/usr/bin/env bash
# A spectral-decoder round on the GPU machine (docs/training.md, "The spectral decoder"): fresh lossless teacher
# speech on its 16 cores while the decoder trains on the GPU from what is spoken so far.
#   bash training/gpu_decoder.sh stash           each call: move the carried upload/ files into /root/stash
#   bash training/gpu_decoder.sh start           unpack the teachers, start speaking and training (detached)
#   bash training/gpu_decoder.sh wait SECONDS    sleep (holds the machine: it goes back 30 s after a call), then poll
#   bash training/gpu_decoder.sh finish          the checkpoint and logs into $OUT
# Carried in calls of at most ~17 MB beside the repository (made by `training/pack_teachers.sh` and
# `python -m training.piper_parts pack upload/piper`): upload/piper/part-*, upload/teachers/site312.tar.xz,
# upload/teachers/tbundle.tar.xz split as upload/tb/part-*, upload/utterances.json.xz. The decoder resumes from
# training/checkpoints/spectral (tracked). Room: the repository is ~66 MB with that checkpoint, over a call's
# 64 MiB with anything carried, so move the AR model aside for these calls (the decoder does not need it):
#   mkdir -p /tmp/aside && mv voices/model-0*.safetensors /tmp/aside/   ... calls ...   mv /tmp/aside/* voices/
# (a tracked file missing from the working tree simply does not travel: checked 2026-12-06).
# Knobs: TRAIN_MIN (18), CORPUS_MIN (20), JOE_WORKERS (9), OTHER_WORKERS (5), JOE_OFFSET (0), OTHER_OFFSET (6000).
set -euo pipefail
STASH=/root/stash
case "$1" in
stash)
    mkdir -p "$STASH"
    for dir in upload/*; do [ -d "$dir" ] && mkdir -p "$STASH/$(basename "$dir")" && cp -r "$dir"/. "$STASH/$(basename "$dir")/"; done
    for file in upload/*.xz; do [ -e "$file" ] && cp "$file" "$STASH/"; done
    find "$STASH" -type f | xargs ls -la ;;
start)
    mkdir -p /tmp/site /root/tb /root/runs
    tar xJf "$STASH/teachers/site312.tar.xz" -C /tmp/site
    cat "$STASH"/tb/part-* | tar xJf - -C /root/tb
    python3 -m training.piper_parts unpack "$STASH/piper" --site /tmp/site
    xz -dc "$STASH/utterances.json.xz" > /root/utterances.json
    export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 PATH=/root/tb/bin:$PATH LD_LIBRARY_PATH=/root/tb/lib
    common="--out /root/corpus --format flac --utterances /root/utterances.json --minutes ${CORPUS_MIN:-20}"
    setsid nohup python3 -m training.corpus $common --hours joe=40 --offset "${JOE_OFFSET:-0}" \
        --workers "${JOE_WORKERS:-9}" > /root/runs/corpus_joe.log 2>&1 < /dev/null &
    setsid nohup python3 -m training.corpus $common --hours slt=10 rms=10 kal=10 awb=10 --offset "${OTHER_OFFSET:-6000}" \
        --workers "${OTHER_WORKERS:-5}" > /root/runs/corpus_others.log 2>&1 < /dev/null &
    init=""  # resume the last round's decoder (a fresh one the first time)
    [ -e training/checkpoints/spectral/spectral_decoder.safetensors ] && init="--init training/checkpoints/spectral"
    setsid nohup python3 -m training.train_decoder --corpus /root/corpus --codec voices $init \
        --minutes "${TRAIN_MIN:-18}" --min-hours 0.5 --workers 3 --out /root/runs/spectral \
        > /root/runs/decoder.log 2>&1 < /dev/null &
    sleep 20; tail -n 5 /root/runs/*.log ;;
wait)
    sleep "${2:-500}"; tail -n 3 /root/runs/corpus_*.log; tail -n 12 /root/runs/decoder.log; nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv ;;
finish)
    cp /root/runs/spectral/spectral_decoder*.safetensors /root/runs/spectral/decoder_log.json "$OUT"/
    cp /root/runs/decoder.log "$OUT"/decoder.log
    tail -n 2 /root/runs/corpus_*.log > "$OUT"/corpus.txt
    ls -la "$OUT" ;;
esac
