#!/usr/bin/env bash
# ToMA stacked with step caches on the two trained built-ins (issue 26, section 3), where
# caching is real: random weights barely change between steps, so a cache's skipping there
# is not the one it has on trained weights. Per model, one toma eval (the variants timed
# interleaved, batch by batch, in one process), 20 Euler steps, one thread:
# cache-dit runs with its defaults but for the first block computing (F1B0): its first 8
# steps compute every block (warm-up).
# - none: the unmerged reference, against which PSNR, SSIM and accuracy are reported;
# - each cache alone at two thresholds: FirstBlockCache (diffusers) and DBCache (cache-dit);
# - ToMA alone at ratio 0.5;
# - ToMA with each cache at each threshold.
# Speedups are against none in the same run. Results in $OUT/cache_stack_<model>/; hours
# on this CPU at N=100 (the interleaved run generates N images per variant, 10 variants).
# A tiny run that only proves it works: N=1 STEPS=2 benchmarks/cache_stack.sh
# TOMA_FLAGS: more ToMA options for toma eval, e.g. TOMA_FLAGS="--tile-size 2 --proportional-attention";
# MODELS: which built-ins (default both).
set -euo pipefail
OUT=${OUT:-bench-results}
N=${N:-100}
STEPS=${STEPS:-20}
RATIO=${RATIO:-0.5}
FB=${FB:-"0.05 0.1"}            # FirstBlockCache thresholds (diffusers' default 0.05)
DB=${DB:-"0.08 0.16"}           # DBCache residual_diff_threshold (cache-dit's default 0.08)
TOMA_FLAGS=${TOMA_FLAGS:-}
MODELS=${MODELS:-"builtin-dit builtin-video"}
python3 -c "import cache_dit" || { echo "cache_stack.sh needs cache-dit: pip install --no-deps cache-dit==1.5.3" >&2; exit 2; }
methods=toma
for t in $FB; do methods+=",none+fbcache:$t,toma+fbcache:$t"; done
for t in $DB; do methods+=",none+cachedit:$t,toma+cachedit:$t"; done
uptime
for model in $MODELS; do
  # shellcheck disable=SC2086  # TOMA_FLAGS is a list of options
  toma eval --model "$model" --methods "$methods" --ratios "$RATIO" --num-images "$N" --steps "$STEPS" \
    --batch-size "${BATCH:-10}" --threads 1 --out-dir "$OUT/cache_stack_$model" $TOMA_FLAGS
done
uptime
