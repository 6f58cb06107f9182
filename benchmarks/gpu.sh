#!/usr/bin/env bash
# GPU latency in one command, for a machine with a CUDA GPU and no internet (weights are
# random, built from the published configs; nothing is downloaded). First `toma doctor`
# (versions, the kernel path, every Triton kernel against the torch path; its report in
# $RESULTS/doctor.json), then full-size SDXL UNet (eager and CUDA graph replays),
# full-depth Flux.1-dev and SD3.5-Medium transformers, bf16, 1024x1024, and Wan 2.1 1.3B at
# 832x480 x 81 frames (32,760 video tokens), ratio 0.5: unpatched, ToMA, tomesd (SDXL only;
# a UNet method) and the ideal, interleaved. The default selection is sized to finish
# within 8 minutes on one H200 (Flux needs ~75 GB of GPU memory while it is built).
# ONLY=sd35,wan runs just those; the rest is opt-in by name:
#
#   benchmarks/gpu.sh                          # results in bench-results/gpu/*.json|png
#   RESULTS=/tmp/gpu REPEATS=20 benchmarks/gpu.sh
#   ONLY=doctor,sdxl,flux,sd35,wan,cp          # the default selection
#   ONLY=sdxl-mlp benchmarks/gpu.sh            # SDXL with the MLPs merged too (~1 minute)
#   ONLY=flux-prop benchmarks/gpu.sh           # Flux with proportional attention (~1.5 minutes)
#   ONLY=kernels benchmarks/gpu.sh             # ToMA's Triton kernels against its torch path (~4 minutes)
#   ONLY=kontext benchmarks/gpu.sh             # Flux.1 Kontext, one reference image (~1 minute)
#   ONLY=comfyui benchmarks/gpu.sh             # ComfyUI's own Flux, Wan, SDXL and Z-Image through the node
#                                              # (needs a ComfyUI checkout and its requirements)
#   ONLY=cp benchmarks/gpu.sh                  # context parallelism over 2 GPUs (also in the default
#                                              # selection; skipped with fewer than 2 GPUs)
#   COMPILE=1 benchmarks/gpu.sh                # also SDXL under torch.compile (a few minutes more)
#   EXTRAS=1 benchmarks/gpu.sh                 # also the hot-path micro-timings, the SDXL
#                                              # tile-order A/B and SDXL graph replays without
#                                              # the proportional-attention mask (~2 minutes more)
#   PYTHON=python3.12 benchmarks/gpu.sh        # the interpreter that has torch and diffusers
# ToMA rows run ToMA's Triton kernels wherever triton imports (it ships with CUDA torch);
# TOMA_KERNELS=torch benchmarks/gpu.sh times its torch path instead.
set -euo pipefail
cd "$(dirname "$0")/.."
RESULTS=${RESULTS:-bench-results/gpu}
REPEATS=${REPEATS:-10}
STEPS=${STEPS:-4}
PY=${PYTHON:-python3}
"$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'gpu.sh needs a CUDA GPU (torch.cuda.is_available() is False)')"
bench() { "$PY" -m toma bench "$@"; }
want() { [[ -z "${ONLY:-}" || ",$ONLY," == *",$1,"* ]]; }      # default selection, or named
opted() { [[ ",${ONLY:-}," == *",$1,"* ]]; }                    # named only
common=(--device cuda --dtype bfloat16 --resolution 1024 --ratios 0.5
        --steps "$STEPS" --repeats "$REPEATS" --warmup 2 --out "$RESULTS" --no-progress)
if want doctor; then
  mkdir -p "$RESULTS"
  # a failing check is reported, and the timings still run (they say which path ran)
  "$PY" -m toma doctor --json "$RESULTS/doctor.json" | tee "$RESULTS/doctor.txt" || echo "toma doctor failed: see above"
fi
if want sdxl; then
  # SDXL: both attention levels (64x64 and 32x32 tokens), self-attention; batch 2 = a CFG batch
  bench --arch sdxl --methods none,toma,tomesd,ideal --levels 2 --batch 1,2 --name sdxl_levels2_gpu "${common[@]}" "$@"
  # the same timed as CUDA graph replays: what a launch-free deployment (graphs, compile) sees
  bench --arch sdxl --methods none,toma,ideal,tomesd --levels 2 --batch 1,2 --cuda-graph --no-profile \
    --name sdxl_levels2_cudagraph_gpu "${common[@]}" "$@"
fi
# SDXL with the MLPs merged too
opted sdxl-mlp && bench --arch sdxl --methods none,toma,tomesd,ideal --levels 2 --merge-mlp --name sdxl_levels2_mlp_gpu \
  "${common[@]}" "$@"
# Flux.1-dev at full depth (19 double + 38 single blocks; the first 5 of each unmerged)
want flux && bench --arch flux --methods none,toma,ideal --name flux_gpu "${common[@]}" "$@"
# the same with proportional attention, whose float mask rules out flash kernels: it adds
# 4-5 dB of fidelity on the built-in Flux DiT, and this row decides whether Flux turns it on
opted flux-prop && bench --arch flux --methods none,toma --proportional-attention --name flux_prop_gpu "${common[@]}" "$@"
# Flux.1 Kontext (editing): the same model with one 1024px reference image's 4096 tokens
# after the image's; they pass whole. Opt-in (ONLY=kontext): about a minute more
if opted kontext; then
  bench --arch flux-kontext --methods none,toma,ideal --name flux_kontext_gpu "${common[@]}" "$@"
