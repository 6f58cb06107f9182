"""The example workflows in ``examples/comfyui/`` against the vendored ComfyUI's own prompt
validation (``execution.validate_prompt``), with the node registered as ComfyUI registers it
(``nodes.load_custom_node`` on ``comfyui_toma/``).

What validation checks, and what it does not: it checks every node type exists, every link
joins an output to an input of the same type, every required input is there, numbers are
within the widgets' limits, and every COMBO value is one of its options. The loaders'
options are folder listings (``folder_paths.get_filename_list``), so the model files a
workflow names must be listed. They are not here (gigabytes each): the test points those
folders at a temporary directory holding *empty* placeholder files named as in the JSON.
Validation only lists files, it never opens them, so the placeholders prove the names are
listed, not that the weights load; nothing here runs the workflows.

Validation ignores inputs a node does not declare, so an optional input renamed in the node
would pass silently: the test also compares the ToMA node's inputs in each JSON with the
node's schema, and applies those inputs to a tiny model of the workflow's family to check
the node accepts them there and merges.

Each API file has a UI-format twin (``*_ui.json``, what ComfyUI's menu saves and loads),
written by ``scripts/comfyui_ui_workflows.py`` from the node schemas: the test rebuilds it
from the API file and the current schemas (a moved widget or a renamed node changes it),
and pins the order of the ToMA node's widgets, which saved UI workflows store by position.
"""

from __future__ import annotations

import asyncio
import copy
import json
from pathlib import Path

import pytest
from tiny_comfy import flux_patcher, node_widgets, ui_workflow, unet_patcher, wan_patcher

from toma.comfyui.node import ToMAModel
from toma.comfyui.patch import patch_model

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples" / "comfyui"
# example file -> a tiny model of its family (tests/comfyui/tiny_comfy.py; deep enough that the
# family's default, which skips the first 5 blocks, selects some) and its family's name
WORKFLOWS = {
    "sdxl_toma_api.json": (lambda comfy: unet_patcher(comfy, sdxl_like=True), "unet"),
    "flux_toma_api.json": (lambda comfy: flux_patcher(comfy, double=6, single=6), "flux"),
    "wan21_t2v_toma_api.json": (lambda comfy: wan_patcher(comfy, layers=6), "wan"),
}
# the order of the ToMA node's widgets: a saved UI workflow stores their values by position,
# so reordering the node's inputs would feed old workflows' values to the wrong inputs
TOMA_WIDGETS = ["ratio", "tile_size", "start_percent", "end_percent", "blocks", "merge_mlp", "proportional_attention"]
# the core nodes the examples use that live in comfy_extras (loaded by ComfyUI at start-up)
EXTRAS = ("nodes_sd3.py", "nodes_flux.py", "nodes_hunyuan.py", "nodes_model_advanced.py", "nodes_video.py")
# loader inputs whose options are a model folder's listing
MODEL_FILES = {
    ("CheckpointLoaderSimple", "ckpt_name"): "checkpoints",
    ("UNETLoader", "unet_name"): "diffusion_models",
    ("DualCLIPLoader", "clip_name1"): "text_encoders",
    ("DualCLIPLoader", "clip_name2"): "text_encoders",
    ("CLIPLoader", "clip_name"): "text_encoders",
    ("VAELoader", "vae_name"): "vae",
}


def _load(name: str) -> dict:
    return json.loads((EXAMPLES / name).read_text())


def _model_files(prompt: dict) -> list[tuple[str, str]]:
    """``(folder, file name)`` of every model file the prompt's loaders name."""
    found = []
    for node in prompt.values():
        for name, value in node["inputs"].items():
            folder = MODEL_FILES.get((node["class_type"], name))
            if folder is not None:
                found.append((folder, value))
    return found


@pytest.fixture(scope="module")
def registered(comfy):
    """The ToMA node and the comfy_extras nodes the examples use, registered through
    ComfyUI's own loader; ComfyUI's node tables are restored afterwards."""
    import execution

    nodes = comfy.nodes
    saved = copy.copy(nodes.NODE_CLASS_MAPPINGS), copy.copy(nodes.NODE_DISPLAY_NAME_MAPPINGS)
    try:
        assert asyncio.run(nodes.load_custom_node(str(REPO / "comfyui_toma")))
        for extra in EXTRAS:
            path = comfy.root / "comfy_extras" / extra
            assert asyncio.run(nodes.load_custom_node(str(path), module_parent="comfy_extras")), extra
        yield execution
    finally:
        nodes.NODE_CLASS_MAPPINGS.clear()
        nodes.NODE_CLASS_MAPPINGS.update(saved[0])
        nodes.NODE_DISPLAY_NAME_MAPPINGS.clear()
        nodes.NODE_DISPLAY_NAME_MAPPINGS.update(saved[1])


