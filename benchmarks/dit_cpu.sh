#!/usr/bin/env bash
# Transformers at full width and reduced depth on the CPU (random weights, fp32, batch 1):
# unpatched, ToMA and the ideal at ratio 0.5, interleaved. ONLY=sd35,wan,pixart,ltx,hunyuanvideo,cogvideox,qwenimage,flux2 picks.
# - SD3.5-Medium at 1024x1024 (4096 image tokens), --depth 4: 6 of 24 blocks, blocks 1-5
#   merged (the default skip of 5 scaled to the depth).
# - Wan 2.1 1.3B at 832x480, 25 frames (7 latent frames, 7 x 30 x 52 = 10,920 video tokens),
#   --depth 30: one block, merged; with spatio-temporal tiles (2 x 4 x 4) and with 2-D tiles
#   (1 x 4 x 4, the default).
# - PixArt-Sigma XL at 1024x1024 (4096 tokens), --depth 4: 7 of 28 blocks, blocks 1-6 merged.
# - LTX-Video 0.9 at 768x512, 121 frames (16 x 16 x 24 = 6144 tokens), --depth 7: 4 of 28
#   blocks, blocks 1-3 merged.
# - HunyuanVideo 13B at 848x480, 5 frames (2 x 30 x 53 = 3180 video tokens + 256 text),
#   --depth 40: one dual-stream and one single-stream block, both merged.
# - CogVideoX-5B at 720x480, 9 frames (3 x 30 x 45 = 4050 video tokens + 226 text),
#   --depth 42: one block, merged.
# - Qwen-Image at 1024x1024 (4096 image tokens, 128 text tokens), --depth 60: one of 60
#   blocks, merged.
# - FLUX.2-dev at 1024x1024 (4096 image tokens, 512 text tokens), --depth 48: one double and
#   one single block, both merged. Needs about 12 GB of memory in float32 (2.3 B parameters
#   with the shared modulation layers). On a busy machine, time it by CPU time instead:
#   python benchmarks/cpu_time_ab.py --arch flux2 --depth 48 --resolution 1024 --rounds 2
set -euo pipefail
OUT=${OUT:-bench-results}
THREADS=${THREADS:-1}
REPEATS=${REPEATS:-5}
want() { [[ -z "${ONLY:-}" || ",$ONLY," == *",$1,"* ]]; }
common=(--dtype float32 --device cpu --batch 1 --ratios 0.5 --methods none,toma,ideal --threads "$THREADS"
        --repeats "$REPEATS" --warmup 1 --out "$OUT")
if want sd35; then
  toma bench --arch sd35 --depth 4 --resolution 1024 --name sd35_1024_depth4_cpu "${common[@]}" "$@"
fi
if want wan; then
  for tf in 2 1; do
    toma bench --arch wan --depth 30 --resolution 480 --frames 25 --tile-frames "$tf" \
      --name "wan_480p_f25_depth30_tf${tf}_cpu" "${common[@]}" "$@"
  done
fi
if want pixart; then
  toma bench --arch pixart --depth 4 --resolution 1024 --name pixart_1024_depth4_cpu "${common[@]}" "$@"
fi
if want ltx; then
  toma bench --arch ltx --depth 7 --resolution 512 --frames 121 --name ltx_512_f121_depth7_cpu "${common[@]}" "$@"
fi
if want hunyuanvideo; then
  toma bench --arch hunyuanvideo --depth 40 --resolution 480 --frames 5 --name hunyuanvideo_480p_f5_depth40_cpu "${common[@]}" "$@"
fi
if want cogvideox; then
  toma bench --arch cogvideox --depth 42 --resolution 480 --frames 9 --name cogvideox_480p_f9_depth42_cpu "${common[@]}" "$@"
fi
if want qwenimage; then
  toma bench --arch qwenimage --depth 60 --resolution 1024 --name qwenimage_1024_depth60_cpu "${common[@]}" "$@"
fi
if want flux2; then
  toma bench --arch flux2 --depth 48 --resolution 1024 --name flux2_1024_depth48_cpu "${common[@]}" "$@"
fi
