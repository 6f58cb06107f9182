"""The compatibility matrix: every model family against the features toma composes with.

:func:`matrix` gives, for each family of :func:`toma.supported` and each feature of
:data:`FEATURES`, a :class:`Cell`: ``✔`` (a test checks it; with a note where the model
itself keeps it from being whole), ``✖`` (refused or failing, with the reason the code gives) or
``untested``. It is the one place this is said: the generated
page ``docs/compatibility.md`` prints it, and the tests that back each ``✔`` are parametrized
from it (``tests/compat_cells.py``), each case marked ``compat(feature, family, status)``.
``python -m toma.tools.docs`` collects those marks from the test files named in
:data:`FEATURES` and fails on a ``✔`` that no test case covers.

What the code says at run time is read from the code: the families (:func:`toma.supported`),
context parallelism (:data:`toma.adapters.parallel.SUPPORTED` and its refusal) and ComfyUI
(:data:`toma.comfyui.families.FAMILIES`). What can only be seen on a model (which blocks have
a cross-attention, which processors take the key bias, which caches run on a class) is
written below; the tests parametrized from it fail where it is wrong.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

YES, NO, UNTESTED = "✔", "✖", "untested"


@dataclass(frozen=True)
class Feature:
    """One column of the matrix.

    Attributes:
        key: short name, as in the tests' ``compat`` marks.
        title: the column's heading.
        what: what a ``✔`` means, and how it is switched on.
        tests: the test files whose cases back its ``✔`` cells (relative to the checkout).
    """

    key: str
    title: str
    what: str
    tests: tuple[str, ...]


@dataclass(frozen=True)
class Cell:
    """One family's support of one feature: ``status`` (``✔``, ``✖`` or ``untested``) and
    ``reason``: where it is not ``✔``, why; on a ``✔``, what it does not promise (empty where
    there is nothing to say)."""

    status: str
    reason: str = ""


CONFORMANCE = "tests/adapters/test_conformance.py"
MATRIX_TESTS = "tests/adapters/test_compat_matrix.py"

FEATURES: tuple[Feature, ...] = (
    Feature(
        "attention",
        "attention",
        "`apply_toma(pipe, ratio=0.5)` merges the image tokens of its self- or joint attention; ratio 0 and "
        "`remove_toma` give back the unmerged model bitwise",
        (CONFORMANCE,),
    ),
    Feature("mlp", "MLP", "`merge_mlp=True` merges the MLP's tokens too", (MATRIX_TESTS,)),
    Feature(
        "cross", "cross-attention", "`merge_crossattn=True` merges the queries of its cross-attention", (MATRIX_TESTS,)
    ),
    Feature(
        "proportional",
        "proportional attention",
        "`proportional_attention=True`: each merged key weighs as the tokens it stands for",
        (MATRIX_TESTS,),
    ),
    Feature(
        "context_parallel",
        "context parallel",
        "merges under diffusers' context parallelism (`enable_parallelism`, Ulysses or ring): each rank's "
        "shard merges as one process would",
        ("tests/adapters/test_context_parallel.py",),
    ),
    Feature(
        "compile",
        "torch.compile",
        "`torch.compile` traces the merged blocks with no graph break added by toma",
        (CONFORMANCE,),
    ),
    Feature(
        "fbcache",
        "FirstBlockCache",
        "diffusers' `FirstBlockCache` (`enable_cache`) with ToMA, either enabled first: the same outputs",
        (CONFORMANCE,),
    ),
    Feature(
        "cache_dit",
        "cache-dit",
        "cache-dit's DBCache (`cache_dit.enable_cache`) with ToMA, either enabled first: the same outputs",
        (CONFORMANCE,),
    ),
    Feature(
        "comfyui",
        "ComfyUI",
        "the `ToMA Token Merging` node merges the family's ComfyUI model (its own classes, not diffusers')",
        ("tests/comfyui/test_comfyui_compat.py",),
    ),
)

# Families whose blocks have a cross-attention (text as keys and values only); in the others
# the text joins the image tokens in one attention, and merge_crossattn=True is refused.
CROSS_ATTENTION = frozenset(
    {
        "unet",
        "pixart",
        "wan",
        "ltx",
        "ltx2",
        "wan-vace",
        "skyreels-v2",
        "wan-animate",
        "cosmos",
        "helios",
        "kandinsky5",
        "chronoedit",
    }
)
# Families with no MLP site: merge_mlp=True is refused (CogView4's feed-forward runs on the
# image and then on the text, two calls a site cannot tell apart)
NO_MLP = frozenset({"cogview4"})
# Families whose attention processors cannot take the key bias: proportional_attention=True is
# refused (None, the default, runs without it).
NO_KEY_BIAS = frozenset({"hidream", "lumina2"})

# Families whose own code breaks torch.compile's graphs, unpatched: their ✔ means that toma adds
# no break to the model's own (the compile test checks both)
OWN_GRAPH_BREAKS = {
    "hidream": "toma adds no graph break, but HiDream's own mixture-of-experts MLP breaks the graph (it "
    "counts each expert's tokens on the host), unpatched too",
}

_UNET_CACHES = "a UNet: the block caches hook transformer blocks, which it has none of"
_NO_CACHE_MIXIN = "diffusers' model class has no `enable_cache`"
_NOT_REGISTERED = "diffusers' FirstBlockCache does not know its block class"
# diffusers' FirstBlockCache on each family's model, unpatched (diffusers 0.42): where it runs,
# ToMA composes with it (the ✔ cells' tests); elsewhere it fails before ToMA is involved
FIRST_BLOCK_CACHE: dict[str, str | None] = {
    **dict.fromkeys(
        (
            "flux",
            "wan",
            "ltx",
            "qwenimage",
            "hunyuanvideo",
            "cogvideox",
            "wan-vace",
            "hunyuanimage",
            "framepack",
            "cogview4",
            "mochi",
        )
    ),
    "unet": _UNET_CACHES,
    **dict.fromkeys(
        (
            "sd3",
            "pixart",
            "cosmos",
            "joyimage",
            "krea2",
            "zimage",
            "bria-fibo",
            "hidream",
            "ideogram4",
            "ernie-image",
            "lumina2",
            "flux3",
        ),
        _NO_CACHE_MIXIN,
    ),
    **dict.fromkeys(
        (
            "ltx2",
            "hunyuanvideo15",
            "skyreels-v2",
            "wan-animate",
            "longcat-image",
            "chroma",
            "helios",
            "minimax-h3",
            "qwenimage21",
            "chronoedit",
        ),
        _NOT_REGISTERED,
    ),
    "flux2": "diffusers' FirstBlockCache fails on its blocks' outputs (a tuple it subtracts a list from)",
    "kandinsky5": "diffusers' FirstBlockCache fails on its blocks' signature (no `hidden_states`)",
}
_NO_ADAPTER = "cache-dit has no block adapter for the class"
_OTHER_CLASS = "cache-dit's adapter for its base family refuses the class"
# cache-dit's DBCache on each family's model, unpatched (cache-dit as .ci/run installs it)
CACHE_DIT: dict[str, str | None] = {
    **dict.fromkeys(
        (
            "flux",
            "pixart",
            "wan",
            "ltx",
            "ltx2",
            "qwenimage",
            "flux2",
            "hunyuanvideo",
            "cogvideox",
            "hunyuanvideo15",
            "wan-vace",
            "skyreels-v2",
            "cosmos",
            "longcat-image",
            "hunyuanimage",
            "chroma",
            "joyimage",
            "krea2",
            "zimage",
            "bria-fibo",
            "helios",
            "hidream",
            "kandinsky5",
            "ernie-image",
            "lumina2",
            "chronoedit",
            "cogview4",
            "mochi",
        )
    ),
    "unet": _UNET_CACHES,
    **dict.fromkeys(("sd3", "minimax-h3", "ideogram4"), _NO_ADAPTER),
    **dict.fromkeys(("wan-animate", "framepack", "qwenimage21", "flux3"), _OTHER_CLASS),
}


def _declared(table: dict[str, str | None], family: str) -> Cell:
    if family not in table:
        return Cell(UNTESTED)
    reason = table[family]
    return Cell(YES) if reason is None else Cell(NO, reason)


def matrix() -> dict[str, dict[str, Cell]]:
    """The compatibility matrix: ``family -> feature key -> Cell``, for every family of
    :func:`toma.supported` (in its order) and every feature of :data:`FEATURES`.

    Returns:
        A dict of dicts; each inner dict has one :class:`Cell` per feature, in
        :data:`FEATURES`' order.
    """
    from toma.adapters.engine import NO_BIAS, NO_PART
    from toma.adapters.parallel import refusal
    from toma.comfyui.families import FAMILIES as COMFY
    from toma.support import supported

    comfy = {f.name: f for f in COMFY}
    cp = SimpleNamespace(ulysses_anything=False, ring_anything=False)  # plain enable_parallelism
    out: dict[str, dict[str, Cell]] = {}
    for f in supported():
        name = f.family
        cp_refusal = refusal(name, cp, None)
        node = comfy.get(name)
        out[name] = {
            "attention": Cell(YES),
            "mlp": Cell(NO, f"has no {NO_PART['mlp']}") if name in NO_MLP else Cell(YES),
            "cross": Cell(YES) if name in CROSS_ATTENTION else Cell(NO, f"has no {NO_PART['cross']}"),
            "proportional": Cell(NO, NO_BIAS.format(where="its attention processor"))
            if name in NO_KEY_BIAS
            else Cell(YES),
            # the refusal apply_toma gives under enable_parallelism, said of any model
            "context_parallel": Cell(YES) if cp_refusal is None else Cell(NO, refusal(None, cp, None) or ""),
            "compile": Cell(YES, OWN_GRAPH_BREAKS.get(name, "")),
            "fbcache": _declared(FIRST_BLOCK_CACHE, name),
            "cache_dit": _declared(CACHE_DIT, name),
            "comfyui": Cell(UNTESTED, "the node has no record of it")
            if node is None
            else (Cell(YES) if node.merges else Cell(NO, node.reason or "")),
        }
    return out


def families_with(feature: str, status: str = YES) -> list[str]:
    """The families whose cell of ``feature`` has ``status`` (``✔`` by default), in the
    matrix's order."""
    if feature not in {f.key for f in FEATURES}:
        raise ValueError(f"feature must be one of {[f.key for f in FEATURES]}; got {feature!r}")
    return [family for family, cells in matrix().items() if cells[feature].status == status]