@pytest.fixture
def model_folders(comfy, tmp_path, monkeypatch):
    """Point every model folder the loaders list at an empty folder under ``tmp_path``;
    returns a function that puts an empty placeholder file into one."""
    fp = comfy.folder_paths
    for folder in {*MODEL_FILES.values(), "vae_approx"}:
        (tmp_path / folder).mkdir(exist_ok=True)
        _, extensions = fp.folder_names_and_paths[folder]
        monkeypatch.setitem(fp.folder_names_and_paths, folder, ([str(tmp_path / folder)], extensions))
    monkeypatch.setattr(fp, "filename_list_cache", {})

    def place(files: list[tuple[str, str]]) -> None:
        for folder, name in files:
            (tmp_path / folder / name).write_bytes(b"")

    return place


def _validate(execution, prompt: dict) -> tuple:
    return asyncio.run(execution.validate_prompt("toma-example", copy.deepcopy(prompt), None))


def _toma_node(prompt: dict) -> dict:
    (node,) = [n for n in prompt.values() if n["class_type"] == "ToMAModel"]
    return node


@pytest.mark.parametrize("name", list(WORKFLOWS))
def test_example_workflow_passes_comfyui_validation(comfy, registered, model_folders, name):
    prompt = _load(name)
    model_folders(_model_files(prompt))
    ok, error, outputs, node_errors = _validate(registered, prompt)
    assert ok, (error, node_errors)
    assert node_errors == {} and len(outputs) == 1
    # the ToMA node sits between the model loader and the sampler: its MODEL feeds the KSampler
    toma_id = next(i for i, n in prompt.items() if n["class_type"] == "ToMAModel")
    (sampler,) = [n for n in prompt.values() if n["class_type"] == "KSampler"]
    assert sampler["inputs"]["model"] == [toma_id, 0]


@pytest.mark.parametrize("name", list(WORKFLOWS))
def test_example_sets_every_toma_input_and_the_node_merges_its_family_with_them(comfy, name):
    prompt = _load(name)
    inputs = dict(_toma_node(prompt)["inputs"])
    schema = ToMAModel.INPUT_TYPES()
    assert set(inputs) == {*schema["required"], *schema["optional"]}
    source, slot = inputs.pop("model")
    assert prompt[source]["class_type"] in ("CheckpointLoaderSimple", "UNETLoader", "ModelSamplingSD3") and slot == 0
    make, family = WORKFLOWS[name]
    patched = patch_model(make(comfy), **inputs)
    run = getattr(patched, "toma_run", None)
    assert run is not None and run.family.name == family and any(run.blocks.values())


@pytest.mark.parametrize(
    "change, error_type",
    [
        (lambda p, files: files.pop(0), "value_not_in_list"),  # a model file not in its folder
        (lambda p, files: _toma_node(p)["inputs"].__setitem__("ratio", 0.99), "value_bigger_than_max"),
        (lambda p, files: _toma_node(p)["inputs"].__setitem__("merge_mlp", "always"), "value_not_in_list"),
        (lambda p, files: _toma_node(p)["inputs"].pop("ratio"), "required_input_missing"),
        (lambda p, files: _toma_node(p).__setitem__("class_type", "ToMAModelRenamed"), "missing_node_type"),
    ],
    ids=["missing-model-file", "ratio-above-max", "bad-merge-mlp", "no-ratio", "unknown-node"],
)
def test_validation_catches_a_broken_example(comfy, registered, model_folders, change, error_type):
    """The validation above can fail: each break of the Flux example is caught, with its type."""
    prompt = _load("flux_toma_api.json")
    files = _model_files(prompt)
    change(prompt, files)
    model_folders(files)
    ok, error, _, node_errors = _validate(registered, prompt)
    assert not ok
    types = {error["type"]} | {e["type"] for n in node_errors.values() for e in n["errors"]}
    assert error_type in types, (error, node_errors)


@pytest.mark.parametrize("name", list(WORKFLOWS))
def test_ui_twin_is_the_api_workflow_under_the_current_schemas(comfy, registered, name):
    ui_path = EXAMPLES / name.replace("_api.json", "_ui.json")
    ui = json.loads(ui_path.read_text())
    prompt = _load(name)
    assert ui == ui_workflow(prompt, comfy.nodes.NODE_CLASS_MAPPINGS), (
        f"rerun scripts/comfyui_ui_workflows.py for {ui_path.name}"
    )
    assert [w for w, _ in node_widgets(ToMAModel)] == TOMA_WIDGETS
    (toma_node,) = [n for n in ui["nodes"] if n["type"] == "ToMAModel"]
    api_inputs = _toma_node(prompt)["inputs"]
    assert toma_node["widgets_values"] == [api_inputs[w] for w in TOMA_WIDGETS]
    assert [i["name"] for i in toma_node["inputs"]] == ["model"] and toma_node["outputs"][0]["type"] == "MODEL"
