"""The names of ``toma eval`` that its parser, its harness and its metrics all read.

A leaf, torch-free module: the package's ``register`` builds ``--help`` from it without
torch, and :mod:`toma.tools.eval.metrics` takes its default model ids from here rather
than from the harness that uses the metrics (that was a circle).
"""

from __future__ import annotations

METHODS = ("none", "toma", "toma-random", "toma-grid", "tomesd")
# hub ids of the metric models that --clip and --dino load (from the local cache only)
DEFAULT_CLIP_MODEL = "openai/clip-vit-large-patch14"
DEFAULT_DINO_MODEL = "facebook/dinov2-base"
