"""ComfyUI custom-node folder for toma: link or copy this folder into ComfyUI's
``custom_nodes/``, with the ``toma-diffusion`` package installed in ComfyUI's Python.

It is thin on purpose: the node lives in the installed package (imported absolutely, since
ComfyUI loads this folder under a module name of its own), so updating the package updates
the node.
"""

from toma.comfyui.node import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS

__all__ = ["NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS"]
