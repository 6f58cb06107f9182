"""The documentation: generated pages match the code, ``toma.supported()`` matches the
family records, the README stays short and in order, and the site's strict build passes and
fails where it should (a broken link, a page missing from the nav).

The generated pages are compared with what ``python -m toma.tools.docs`` writes, so editing
a family, ``ToMAConfig`` or a command's options without rerunning it fails here. The MkDocs
builds run on a copy of ``docs/`` in a temporary folder: nothing is written in the checkout.
"""

from __future__ import annotations

import functools
import importlib
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import toma
from toma import support
from toma.adapters import FAMILIES, UNSUPPORTED
from toma.adapters.parallel import SUPPORTED as CONTEXT_PARALLEL
from toma.tools import docs as gen
from toma.tools.cli import main as cli

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def expected() -> dict[Path, str]:
    return gen.expected(ROOT)


def test_committed_generated_pages_are_what_the_command_writes(expected):
    stale = [str(p.relative_to(ROOT)) for p, text in expected.items() if p.read_text(encoding="utf-8") != text]
    assert not stale, f"stale generated pages {stale}: run `python -m toma.tools.docs` and commit them"


def _checkout_copy(tmp_path: Path) -> Path:
    """The files the generator reads and writes, copied to a scratch checkout."""
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    shutil.copy(ROOT / "README.md", tmp_path / "README.md")
    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    return tmp_path


def test_check_reports_an_edited_page_and_a_rerun_restores_it(tmp_path, capsys):
    root = _checkout_copy(tmp_path)
    page = root / "docs" / "options.md"
    original = page.read_text(encoding="utf-8")
    page.write_text(original.replace("| `ratio` |", "| `ratio_old` |"), encoding="utf-8")
    readme = root / "README.md"
    readme.write_text(re.sub(r"\n\| Flux\.1 \|[^\n]*", "", readme.read_text(encoding="utf-8")), encoding="utf-8")
    assert gen.main(["--root", str(root), "--check"]) == 1
    err = capsys.readouterr().err
    assert "docs/options.md" in err and "README.md" in err and "docs/models.md" not in err
    assert page.read_text(encoding="utf-8") != original  # --check writes nothing
    assert gen.main(["--root", str(root)]) == 0
    assert page.read_text(encoding="utf-8") == original
    assert readme.read_text(encoding="utf-8") == (ROOT / "README.md").read_text(encoding="utf-8")
    assert gen.main(["--root", str(root), "--check"]) == 0


def test_generator_refuses_a_readme_without_the_table_markers(tmp_path):
    root = _checkout_copy(tmp_path)
    (root / "README.md").write_text("# toma\n", encoding="utf-8")
    with pytest.raises(ValueError, match="models table markers"):
        gen.main(["--root", str(root), "--check"])


def test_options_page_needs_every_field_described(monkeypatch):
    doc = toma.ToMAConfig.__doc__
    monkeypatch.setattr(toma.ToMAConfig, "__doc__", re.sub(r"\n {8}seed: [^\n]*", "", doc))
    with pytest.raises(ValueError, match="does not describe seed"):
        gen.options_page()


def test_supported_lists_every_family_from_the_records():
    families = toma.supported()
    assert [f.family for f in families] == ["unet", *FAMILIES]
    for f in families[1:]:
        module, classes = FAMILIES[f.family]
        spec = importlib.import_module(module).SPEC
        assert f.classes == classes and f.video == spec.video
        assert f.context_parallel == (f.family in CONTEXT_PARALLEL)
        assert f.title and f.summary, f"{f.family}: its module docstring lacks 'Title (``Class``): summary'"
        # every family's default today: skip_first(5), in each of its stacks
        several = " of each stack" if len(spec.stacks) > 1 else ""
        assert f.default_blocks.startswith(f"every block but the first 5{several} (at most half")
    assert {f.family for f in families if f.context_parallel} == set(CONTEXT_PARALLEL)


def test_the_comfyui_column_is_the_nodes_own_record():
    from toma.comfyui.families import FAMILIES as COMFY

    shown = {f.family: f.comfyui for f in toma.supported()}
    recorded = {c.name: c for c in COMFY if c.name in shown}
    assert {"unet", "flux", "wan", "qwenimage", "hunyuanvideo", "zimage", "ltx"} <= set(recorded)
    for name, comfy in recorded.items():
        assert shown[name] == ("✔" if comfy.merges else f"✖ {comfy.reason}")
    assert all(not text for name, text in shown.items() if name not in recorded)


