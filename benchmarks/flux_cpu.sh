#!/usr/bin/env bash
# Flux.1-dev transformer at full width and reduced depth on the CPU (random weights, fp32,
# batch 1, 1024x1024): unpatched, ToMA and the ideal at ratio 0.5, interleaved.
# The full 12B model needs ~48 GB in fp32; --depth 10 builds 2 double-stream and 4
# single-stream blocks at full width and merges them under the default skip rule scaled
# to that depth (double block 1, single blocks 1-3). The output says so.
set -euo pipefail
OUT=${OUT:-bench-results}
toma bench --arch flux --depth "${DEPTH:-10}" --resolution 1024 --dtype float32 --device cpu --batch 1 \
  --ratios 0.5 --methods none,toma,ideal --repeats "${REPEATS:-3}" --warmup 1 \
  --out "$OUT" --name "flux_1024_depth${DEPTH:-10}_cpu" "$@"
