"""The layout objects a site picks (toma/adapters/layouts.py), each on its own, against
brute-force references: which rows merge, which pass whole, how rotary rows follow, how
many keys lead a bias, how a bias is routed and how the one-family call rules rewrite a
call. The families' tests cover them in models; these pin each object's contract."""

from __future__ import annotations

import pytest
import torch

from toma.adapters.attention import BIAS_KWARG, KeyBias
from toma.adapters.layouts import (
    ALONE,
    BETWEEN,
    IMAGE_FIRST,
    TEXT_FIRST,
    Conditioned,
    Fit,
    InMask,
    MergedCount,
    Packed,
    SameTokens,
    SeqFirst,
    Span,
    Spread,
    Stream,
    ViaCall,
    read_arg,
)
from toma.adapters.spec import BlockRope, FamilySpec, RopeModule, Rotary, Site, gather_rows, tile_order_unless

N, TEXT, C = 6, 3, 4


def pair_merge(x: torch.Tensor) -> torch.Tensor:
    """A stand-in merge: the mean of neighbouring token pairs (N -> N / 2)."""
    return x.view(x.shape[0], -1, 2, x.shape[-1]).mean(2)


def pair_unmerge(y: torch.Tensor) -> torch.Tensor:
    """Its unmerge: each merged token copied back to both of its pair."""
    return y.repeat_interleave(2, dim=1)


