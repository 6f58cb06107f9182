"""Diffusers pipelines as the commands run them: loaded offline, called per prompt and seed, timed.

torch and diffusers load in the functions that use them, so that importing this module for a
parser costs nothing.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

if TYPE_CHECKING:
    import torch


class PipelineUnavailableError(RuntimeError):
    """A ``--model`` pipeline cannot be loaded offline, or cannot run for lack of a package."""


def dtype_kwargs(dtype: torch.dtype) -> dict[str, torch.dtype]:
    """The dtype keyword ``from_pretrained`` expects: recent diffusers renamed ``torch_dtype`` to ``dtype``."""
    try:
        from diffusers.utils.deprecation_utils import _resolve_dtype  # noqa: F401  (present since the rename)
    except ImportError:
        return {"torch_dtype": dtype}
    return {"dtype": dtype}


def first_sentence(err: BaseException, limit: int = 200) -> str:
    """The first sentence of an error message, for one-line reports."""
    text = " ".join(str(err).split())
    cut = text.find(". ")
    text = text[: cut + 1] if cut >= 0 else text
    return text if len(text) <= limit else text[: limit - 3] + "..."


# short names a newcomer tries for --model, and the Hugging Face id each means
KNOWN_IDS = {
    "sd15": "stable-diffusion-v1-5/stable-diffusion-v1-5",
    "sdxl": "stabilityai/stable-diffusion-xl-base-1.0",
    "sd35": "stabilityai/stable-diffusion-3.5-medium",
    "flux": "black-forest-labs/FLUX.1-dev",
    "wan": "Wan-AI/Wan2.1-T2V-1.3B-Diffusers",
}


def check_model_name(model_id: str, builtin_names: Sequence[str]) -> None:
    """Refuse a ``--model`` that can be neither a folder nor a Hugging Face id, before loading.

    A path (``./x``, ``/x``, ``~/x``, ``a/b/c``) that does not exist would otherwise be looked up
    on the Hub and answered with download advice; a bare word (``sdxl``) is no Hub id of a
    pipeline, which are ``owner/name``. Both get what ``--model`` takes, with near names.

    Raises:
        PipelineUnavailableError: naming ``--model`` and what it takes.
    """
    import difflib

    takes = (
        "--model takes a folder written by `pipe.save_pretrained(...)`, a Hugging Face id (owner/name) whose "
        f"weights are in the local cache, or a built-in model ({', '.join(builtin_names)})"
    )
    path = Path(model_id).expanduser()
    if path.exists():
        return
    looks_like_path = model_id.startswith((".", "/", "~", "\\")) or model_id.count("/") > 1 or "\\" in model_id
    if looks_like_path:
        raise PipelineUnavailableError(f"--model {model_id!r}: no such folder (from {Path.cwd()}). {takes}")
    if "/" not in model_id:
        names = [*builtin_names, *KNOWN_IDS]
        close = difflib.get_close_matches(model_id, names, n=3, cutoff=0.6)
        close += [n for n in names if n not in close and (n.startswith(model_id) or model_id.startswith(n))]
        hints = [KNOWN_IDS.get(n, n) for n in close[:3]]
        near = f"; did you mean {' or '.join(hints)}?" if hints else "."
        raise PipelineUnavailableError(f"--model {model_id!r} is neither a folder nor a built-in model{near} {takes}")


def load_pipeline(model_id: str, device: str, dtype: torch.dtype) -> Any:
    """Load a diffusers pipeline from the local cache or a folder, never downloading.

    A folder or cached repo with ``modular_model_index.json`` and no ``model_index.json``
    (FLUX.3 ships only that) loads as a modular pipeline, its components with it.

    Raises:
        PipelineUnavailableError: the weights are not available offline, with how to get them.
    """
    from diffusers import DiffusionPipeline

    try:
        if is_modular(model_id):
            pipe = load_modular(model_id, dtype)
        else:
            pipe = DiffusionPipeline.from_pretrained(model_id, local_files_only=True, **dtype_kwargs(dtype))
    except (OSError, ValueError) as err:  # hub "not cached" errors subclass these
        reason = f"{type(err).__name__}: {first_sentence(err)}"
        if Path(model_id).exists():
            raise PipelineUnavailableError(
                f"{model_id!r} is not a loadable diffusers pipeline folder ({reason}). "
                "Pass a folder written by `pipe.save_pretrained(...)` (it contains model_index.json, or "
                "modular_model_index.json for a modular pipeline) or a Hugging Face model id that is in the "
                "local cache."
            ) from err
        raise PipelineUnavailableError(
            f"the weights of {model_id!r} are not in the local Hugging Face cache ({reason}).\n"
            "toma never downloads weights. Fetch them once with network access:\n"
            f"    hf download {model_id}        (older huggingface_hub: huggingface-cli download {model_id})\n"
            "Gated models (e.g. black-forest-labs/FLUX.1-dev) need `hf auth login` and accepting the "
            "licence on the model page first. Or pass --model /path/to/a/save_pretrained/folder."
        ) from err
    return pipe.to(device)


def load_modular(model_id: str, dtype: torch.dtype) -> Any:
    """A modular pipeline and every component its blocks use, from the folder or the local cache."""
    from diffusers.modular_pipelines import ModularPipeline

    pipe = ModularPipeline.from_pretrained(model_id, local_files_only=True)
    pipe.load_components(local_files_only=True, **dtype_kwargs(dtype))
    missing = [name for name in pipe.pretrained_component_names if getattr(pipe, name, None) is None]
    if missing:
        raise ValueError(f"its components {', '.join(missing)} did not load")
    return pipe


def is_modular_pipeline(pipe: Any) -> bool:
    """Whether ``pipe`` is a modular pipeline (called with ``output=``, inputs named by its blocks)."""
    from diffusers.modular_pipelines import ModularPipeline

    return isinstance(pipe, ModularPipeline)


def call_inputs(pipe: Any) -> set[str]:
    """The keyword inputs a pipeline's call takes: a modular pipeline's blocks' input names."""
    import inspect

    if is_modular_pipeline(pipe):
        return set(pipe.blocks.input_names)
    return set(inspect.signature(pipe.__call__).parameters)


