#!/usr/bin/env bash
# SD3.5-Medium and Wan 2.1 1.3B transformers at full width and reduced depth on the CPU
# (random weights, fp32, batch 1): unpatched, ToMA and the ideal at ratio 0.5, interleaved.
# SD3.5 at 1024x1024 (4096 image tokens) with --depth 4: 6 of 24 blocks, blocks 1-5 merged
# (the default skip of 5 scaled to the depth). Wan at 832x480 with 25 frames (7 latent
# frames, 7 x 30 x 52 = 10,920 video tokens) with --depth 30: one block, merged; once with
# spatio-temporal tiles (2 x 4 x 4, the default) and once with 2-D tiles (1 x 4 x 4).
set -euo pipefail
OUT=${OUT:-bench-results}
THREADS=${THREADS:-1}
common=(--dtype float32 --device cpu --batch 1 --ratios 0.5 --threads "$THREADS" --out "$OUT")
toma bench --arch sd35 --depth "${SD3_DEPTH:-4}" --resolution 1024 --methods none,toma,ideal \
  --repeats "${REPEATS:-5}" --warmup 1 --name "sd35_1024_depth${SD3_DEPTH:-4}_cpu" "${common[@]}" "$@"
for tf in 2 1; do
  toma bench --arch wan --depth "${WAN_DEPTH:-30}" --resolution 480 --frames "${FRAMES:-25}" --tile-frames "$tf" \
    --methods none,toma,ideal --repeats "${REPEATS:-5}" --warmup 1 \
    --name "wan_480p_f${FRAMES:-25}_depth${WAN_DEPTH:-30}_tf${tf}_cpu" "${common[@]}" "$@"
done
