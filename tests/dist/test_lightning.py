"""PyTorch Lightning through ZeroSpeedStrategy: a LightningModule trains at ZeRO stages 2 and 3 on 2 ranks with
the losses of Lightning's own single-device run, checkpoints and resumes on the same loss curve."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from zerospeed.testing import run_distributed

pytest.importorskip("lightning")

STEPS = 8


def _module():
    import lightning.pytorch as pl

    class Net(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))
            self.seen: list[float] = []

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = nn.functional.mse_loss(self.net(x), y)
            self.seen.append(float(loss))
            self.wrapped_by = type(self.trainer.model).__name__
            return loss

        def configure_optimizers(self):
            opt = torch.optim.AdamW(self.parameters(), lr=0.02, weight_decay=0.01)
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    return Net()


def _data(batch: int, world: int = 1, n: int = 64) -> DataLoader:
    """Samples in order; with ``world`` ranks, rank r takes samples r, r+world, ... (its share of each batch)."""
    import zerospeed

    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 6, generator=g)
    y = x[:, :1] * 2 - x[:, 1:2] + 0.1 * torch.randn(n, 1, generator=g)
    rank = zerospeed.comm.get_rank() if world > 1 else 0
    return DataLoader(TensorDataset(x[rank::world], y[rank::world]), batch_size=batch, shuffle=False)


def _trainer(devices: int, strategy, max_steps: int, root: str, accumulate: int = 1):
    import lightning.pytorch as pl

    return pl.Trainer(accelerator="cpu", devices=devices, num_nodes=1, strategy=strategy, max_steps=max_steps,
                      logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      default_root_dir=root, accumulate_grad_batches=accumulate, gradient_clip_val=1.0,
                      use_distributed_sampler=False)


def _single(root: str, accumulate: int) -> list[float]:
    model = _module()
    _trainer(1, "auto", STEPS, root, accumulate).fit(model, _data(4 // accumulate))
    return model.seen


def _zerospeed(root: str, stage: int, accumulate: int) -> dict:
    import zerospeed.integrations.lightning  # noqa: F401  (registers the strategy names)

    model = _module()
    trainer = _trainer(2, f"zerospeed_stage_{stage}", STEPS, root, accumulate)
    trainer.fit(model, _data(2 // accumulate, world=2))
    return {"seen": model.seen, "lr": trainer.optimizers[0].param_groups[0]["lr"],
            "engine": model.wrapped_by}


@pytest.mark.parametrize("stage", [2, 3])
def test_losses_equal_single_device(tmp_path, stage: int) -> None:
    (ref,) = run_distributed(_single, 1, str(tmp_path / "ref"), 1)
    r0, r1 = run_distributed(_zerospeed, 2, str(tmp_path / "zs"), stage, 1, timeout=120)
    assert r0["engine"] == "Engine" and len(r0["seen"]) == STEPS
    mean = [(a + b) / 2 for a, b in zip(r0["seen"], r1["seen"])]
    assert mean == pytest.approx(ref, rel=1e-5)
    assert r0["lr"] == pytest.approx(0.02 * 0.5 ** (STEPS // 3))  # Lightning stepped the client scheduler


def test_gradient_accumulation_is_not_divided_twice(tmp_path) -> None:
    (ref,) = run_distributed(_single, 1, str(tmp_path / "ref"), 2)  # micro-batch 2, 2 accumulated
    r0, r1 = run_distributed(_zerospeed, 2, str(tmp_path / "zs"), 2, 2, timeout=120)  # micro-batch 1 per rank
    # per micro-step: the single run sees samples (0,1), the ranks see 0 and 1
    assert [(a + b) / 2 for a, b in zip(r0["seen"], r1["seen"])] == pytest.approx(ref, rel=1e-5)


def _resume(root: str, stage: int | None) -> dict:
    """Train half, save, resume in a fresh Trainer and model; ``stage=None``: Lightning's own single-device run
    with its own checkpoint (the reference for where Lightning's loops resume the data)."""
    import zerospeed.integrations.lightning  # noqa: F401

    devices, strategy = (1, "auto") if stage is None else (2, f"zerospeed_stage_{stage}")
    data = (lambda: _data(4, 1, n=32)) if stage is None else (lambda: _data(2, 2, n=32))
    first = _module()
    trainer = _trainer(devices, strategy, STEPS // 2, root + "/b")
    trainer.fit(first, data())
    trainer.save_checkpoint(root + "/half.ckpt")
    second = _module()
    with torch.no_grad():
        for p in second.parameters():
            p.zero_()
    trainer2 = _trainer(devices, strategy, STEPS, root + "/c")
    trainer2.fit(second, data(), ckpt_path=root + "/half.ckpt")
    return {"resumed": first.seen + second.seen, "step": trainer2.global_step,
            "lr": trainer2.optimizers[0].param_groups[0]["lr"]}


@pytest.mark.parametrize("stage", [2, 3])
def test_checkpoint_and_resume(tmp_path, stage: int) -> None:
    (ref,) = run_distributed(_resume, 1, str(tmp_path / "ref"), None, timeout=180)
    r0, r1 = run_distributed(_resume, 2, str(tmp_path / "zs"), stage, timeout=180)
    assert r0["step"] == ref["step"] == STEPS and r0["lr"] == pytest.approx(ref["lr"])
    assert [(a + b) / 2 for a, b in zip(r0["resumed"], r1["resumed"])] == pytest.approx(ref["resumed"], rel=1e-5)


# --- Fabric ---------------------------------------------------------------------------------------------
def _fabric(root: str, strategy: str | None) -> dict:
    import lightning as L

    import zerospeed.integrations.lightning  # noqa: F401

    world = 1 if strategy is None else 2
    fabric = L.Fabric(accelerator="cpu", devices=world, strategy="auto" if strategy is None else strategy)
    fabric.launch()
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))
    opt = torch.optim.AdamW(net.parameters(), lr=0.02)
    if strategy is not None:
        fabric.strategy.config["gradient_clipping"] = 0.0
    model, opt = fabric.setup(net, opt)
    losses = []
    loader = _data(4 // world, world)
    for i, (x, y) in enumerate(loader):
        if i == 6:
            break
        loss = nn.functional.mse_loss(model(x), y)
        fabric.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
        if i == 2:
            fabric.save(root + "/fab", {"model": model, "optimizer": opt, "step": i})
            probe = float(model(torch.ones(2, 6)).sum())
    state = {"model": model, "optimizer": opt, "step": -1}
    fabric.load(root + "/fab", state)
    return {"losses": losses, "step": state["step"], "engine": type(model._forward_module).__name__,
            "probe": probe, "probe_after_load": float(model(torch.ones(2, 6)).sum())}


def test_fabric_losses_and_checkpoint(tmp_path) -> None:
    (ref,) = run_distributed(_fabric, 1, str(tmp_path / "ref"), None)
    r0, r1 = run_distributed(_fabric, 2, str(tmp_path / "zs"), "zerospeed_stage_2", timeout=120)
    assert r0["engine"] == "Engine" and r0["step"] == 2 and r0["probe_after_load"] == pytest.approx(r0["probe"])
    assert [(a + b) / 2 for a, b in zip(r0["losses"], r1["losses"])] == pytest.approx(ref["losses"], rel=1e-5)