def is_modular(model_id: str) -> bool:
    """Whether ``model_id`` (a folder, or a hub id in the local cache) holds a modular pipeline:
    a ``modular_model_index.json`` and no ``model_index.json``."""
    folder = Path(model_id)
    if folder.is_dir():
        return (folder / "modular_model_index.json").is_file() and not (folder / "model_index.json").is_file()
    from huggingface_hub import try_to_load_from_cache

    try:
        found = try_to_load_from_cache(model_id, "modular_model_index.json")
        classic = try_to_load_from_cache(model_id, "model_index.json")
    except ValueError:  # not a valid repo id
        return False
    return isinstance(found, str) and not isinstance(classic, str)


_AUDIO_NOTED: set[str] = set()  # pipelines whose audio output has been mentioned (once per process)


def pipeline_call(
    pipe: Any,
    prompts: Sequence[str],
    seeds: Sequence[int],
    steps: int,
    args: argparse.Namespace,
    device: str,
    progress: bool | str = True,
) -> torch.Tensor:
    """Run a pipeline once per prompt/seed pair; returns images ``(B, 3, H, W)`` in ``[0, 1]``,
    or clips ``(B, T, 3, H, W)`` from a video pipeline.

    ``progress``: show the pipeline's progress bar; a string labels it (which run it is).
    """
    import torch

    # the config persists on the pipeline: reset the label when none is given
    pipe.set_progress_bar_config(
        disable=not progress, leave=False, desc=progress if isinstance(progress, str) else None
    )
    kwargs: dict[str, Any] = {"num_inference_steps": steps, "output_type": "pt"}
    if getattr(args, "frames", None) is not None:
        kwargs["num_frames"] = args.frames
    if getattr(args, "video_frames", None) is not None:
        kwargs["video"] = args.video_frames  # toma generate --video (the same clip for every prompt)
    if args.guidance_scale is not None:
        kwargs["guidance_scale"] = args.guidance_scale
    if args.height is not None:
        kwargs["height"] = args.height
    if args.width is not None:
        kwargs["width"] = args.width
    video, modular = is_video_pipeline(pipe), is_modular_pipeline(pipe)
    if modular:
        kwargs = modular_kwargs(pipe, kwargs)
    gen_device = device if device.startswith("cuda") else "cpu"
    images = []
    for prompt, seed in zip(prompts, seeds):
        gen = torch.Generator(gen_device).manual_seed(int(seed))
        try:
            result = pipe(prompt=prompt, generator=gen, **kwargs)
        except NameError as err:
            # diffusers 0.42.1's WanVACEPipeline calls ftfy without checking it is installed
            # (WanPipeline checks): a bare NameError deep in its prompt cleaning
            if getattr(err, "name", None) != "ftfy":
                raise
            raise PipelineUnavailableError(
                f"{type(pipe).__name__} needs the ftfy package to clean its prompts, which is not installed: "
                "pip install ftfy"
            ) from err
        # a modular pipeline returns the output named by ``output=``
        out = result if modular else result.frames if video else result.images
        if getattr(result, "audio", None) is not None and type(pipe).__name__ not in _AUDIO_NOTED:
            _AUDIO_NOTED.add(type(pipe).__name__)
            print(
                f"note: {type(pipe).__name__} also returns audio; toma saves and scores the frames only",
                file=sys.stderr,
            )
        images.append(torch.as_tensor(out).float().cpu())
    return torch.cat(images)