def test_models_page_and_readme_table_name_every_family_and_refused_class(expected):
    models = expected[ROOT / "docs" / "models.md"]
    readme = expected[ROOT / "README.md"]
    table = readme.split(gen.TABLE_START)[1].split(gen.TABLE_END)[0]
    rows = [line for line in table.strip().splitlines()[2:]]
    assert len(rows) == len(FAMILIES) + 1  # one line per family, the UNets first
    for f in toma.supported():
        assert f"### {f.family}\n" in models and f"`{f.classes[0]}`" in table
    for cls in UNSUPPORTED:
        assert f"| `{cls}` |" in models


def _readme_rows() -> tuple[list[str], list[list[str]]]:
    """The committed README's models table: its header cells and each row's cells."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    lines = text.split(gen.TABLE_START)[1].split(gen.TABLE_END)[0].strip().splitlines()
    [header, *rows] = [[c.strip() for c in re.split(r"(?<!\\)\|", line.strip()[1:-1])] for line in lines]
    return header, rows[1:]  # rows[0] is the --- line


def test_readme_table_says_what_merges_in_each_family_as_its_record_does():
    header, rows = _readme_rows()
    assert "merged by default" in header, f"the README's models table lacks the column of what merges: {header}"
    assert len(header) == len(gen.README_COLUMNS) and all(len(row) == len(header) for row in rows)
    families = toma.supported()
    assert len(rows) == len(families)
    for row, f in zip(rows, families):
        cell = dict(zip(header, row))
        assert cell["models"] == gen._cell(f.title)
        assert cell["merged by default"] == gen._cell(f.merges), f.family
        assert cell["image / video"] == ("video" if f.video else "image")
        assert cell["context parallel"] == ("✔" if f.context_parallel else "✖")
        assert cell["ComfyUI"] == (f.comfyui[:1] or "–")


def test_what_merges_is_what_the_specs_and_config_defaults_choose():
    parts = [word for switch, word in support._PARTS if getattr(toma.ToMAConfig(), switch)]
    assert parts == ["attention"]  # merge_attn on, merge_crossattn and merge_mlp off by default
    for f in toma.supported()[1:]:
        spec = importlib.import_module(FAMILIES[f.family][0]).SPEC
        [skipped] = {len(range(40)) - len(spec.default_blocks(stack, 40)) for stack in spec.stacks}
        assert all(spec.default_blocks(stack, 40) == tuple(range(skipped, 40)) for stack in spec.stacks)
        assert f.merges == f"attention, blocks {skipped}+", f.family
        # a short stack keeps its second half: Flux.2's 8 double blocks skip 4
        halved = all(
            spec.default_blocks(s, 2 * skipped - 2) == tuple(range(skipped - 1, 2 * skipped - 2)) for s in spec.stacks
        )
        assert ("at most half" in f.default_blocks) == halved, f.family
    assert toma.supported()[0].merges == "attention, highest-res level"  # levels=1


def test_default_blocks_words_follow_the_rule_of_the_spec(monkeypatch):
    from types import SimpleNamespace

    from toma.adapters.spec import skip_first

    def spec(stacks, rule):
        return SimpleNamespace(stacks=stacks, default_blocks=rule)

    assert support._default_blocks(spec(("b",), skip_first(5))) == (
        "every block but the first 5 (at most half the blocks)",
        "blocks 5+",
    )
    assert support._default_blocks(spec(("a", "b"), skip_first(3))) == (
        "every block but the first 3 of each stack (at most half its blocks)",
        "blocks 3+",
    )
    assert support._default_blocks(spec(("a",), lambda s, n: tuple(range(n)))) == ("every block", "all blocks")
    assert support._default_blocks(spec(("a",), lambda s, n: tuple(range(2, n)))) == (
        "every block but the first 2",
        "blocks 2+",
    )
    mixed = spec(("a", "b"), lambda s, n: tuple(range(n)) if s == "a" else (0, 3))
    assert support._default_blocks(mixed) == ("a: every block; b: 0, 3 (of 40)", "a: all blocks; b: 0, 3 (of 40)")
    # the parts and the UNet levels follow ToMAConfig's defaults
    monkeypatch.setattr("toma.config.ToMAConfig", functools.partial(toma.ToMAConfig, merge_mlp=True, levels=2))
    assert support._default_parts() == "attention, MLP"
    assert support._unet_levels() == ("the 2 highest-resolution attention levels", "2 highest-res levels")


def test_doctor_models_prints_every_family_and_runs_no_check(capsys):
    assert cli(["doctor", "--models"]) == 0
    out = capsys.readouterr().out
    assert f"toma merges {len(FAMILIES) + 1} model families" in out
    lines = out.splitlines()
    for name in ["unet", *FAMILIES]:
        assert any(line.split()[0] == name for line in lines[2:]), name
    assert "checks passed" not in out


def test_version_stays_one_line(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out == f"toma {toma.__version__}\n"


def test_readme_is_short_in_the_issue_order_and_its_links_resolve():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(text.encode()) <= 12_000
    headings = re.findall(r"^## (.+)$", text, flags=re.M)
    order = ["What it looks like", "Speed today", "Install", "Quick start", "Supported models", "Documentation"]
    assert [h for h in headings if h in order] == order
    # the distribution is toma-diffusion: the `toma` on PyPI is another project
    assert not re.search(r"pip install (-U )?toma\b(?!-)", text)
    assert "no gpu has run" in text.lower()
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text)
    missing = [link for link in links if "://" not in link and not (ROOT / link).exists()]
    assert not missing, missing
    # .ci/run runs the README's test command: the development page holds it
    assert "docs/development.md" in links
    development = (ROOT / "docs" / "development.md").read_text(encoding="utf-8")
    assert "python3 -m pytest -q" in development and ".ci/run" in development


def test_troubleshooting_quotes_the_error_of_a_shadowing_checkout(tmp_path):
    # a checkout folder named toma/ beside a script: Python imports it as a namespace package
    (tmp_path / "toma").mkdir()
    (tmp_path / "toma" / "pyproject.toml").write_text("", encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    # -S: no site-packages, as where toma is not installed; the folder is all that `import toma` finds
    script = "import toma; toma.apply_toma"
    run = subprocess.run([sys.executable, "-S", "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True)
    [error] = run.stderr.strip().splitlines()[-1:]
    assert error == "AttributeError: module 'toma' has no attribute 'apply_toma'"
    troubleshooting = (ROOT / "README.md").read_text(encoding="utf-8").split("\n## Troubleshooting\n", 1)[1]
    assert "`module 'toma' has no attribute 'apply_toma'`" in troubleshooting.split("\n## ", 1)[0]


def test_accelerate_is_a_dependency():
    # without it diffusers prints a 6-line warning at every pipeline load of `toma generate`
    # read without tomllib, which Python 3.10 lacks: the list's quoted items, comments aside
    pyproject = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    [block] = re.findall(r"^dependencies = \[\n(.*?)^\]", pyproject, re.M | re.S)
    names = re.findall(r'^\s*"([A-Za-z0-9_.-]+)', block, re.M)
    assert "torch" in names and "accelerate" in names


def _github_anchor(heading: str) -> str:
    """The anchor GitHub gives a Markdown heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_readme_speed_rows_lead_to_their_figures_in_benchmarks():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    table = readme.split("\n## Speed today\n", 1)[1].split("\n## ", 1)[0]
    lines = [line.strip("| ") for line in table.splitlines() if line.startswith("| ") and "---" not in line]
    rows = [line.split(" | ") for line in lines[1:]]
    benchmarks = (ROOT / "BENCHMARKS.md").read_text(encoding="utf-8")
    sections = {
        _github_anchor(h): body for h, body in re.findall(r"^## ([^\n]+)\n(.*?)(?=^## |\Z)", benchmarks, re.M | re.S)
    }
    assert len(rows) >= 5
    for model, _machine, merged, ideal, source in rows:
        # each row links to the BENCHMARKS.md section that holds its figures with their command
        [anchor] = re.findall(r"\]\(BENCHMARKS\.md#([^)]+)\)", source) or [None]
        assert anchor in sections, f"{model}: {source} is not a BENCHMARKS.md heading"
        shown = {f"{float(x):.2f}" for x in re.findall(r"(\d+\.\d+)x", sections[anchor])}
        for figure in (merged, ideal):
            assert figure.removesuffix("x") in shown, f"{model}: {figure} is not in BENCHMARKS.md#{anchor}"