def rows(seed: int, length: int, batch: int = 2) -> torch.Tensor:
    return torch.randn(batch, length, C, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize(
    "layout, image_at",
    [(TEXT_FIRST, slice(TEXT, TEXT + N)), (IMAGE_FIRST, slice(0, N)), (ALONE, slice(TEXT, TEXT + N))],
)
def test_only_the_image_rows_merge_and_the_rest_pass_whole(layout, image_at):
    x = rows(0, TEXT + N)
    text = layout.text(x.shape[1], N, extra=True)  # the image alone: conditioning tokens lead
    assert text == TEXT
    assert torch.equal(layout.image(x, N, text), x[:, image_at])
    merged = layout.merge(pair_merge, x, N, text)
    assert merged.shape == (2, TEXT + N // 2, C)
    image = torch.zeros(x.shape[1], dtype=torch.bool)
    image[image_at] = True
    others = merged[:, N // 2 :] if layout == IMAGE_FIRST else merged[:, :TEXT]
    assert torch.equal(others, x[:, ~image])  # the text, whole and in place
    back = layout.unmerge(pair_unmerge, merged, text)
    assert torch.equal(back[:, ~image], x[:, ~image])
    assert torch.equal(back[:, image], pair_unmerge(pair_merge(x[:, image])))


def test_an_image_alone_counts_no_text_without_leading_tokens():
    assert ALONE.text(N, N, extra=False) == 0
    assert ALONE.text(N + 2, N, extra=False) == 0  # not the image's: the engine sees the grid mismatch
    assert TEXT_FIRST.text(N - 1, N, extra=False) < 0  # too short to hold the image: runs unmerged


def test_seq_first_is_its_inner_layout_on_the_transpose():
    layout = SeqFirst(IMAGE_FIRST)
    x = rows(1, N + TEXT).transpose(0, 1)  # (S, B, C)
    seen = layout.rows(x)
    assert seen.shape == (2, N + TEXT, C) and seen.data_ptr() == x.data_ptr()  # a view
    text = layout.text(seen.shape[1], N, extra=False)
    merged = layout.unrows(layout.merge(pair_merge, seen, N, text))
    expected = IMAGE_FIRST.merge(pair_merge, x.transpose(0, 1), N, text).transpose(0, 1)
    assert merged.shape == (N // 2 + TEXT, 2, C) and torch.equal(merged, expected)
    assert layout.bias_lead(TEXT) == IMAGE_FIRST.bias_lead(TEXT) == 0
    assert layout == SeqFirst(IMAGE_FIRST) and layout != SeqFirst(ALONE)


@pytest.mark.parametrize("table_batch", [1, 2])
def test_rotary_rows_follow_the_layout(table_batch):
    g = torch.Generator().manual_seed(2)
    table = torch.randn(table_batch, TEXT + N, 5, generator=g)
    dest = torch.stack([torch.randperm(N, generator=g)[:4] for _ in range(2)])
    got = TEXT_FIRST.table_rows(gather_rows, table, dest, N, TEXT)
    first = IMAGE_FIRST.table_rows(gather_rows, table.roll(-TEXT, dims=1), dest, N, TEXT)
    for b in range(2):  # brute force, row by row
        t = table[0 if table_batch == 1 else b]
        image = [t[TEXT + int(i)] for i in dest[b]]
        assert torch.equal(got[b], torch.stack(list(t[:TEXT]) + image))
        assert torch.equal(first[b], torch.stack(image + list(t[:TEXT])))
    # the image alone: the family's gather sees the whole table
    assert torch.equal(ALONE.table_rows(gather_rows, table, dest, N, TEXT), gather_rows(table, dest))
    # no text in the call: a text-first site's table is the image's alone
    assert torch.equal(TEXT_FIRST.table_rows(gather_rows, table, dest, N, 0), gather_rows(table, dest))


@pytest.mark.parametrize("lead,tail", [(0, 0), (TEXT, 0), (0, 2), (TEXT, 2)])
def test_between_passes_the_lead_and_the_tail_whole(lead, tail):
    # [lead; image; tail], each token numbered by its position: brute force by position
    x = torch.arange(2 * (lead + N + tail) * C, dtype=torch.float32).view(2, lead + N + tail, C)
    head, image, rest = BETWEEN.split(x, lead, N)
    assert [head.shape[1], image.shape[1], rest.shape[1]] == [lead, N, tail]
    for i in range(lead + N + tail):
        part, j = (head, i) if i < lead else (image, i - lead) if i < lead + N else (rest, i - lead - N)
        assert torch.equal(part[:, j], x[:, i])
    merged = BETWEEN.join(head, pair_merge(image), rest)
    assert merged.shape[1] == lead + N // 2 + tail
    assert torch.equal(BETWEEN.join(head, image, rest), x)
    # positions kept: the lead's, each destination's, the tail's
    dest = torch.tensor([[0, 3, 4], [1, 2, 5]])
    kept = BETWEEN.kept(dest, lead, N, lead + N + tail)
    for b in range(2):
        expect = list(range(lead)) + [lead + int(d) for d in dest[b]] + list(range(lead + N, lead + N + tail))
        assert kept[b].tolist() == expect
    # a per-token table (tokens on dim 1 or 2), shared or per sample, taken at those positions
    for shape, dim in (((1, lead + N + tail, 2), 1), ((2, 3, lead + N + tail, 5), 2)):
        table = torch.randn(shape)
        rows = BETWEEN.gather(table, kept, dim)
        for b in range(2):
            for j, pos in enumerate(kept[b].tolist()):
                assert torch.equal(rows[b].select(dim - 1, j), table[min(b, shape[0] - 1)].select(dim - 1, pos))
    log_mass = torch.randn(2, 3)
    bias = BETWEEN.bias(log_mass, lead, tail, torch.float64)
    assert bias.dtype == torch.float64 and bias.shape == (2, lead + 3 + tail)
    assert (
        torch.equal(bias[:, lead : lead + 3], log_mass.double())
        and not bias[:, :lead].any()
        and not bias[:, lead + 3 :].any()
    )


def test_keys_that_lead_the_bias():
    assert ALONE.bias_lead(TEXT) == TEXT_FIRST.bias_lead(TEXT) == TEXT
    assert IMAGE_FIRST.bias_lead(TEXT) == 0  # its form pads the text keys after the image's


def test_a_bias_in_the_mask_slot_takes_in_the_models_own_mask():
    route = InMask(("attention_mask", 2), form=lambda log_mass, b, h: KeyBias(log_mass))
    bias = KeyBias(torch.zeros(1, 4))
    own = torch.ones(2, 1, 1, 4, dtype=torch.bool)
    args, kwargs = route.route(("x", None, None), {}, bias, own, dense=dict)
    assert kwargs == {} and isinstance(args[2], KeyBias) and args[2].model_mask is own
    args, kwargs = route.route(("x",), {}, bias, None, dense=dict)  # not passed positionally: by keyword
    assert args == ("x",) and kwargs["attention_mask"] is bias
    assert route.calls() == ()


def test_a_bias_past_the_processor_rides_in_its_keyword():
    def strategy(forward, hook, *args, **kwargs):
        return forward(*args, **kwargs)

    route = ViaCall(strategy, form=lambda log_mass, b, h: KeyBias(log_mass))
    bias = KeyBias(torch.zeros(1, 4))
    args, kwargs = route.route(("x",), {"attention_mask": "the model's"}, bias, None, dense=dict)
    assert args == ("x",) and kwargs == {"attention_mask": "the model's", BIAS_KWARG: bias}
    assert route.calls() == (strategy,) and route.slot is None


def test_the_models_own_mask_is_read_from_the_fit_then_the_bias_then_attention_mask():
    form = lambda log_mass, b, h: log_mass  # noqa: E731
    fit = Fit(lambda mask, n, k: mask)
    assert Site("a", "attn", fit=Fit(fit.fit, slot=("hidden_states_masks", 1))).own_slot() == ("hidden_states_masks", 1)
    assert Site("a", "attn", bias=InMask(("mask", 3), form), fit=fit).own_slot() == ("mask", 3)
    assert Site("a", "attn", bias=ViaCall(lambda *a, **k: None, form), fit=fit).own_slot() == ("attention_mask", None)
    assert read_arg(("x", "m"), {}, "attention_mask", 1) == "m"
    assert read_arg(("x",), {"attention_mask": "k"}, "attention_mask", 1) == "k"


def test_same_tokens_refuses_other_keys_and_passes_the_merged_ones():
    rule = SameTokens("encoder_hidden_states")
    x, other = torch.zeros(1, 2, 3), torch.zeros(1, 2, 3)
    assert rule.refuses((x,), {"encoder_hidden_states": x}) is None
    assert "encoder_hidden_states" in rule.refuses((x,), {"encoder_hidden_states": other})
    merged = torch.ones(1, 1, 3)
    _, kwargs = rule.apply((merged,), {"encoder_hidden_states": x}, 1)
    assert kwargs["encoder_hidden_states"] is merged


def test_merged_count_replaces_the_image_count():
    rule = MergedCount("original_context_length", 2)
    assert rule.refuses((), {}) is None
    assert rule.apply(("x", "m", 16), {}, 9) == (("x", "m", 9), {})
    assert rule.apply(("x",), {"original_context_length": 16}, 9) == (("x",), {"original_context_length": 9})


@pytest.mark.parametrize(
    "layout, options, message",
    [
        (IMAGE_FIRST, {"span": Span(call="attn", until="proj_out")}, "image-first"),
        (IMAGE_FIRST, {"rotary": Rotary("freqs", None, shared=True)}, "image-first"),
        (SeqFirst(ALONE), {"bias": InMask(("attention_mask", None), gather_rows)}, "sequence-first"),
        (SeqFirst(ALONE), {"span": Span(call="attn", until="proj_out")}, "sequence-first"),
        (SeqFirst(IMAGE_FIRST), {"rotary": Rotary("freqs", None, shared=True)}, "image-first"),
    ],
)
def test_a_site_refuses_what_its_layout_cannot_carry(layout, options, message):
    with pytest.raises(ValueError, match=message):
        Site("attention", "attn", layout=layout, **options)


def test_streams_say_what_leads_or_follows_the_image():
    class Rows(Spread):
        def length(self, call):
            return 7

    assert (Stream().packed, Stream().conditioning, Stream().spread) == (False, False, None)
    packed = Packed(positions=("position_ids",), spread_rows=Rows())
    assert packed.packed and packed.spread.length({}) == 7 and not packed.conditioning
    count = lambda model, call: 2  # noqa: E731
    assert Conditioned().conditioning is True and Conditioned(count=count).conditioning is count
    assert not Conditioned().packed and Conditioned().spread is None


def test_tile_order_unless_a_keyword_is_passed():
    ok = tile_order_unless("controlnet_block_samples", check=lambda model, call: call.get("t") != 2)
    assert ok(None, {}) and ok(None, {"controlnet_block_samples": None})
    assert not ok(None, {"controlnet_block_samples": [1]})
    assert not ok(None, {"t": 2})
    assert not tile_order_unless("a")(None, {"a": 0}) and tile_order_unless("a")(None, {"b": 0})


def test_a_spec_refuses_an_unknown_entry_and_two_block_tables():
    base = dict(name="toy", classes=("Toy",), stacks=("blocks",), sites=lambda s, b: [], grid=None, leave="out")
    with pytest.raises(ValueError, match="enter's kind"):
        FamilySpec(enter=("input", "x"), **base)
    with pytest.raises(ValueError, match="one BlockRope"):
        FamilySpec(enter=("block", ""), tables=(BlockRope("rope", 3, 0), BlockRope("rope2", 4, 0)), **base)
    FamilySpec(enter=("block", ""), tables=(RopeModule("rope", 1), BlockRope("rope", 3, 0)), **base)


def test_site_and_spec_fields_stay_few():
    # the family's facts as objects it picks, not one flag per family: Site at the issue's
    # target of 9; FamilySpec at 14 (the note says why each stays)
    assert len(Site.__dataclass_fields__) <= 9
    assert len(FamilySpec.__dataclass_fields__) <= 14
