"""toma: ToMA token merging with attention for diffusers pipelines.

Quick start::

    import toma
    toma.apply_toma(pipe, ratio=0.5)   # pipeline or denoiser
    image = pipe(prompt).images[0]
    toma.remove_toma(pipe)             # exact undo
    toma.apply_toma(pipe, config=toma.load_config("tuned.json"))   # settings from `toma tune`
"""

from toma.api import ToMAPatch, apply_toma, get_toma, remove_toma
from toma.config import ConfigFileError, ToMAConfig, load_config

__version__ = "0.1.0"

__all__ = ["ConfigFileError", "ToMAConfig", "ToMAPatch", "apply_toma", "get_toma", "load_config", "remove_toma", "__version__"]