def test_development_set_up_installs_what_ci_installs_and_says_where_comfyui_is():
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    [extras] = re.findall(r'-e "\.\[([^\]]+)\]"', ci)
    development = (ROOT / "docs" / "development.md").read_text(encoding="utf-8")
    # the set-up block installs the same extras, so that the suite runs as in CI
    assert f'pip install -e ".[{extras}]"' in development
    # the ComfyUI tests skip without a ComfyUI checkout: the page says where they look
    assert "../shared/vendor/ComfyUI" in development and "$TOMA_COMFYUI" in development
    assert "cache-dit" in development and re.search(r"\d+ min \d+ s", development)  # its tests; the measured run


def _mkdocs(tmp_path: Path, edit=None) -> subprocess.CompletedProcess:
    """``mkdocs build --strict`` of a copy of the site (``edit(root)`` changes the copy first)."""
    if importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("material") is None:
        if os.environ.get("CI"):
            pytest.fail("mkdocs and mkdocs-material are missing: CI installs the docs extra (.ci/run)")
        pytest.skip("mkdocs is not installed (pip install -e '.[docs]')")
    root = tmp_path / "site-src"
    root.mkdir()
    shutil.copy(ROOT / "mkdocs.yml", root / "mkdocs.yml")
    shutil.copytree(ROOT / "docs", root / "docs")
    if edit is not None:
        edit(root)
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    command = [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "out")]
    return subprocess.run(command, cwd=root, capture_output=True, text=True, env=env, timeout=300)


