"""SuperOffload (``offload_optimizer.super_offload``) at ZeRO-3, world 2, Gloo: the sub-group steps started
during backward give the one-process AdamW run (fp32, rtol 1e-5), and a step skipped for overflow (bf16 with
``check_grad_overflow``, an inf loss injected) rolls the speculative updates back to exactly what the plain
CPU-offloaded engine holds."""

from __future__ import annotations

from typing import Any

import torch

from zerospeed.testing import run_distributed

from .zero3_fixtures import config, make_model, micro_batch, reference

STEPS, MB, GAS, SUB_GROUP = 3, 2, 2, 64


def _train(super_offload: bool, extra: dict[str, Any], poison_step: int | None = None) -> dict[str, Any]:
    import zerospeed
    from zerospeed import comm
    from zerospeed.zero import full_state_dict

    world, rank = comm.get_world_size(), comm.get_rank()
    cfg = config(3, MB, GAS, 0.0, sub_group_size=SUB_GROUP,
                 offload_optimizer={"device": "cpu", "super_offload": super_offload})
    cfg.update(extra)
    model = make_model()
    engine, opt, _, _ = zerospeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    losses, speculated = [], []
    for step in range(STEPS):
        total = torch.zeros(())
        for m in range(GAS):
            x, y = micro_batch(step, m, rank, world, MB, GAS)
            loss = engine(x, y)
            if step == poison_step and m == GAS - 1:
                loss = loss * float("inf")
            engine.backward(loss)
            engine.step()
            total += loss.detach().float() / GAS
        comm.all_reduce(total)
        losses.append(float(total) / world)
        speculated.append(getattr(opt.stepper, "speculated_last", 0))
    fp32 = full_state_dict(model, optimizer=opt, fp32=True, rank0_only=False)
    return {"losses": losses, "fp32": fp32, "speculated": speculated, "skipped": engine.skipped_steps,
            "subgroups": sum(len(s) for s in opt.stepper.subgroups)}


def _ranks() -> dict[str, Any]:
    bf16 = {"bf16": {"enabled": True, "check_grad_overflow": True}}
    return {"fp32": _train(True, {}), "super_bf16": _train(True, bf16, poison_step=1),
            "plain_bf16": _train(False, bf16, poison_step=1)}


def test_super_offload_speculates_matches_one_process_and_rolls_back_on_overflow() -> None:
    ref_losses, ref_state, _ = reference(STEPS, MB, GAS, 2, 0.0)
    for r in run_distributed(_ranks, 2, timeout=180):
        fp32 = r["fp32"]
        assert fp32["subgroups"] > 2 and all(n > 0 for n in fp32["speculated"])  # steps started in backward
        torch.testing.assert_close(torch.tensor(fp32["losses"]), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
        for k, v in ref_state.items():
            torch.testing.assert_close(fp32["fp32"][k].float(), v.float(), rtol=1e-5, atol=1e-6, msg=f"fp32 {k}")
        sup, plain = r["super_bf16"], r["plain_bf16"]
        assert sup["skipped"] == plain["skipped"] == 1 and sup["speculated"][1] == 0
        assert sup["losses"][2:] == plain["losses"][2:]
        for k, v in plain["fp32"].items():
            assert torch.equal(sup["fp32"][k], v), f"rolled-back master {k} differs from the plain offloaded one"
