"""The engine's grid-shaped enter and leave points (``enter=("channels_last", path)``), on a toy model.

Its forward embeds channel-last latents ``(B, t, h, w, C)`` into a grid of the same shape,
flattens it into the blocks' sequence with a plain reshape, and reshapes the blocks' output
back into a grid for its head, as Kandinsky 5 does: no module takes or gives the
``(B, N, C)`` sequence outside the blocks.
"""

from __future__ import annotations

import dataclasses

import torch

from toma.adapters.ledger import Ledger
from toma.adapters.engine import FamilySpec, Site, attach, find_targets
from toma.adapters.state import PlanCache
from toma.config import ToMAConfig


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(16)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 16))

    def forward(self, hidden_states):
        return hidden_states + self.mlp(self.norm(hidden_states))


class ToyGridDiT(torch.nn.Module):
    """Latents ``(B, t, h, w, 4)`` in, a prediction of the same shape out."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Linear(4, 16)
        self.blocks = torch.nn.ModuleList([_Block() for _ in range(2)])
        self.head = torch.nn.Linear(16, 4)

    def forward(self, hidden_states):
        grid = self.embed(hidden_states)
        x = grid.flatten(1, 3)
        for block in self.blocks:
            x = block(x)
        return self.head(x.reshape(grid.shape))


SPEC = FamilySpec(
    name="toy-grid",
    classes=("ToyGridDiT",),
    stacks=("blocks",),
    sites=lambda stack, block: [Site("mlp", "mlp")],
    grid=lambda model, call: tuple(call["hidden_states"].shape[1:4]),
    enter=("channels_last", "embed"),
    leave="head",
)


def run(spec: FamilySpec, latents: torch.Tensor, monkeypatch, tiled: bool) -> torch.Tensor:
    """The toy's output merged under ``spec`` (ratio 0.5, MLPs), in tile order or forced raster order."""
    model = ToyGridDiT()
    config = ToMAConfig(ratio=0.5, merge_attn=False, merge_mlp=True, blocks={"blocks": range(2)})
    cache = PlanCache(config)
    attach(spec, model, find_targets(spec, model, config)[0], cache, Ledger())
    real, used = PlanCache.tile_order_layout, []
    layout = (lambda self, *a, **k: used.append(real(self, *a, **k)) or used[-1]) if tiled else None
    monkeypatch.setattr(PlanCache, "tile_order_layout", layout or (lambda self, *a, **k: None))
    with torch.no_grad():
        out = model(latents)
    monkeypatch.setattr(PlanCache, "tile_order_layout", real)
    assert cache._plans  # it merged
    assert not tiled or any(layout is not None for layout in used)  # and kept tile order
    return out


LATENTS = torch.randn(2, 2, 8, 8, 4, generator=torch.Generator().manual_seed(1))


def test_grid_tokens_in_tile_order_compute_what_raster_order_does(monkeypatch):
    # the same plans and merges, from a view of tile-ordered tokens or by gathers; MLPs
    # treat tokens one at a time, so only the merges' sums differ (float32 ulps)
    with torch.no_grad():
        plain = ToyGridDiT()(LATENTS)
    tiled = run(SPEC, LATENTS, monkeypatch, tiled=True)
    torch.testing.assert_close(tiled, run(SPEC, LATENTS, monkeypatch, tiled=False), rtol=1e-5, atol=1e-6)
    assert (tiled - plain).abs().max() > 1e-3  # merging moved the output: the check above can tell


def test_as_plain_tokens_a_grid_would_stay_in_raster_order(monkeypatch):
    # the reorder points pass a grid untouched when told it is (B, N, C) tokens: the blocks would read
    # raster-ordered tokens as tile-ordered ones, and the head get them scrambled
    wrong = run(dataclasses.replace(SPEC, enter=("output", "embed")), LATENTS, monkeypatch, tiled=True)
    raster = run(SPEC, LATENTS, monkeypatch, tiled=False)
    assert (wrong - raster).abs().max() > 1e-2