def _warnings(run: subprocess.CompletedProcess) -> list[str]:
    return [line for line in run.stderr.splitlines() if line.startswith(("WARNING", "ERROR"))]


def test_site_builds_strictly(tmp_path):
    run = _mkdocs(tmp_path)
    assert run.returncode == 0 and not _warnings(run), run.stderr[-3000:]


def test_a_broken_link_fails_the_strict_build(tmp_path):
    def break_a_link(root: Path) -> None:
        with open(root / "docs" / "caches.md", "a", encoding="utf-8") as f:
            f.write("\nSee [the missing page](no-such-page.md).\n")

    run = _mkdocs(tmp_path, break_a_link)
    assert run.returncode != 0
    assert any("no-such-page.md" in w for w in _warnings(run)), run.stderr[-3000:]


def test_a_page_missing_from_the_nav_fails_the_strict_build(tmp_path):
    def orphan(root: Path) -> None:
        (root / "docs" / "orphan.md").write_text("# Orphan\n\nIn no nav.\n", encoding="utf-8")

    run = _mkdocs(tmp_path, orphan)
    assert run.returncode != 0
    assert any('not included in the "nav"' in w for w in _warnings(run)), run.stderr[-3000:]
    assert "  - orphan.md" in run.stderr.splitlines()


# ------------------------------------------------------------------ the compatibility matrix
def _session_marks(config: pytest.Config) -> list[list[str]] | None:
    """The matrix's marks as this session collected them (``tests/conftest.py``), where it
    collected every file the matrix names whole (no ``file::test`` selection), else None."""
    from tests.compat_cells import COMPAT_MARKS
    from toma.compat import FEATURES

    found = config.stash.get(COMPAT_MARKS, {})
    files = sorted({t for f in FEATURES for t in f.tests})
    narrowed = any("::" in str(arg) for arg in config.invocation_params.args)
    if narrowed or not all(f in found for f in files):
        return None
    return [mark for f in files for mark in found[f]]


@pytest.fixture(scope="module")
def compat_marks(request) -> list[list[str]]:
    """The ``compat`` marks of the tests that back the matrix: this session's, where it
    collected those files (the whole suite does), else collected once in a subprocess as
    ``python -m toma.tools.docs`` does (not run)."""
    return _session_marks(request.config) or gen.collect_marks(ROOT)


def test_the_generators_collection_finds_the_marks_of_the_files_it_is_given(tmp_path, monkeypatch):
    # the generator's own collection (a pytest subprocess with its plugin), which the suite
    # skips when it collected the matrix's files itself: on a scratch checkout of one file
    from types import SimpleNamespace

    from toma import compat

    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_cells.py").write_text(
        "import pytest\n\n"
        "@pytest.mark.parametrize('family', [pytest.param('a', marks=pytest.mark.compat('f', 'a', 'Y')), 'b'])\n"
        "def test_cell(family):\n    pass\n\n"
        "@pytest.mark.compat('g', 'c', 'N')\ndef test_other():\n    pass\n"
    )
    monkeypatch.setattr(compat, "FEATURES", (SimpleNamespace(key="f", tests=("tests/test_cells.py",)),))
    assert gen.collect_marks(tmp_path) == [
        ["f", "a", "Y", "tests/test_cells.py::test_cell[a]"],
        ["g", "c", "N", "tests/test_cells.py::test_other"],
    ]


