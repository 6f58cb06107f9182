"""``toma bench`` end to end on tiny architectures, and the ideal / ToDo baselines."""

from __future__ import annotations

import json

import pytest
import torch

import toma
from toma.tools.bench import harness as bench_harness
from toma.tools.archs import ARCHS, build_model, call_denoiser, make_inputs, merged_blocks, reduced_config
from toma.tools.baselines import (
    IdealPlan,
    apply_ideal,
    apply_todo,
    apply_tomesd,
    get_baseline,
    remove_baseline,
    tomesd_available,
    todo_pool,
)
from toma.tools.cli import main
from toma.core.tiling import make_layout


@pytest.fixture(scope="module")
def tiny_unet():
    return build_model(ARCHS["tiny-unet"])


@pytest.fixture(scope="module")
def tiny_flux():
    return build_model(ARCHS["tiny-flux"])


def forward(arch_name, model, **kw):
    arch = ARCHS[arch_name]
    with torch.no_grad():
        return call_denoiser(arch, model, make_inputs(arch, 64, **kw))[0]


def recorder(seen, key):
    """A forward pre-hook storing the token count of the first call's input under ``key``."""

    def hook(module, args):
        seen.setdefault(key, args[0].shape[1])

    return hook


def token_counts(model, names):
    """Tokens reaching the first projection of each named attention (after any merge)."""
    seen = {}
    handles = []
    for name in names:
        module = model.get_submodule(name)
        first = module.to_q if hasattr(module, "to_q") else module.net[0]
        handles.append(first.register_forward_pre_hook(recorder(seen, name)))
    return seen, handles


def test_bench_cli_tiny_unet_writes_json_and_png(tmp_path, capsys):
    rc = main(
        [
            "bench",
            "--arch",
            "tiny-unet",
            "--resolution",
            "64",
            "--ratios",
            "0.5",
            "--methods",
            "none,toma,tomesd,ideal,todo",
            "--repeats",
            "1",
            "--warmup",
            "0",
            "--batch",
            "1,2",
            "--out",
            str(tmp_path),
            "--name",
            "t",
            "--no-progress",
            "--clock",
            "cpu",
        ]
    )
    assert rc == 0
    report = json.loads((tmp_path / "t.json").read_text())
    assert report["clock"] == "cpu"
    assert (tmp_path / "t.png").read_bytes()[:4] == b"\x89PNG"
    rows = {(r["method"], r["batch"]): r for r in report["results"]}
    methods = {"none", "toma", "ideal", "todo"} | ({"tomesd"} if tomesd_available() else set())
    assert {m for m, _ in rows} == methods
    assert report["threads"] == torch.get_num_threads()
    # None when timing noise makes the tiny ideal no faster than unpatched
    assert rows[("ideal", 1)]["efficiency"] in (None, pytest.approx(1.0))
    assert set(rows[("toma", 1)]["overhead"]) == {"select", "weights", "merge", "unmerge", "total"}
    assert rows[("toma", 1)]["overhead"]["merge"] > 0
    assert "vs_batch1" in rows[("toma", 2)]
    # kernel counts at the first batch size: the unpatched total, the others relative to it
    assert rows[("none", 1)]["kernels"] > 0 and rows[("none", 1)]["extra_kernels"] == 0
    assert 0 < rows[("ideal", 1)]["extra_kernels"] < rows[("toma", 1)]["extra_kernels"]
    assert rows[("toma", 2)]["kernels"] is None
    out = capsys.readouterr().out
    assert "speedup" in out and "efficiency" in out and "CPU time of this process" in out
    assert f"kernels per forward (batch 1): none {rows[('none', 1)]['kernels']}; " in out
    assert f"toma@0.5 {rows[('toma', 1)]['extra_kernels']:+d}" in out
    if hasattr(__import__("os"), "getloadavg"):
        assert len(report["load_average_before"]) == 3 and len(report["load_average_after"]) == 3
        assert "load average" in out


# the fields of a toma bench report that the --from-json tests leave as they are
REPORT = {
    "arch": "x",
    "description": "d",
    "parameters": 1,
    "resolution": 64,
    "dtype": "float32",
    "device": "cpu",
    "device_name": "cpu",
    "threads": 2,
    "steps_per_sample": 1,
    "repeats": 3,
    "warmup": 1,
    "placement": {},
    "notes": [],
    "skipped": {},
    "interrupted": False,
    "batches": [1],
}


def spread_report(none, toma, ideal):
    return {
        **REPORT,
        "results": [
            {"method": "none", "ratio": None, "batch": 1, "compiled": False, "times_s": none, "overhead": None},
            {"method": "toma", "ratio": 0.5, "batch": 1, "compiled": False, "times_s": toma, "overhead": None},
            {"method": "ideal", "ratio": 0.5, "batch": 1, "compiled": False, "times_s": ideal, "overhead": None},
        ],
    }


def test_rows_that_noise_decides_are_flagged(tmp_path, capsys):
    # samples 2.7x apart for a ~10% effect, and ToMA "beating" the ideal: both flagged
    path = tmp_path / "noisy.json"
    path.write_text(json.dumps(spread_report([10.0, 27.0, 11.0], [9.0, 10.0, 9.5], [10.0, 10.5, 9.8])))
    assert main(["bench", "--from-json", str(path), "--out", str(tmp_path / "o")]) == 0
    out = capsys.readouterr().out
    assert "UNRELIABLE toma@0.5 (batch 1): samples spread 155%, more than the 14% effect" in out
    assert "efficiency 150% is above the ideal's 100%" in out and "--threads 1" in out
    rows = {r["method"]: r for r in json.loads((tmp_path / "o" / "noisy.json").read_text())["results"]}
    assert rows["none"]["spread"] == pytest.approx(17 / 11) and rows["toma"]["flags"]
    # a steady run is not flagged
    path.write_text(json.dumps(spread_report([10.0, 10.1, 10.05], [8.0, 8.05, 8.1], [7.5, 7.55, 7.6])))
    assert main(["bench", "--from-json", str(path), "--out", str(tmp_path / "o")]) == 0
    assert "UNRELIABLE" not in capsys.readouterr().out


