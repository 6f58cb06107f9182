"""Old code against new, bitwise, in one process: the check that a refactor changed nothing.

Imports an older toma (a git revision, checked out as a worktree, or a folder), runs every
family of tests/tiny_models.py through it, then drops it from the process, imports the
working tree's toma and runs the same calls. Same machine, same process, same thread
count: any difference is the code's. Per family it compares, with torch.equal:

* two forwards of a patched model at ratio 0.5 (the second one at a lower timestep reuses
  nothing across steps by default, but runs the step logic), with proportional attention
  where the family takes it;
* the input gradient and a parameter gradient of a checkpointed forward and backward,
  with a no-grad forward in between (the replay path of checkpointed blocks);
* the output after remove_toma.

    python benchmarks/bitwise_ab.py --old HEAD~1
    python benchmarks/bitwise_ab.py --old /path/to/old/checkout --families flux,wan
Exits 1 if anything differs.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from tests.tiny_models import FAMILIES  # noqa: E402  (imports no toma)


def old_tree(old: str) -> Path:
    path = Path(old)
    if path.is_dir():
        return path.resolve()
    rev = subprocess.run(
        ["git", "rev-parse", "--short", old], cwd=ROOT, check=True, capture_output=True, text=True
    ).stdout.strip()
    tree = Path(tempfile.gettempdir()) / f"toma-ab-{rev}"
    if not tree.exists():
        subprocess.run(
            ["git", "worktree", "add", "--detach", str(tree), rev], cwd=ROOT, check=True, capture_output=True
        )
    return tree


def first_float_input(kw: dict) -> str:
    """The first input that is a float tensor of 3 or more dimensions, or a list of float
    tensors (Z-Image takes its latents as one tensor per sample)."""

    def is_float(v) -> bool:
        return isinstance(v, torch.Tensor) and v.is_floating_point()

    return next(
        k
        for k, v in kw.items()
        if (is_float(v) and v.dim() >= 3) or (isinstance(v, list) and v and all(is_float(t) for t in v))
    )


def run_family(toma, fam) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    options = dict(fam.options, ratio=0.5, proportional_attention=True if fam.proportional else None)
    model, kw = fam.make(), fam.inputs(2)
    toma.apply_toma(model, **options)
    out["forward"] = fam.output(model, kw)
    ts = kw.get("timestep")
    if isinstance(ts, torch.Tensor):
        out["forward, next step"] = fam.output(model, {**kw, "timestep": ts * 0.5})
    # checkpointed backward, with another forward between the forward and its backward
    if fam.checkpointing and hasattr(model, "enable_gradient_checkpointing"):
        model.enable_gradient_checkpointing()
    name = first_float_input(kw)
    given = kw[name]
    xs = [t.clone().requires_grad_(True) for t in (given if isinstance(given, list) else [given])]
    loss = fam.sample(model, {**kw, name: xs if isinstance(given, list) else xs[0]}).square().mean()
    fam.output(model, fam.inputs(2))
    loss.backward()
    out["input gradient"] = torch.cat([x.grad.flatten() for x in xs])
    param = next(p for p in model.parameters() if p.grad is not None)
    out["a parameter's gradient"] = param.grad
    model.zero_grad(set_to_none=True)
    toma.remove_toma(model)
    out["after remove_toma"] = fam.output(model, kw)
    return out


def run_side(root: Path, families: list[str]) -> dict[str, dict[str, torch.Tensor]]:
    for name in [m for m in sys.modules if m == "toma" or m.startswith("toma.")]:
        del sys.modules[name]
    sys.path.insert(0, str(root))
    try:
        import toma

        assert Path(toma.__file__).resolve().is_relative_to(root.resolve()), toma.__file__
        results = {}
        for fam in families:
            torch.manual_seed(0)
            results[fam] = run_family(toma, FAMILIES[fam])
        return results
    finally:
        sys.path.remove(str(root))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old", required=True, help="a git revision, or a folder holding the old checkout")
    parser.add_argument("--families", default=",".join(FAMILIES), help=f"of {', '.join(FAMILIES)}")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    families = [f for f in args.families.split(",") if f]
    for f in families:
        if f not in FAMILIES:
            parser.error(f"--families: unknown family {f!r}; known: {', '.join(FAMILIES)}")
    old = run_side(old_tree(args.old), families)
    new = run_side(ROOT, families)
    differ = 0
    for fam in families:
        for what, ref in old[fam].items():
            same = torch.equal(ref, new[fam][what])
            differ += not same
            gap = "" if same else f"  max |diff| {(ref.double() - new[fam][what].double()).abs().max().item():.3g}"
            print(f"{fam:13} {what:24} {'bitwise equal' if same else 'DIFFERS'}{gap}")
    print(f"{'all bitwise equal' if not differ else f'{differ} differ'} ({len(families)} families, old {args.old})")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
