#!/usr/bin/env bash
# One forward of the full-size SDXL-architecture UNet at 1024x1024 on the CPU (random
# weights, fp32, batch 1): unpatched, ToMA, tomesd and the ideal at ratio 0.5, timed
# side by side (interleaved, medians of REPEATS samples after a warm-up).
#
#   benchmarks/sdxl_unet_cpu.sh            # levels 1 and 2, about 30 minutes on 2 cores
#   LEVELS=1 REPEATS=5 benchmarks/sdxl_unet_cpu.sh
#
# LEVELS=1 merges the 64x64-token level only (tomesd max_downsample=2, its setting for
# SDXL); LEVELS=2 adds the 32x32-token level (tomesd max_downsample=4, same placement).
# Extra arguments go to every `toma bench` call (e.g. --threads 2).
set -euo pipefail
OUT=${OUT:-bench-results}
REPEATS=${REPEATS:-3}
for levels in ${LEVELS:-1 2}; do
  toma bench --arch sdxl --resolution 1024 --dtype float32 --device cpu --batch 1 \
    --ratios 0.5 --methods none,toma,tomesd,ideal --levels "$levels" \
    --repeats "$REPEATS" --warmup 1 --out "$OUT" --name "sdxl_1024_levels${levels}_cpu" "$@"
done
