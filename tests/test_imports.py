"""What ``import toma`` loads: the library only, and nothing heavy beyond torch."""

from __future__ import annotations

import ast
import importlib
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[1]
HEAVY = ("torch", "diffusers", "transformers", "matplotlib")


def loaded_after(code: str) -> list[str]:
    """Modules loaded by a fresh interpreter after running ``code`` (after ``import torch``)."""
    script = (
        f"import torch, sys; before = set(sys.modules); {code}; "
        "print(__import__('json').dumps(sorted(set(sys.modules) - before)))"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, cwd=Path(__file__).parents[1]
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_import_toma_loads_no_tool_no_diffusers_and_no_compiler():
    mods = loaded_after("import toma")
    assert not [m for m in mods if m.startswith("toma.tools")]
    # diffusers' model code took ~9 s and torch._dynamo ~2 s: both wait for apply_toma
    assert not [m for m in mods if m == "diffusers" or m.startswith(("diffusers.", "torch._dynamo"))]


def test_applying_to_one_family_imports_only_its_adapter():
    mods = loaded_after(
        "from diffusers import SD3Transformer2DModel as M; import toma; "
        "m = M(sample_size=8, patch_size=2, in_channels=4, out_channels=4, num_layers=1, attention_head_dim=8, "
        "num_attention_heads=2, joint_attention_dim=16, caption_projection_dim=16, pooled_projection_dim=16, "
        "pos_embed_max_size=16); "
        "toma.apply_toma(m, ratio=0.5)"
    )
    adapters = {m for m in mods if m.startswith("toma.adapters.")}
    # the engine (its spec types, merge hooks, MLP-chunking, checkpoint-replay and
    # context-parallel parts), the guard of the model's hook (caches), the ledger of changes,
    # the names of other projects' private attributes and SD3's spec; no other family's
    assert adapters == {
        "toma.adapters._private",
        "toma.adapters.base",
        "toma.adapters.caches",
        "toma.adapters.ledger",
        "toma.adapters.engine",
        "toma.adapters.spec",
        "toma.adapters.layouts",
        "toma.adapters.merging",
        "toma.adapters.state",
        "toma.adapters.chunking",
        "toma.adapters.replay",
        "toma.adapters.families",
        "toma.adapters.families.sd3",
        "toma.adapters.parallel",
        "toma.adapters.attention",
    }


def loaded_by_cli(*argv: str) -> tuple[int, set[str]]:
    """Exit code and the modules loaded when a fresh interpreter runs the ``toma`` CLI with ``argv``."""
    script = (
        "import sys, json\n"
        "from toma.tools.cli import main\n"
        "try:\n    code = main(sys.argv[1:])\nexcept SystemExit as e:\n    code = e.code\n"
        "print(json.dumps([code, sorted(sys.modules)]), file=sys.stderr)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script, *argv], capture_output=True, text=True, cwd=Path(__file__).parents[1]
    )
    code, mods = json.loads(out.stderr.strip().splitlines()[-1])
    return code, set(mods)


def test_cli_help_version_and_argument_errors_do_not_import_torch():
    # torch takes ~1.3 s to import: help, version and argparse errors must answer without it
    cases = [
        ("--help",),
        ("--version",),
        ("bench", "--help"),
        ("eval", "--help"),
        ("generate", "--help"),
        ("doctor", "--help"),
        ("tune", "--help"),
        ("bench", "--arch", "no-such-arch"),
        ("eval", "--steps", "x"),
        ("doctor", "--grid", "0"),
        ("tune", "--ratios"),
        ("no-such-command",),
    ]
    for argv in cases:
        code, mods = loaded_by_cli(*argv)
        assert code in (0, 2), (argv, code)
        heavy = sorted(m for m in mods if m.split(".")[0] in HEAVY)
        assert not heavy, (argv, heavy[:5])


def test_python_dash_m_toma_answers_help_without_torch():
    for argv in (("--help",), ("bench", "--help"), ("tune", "--help")):
        out = subprocess.run(
            [sys.executable, "-X", "importtime", "-m", "toma", *argv], capture_output=True, text=True, cwd=ROOT
        )
        assert out.returncode == 0 and out.stdout.startswith("usage: toma"), (argv, out.stderr[-500:])
        # -X importtime lists every module imported, one "import time: ... | name" line each
        imported = {
            line.rsplit("|", 1)[-1].strip() for line in out.stderr.splitlines() if line.startswith("import time:")
        }
        heavy = sorted(m for m in imported if m.split(".")[0] in HEAVY)
        assert not heavy, (argv, heavy[:5])


def test_command_packages_and_shared_helpers_import_without_torch():
    # a command's package holds its parser and constants; what needs torch waits for its run
    modules = [
        "toma.tools.cli",
        "toma.tools.archs",
        "toma.tools.generate",
        "toma.tools.bench",
        "toma.tools.bench.constants",
        "toma.tools.bench.report",
        "toma.tools.eval",
        "toma.tools.eval.constants",
        "toma.tools.tune",
        "toma.tools.tune.constants",
        "toma.tools.common",
        "toma.tools.common.options",
        "toma.tools.common.pipelines",
        "toma.tools.common.images",
        "toma.tools.common.report",
        "toma.tools.builtin",
        "toma.tools.builtin.samplers",
    ]
    script = (
        f"import importlib, json, sys; [importlib.import_module(m) for m in {modules!r}]; "
        "print(json.dumps(sorted(sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, cwd=ROOT)
    heavy = sorted(m for m in json.loads(out.stdout.strip().splitlines()[-1]) if m.split(".")[0] in HEAVY)
    assert not heavy, heavy[:5]


def toma_import_graph() -> dict[str, set[str]]:
    """Each toma module -> the toma modules its source imports, wherever the import statement is.

    Imports inside functions and under ``TYPE_CHECKING`` count: a lazy import still makes
    the two modules depend on each other, and a circle hidden that way was how the tools
    grew theirs. ``import a.b`` and ``from a.b import x`` import ``a.b``; ``from a import
    b`` imports the module ``a.b`` when there is one, else the package ``a`` (``from toma
    import apply_toma`` is an import of ``toma/__init__.py`` only). Parent packages do not
    count: Python runs them for every submodule import, and counting that would make a
    circle of every package whose ``__init__`` imports one of its submodules lazily.
    """
    package = ROOT / "toma"
    modules: dict[str, tuple[Path, bool]] = {}
    for path in package.rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        modules[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, (path, is_package) in modules.items():
        here = name if is_package else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.Import):
                graph[name] |= {a.name for a in node.names if a.name in modules}
            elif isinstance(node, ast.ImportFrom):
                if node.level:  # relative: from its own package upwards
                    base = here.split(".")[: len(here.split(".")) - node.level + 1]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                for alias in node.names:
                    target = f"{source}.{alias.name}"
                    if target in modules:
                        graph[name].add(target)
                    elif source in modules:
                        graph[name].add(source)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of ``graph`` with more than one module, or one that imports itself."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in graph[v]:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_circles_are_found():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}, "f": set()}
    assert sorted(circles(graph)) == [["a", "b", "c"], ["e"]]


def test_no_import_circle_among_toma_modules():
    graph = toma_import_graph()
    assert "toma.tools.bench.report" in graph and "toma.tools.bench.constants" in graph["toma.tools.bench.report"]
    found = circles(graph)
    # each circle with its edges, which name the imports to move
    assert not found, "\n".join(
        " <-> ".join(c) + ": " + "; ".join(f"{a} -> {b}" for a in c for b in sorted(graph[a]) if b in c) for c in found
    )


def test_core_and_the_kernels_are_leaves():
    # core/ is pure tensor maths: it imports only core/ and the optional kernels, which
    # import nothing of toma's outside themselves
    graph = toma_import_graph()
    for name, targets in graph.items():
        if name == "toma.core" or name.startswith("toma.core."):
            assert all(t.startswith(("toma.core", "toma.kernels")) for t in targets), (name, targets)
        if name == "toma.kernels" or name.startswith("toma.kernels."):
            assert all(t.startswith("toma.kernels") for t in targets), (name, targets)
    assert "toma.kernels" in graph["toma.core.plan"] or "toma.kernels.triton_ops" in graph["toma.core.plan"]


# what a family module may import: the spec and its layouts, the shared grid readers,
# attention's bias forms, the hook base (Lumina 2's own hook), the settings and core maths
FAMILY_MAY_IMPORT = (
    "toma.adapters.spec",
    "toma.adapters.layouts",
    "toma.adapters.grids",
    "toma.adapters.attention",
    "toma.adapters.base",
    "toma.config",
    "toma.core",
)


def imported_names(path: Path) -> list[tuple[str, tuple[str, ...]]]:
    """Each import statement of ``path``'s source (in functions and under ``TYPE_CHECKING``
    too) as ``(module, names)``: ``from a import b, c`` is ``("a", ("b", "c"))``, ``import
    a.b`` is ``("a.b", ())``. Relative imports are refused: toma's modules import absolutely."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name, ()) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            assert not node.level, f"{path}: relative import"
            found.append((node.module or "", tuple(alias.name for alias in node.names)))
    return found


def test_families_rest_on_the_spec_and_derive_only_from_a_spec():
    from toma.adapters import FAMILIES

    package = ROOT / "toma" / "adapters" / "families"
    family_modules = {f"toma.adapters.families.{p.stem}" for p in package.glob("*.py") if p.stem != "__init__"}
    # every registered family lives in families/, one module each, and nothing else does
    assert {module for module, _ in FAMILIES.values()} == family_modules
    for module in sorted(family_modules):
        path = package / f"{module.rpartition('.')[2]}.py"
        for source, names in imported_names(path):
            if not source.startswith("toma"):
                continue
            whole = [f"{source}.{n}" for n in names] if source == "toma.adapters.families" else [source]
            for target in whole:
                if target in family_modules:  # another family: its declaration only
                    assert source == target and set(names) == {"SPEC"}, (
                        f"{module} imports {names or target} of {target}; a family may take another's SPEC only"
                    )
                else:
                    assert target.startswith(FAMILY_MAY_IMPORT), (
                        f"{module} imports {target}; a family imports only {', '.join(FAMILY_MAY_IMPORT)}"
                    )


def test_the_registry_reads_each_familys_own_declaration():
    # a family lands by adding its file: the registry reads the name and classes its SPEC
    # states, without importing it; they must be what the imported spec says
    from toma.adapters import FAMILIES

    for name, (module, classes) in FAMILIES.items():
        spec = importlib.import_module(module).SPEC
        assert (spec.name, spec.classes) == (name, classes), module


def test_a_new_family_file_is_found_without_registering_it(tmp_path):
    import toma.adapters as adapters

    source = ROOT / "toma" / "adapters" / "families"
    package = tmp_path / "adapters" / "families"
    package.mkdir(parents=True)
    for path in source.glob("*.py"):
        (package / path.name).write_text(path.read_text(encoding="utf-8"), encoding="utf-8")
    (package / "toy.py").write_text(
        "import dataclasses\n"
        "from toma.adapters.families.wan import SPEC as WAN\n"
        'SPEC = dataclasses.replace(WAN, name="toy", classes=("ToyTransformer3DModel",))\n',
        encoding="utf-8",
    )
    real = adapters.__file__
    adapters.__file__ = str(tmp_path / "adapters" / "__init__.py")
    adapters._registry.cache_clear()
    try:
        found = adapters._registry()
    finally:
        adapters.__file__ = real
        adapters._registry.cache_clear()
    assert found["toy"] == ("toma.adapters.families.toy", ("ToyTransformer3DModel",))
    assert set(found) - {"toy"} == set(adapters.FAMILIES)


def test_nothing_outside_the_families_imports_or_names_one():
    # the engine and the tools reach a family only through the registry's FAMILIES table
    graph = toma_import_graph()
    for name, targets in graph.items():
        if name.startswith("toma.adapters.families"):
            continue
        assert not [t for t in targets if t.startswith("toma.adapters.families")], (name, sorted(targets))
    # nor does an engine module name one for a lazy import; the registry is the one that does
    for path in (ROOT / "toma" / "adapters").glob("*.py"):
        if path.name != "__init__.py":
            assert "adapters.families" not in path.read_text(encoding="utf-8"), path


def test_lazy_public_names_resolve():
    import toma

    assert {"apply_toma", "remove_toma", "get_toma", "ToMAConfig", "ToMAPatch"} <= set(dir(toma))
    from toma import ToMAConfig, apply_toma
    from toma.api import apply_toma as direct

    assert apply_toma is direct and ToMAConfig(ratio=0.25).ratio == 0.25
    import pytest

    with pytest.raises(AttributeError, match="no_such_name"):
        toma.no_such_name
