#!/usr/bin/env bash
# GPU latency in one command, for a machine with a CUDA GPU and no internet (weights are
# random, built from the published configs; nothing is downloaded). Full-size SDXL UNet
# and full-depth Flux.1-dev transformer, bf16, 1024x1024, batch 1, ratio 0.5: unpatched,
# ToMA, tomesd (SDXL only; a UNet method) and the ideal, interleaved. Sized to finish in
# under 5 minutes on one H200 (Flux needs ~75 GB of GPU memory while it is built).
#
#   benchmarks/gpu.sh                  # results in bench-results/gpu/*.json|png
#   OUT=/tmp/gpu REPEATS=20 benchmarks/gpu.sh
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench-results/gpu}
REPEATS=${REPEATS:-10}
STEPS=${STEPS:-4}
python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'gpu.sh needs a CUDA GPU (torch.cuda.is_available() is False)')"
common=(--device cuda --dtype bfloat16 --resolution 1024 --batch 1 --ratios 0.5
        --steps "$STEPS" --repeats "$REPEATS" --warmup 2 --out "$OUT" --no-progress)
# SDXL: both attention levels (64x64 and 32x32 tokens), self-attention, then also the MLPs
toma bench --arch sdxl --methods none,toma,tomesd,ideal --levels 2 --name sdxl_levels2_gpu "${common[@]}" "$@"
toma bench --arch sdxl --methods none,toma,tomesd,ideal --levels 2 --merge-mlp --name sdxl_levels2_mlp_gpu "${common[@]}" "$@"
# Flux.1-dev at full depth (19 double + 38 single blocks; the first 5 of each unmerged)
toma bench --arch flux --methods none,toma,ideal --name flux_gpu "${common[@]}" "$@"