fi
# SD3.5-Medium at full depth (24 blocks; the first 5 unmerged), 4096 image tokens
want sd35 && bench --arch sd35 --methods none,toma,ideal --name sd35_gpu "${common[@]}" "$@"
# Wan 2.1 T2V 1.3B at 480p x 81 frames: 21 x 30 x 52 = 32,760 tokens in self-attention; one
# forward per sample (a forward takes seconds), spatio-temporal 2x4x4 tiles
if want wan; then
  bench --arch wan --methods none,toma,ideal --device cuda --dtype bfloat16 --resolution 480 --frames 81 \
    --ratios 0.5 --steps 1 --repeats "${WAN_REPEATS:-5}" --warmup 1 --out "$RESULTS" --no-progress \
    --name wan_480p_81f_gpu "$@"
fi
if want cp; then
  # ToMA under diffusers' context parallelism, one rank per GPU (NCCL): the bytes each rank
  # hands the collectives per forward, unmerged and merged, and forward times, for a
  # Wan-shaped model with random weights on 21x30x30 = 18,900 video tokens and a Flux-shaped
  # one on 60x60 image tokens.
  # Ulysses on the native backend; ring needs a backend that returns the log-sum-exp.
  gpus=$("$PY" -c "import torch; print(torch.cuda.device_count())")
  if (( gpus >= 2 )); then
    mkdir -p "$RESULTS"
    for world in 2 4; do
      (( gpus >= world )) || continue
      "$PY" -m torch.distributed.run --standalone --nproc_per_node="$world" benchmarks/cp_comm.py --device cuda \
        --modes ulysses --frames 21 --side 30 --heads 8 --time "$REPEATS" --out "$RESULTS/cp_comm_ulysses_${world}gpu.json"
      "$PY" -m torch.distributed.run --standalone --nproc_per_node="$world" benchmarks/cp_comm.py --device cuda \
        --modes ring --backend _native_cudnn --frames 21 --side 30 --heads 8 --time "$REPEATS" \
        --out "$RESULTS/cp_comm_ring_${world}gpu.json" || echo "cp: ring attention did not run (its backend needs cuDNN attention)"
    done
  else
    echo "cp: skipped, context parallelism needs at least 2 GPUs (this machine has $gpus)"
  fi
fi
if opted kernels; then
  # the Triton kernels (one launch per plan; merges straight from raster order) against the
  # torch path, interleaved in one process: hot path, SDXL eager forwards and the gap between
  # the two paths' outputs; then graph replays on the torch path, to set beside the default
  # (Triton) rows of ONLY=sdxl
  mkdir -p "$RESULTS"
  "$PY" -c "import triton" || { echo "ONLY=kernels needs triton"; exit 1; }
  "$PY" benchmarks/kernels_ab.py --arch sdxl --levels 2 --device cuda --dtype bfloat16 --batch 1,2 \
    | tee "$RESULTS/kernels_ab_sdxl_gpu.txt"
  TOMA_KERNELS=torch bench --arch sdxl --methods none,toma,ideal --levels 2 --batch 1,2 --cuda-graph --no-profile \
    --name sdxl_levels2_cudagraph_torchpath_gpu "${common[@]}" "$@"
  TOMA_KERNELS=triton bench --arch sdxl --methods none,toma,ideal --levels 2 --batch 1,2 --cuda-graph --no-profile \
    --name sdxl_levels2_cudagraph_tritonpath_gpu "${common[@]}" "$@"
fi
if opted comfyui; then
  # ComfyUI's own model classes through the ToMA node (toma bench --host comfyui), random
  # weights, bf16: unpatched, the node's patch and the ideal (the same ComfyUI model on K
  # tokens). Flux.1-dev at full depth, Wan 2.1 1.3B at 480p x 33 frames, the SDXL UNet with
  # a CFG batch, Z-Image-Turbo at full depth (1024x1024). The checkout: $TOMA_COMFYUI, else the vendored one beside this repository
  comfy=${TOMA_COMFYUI:-../shared/vendor/ComfyUI}
  if [[ -f "$comfy/comfy/model_patcher.py" ]]; then
    cbench() { bench --host comfyui --comfyui "$comfy" "$@" || echo "comfyui: $2 did not run (see above)"; }
    cbench --arch flux --name comfyui_flux_gpu "${common[@]}" "$@"
    cbench --arch wan --name comfyui_wan_480p_33f_gpu "${common[@]}" --resolution 480 --frames 33 "$@"
    cbench --arch sdxl --batch 1,2 --name comfyui_sdxl_gpu "${common[@]}" "$@"
    cbench --arch zimage --name comfyui_zimage_gpu "${common[@]}" "$@"
  else
    echo "comfyui: skipped, no ComfyUI checkout at $comfy (set TOMA_COMFYUI)"
  fi
fi
if [[ "${COMPILE:-0}" == 1 ]]; then
  # eager and torch.compile'd, unpatched and ToMA (compiles take most of this run)
  bench --arch sdxl --methods none,toma --levels 2 --compile --no-profile --name sdxl_levels2_compile_gpu \
    "${common[@]}" "$@"
fi
if [[ "${EXTRAS:-0}" == 1 ]]; then
  mkdir -p "$RESULTS"
  "$PY" benchmarks/hot_path.py --device cuda --dtype bfloat16 --batch 1 | tee "$RESULTS/hot_path_gpu.txt"
  "$PY" benchmarks/tile_order_ab.py --arch sdxl --levels 2 --device cuda --dtype bfloat16 --repeats 10 \
    | tee "$RESULTS/tile_order_ab_sdxl_gpu.txt"
  # a float attention mask keeps SDPA off its flash kernels: what does the bias cost here?
  bench --arch sdxl --methods none,toma,ideal --levels 2 --batch 1,2 --cuda-graph --no-profile \
    --no-proportional-attention --name sdxl_levels2_cudagraph_nobias_gpu "${common[@]}" "$@"
fi