def plotted(monkeypatch, report, tmp_path):
    """The figure plot_report draws for ``report`` (statistics derived first)."""
    from toma.tools.bench import report as bench_report

    figs = []
    monkeypatch.setattr(bench_report, "save_figure", lambda fig, path: figs.append(fig))
    bench_report.derive(report["results"], 1)
    assert bench_report.plot_report({**report, "arch": "x", "resolution": 64}, tmp_path / "p.png")
    (fig,) = figs
    return fig.axes[0]


def test_bench_plot_uses_bars_for_one_ratio(monkeypatch, tmp_path):
    from matplotlib.patches import Rectangle

    ax = plotted(monkeypatch, spread_report([10.0, 10.2, 10.1], [8.0, 8.1, 8.2], [7.0, 7.1, 7.2]), tmp_path)
    bars = [p for p in ax.patches if isinstance(p, Rectangle)]
    assert [round(b.get_height(), 6) for b in bars] == [10.1, 8.1, 7.1]  # none, toma, ideal medians
    assert [t.get_text() for t in ax.get_xticklabels()] == ["none (unpatched)", "toma", "ideal"]
    assert "ratio 0.5" in ax.get_title()
    # several ratios: latency against the ratio axis, no bars
    report = spread_report([10.0, 10.2, 10.1], [8.0, 8.1, 8.2], [7.0, 7.1, 7.2])
    report["results"] += [{**r, "ratio": 0.25, "times_s": [t + 1 for t in r["times_s"]]} for r in report["results"][1:]]
    ax = plotted(monkeypatch, report, tmp_path)
    assert not [p for p in ax.patches if isinstance(p, Rectangle)] and list(ax.get_xticks()) == [0.25, 0.5]


def test_from_json_rederives_statistics_and_replots(tmp_path, capsys):
    report = {
        **REPORT,
        "results": [
            {
                "method": "none",
                "ratio": None,
                "batch": 1,
                "compiled": False,
                "times_s": [10.0, 12.0, 11.0],
                "overhead": None,
            },
            {
                "method": "toma",
                "ratio": 0.5,
                "batch": 1,
                "compiled": False,
                "times_s": [9.5, 9.0, 8.0],
                "overhead": None,
            },
            {
                "method": "ideal",
                "ratio": 0.5,
                "batch": 1,
                "compiled": False,
                "times_s": [9.0, 8.0, 7.5],
                "overhead": None,
            },
        ],
    }
    path = tmp_path / "r.json"
    path.write_text(json.dumps(report))
    assert main(["bench", "--from-json", str(path), "--out", str(tmp_path / "o")]) == 0
    rows = {r["method"]: r for r in json.loads((tmp_path / "o" / "r.json").read_text())["results"]}
    assert rows["toma"]["speedup"] == pytest.approx(11 / 9)
    assert rows["toma"]["efficiency"] == pytest.approx((11 - 9) / (11 - 8))
    assert rows["toma"]["efficiency_min"] == pytest.approx((10 - 8) / (10 - 7.5))
    assert (tmp_path / "o" / "r.png").exists()
    assert "eff/min" in capsys.readouterr().out


def test_bench_flux_reduced_depth_says_so_and_skips_unet_peers(tmp_path, capsys):
    rc = main(
        [
            "bench",
            "--arch",
            "tiny-flux",
            "--depth",
            "2",
            "--resolution",
            "64",
            "--ratios",
            "0.5",
            "--methods",
            "none,toma,tomesd,ideal",
            "--repeats",
            "1",
            "--warmup",
            "0",
            "--no-profile",
            "--out",
            str(tmp_path),
            "--name",
            "f",
            "--no-progress",
        ]
    )
    assert rc == 0
    out = capsys.readouterr().out
    assert "skipping tomesd" in out and "reduced depth" in out
    report = json.loads((tmp_path / "f.json").read_text())
    assert report["blocks"] == {"double": 1, "single": 1}
    assert {r["method"] for r in report["results"]} == {"none", "toma", "ideal"}


@pytest.mark.parametrize("tile_frames", ["1", "2"])
def test_bench_video_arch_with_frames_and_tile_frames(tmp_path, capsys, tile_frames):
    rc = main(
        [
            "bench",
            "--arch",
            "tiny-wan",
            "--frames",
            "9",
            "--tile-frames",
            tile_frames,
            "--resolution",
            "64",
            "--ratios",
            "0.5",
            "--methods",
            "none,toma,ideal",
            "--repeats",
            "1",
            "--warmup",
            "0",
            "--out",
            str(tmp_path),
            "--name",
            "w",
            "--no-progress",
        ]
    )
    assert rc == 0
    assert "3 latent frames" in capsys.readouterr().out
    report = json.loads((tmp_path / "w.json").read_text())
    rows = {r["method"]: r for r in report["results"]}
    assert set(rows) == {"none", "toma", "ideal"} and report["blocks"] == {"blocks": 2}
    assert rows["toma"]["settings"]["tile_frames"] == int(tile_frames)