def test_every_tick_of_the_matrix_is_backed_by_a_test(compat_marks):
    from toma.compat import FEATURES, YES, matrix

    assert gen.uncovered(matrix(), compat_marks) == []
    # every feature has cases, each in one of the files the matrix names for it
    files = {f.key: f.tests for f in FEATURES}
    assert {feature for feature, *_ in compat_marks} == set(files)
    for feature, family, status, test in compat_marks:
        assert test.split("::")[0] in files[feature], test
    cells = sum(row[f].status == YES for row in matrix().values() for f in files)
    assert cells > 150  # 33 families x 9 features, most of them ✔


def test_a_tick_no_test_covers_fails_the_generator(compat_marks, monkeypatch, capsys):
    from toma import compat

    # the matrix claims a cross-attention for Flux, whose blocks have none: no case covers it
    monkeypatch.setattr(compat, "CROSS_ATTENTION", compat.CROSS_ATTENTION | {"flux"})
    assert gen.uncovered(compat.matrix(), compat_marks) == [("flux", "cross")]
    monkeypatch.setattr(gen, "collect_marks", lambda root: compat_marks)
    assert gen.check_coverage(ROOT) == 1
    assert "flux / cross" in capsys.readouterr().err
    monkeypatch.setattr(compat, "CROSS_ATTENTION", compat.CROSS_ATTENTION - {"flux"})
    assert gen.check_coverage(ROOT) == 0


def test_compatibility_page_shows_every_cell_and_the_codes_reasons(expected):
    from types import SimpleNamespace

    from toma.adapters.engine import NO_PART
    from toma.adapters.parallel import refusal
    from toma.compat import FEATURES, matrix

    page = expected[ROOT / "docs" / "compatibility.md"]
    cells = matrix()
    rows = [line for line in page.splitlines() if line.startswith("| [")]
    assert [row.split("]")[0][3:] for row in rows] == list(cells) == [f.family for f in toma.supported()]
    assert all(row.count(" | ") == len(FEATURES) for row in rows)
    assert f"no {NO_PART['cross']}" in page  # the refusal's own words
    cp = SimpleNamespace(ulysses_anything=False, ring_anything=False)
    for family, row in cells.items():
        assert (row["context_parallel"].status == "✔") == (refusal(family, cp, None) is None), family
    assert refusal(None, cp, None) in page
    # a ✔ with a note (HiDream's own graph breaks) leads to it by its number
    note = cells["hidream"]["compile"]
    assert note.status == "✔" and "HiDream's own mixture-of-experts MLP breaks the graph" in note.reason
    [number] = re.findall(rf"^(\d+)\. {re.escape(gen._md(note.reason))}$", page, re.M)
    [hidream] = [row for row in rows if row.startswith("| [hidream]")]
    keys = [f.key for f in FEATURES]
    assert hidream.split(" | ")[1 + keys.index("compile")] == f"✔ ({number})"
    from toma.comfyui.families import FAMILIES as COMFY

    for node in COMFY:
        name = node.name
        assert (cells[name]["comfyui"].status == "✔") == node.merges
        if not node.merges:
            assert gen._md(node.reason) in page


def test_node_page_lists_every_input_and_needs_a_tooltip_for_each(expected, monkeypatch):
    from toma.comfyui.node import ToMAModel

    page = expected[ROOT / "docs" / "comfyui-node.md"]
    schema = ToMAModel.INPUT_TYPES()
    for group in ("required", "optional"):
        for name, spec in schema[group].items():
            assert f"| `{name}` | {'yes' if group == 'required' else 'no'} |" in page
            assert gen._cell(spec[1]["tooltip"]) in page
    assert "| `ratio` | yes | `FLOAT` | `0.5` | 0.0 to 0.95, step 0.05 |" in page
    untipped = {**schema, "optional": {**schema["optional"], "extra": ("INT", {"default": 1})}}
    monkeypatch.setattr(ToMAModel, "INPUT_TYPES", classmethod(lambda cls: untipped))
    with pytest.raises(ValueError, match="'extra' has no tooltip"):
        gen.node_page()


def test_plain_doctor_names_the_supported_families_in_one_line(capsys):
    from toma.support import family_names

    tiny = ["--device", "cpu", "--grid", "8", "--channels", "16", "--attn-grid", "8", "--heads", "2"]
    tiny += ["--head-dim", "8", "--repeats", "1", "--dtypes", "fp32", "--backends", "native"]
    assert cli(["doctor", *tiny]) == 0
    out = capsys.readouterr().out
    [line] = [line for line in out.splitlines() if line.startswith("families: ")]
    names = [f.family for f in toma.supported()]
    assert family_names() == names
    assert line == f"families: {len(names)}: {', '.join(names)} (toma doctor --models: what each supports)"