# the command-line flag of each pipeline input the commands may set, for errors
_FLAGS = {"num_frames": "--frames", "video": "--video", "guidance_scale": "--guidance-scale"}


def modular_kwargs(pipe: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` for a modular pipeline's call: the output by name (``videos`` where its blocks
    take ``num_frames``), and a guidance scale its blocks do not take set on its guider instead
    (FLUX.3 guides through its guider component). Raises ``ValueError`` naming the flag the
    pipeline takes no input for."""
    names = call_inputs(pipe)
    kwargs = {**kwargs, "output": "videos" if "num_frames" in names else "images"}
    scale = kwargs.get("guidance_scale")
    if scale is not None and "guidance_scale" not in names and getattr(pipe, "guider", None) is not None:
        del kwargs["guidance_scale"]
        if getattr(pipe.guider, "guidance_scale", None) != scale:
            pipe.update_components(guider=pipe.guider.new(guidance_scale=scale))
    for key in kwargs:
        if key not in names and key not in ("output", "num_inference_steps", "output_type"):
            flag = _FLAGS.get(key, f"--{key}")
            raise ValueError(f"{flag} is not an input of {type(pipe).__name__}'s blocks")
    return kwargs


def is_video_pipeline(pipe: Any) -> bool:
    """Whether ``pipe`` draws videos: its call takes ``num_frames`` (Wan, LTX, CogVideoX, HunyuanVideo)."""
    return "num_frames" in call_inputs(pipe)


def check_frames(pipe: Any, frames: int | None) -> None:
    """``--frames`` is for video pipelines and must be positive."""
    if frames is None:
        return
    if not is_video_pipeline(pipe):
        raise ValueError(f"--frames applies to video pipelines; {type(pipe).__name__} draws images")
    if frames < 1:
        raise ValueError(f"--frames must be >= 1; got {frames}")


def sync(device: str) -> None:
    """Wait for queued GPU work so timings are honest."""
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    """Run ``fn`` and return its result and wall-clock seconds."""
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start