def test_bench_rejects_frames_on_images_and_bad_frame_counts(capsys):
    assert main(["bench", "--arch", "tiny-sd3", "--frames", "5"]) == 2
    assert "--frames and --tile-frames apply to video archs" in capsys.readouterr().err
    assert main(["bench", "--arch", "tiny-wan", "--frames", "6"]) == 2
    assert "frames must be 1 + 4k" in capsys.readouterr().err
    assert main(["bench", "--arch", "sdxl", "--depth", "2"]) == 2
    assert "--depth applies to transformers" in capsys.readouterr().err


def test_missing_tomesd_is_skipped_with_a_message(monkeypatch, capsys):
    import toma.tools.baselines

    monkeypatch.setattr(toma.tools.baselines, "tomesd_available", lambda: False)
    logged = []
    report = bench_harness.benchmark(
        ARCHS["tiny-unet"], 64, ["none", "tomesd"], [0.5], repeats=1, warmup=0, profile=False, log=logged.append
    )
    assert "tomesd is not installed" in report["skipped"]["tomesd"]
    assert any("skipping tomesd" in line for line in logged)
    assert [r["method"] for r in report["results"]] == ["none"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--methods", "none,fast"], "--methods"),
        (["--methods", "toma+bogus"], "--methods"),
        (["--fbcache-threshold", "0"], "--fbcache-threshold"),
        (["--ratios", "0.5,1.5"], "--ratios"),
        (["--depth", "2"], "--depth applies to transformers"),
        (["--dtype", "float8"], "--dtype"),
        (["--cuda-graph", "--device", "cpu"], "--cuda-graph needs a CUDA device"),
        (["--freezing"], "--freezing applies to compiled rows: add --compile"),
    ],
)
def test_bench_rejects_bad_arguments(argv, message, capsys):
    assert main(["bench", "--arch", "tiny-unet", *argv]) == 2
    assert message in capsys.readouterr().err


