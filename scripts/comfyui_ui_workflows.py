"""Write the UI-format twins (``*_ui.json``) of the API-format example workflows in
``examples/comfyui/``, from the vendored ComfyUI's own node schemas (widget order and
output types); ``tests/comfyui/test_comfyui_examples.py`` checks they are up to date.

    python scripts/comfyui_ui_workflows.py
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples" / "comfyui"
sys.path.insert(0, str(REPO / "tests" / "comfyui"))
# the core nodes the examples use that live in comfy_extras
EXTRAS = ("nodes_sd3.py", "nodes_flux.py", "nodes_hunyuan.py", "nodes_model_advanced.py", "nodes_video.py")


def main() -> None:
    """Register the node and the extras, then write one ``*_ui.json`` per ``*_api.json``."""
    import tiny_comfy

    root = Path(os.environ.get("TOMA_COMFYUI") or REPO.parent / "shared" / "vendor" / "ComfyUI")
    comfy = tiny_comfy.import_comfyui(root, Path(tempfile.mkdtemp()))
    nodes = comfy.nodes
    assert asyncio.run(nodes.load_custom_node(str(REPO / "comfyui_toma")))
    for extra in EXTRAS:
        assert asyncio.run(nodes.load_custom_node(str(root / "comfy_extras" / extra), module_parent="comfy_extras"))
    for api in sorted(EXAMPLES.glob("*_api.json")):
        ui = tiny_comfy.ui_workflow(json.loads(api.read_text()), nodes.NODE_CLASS_MAPPINGS)
        path = api.with_name(api.name.replace("_api.json", "_ui.json"))
        path.write_text(json.dumps(ui, indent=1) + "\n")
        print(path.relative_to(REPO))


if __name__ == "__main__":
    main()
