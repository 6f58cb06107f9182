"""ToMA in ComfyUI: a node that merges tokens in ComfyUI's own model classes.

``node`` holds the node class and ComfyUI's mappings, ``patch`` the patching and its state,
``families`` one module per ComfyUI denoiser family (each a ``FAMILY`` record, ``family``,
on the kinds of site in ``sites``), and ``hooks`` every ComfyUI internal the rest relies
on. Nothing here imports ComfyUI at import time.
"""

from toma.comfyui.families import supported

__all__ = ["supported"]