def test_interrupt_reports_partial_results(monkeypatch):
    calls = {"n": 0}
    real = bench_harness._time_sample

    def flaky(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 4:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(bench_harness, "_time_sample", flaky)
    report = bench_harness.benchmark(ARCHS["tiny-unet"], 64, ["none", "toma", "ideal"], [0.5], repeats=2, warmup=0)
    assert report["interrupted"]
    assert [r["method"] for r in report["results"]] == ["none", "toma", "ideal"]
    # round 1 timed none, toma, ideal; round 2 (rotated: toma first) was cut at its first sample
    assert [len(r["times_s"]) for r in report["results"]] == [1, 1, 1]
    assert all(r["overhead"] is None for r in report["results"])  # no profiling after Ctrl-C


def test_ideal_plan_keeps_every_kth_token_and_repeats_back():
    x = torch.arange(2 * 8 * 3, dtype=torch.float32).reshape(2, 8, 3)
    plan = IdealPlan(8, 4, x.device)
    merged = plan.merge(x)
    assert torch.equal(merged, x[:, ::2])
    assert torch.equal(plan.unmerge(merged), x[:, ::2].repeat_interleave(2, dim=1))
    assert torch.equal(plan.dest_tokens, torch.tensor([[0, 2, 4, 6]]))
    odd = IdealPlan(10, 4, x.device)  # no whole stride: gather kept tokens, owners at or before
    y = torch.arange(10, dtype=torch.float32).reshape(1, 10, 1)
    assert odd.merge(y).flatten().tolist() == [0.0, 2.0, 5.0, 7.0]
    assert odd.unmerge(odd.merge(y)).flatten().tolist() == [0, 0, 2, 2, 2, 5, 5, 7, 7, 7]


@pytest.mark.parametrize("options", [{"levels": 1}, {"levels": 2, "merge_mlp": True}, {"levels": 1, "tile_size": 3}])
def test_ideal_matches_toma_placement_and_token_count(tiny_unet, options):
    patch = toma.apply_toma(tiny_unet, ratio=0.5, **options)
    names = [p.name for p in patch.patched]
    seen_toma, handles = token_counts(tiny_unet, names)
    forward("tiny-unet", tiny_unet)
    toma.remove_toma(tiny_unet)
    for h in handles:
        h.remove()
    ideal = apply_ideal(tiny_unet, 0.5, **options)
    assert [p.name for p in ideal.patched] == names
    seen_ideal, handles = token_counts(tiny_unet, names)
    forward("tiny-unet", tiny_unet)
    remove_baseline(tiny_unet)
    for h in handles:
        h.remove()
    assert seen_ideal == seen_toma and len(seen_toma) == len(names)
    # K is ToMA's: the layout's kept count on the 8x8 token grid of a 64px image
    tile = options.get("tile_size", 4)
    assert seen_ideal[names[0]] == make_layout(8, 8, (tile, tile), 0.5).num_merged


def test_ideal_flux_matches_toma_blocks_and_counts(tiny_flux):
    patch = toma.apply_toma(tiny_flux, ratio=0.5)
    names = [p.name for p in patch.patched]
    toma.remove_toma(tiny_flux)
    ideal = apply_ideal(tiny_flux, 0.5)
    assert [p.name for p in ideal.patched] == names
    attns = {n: n if n.endswith(".attn") else f"{n}.attn" for n in names}  # double: attn sites; single: spans
    seen, handles = token_counts(tiny_flux, list(attns.values()))
    forward("tiny-flux", tiny_flux)
    remove_baseline(tiny_flux)
    for h in handles:
        h.remove()
    text = ARCHS["tiny-flux"].text_tokens
    grid = 64 // 16
    kept = make_layout(grid, grid, (4, 4), 0.5).num_merged
    for name in names:  # double blocks project image tokens alone; single blocks [text; image]
        assert seen[attns[name]] == (kept if name.startswith("transformer_blocks") else text + kept)


def test_ideal_with_merged_mlp_removes_exactly(tiny_unet):
    # the merged MLP's chunking hook stayed behind after remove_baseline, and the next
    # apply_toma(merge_mlp=True) on the model failed ("toma_chunk already exists")
    ref = forward("tiny-unet", tiny_unet)
    apply_ideal(tiny_unet, 0.5, merge_mlp=True)
    assert remove_baseline(tiny_unet)
    assert not any(getattr(m, "_diffusers_hook", None) for m in tiny_unet.modules())
    assert torch.equal(forward("tiny-unet", tiny_unet), ref)
    toma.apply_toma(tiny_unet, ratio=0.5, merge_mlp=True)
    assert toma.remove_toma(tiny_unet)


def test_baselines_remove_exactly_and_refuse_to_stack(tiny_unet):
    ref = forward("tiny-unet", tiny_unet)
    appliers = [apply_ideal, apply_todo] + ([apply_tomesd] if tomesd_available() else [])
    for apply in appliers:
        apply(tiny_unet, 0.5)
        assert get_baseline(tiny_unet).method in ("ideal", "todo", "tomesd")
        with pytest.raises(RuntimeError, match="already"):
            apply_ideal(tiny_unet, 0.5)
        assert not torch.equal(forward("tiny-unet", tiny_unet), ref)
        assert remove_baseline(tiny_unet)
        assert torch.equal(forward("tiny-unet", tiny_unet), ref)
    assert not remove_baseline(tiny_unet)


def test_todo_pools_keys_values_only(tiny_unet):
    assert todo_pool(0.5) == (1, 2) and todo_pool(0.75) == (2, 2) and todo_pool(0.2) == (1, 1)
    apply_todo(tiny_unet, 0.75)
    attn = tiny_unet.get_submodule("down_blocks.0.attentions.0.transformer_blocks.0.attn1")
    shapes = {}
    hq = attn.to_q.register_forward_pre_hook(recorder(shapes, "q"))
    hk = attn.to_k.register_forward_pre_hook(recorder(shapes, "k"))
    forward("tiny-unet", tiny_unet)
    hq.remove(), hk.remove()
    remove_baseline(tiny_unet)
    assert shapes == {"q": 64, "k": 16}
    with pytest.raises(ValueError, match="UNets only"):
        apply_todo(build_model(ARCHS["tiny-flux"]), 0.5)


def test_reduced_flux_depth_and_scaled_skip_rule():
    cfg = reduced_config("flux", ARCHS["flux"].config, 10)
    assert (cfg["num_layers"], cfg["num_single_layers"]) == (2, 4)
    assert cfg["num_attention_heads"] * cfg["attention_head_dim"] == 3072  # full width
    assert merged_blocks(19, 19) == tuple(range(5, 19))  # the authors' default at full depth
    assert merged_blocks(38, 38) == tuple(range(5, 38))
    assert merged_blocks(2, 19) == (1,) and merged_blocks(4, 38) == (1, 2, 3)
    with pytest.raises(ValueError, match="depth"):
        reduced_config("flux", ARCHS["flux"].config, 0)
    with pytest.raises(ValueError, match="depth applies to transformers"):
        reduced_config("unet", ARCHS["sdxl"].config, 2)


def test_reduced_sd35_and_wan_keep_their_width_and_dual_attention_share():
    sd3 = reduced_config("sd3", ARCHS["sd35"].config, 4)
    assert sd3["num_layers"] == 6 and sd3["dual_attention_layers"] == (0, 1, 2)  # 13 of 24 -> 3 of 6
    wan = reduced_config("wan", ARCHS["wan"].config, 10)
    assert wan["num_layers"] == 3 and wan["ffn_dim"] == 8960 and wan["num_attention_heads"] == 12


def test_methods_combine_with_diffusers_caches(tmp_path, monkeypatch, capsys):
    # toma+fbcache: the cache is enabled for each timed sample (a fresh run each) and skips
    # the tail blocks on steps that change little; cached rows get no efficiency (the ideal
    # has no cache), and the report says what random weights cannot show
    real_build = bench_harness.build_model
    rc = main(
        [
            "bench",
            "--arch",
            "tiny-flux",
            "--resolution",
            "64",
            "--ratios",
            "0.5",
            "--methods",
            "none,toma,none+fbcache,toma+fbcache",
            "--fbcache-threshold",
            "0.5",
            "--steps",
            "4",
            "--repeats",
            "1",
            "--warmup",
            "0",
            "--no-profile",
            "--out",
            str(tmp_path),
            "--name",
            "c",
            "--no-progress",
        ]
    )
    assert rc == 0
    assert "depends on the weights" in capsys.readouterr().out
    rows = {r["method"]: r for r in json.loads((tmp_path / "c.json").read_text())["results"]}
    assert set(rows) == {"none", "toma", "none+fbcache", "toma+fbcache"}
    assert "cache" not in rows["toma"]["settings"]
    assert rows["toma+fbcache"]["efficiency"] is None and "FirstBlockCache" in rows["toma+fbcache"]["settings"]["cache"]
    assert rows["toma+fbcache"]["ratio"] == 0.5 and rows["none+fbcache"]["ratio"] is None

    counts = {}
    for methods in ("toma", "toma+fbcache"):
        harness_calls = []
        model = real_build(ARCHS["tiny-flux"])
        monkeypatch.setattr(bench_harness, "build_model", lambda *a, **k: model)
        model.single_transformer_blocks[-1].proj_out.register_forward_hook(lambda *a: harness_calls.append(1))
        report = bench_harness.benchmark(
            ARCHS["tiny-flux"],
            64,
            [methods],
            [0.5],
            steps=4,
            repeats=1,
            warmup=0,
            profile=False,
            cache_options={"fbcache": {"threshold": 0.5}},
        )
        assert [r["method"] for r in report["results"]] == [methods]
        counts[methods] = len(harness_calls)
        assert not hasattr(model, "_toma_patch") and not model.is_cache_enabled  # all undone
    assert counts["toma"] == 4 and 1 <= counts["toma+fbcache"] < 4


def test_caches_are_skipped_for_unets(capsys):
    report = bench_harness.benchmark(
        ARCHS["tiny-unet"], 64, ["none", "toma+fbcache"], [0.5], repeats=1, warmup=0, profile=False
    )
    assert "fbcache is a diffusers cache for transformers" in report["skipped"]["toma+fbcache"]


def test_compiled_rows_are_timed_interleaved_with_the_eager_ones(monkeypatch):
    """Each compiled variant runs on its own patched copy, in the same rounds as the eager rows.

    Before, the compiled rows were timed one after another once the eager rounds were over,
    so load that changed during the run decided their speedup.
    """
    real_compile = torch.compile
    monkeypatch.setattr(torch, "compile", lambda model, **kw: real_compile(model, backend="eager"))
    order = []
    real = bench_harness._time_sample

    def logged(call, inputs, device, *clock):
        order.append(getattr(call, "toma_variant", None))
        return real(call, inputs, device, *clock)

    monkeypatch.setattr(bench_harness, "_time_sample", logged)
    # a tiny DiT: the test takes 60% of its time with the tiny UNet, and the rounds do not
    # depend on the family
    report = bench_harness.benchmark(
        ARCHS["tiny-sd3"], 64, ["none", "toma"], [0.5], repeats=2, warmup=0, compile=True, profile=False
    )
    rows = {(r["method"], r["compiled"]): r for r in report["results"]}
    assert set(rows) == {("none", False), ("toma", False), ("none", True), ("toma", True)}
    assert all(len(r["times_s"]) == 2 for r in rows.values())
    timed = order[-8:]  # 2 rounds x 4 variants, after 2 warm-ups x 2 compiled copies
    assert [v is not None for v in timed[:4]].count(True) == 2  # compiled in the first round already
    assert [v is not None for v in timed[4:]].count(True) == 2


def test_compiled_copy_keeps_its_patch_and_shares_weights(tiny_unet):
    """The compiled toma copy gives the eager ToMA output; the original model stays unpatched."""
    arch = ARCHS["tiny-unet"]
    harness = bench_harness.MethodPatcher(tiny_unet, arch, {"levels": 1, "tile_size": 4}, {}, None)
    variant = bench_harness.Variant("toma", 0.5)
    inputs = make_inputs(arch, 64)
    with torch.no_grad():
        plain = call_denoiser(arch, tiny_unet, inputs)[0]
        harness.apply(variant)
        merged = call_denoiser(arch, tiny_unet, inputs)[0]
        harness.remove()
        real_compile = torch.compile
        try:
            torch.compile = lambda model, **kw: real_compile(model, backend="eager")
            calls = bench_harness.compile_variants(
                harness, [variant], [1], {1: [inputs]}, 0, torch.device("cpu"), lambda s: None
            )
        finally:
            torch.compile = real_compile
        (call,) = calls.values()
        copied = call(inputs)[0]
        after = call_denoiser(arch, tiny_unet, inputs)[0]
    assert not torch.equal(plain, merged)
    assert torch.equal(copied, merged)
    assert torch.equal(after, plain)  # the copy's hooks are its own
    copy_params = {p.data_ptr() for p in call.__defaults__[0]._orig_mod.parameters()}
    assert copy_params == {p.data_ptr() for p in tiny_unet.parameters()}


def test_kontext_inputs_carry_a_reference_that_passes_whole():
    # --arch flux-kontext: the generated image's tokens, then a reference image's (ids of
    # frame 1); ToMA and the ideal halve the image's and keep the reference's
    arch = ARCHS["tiny-flux-kontext"]
    assert arch.references == ARCHS["flux-kontext"].references == 1
    kw = make_inputs(arch, 64)
    image = (64 // 8 // 2) ** 2
    assert kw["hidden_states"].shape[1] == kw["img_ids"].shape[0] == 2 * image
    assert kw["img_ids"][:image, 0].eq(0).all() and kw["img_ids"][image:, 0].eq(1).all()
    for apply in (toma.apply_toma, apply_ideal):
        model = build_model(arch)
        apply(model, 0.5, blocks={"transformer_blocks": (0,), "single_transformer_blocks": ()})
        seen = {}
        model.transformer_blocks[0].attn.to_q.register_forward_pre_hook(recorder(seen, "q"))
        with torch.no_grad():
            out = call_denoiser(arch, model, kw)[0]
        assert seen["q"] == image + image // 2 and out.shape == kw["hidden_states"].shape[:2] + (out.shape[-1],)


def test_every_arch_builds_its_spec_class_with_the_stacks_its_depth_keys_count():
    # the bench reads each family's class and block stacks from its spec, and counts the
    # stacks' blocks with DEPTH_KEYS in the same order: built at full size on the meta
    # device (no memory, no init cost), every stack holds what its key says
    from toma.adapters import FAMILIES, adapter_for
    from toma.tools.archs import DEPTH_KEYS, STACKS, block_count

    assert list(STACKS) == list(DEPTH_KEYS) and set(DEPTH_KEYS) <= set(FAMILIES)
    for arch in ARCHS.values():
        model = build_model(arch, device="meta")
        assert adapter_for(model)[0] == arch.family
        if arch.family in STACKS:
            counts = [len(model.get_submodule(stack)) for stack in STACKS[arch.family]]
            assert counts == [block_count(arch.config, key) for key in DEPTH_KEYS[arch.family]], arch.name


def test_zimage_arch_calls_merge_and_step_its_rising_t():
    # the published config, narrowed so it builds in a second: make_inputs' list inputs run
    # the model, the default placement merges its main layers, and set_timestep makes its
    # t (1 - sigma) rise over the run, as the pipeline's does
    import dataclasses

    import toma
    from toma.tools.archs import default_placement, set_timestep

    arch = ARCHS["zimage"]
    narrow = {"dim": 64, "n_heads": 2, "n_kv_heads": 2, "axes_dims": [8, 12, 12], "cap_feat_dim": 32}
    tiny = dataclasses.replace(arch, config={**arch.config, **narrow}, text_dim=32, text_tokens=64)
    model = build_model(tiny, depth=10)
    kw = make_inputs(tiny, 256, batch=2)
    ts = [float(set_timestep(tiny, kw, step, 4)["t"][0]) for step in range(4)]
    assert ts == sorted(ts) and ts[0] == 0.0
    patch = toma.apply_toma(model, ratio=0.5, **default_placement(tiny, model))
    with torch.no_grad():
        out = call_denoiser(tiny, model, set_timestep(tiny, kw, 1, 4))[0]
    assert len(out) == 2 and out[0].shape == (16, 1, 32, 32)
    assert patch.cache._plans  # the 32x32 tokens (a multiple of 32) merged


def test_hidream_arch_calls_merge_at_reduced_depth():
    # the published config, narrowed: --depth cuts the Llama layers fed to the blocks with
    # the blocks (a projection per block), make_inputs' call runs, the default placement
    # merges, and set_timestep steps the call's `timesteps`
    import dataclasses

    import toma
    from toma.tools.archs import default_placement, reduced_config, set_timestep

    arch = ARCHS["hidream"]
    narrow = {"num_attention_heads": 2, "attention_head_dim": 32, "axes_dims_rope": (16, 8, 8)}
    narrow |= {"caption_channels": [24, 20], "text_emb_dim": 12}
    tiny = dataclasses.replace(arch, config={**arch.config, **narrow}, text_dim=24, pooled_dim=12, text_tokens=8)
    config = reduced_config("hidream", tiny.config, 16)
    assert (config["num_layers"], config["num_single_layers"], len(config["llama_layers"])) == (1, 2, 3)
    model = build_model(tiny, depth=16)
    kw = make_inputs(tiny, 256, batch=1)
    ts = [float(set_timestep(tiny, kw, step, 4)["timesteps"][0]) for step in range(4)]
    assert ts == sorted(ts, reverse=True)
    patch = toma.apply_toma(model, ratio=0.5, **default_placement(tiny, model))
    with torch.no_grad():
        out = call_denoiser(tiny, model, set_timestep(tiny, kw, 1, 4))[0]
    assert out.shape == (1, 16, 32, 32)
    assert patch.cache._plans


NARROW = {  # the published configs narrowed to build in a second: (config, arch fields, depth, resolution, frames)
    "chroma": (
        {"num_attention_heads": 2, "attention_head_dim": 32, "axes_dims_rope": (8, 12, 12)}
        | {"joint_attention_dim": 32, "approximator_hidden_dim": 32},
        19,
        256,
        None,
    ),
    "wan-vace": (
        {"num_attention_heads": 2, "attention_head_dim": 32, "ffn_dim": 64, "vace_in_channels": 8},
        20,
        128,
        5,
    ),
    "hunyuanvideo15": (
        {"num_attention_heads": 2, "attention_head_dim": 32, "rope_axes_dim": (8, 12, 12)}
        | {"text_embed_2_dim": 16, "image_embed_dim": 16},
        27,
        256,
        5,
    ),
    "cosmos": ({"num_attention_heads": 2, "attention_head_dim": 24, "adaln_lora_dim": 8}, 14, 256, None),
    # a chunk after the pipeline's three histories (16 long frames, 2 mid, 2 short)
    "helios": (
        {"num_attention_heads": 2, "attention_head_dim": 32, "ffn_dim": 64, "rope_dim": (8, 12, 12)},
        20,
        128,
        5,
    ),
}


@pytest.mark.parametrize("name", NARROW)
def test_2026_video_and_image_archs_call_and_merge_at_reduced_depth(name):
    # make_inputs' call runs each published layout (control input, condition channels,
    # one latent frame, Flux's ids without pooled projections) and the default placement,
    # scaled to the blocks built, merges; Wan VACE keeps control blocks at their share
    import dataclasses

    import toma
    from toma.tools.archs import default_placement, set_timestep

    config, depth, resolution, frames = NARROW[name]
    arch = ARCHS[name]
    text = {"chroma": "joint_attention_dim", "wan-vace": "text_dim", "helios": "text_dim"}.get(name, "text_embed_dim")
    tiny = dataclasses.replace(arch, config={**arch.config, **config, text: 32}, text_dim=32, text_tokens=8)
    model = build_model(tiny, depth=depth)
    kw = make_inputs(tiny, resolution, batch=1, frames=frames)
    placement = default_placement(tiny, model)
    if name == "wan-vace":
        assert len(model.vace_blocks) == 1 and placement["blocks"]["vace_blocks"] == (0,)
    patch = toma.apply_toma(model, ratio=0.5, **placement)
    with torch.no_grad():
        out = call_denoiser(tiny, model, set_timestep(tiny, kw, 1, 4))[0]
    if name == "chroma":  # packed tokens (B, N, C)
        assert out.shape[-1] == arch.config["in_channels"]
    else:  # latents (B, C, F, H, W)
        assert out.shape[1] == arch.config["out_channels"]
    assert patch.cache._plans


def test_qwenimage21_arch_calls_a_cached_step_that_merges():
    # the defaults' layout narrowed so it builds in a second: make_inputs' call is a step
    # after the first (the prompt's keys and values cached), which the default placement,
    # scaled to the blocks built, merges; the cache has a layer for every block of the full
    # model, of which --depth builds fewer
    import dataclasses

    import toma
    from toma.tools.archs import default_placement, set_timestep

    arch = ARCHS["qwenimage21"]
    narrow = {"num_attention_heads": 2, "attention_head_dim": 32, "axes_dims_rope": (8, 12, 12), "context_in_dim": 32}
    tiny = dataclasses.replace(arch, config={**arch.config, **narrow}, text_dim=32, text_tokens=8)
    model = build_model(tiny, depth=16)
    kw = make_inputs(tiny, 256, batch=1)
    assert len(model.transformer_blocks) == 2 and len(kw["kv_cache"].layer_caches) == 32
    patch = toma.apply_toma(model, ratio=0.5, **default_placement(tiny, model))
    with torch.no_grad():
        out = call_denoiser(tiny, model, set_timestep(tiny, kw, 1, 4))[0]
    assert out.shape == (1, 16 * 16, arch.config["out_channels"]) and patch.cache._plans


def test_flux3_arch_calls_merge_at_reduced_depth():
    # the defaults' layout narrowed so it builds in a second: the image's own blocks and the
    # single-stream blocks scale with --depth, and the default placement merges some of each
    import dataclasses

    import toma
    from toma.tools.archs import default_placement, set_timestep

    arch = ARCHS["flux3"]
    narrow = {"num_attention_heads": 2, "attention_head_dim": 32, "joint_attention_dim": 32, "timestep_channels": 32}
    narrow["axes_dims_rope"] = (8, 8, 8, 8)
    tiny = dataclasses.replace(arch, config={**arch.config, **narrow}, text_dim=32, text_tokens=8)
    model = build_model(tiny, depth=2)
    placement = default_placement(tiny, model)
    assert len(model.get_submodule("mode_blocks.image")) == 2 and len(model.single_transformer_blocks) == 14
    assert placement["blocks"] == {"mode_blocks.image": (1,), "single_transformer_blocks": tuple(range(3, 14))}
    patch = toma.apply_toma(model, ratio=0.5, **placement)
    with torch.no_grad():
        out = call_denoiser(tiny, model, set_timestep(tiny, make_inputs(tiny, 256, batch=1), 1, 4))[0]
    assert out.shape == (1, 16 * 16, arch.config["in_channels"]) and patch.cache._plans


def test_minimax_h3_arch_calls_merge_its_video_rows_and_take_17k_plus_5_frames():
    # the published width narrowed so it builds in a second: make_inputs packs the modular
    # pipeline's t2va layout ([text; audio; video]), its video VAE's frame rule gives the
    # latent frames, and the default placement merges the video rows of the merged blocks
    import dataclasses

    import toma
    from toma.tools.archs import default_placement, latent_frames, set_timestep

    arch = ARCHS["minimax-h3"]
    assert arch.size(768) == (768, 1344) and latent_frames(arch) == 37 and latent_frames(arch, 22) == 7
    with pytest.raises(ValueError, match="17k \\+ 5"):
        latent_frames(arch, 9)
    narrow = {
        "num_attention_heads": 2,
        "attention_head_dim": 16,
        "hidden_size": 32,
        "ffn_dim": 32,
        "text_dim": 32,
        "freq_dim": 16,
        "time_embed_hidden_dim": 32,
        "time_embed_dim": 16,
        "rope_freq_dim": 2,
    }
    tiny = dataclasses.replace(arch, config={**arch.config, **narrow}, text_dim=32, text_tokens=8)
    model = build_model(tiny, depth=10)
    kw = make_inputs(tiny, 256, frames=5)
    ts = [float(set_timestep(tiny, kw, step, 4)["timestep"][0]) for step in range(4)]
    assert ts == sorted(ts, reverse=True) and ts[0] == 1.0
    patch = toma.apply_toma(model, ratio=0.5, **default_placement(tiny, model))
    with torch.no_grad():
        video, audio = call_denoiser(tiny, model, set_timestep(tiny, kw, 1, 4))
    assert video.shape == (1, 2 * 8 * 14, 96) and audio.shape == kw["audio_hidden_states"].shape
    assert patch.cache.base_grid == (2, 8, 14) and patch.cache._plans


def test_ideogram4_arch_calls_pack_the_pipelines_layout_and_merge_its_image():
    # the published width narrowed so it builds in a second: make_inputs packs the pipeline's
    # [padding; text; image] with its own _prepare_ids, set_timestep makes the model time
    # (0 is noise) rise, and the default placement merges the image tokens
    import dataclasses

    import toma
    from toma.tools.archs import default_placement, set_timestep

    arch = ARCHS["ideogram4"]
    narrow = {
        "attention_head_dim": 16,
        "num_attention_heads": 2,
        "intermediate_size": 32,
        "adaln_dim": 16,
        "llm_features_dim": 32,
        "mrope_section": (4, 2, 2),
    }
    tiny = dataclasses.replace(arch, config={**arch.config, **narrow}, text_dim=32, text_tokens=300)
    model = build_model(tiny, depth=10)
    kw = make_inputs(tiny, 256)
    assert kw["hidden_states"].shape == (1, 300 + 16 * 16, 128)
    assert (kw["indicator"][0, :44] == 0).all() and (kw["indicator"][0, 44:300] == 3).all()  # 44 pads, 256 text
    ts = [float(set_timestep(tiny, kw, step, 4)["timestep"][0]) for step in range(4)]
    assert ts == sorted(ts) and ts[0] == 0.0
    patch = toma.apply_toma(model, ratio=0.5, **default_placement(tiny, model))
    with torch.no_grad():
        (out,) = call_denoiser(tiny, model, set_timestep(tiny, kw, 1, 4))
    assert out.shape == kw["hidden_states"].shape
    assert patch.cache.base_grid == (1, 16, 16) and patch.cache._plans


def test_ltx2_arch_calls_merge_the_video_and_carry_the_pipelines_audio():
    # the published config, narrowed so it builds in a second: make_inputs gives the audio
    # latents LTX2Pipeline makes for the clip (25 a second at 24 fps) and the default
    # placement merges the video tokens alone
    import dataclasses

    import toma
    from toma.tools.archs import default_placement
    from toma.tools.archs.families.ltx2 import audio_frames

    arch = ARCHS["ltx2"]
    narrow = {
        "attention_head_dim": 8,
        "num_attention_heads": 2,
        "cross_attention_dim": 16,
        "audio_attention_head_dim": 4,
        "audio_num_attention_heads": 2,
        "audio_cross_attention_dim": 8,
        "caption_channels": 32,
        "in_channels": 8,
        "audio_in_channels": 8,
        "out_channels": 8,
        "audio_out_channels": 8,
    }
    tiny = dataclasses.replace(arch, config={**arch.config, **narrow}, text_dim=32, text_tokens=16)
    assert audio_frames(arch) == 126  # 121 frames: 5.04 s
    model = build_model(tiny, depth=12)
    kw = make_inputs(tiny, 128, batch=2, frames=9)
    assert kw["audio_hidden_states"].shape == (2, 9, 8) and kw["audio_num_frames"] == 9
    assert kw["hidden_states"].shape == (2, 2 * 4 * 6, 8)  # 2 latent frames of 128x192 px
    patch = toma.apply_toma(model, ratio=0.5, **default_placement(tiny, model))
    with torch.no_grad():
        video, audio = call_denoiser(tiny, model, kw)
    assert video.shape == (2, 48, 8) and audio.shape == (2, 9, 8)
    assert patch.cache._plans


def test_kandinsky5_arch_calls_merge():
    # the published config, narrowed so it builds in a second: make_inputs' channel-last
    # latents (visual_cond: latents, conditioning and its mask) and rotary positions run the
    # model, and the default placement merges its visual blocks
    import dataclasses

    import toma
    from toma.tools.archs import default_placement

    arch = ARCHS["kandinsky5"]
    narrow = {"model_dim": 64, "ff_dim": 128, "time_dim": 32, "axes_dims": (8, 12, 12), "in_text_dim": 32}
    tiny = dataclasses.replace(arch, config={**arch.config, **narrow}, text_dim=32, text_tokens=8)
    model = build_model(tiny, depth=8)
    kw = make_inputs(tiny, 128, batch=2, frames=5)
    assert kw["hidden_states"].shape == (2, 2, 16, 24, 33)
    patch = toma.apply_toma(model, ratio=0.5, **default_placement(tiny, model))
    with torch.no_grad():
        out = call_denoiser(tiny, model, kw)  # return_dict=False: the tensor itself
    assert out.shape == (2, 2, 16, 24, 16)
    assert patch.cache._plans


def test_ernie_image_arch_calls_merge():
    # the published config, narrowed so it builds in a second: make_inputs' latents and
    # padded text run the model, and the default placement merges its layers
    import dataclasses

    import toma
    from toma.tools.archs import default_placement

    arch = ARCHS["ernie-image"]
    narrow = {"hidden_size": 64, "num_attention_heads": 2, "ffn_hidden_size": 128, "rope_axes_dim": (8, 12, 12)}
    tiny = dataclasses.replace(arch, config={**arch.config, **narrow, "text_in_dim": 32}, text_dim=32, text_tokens=8)
    model = build_model(tiny, depth=9)
    kw = make_inputs(tiny, 256, batch=2)
    assert kw["hidden_states"].shape == (2, 128, 16, 16) and kw["text_lens"].tolist() == [8, 8]
    patch = toma.apply_toma(model, ratio=0.5, **default_placement(tiny, model))
    with torch.no_grad():
        out = call_denoiser(tiny, model, kw)[0]
    assert out.shape == (2, 128, 16, 16)
    assert patch.cache._plans


def test_lumina2_arch_calls_merge():
    # the published config, narrowed so it builds in a second: make_inputs' latents and
    # full-length caption run the model, the timestep rises over a run (1 - t / 1000), and
    # the default placement merges its main layers
    import dataclasses

    import toma
    from toma.tools.archs import default_placement, set_timestep

    arch = ARCHS["lumina2"]
    narrow = {"hidden_size": 64, "num_attention_heads": 4, "num_kv_heads": 2, "axes_dim_rope": (4, 6, 6)}
    tiny = dataclasses.replace(arch, config={**arch.config, **narrow, "cap_feat_dim": 32}, text_dim=32, text_tokens=8)
    model = build_model(tiny, depth=13)
    assert len(model.layers) == 2 and len(model.noise_refiner) == 2
    kw = make_inputs(tiny, 256, batch=2)
    assert kw["hidden_states"].shape == (2, 16, 32, 32) and kw["encoder_attention_mask"].all()
    ts = [float(set_timestep(tiny, kw, step, 4)["timestep"][0]) for step in range(4)]
    assert ts == sorted(ts) and ts[0] == 0.0
    patch = toma.apply_toma(model, ratio=0.5, **default_placement(tiny, model))
    with torch.no_grad():
        out = call_denoiser(tiny, model, set_timestep(tiny, kw, 1, 4))[0]
    assert out.shape == (2, 16, 32, 32)
    assert patch.cache.base_grid == (1, 16, 16) and patch.cache._plans
