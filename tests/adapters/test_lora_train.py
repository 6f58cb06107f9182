"""The LoRA training step of benchmarks/lora_train.py, on a tiny UNet: ToMA with gradient
checkpointing trains the same LoRA as ToMA without it, and only the LoRA learns."""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

import pytest
import torch

import toma
from tests.tiny_models import CROSS_DIM, make_sd15_unet

pytest.importorskip("peft")

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "lora_train.py"
STEPS = 3


def load_script():
    """benchmarks/ is not a package: load the script as a module from its path."""
    spec = importlib.util.spec_from_file_location("lora_train", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


lora_train = load_script()


def batch(step: int) -> dict[str, torch.Tensor]:
    """A training batch shaped like the script's (B = 2, latents 4 x 16 x 16), one per step."""
    g = torch.Generator().manual_seed(100 + step)
    return {
        "noisy": torch.randn(2, 4, 16, 16, generator=g),
        "t": torch.tensor([100, 700]),
        "labels": torch.tensor([3, 10]),  # 10: the null class
        "noise": torch.randn(2, 4, 16, 16, generator=g),
    }


def train(config: str) -> tuple[torch.nn.Module, list[dict[str, torch.Tensor]]]:
    """STEPS LoRA steps of ``config`` from the same model, LoRA and batches; returns the unet
    and each step's gradients by parameter name."""
    unet = make_sd15_unet()
    # random up-projections, so that every LoRA factor has a gradient from the first step
    lora_train.add_lora(unet, rank=2, seed=0, init=False)
    lora_train.prepare(unet, config)
    embeddings = torch.randn(11, 3, CROSS_DIM, generator=torch.Generator().manual_seed(5))
    args = argparse.Namespace(lr=1e-2, warmup=1, steps=STEPS)
    opt = torch.optim.AdamW(lora_train.lora_parameters(unet), lr=args.lr, weight_decay=0.0)
    grads = []
    for step in range(STEPS):
        loss = lora_train.train_step(unet, embeddings, batch(step), opt, step, args)
        assert loss == loss and loss > 0  # finite, and a real loss
        grads.append({n: p.grad.clone() for n, p in unet.named_parameters() if p.grad is not None})
    return unet, grads


def test_toma_with_checkpointing_trains_the_same_lora_and_only_the_lora(one_thread):
    unet, ckpt_grads = train("toma+checkpointing")
    assert toma.get_toma(unet) is not None and unet.is_gradient_checkpointing
    _, grads = train("toma")

    # only the LoRA factors take gradients, all of them, at every step
    lora_names = {n for n, _ in unet.named_parameters() if "lora_" in n}
    assert lora_names and all(not p.requires_grad for n, p in unet.named_parameters() if n not in lora_names)
    for step_grads in ckpt_grads + grads:
        assert set(step_grads) == lora_names
        assert all(g.abs().sum() > 0 for g in step_grads.values())

    # Checkpointing recomputes the same float32 forward from the same inputs; only the order
    # in which autograd sums the gradient paths may change, a few roundings (1e-7 relative)
    # per layer, and Adam turns it into updates that differ as little. 1e-5 of each tensor's
    # largest gradient leaves two orders of headroom.
    for step, (a, b) in enumerate(zip(ckpt_grads, grads)):
        for name in lora_names:
            scale = b[name].abs().max().item()
            torch.testing.assert_close(
                a[name], b[name], rtol=1e-5, atol=1e-5 * scale, msg=lambda m, s=step, n=name: f"step {s}, {n}: {m}"
            )


def test_toma_changes_the_lora_gradients(one_thread):
    # the comparison above is not vacuous: ToMA does merge during training
    _, toma_grads = train("toma")
    _, plain_grads = train("plain")
    for name, g in toma_grads[0].items():
        assert g.shape == plain_grads[0][name].shape
    differ = [not torch.allclose(toma_grads[0][n], plain_grads[0][n], rtol=1e-3, atol=0) for n in toma_grads[0]]
    assert any(differ)


def test_unknown_configuration_is_refused():
    with pytest.raises(ValueError, match="config must be one of"):
        lora_train.prepare(make_sd15_unet(), "toma+ckpt")
