"""toma: ToMA token merging with attention for diffusers pipelines.

Quick start::

    import toma
    toma.apply_toma(pipe, ratio=0.5)   # pipeline or denoiser
    image = pipe(prompt).images[0]
    toma.remove_toma(pipe)             # exact undo
"""

from toma.api import ToMAPatch, apply_toma, get_toma, remove_toma
from toma.config import ToMAConfig

__version__ = "0.1.0"

__all__ = ["ToMAConfig", "ToMAPatch", "apply_toma", "get_toma", "remove_toma", "__version__"]
