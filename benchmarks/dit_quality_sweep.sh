#!/usr/bin/env bash
# Quality of ToMA's settings on the built-in digits Flux DiT (issue 10: defaults from numbers),
# one thread, the same 60 seeds per run, PSNR/SSIM against the unmerged images of each run:
# - ratios 0.25 / 0.5 / 0.75, with and without proportional attention;
# - tile sides 2 and 8 at ratio 0.5 (4 is in the ratio runs);
# - every block merged, against the default (at this depth the first half of each stack is
#   skipped: double block 1 and single blocks 2-3 merge).
# Results in $OUT/<name>/results.{json,md}; about 40 minutes on one quiet core at N=60.
set -euo pipefail
OUT=${OUT:-bench-results}
N=${N:-60}
common=(--model builtin-dit --methods toma --num-images "$N" --steps 20 --threads 1)
toma eval "${common[@]}" --ratios 0.25,0.5,0.75 --proportional-attention --out-dir "$OUT/builtin_dit_ratios_prop"
toma eval "${common[@]}" --ratios 0.25,0.5,0.75 --no-proportional-attention --out-dir "$OUT/builtin_dit_ratios_noprop"
toma eval "${common[@]}" --ratios 0.5 --proportional-attention \
  --blocks "transformer_blocks=0-1;single_transformer_blocks=0-3" --out-dir "$OUT/builtin_dit_allblocks"
for t in 2 8; do
  toma eval "${common[@]}" --ratios 0.5 --proportional-attention --tile-size "$t" --out-dir "$OUT/builtin_dit_tile$t"
done
