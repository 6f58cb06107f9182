#!/usr/bin/env bash
# Speed-quality frontier of ToMA's placements on the built-in digits UNet, against tomesd
# (issue 12: "merge what pays"). One thread, the same N seeds in every run; each run times
# its methods interleaved batch by batch (3 timed batches of 20 at N=60) against its own
# unmerged reference, so a row's speedup and PSNR are both relative to that run's "none".
#
#   placement            levels  attention  MLP (ratio)         cross-attention
#   l1                   1       yes        -                   -           (the default)
#   l2                   2       yes        -                   -
#   l1_mlp               1       yes        ratio               -
#   l2_mlp               2       yes        ratio               -
#   l2_mlp25             2       yes        0.25                -
#   l1_tile8             1       yes (8x8 tiles)                -
#   l2_mlp_xattn         2       yes        ratio               ratio
#   l2_mlp2              2       yes        ratio, level 2 only -
#   l2_mlp_late          l2_mlp on steps 10-19 of 20 only (start_step 10)
#   l2_mlp_last5         l2_mlp on steps 15-19 only (start_step 15)
#   l2_mlp_early         l2_mlp on steps 0-9 only (stop_step 10)
#   l2_mlp_from5         l2_mlp on steps 5-19 only (start_step 5)
#   l1_late              l1 on steps 10-19 only
#
# tomesd runs over its ratios in the l1 run; ratios 0.6 and 0.7 of l1, l1_tile8 and tomesd
# fill in around tomesd's fastest ratio ("<placement>@mid" folders). Each eval's speedup is
# against its own run's reference; `benchmarks/frontier_speed.py` times every setting in one
# process, and `python benchmarks/frontier_table.py $OUT --speed <its json>` joins the two.
# About 45 minutes on one core at N=60.
set -euo pipefail
OUT=${OUT:-bench-results/unet_frontier}
N=${N:-60}
RATIOS=${RATIOS:-0.25,0.5,0.75}
base=(--model builtin --num-images "$N" --batch-size 20 --steps 20 --threads 1)
common=("${base[@]}" --ratios "$RATIOS")
toma eval "${common[@]}" --methods none,toma,tomesd --out-dir "$OUT/l1"
toma eval "${common[@]}" --methods toma --levels 2 --out-dir "$OUT/l2"
toma eval "${common[@]}" --methods toma --merge-mlp --out-dir "$OUT/l1_mlp"
toma eval "${common[@]}" --methods toma --levels 2 --merge-mlp --out-dir "$OUT/l2_mlp"
toma eval "${common[@]}" --methods toma --levels 2 --merge-mlp --mlp-ratio 0.25 --out-dir "$OUT/l2_mlp25"
toma eval "${common[@]}" --methods toma --tile-size 8 --out-dir "$OUT/l1_tile8"
toma eval "${common[@]}" --methods toma --levels 2 --merge-mlp --merge-crossattn --out-dir "$OUT/l2_mlp_xattn"
toma eval "${base[@]}" --ratios 0.6,0.7 --methods toma,tomesd --out-dir "$OUT/l1@mid"
toma eval "${base[@]}" --ratios 0.6,0.7 --methods toma --tile-size 8 --out-dir "$OUT/l1_tile8@mid"
toma eval "${base[@]}" --ratios 0.5,0.75 --methods toma --levels 2 --merge-mlp --mlp-levels 2 --out-dir "$OUT/l2_mlp2"
# step windows (ratio 0.5): time them with frontier_speed.py --steps 20 --only ... (its docstring)
win=("${base[@]}" --ratios 0.5 --methods toma)
toma eval "${win[@]}" --levels 2 --merge-mlp --start-step 10 --out-dir "$OUT/l2_mlp_late"
toma eval "${base[@]}" --ratios 0.75 --methods toma --levels 2 --merge-mlp --start-step 10 --out-dir "$OUT/l2_mlp_late@75"
toma eval "${base[@]}" --ratios 0.5,0.75 --methods toma --levels 2 --merge-mlp --start-step 5 --out-dir "$OUT/l2_mlp_from5"
toma eval "${win[@]}" --levels 2 --merge-mlp --start-step 15 --out-dir "$OUT/l2_mlp_last5"
toma eval "${win[@]}" --levels 2 --merge-mlp --stop-step 10 --out-dir "$OUT/l2_mlp_early"
toma eval "${win[@]}" --start-step 10 --out-dir "$OUT/l1_late"
