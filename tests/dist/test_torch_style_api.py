"""DeepSpeed's 2026 training API (issue 32 item 1), world 2 against one process, stages 0-3.

``loss.backward()`` on the engine's output, ``loss.backward()`` on one loss summed over two engines' modules
called directly (``_backward_epilogue()``; stage 3 takes the gradients as they arrive), ``coalesce_grad_reduction()``
(one reduction for several backward calls), ``managed_gradient_accumulation: false`` (the caller's boundary is ``step()``, also with
offload) and ``gradient_allreduce_op``: each trains as the single-process reference does.
"""

from __future__ import annotations

from typing import Any

import torch

from zerospeed.testing import run_distributed

from .parity import global_batch, make_model, micro_batch, param_groups, reference_losses

STEPS, MB, GAS, CLIP = 3, 2, 2, 0.5


def _engine(stage: int, extra: dict[str, Any], gas: int = GAS) -> Any:
    import zerospeed

    model = make_model()
    config = {"train_micro_batch_size_per_gpu": MB, "gradient_accumulation_steps": gas, "gradient_clipping": CLIP,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "betas": [0.9, 0.999], "eps": 1e-8}},
              "zero_optimization": {"stage": stage, "reduce_bucket_size": 200, "allgather_bucket_size": 300},
              "steps_per_print": 1000, **extra}
    engine, *_ = zerospeed.initialize(model=model, model_parameters=param_groups(model), config=config)
    return engine


def _train(stage: int, mode: str) -> dict[str, Any]:
    """STEPS optimizer steps of GAS micro-batches each, driven the ``mode`` way."""
    from zerospeed import comm

    world, rank = comm.get_world_size(), comm.get_rank()
    extra = {"managed_gradient_accumulation": False} if mode.startswith("unmanaged") else {}
    if mode == "unmanaged_offload":
        extra["zero_optimization"] = {"stage": stage, "offload_optimizer": {"device": "cpu"}}
    engine = _engine(stage, extra, gas=1 if mode == "coalesce" else GAS)
    losses, norms = [], []
    for step in range(STEPS):
        total = torch.zeros(())
        batches = [micro_batch(step, m, rank, world, MB, GAS) for m in range(GAS)]
        if mode == "direct":  # loss.backward() in place of engine.backward(loss), the engine's counter
            for x, y in batches:
                loss = engine(x, y)
                loss.backward()
                engine.step()
                total += loss.detach() / GAS
        elif mode == "coalesce":  # gas 1: the caller scales; one reduction at the block's exit
            with engine.coalesce_grad_reduction():
                for x, y in batches:
                    loss = engine(x, y)
                    engine.backward(loss / GAS)
                    total += loss.detach() / GAS
            engine.step()
        else:  # unmanaged: every backward accumulates, step() is the boundary
            for x, y in batches:
                loss = engine(x, y)
                engine.backward(loss)
                total += loss.detach() / GAS
            engine.step()
        comm.all_reduce(total)
        losses.append(float(total) / world)
        norms.append(engine.get_global_grad_norm())
    from zerospeed.zero import full_state_dict

    state = {k: v.float() for k, v in full_state_dict(engine.module, rank0_only=False).items()}
    return {"losses": losses, "norm0": norms[0], "state": state, "steps": engine.global_steps, "samples": engine.global_samples}


def _train_shared(stage: int) -> list[dict[str, Any]]:
    """Two engines over equal models, one loss summed over their modules called directly (the engines' forwards
    bypassed), ``loss.backward()``, then each engine's ``_backward_epilogue()`` and ``step()``: each one trains as
    the reference does (gradients divided by the accumulation steps, as ``engine.backward`` divides the loss);
    the second one's first gradient norm is a third of the reference's."""
    from zerospeed import comm

    world, rank = comm.get_world_size(), comm.get_rank()
    engines = [_engine(stage, {}), _engine(stage, {})]
    losses, norms, second_norms = [], [], []
    for step in range(STEPS):
        total = torch.zeros(())
        for m in range(GAS):
            x, y = micro_batch(step, m, rank, world, MB, GAS)
            first, second = (e.module(x, y) for e in engines)
            (first + second / 3).backward()  # the second engine's gradients: a third of the first's
            for e in engines:
                e._backward_epilogue()
                e.step()
            total += first.detach() / GAS
        comm.all_reduce(total)
        losses.append(float(total) / world)
        norms.append(engines[0].get_global_grad_norm())
        second_norms.append(engines[1].get_global_grad_norm())
    from zerospeed.zero import full_state_dict

    state = {k: v.float() for k, v in full_state_dict(engines[0].module, rank0_only=False).items()}
    first_run = {"losses": losses, "norm0": norms[0], "state": state, "steps": engines[0].global_steps,
                 "samples": engines[0].global_samples}
    return [first_run, {"norm0": second_norms[0], "steps": engines[1].global_steps}]


def _all_modes() -> dict[str, Any]:
    out: dict[str, Any] = {}
    for stage in (0, 1, 2, 3):
        for mode in ("direct", "coalesce", "unmanaged"):
            out[f"{mode}{stage}"] = _train(stage, mode)
        out[f"shared{stage}"], out[f"shared{stage}_second"] = _train_shared(stage)
    out["unmanaged_offload2"] = _train(2, "unmanaged_offload")
    # gradient_allreduce_op: the sum over the ranks is `world` times their mean (one step, same batch)
    norms = {}
    for op in ("mean", "sum"):
        engine = _engine(2, {"gradient_allreduce_op": op}, gas=1)
        x, y = micro_batch(0, 0, engine.global_rank, 2, MB, 1)
        engine.backward(engine(x, y))
        engine.step()
        norms[op] = engine.get_global_grad_norm()
    out["norms"] = norms
    # torch.func through the engine's forward (DeepSpeed's stages 0-2): the transforms' own gradients, not
    # scaled by the accumulation steps, and no micro-step opened
    funcs = []
    for stage in (0, 1, 2):
        engine, base = _engine(stage, {}), make_model()
        x, y = micro_batch(0, 0, engine.global_rank, 2, MB, 1)
        xs = torch.stack([x, x + 0.1])
        for transform in (torch.func.grad, torch.func.jacrev):
            funcs.append((transform(lambda xx: engine(xx, y))(x), transform(lambda xx: base(xx, y))(x)))
        vgrad = torch.func.vmap(torch.func.grad(lambda xx: engine(xx, y)))
        funcs.append((vgrad(xs), torch.func.vmap(torch.func.grad(lambda xx: base(xx, y)))(xs)))
        funcs.append((engine.optimizer.reducer.tracker.unused, None))
    out["func"] = funcs
    # misuse: step() inside the block, nesting; the engine goes on training after either
    engine, errors = _engine(1, {}, gas=1), []
    x, y = micro_batch(0, 0, engine.global_rank, 2, MB, 1)
    for misuse in ("step", "nest"):
        try:
            with engine.coalesce_grad_reduction():
                engine.backward(engine(x, y))
                if misuse == "step":
                    engine.step()
                with engine.coalesce_grad_reduction():
                    pass
        except RuntimeError as exc:
            errors.append(str(exc))
        engine.zero_grad()
    engine.backward(engine(x, y))
    engine.step()
    out["misuse"] = (errors, engine.global_steps)
    return out


def _reference_norm() -> float:
    """The first step's gradient norm before clipping (Adam and clipping hide a wrongly scaled gradient)."""
    model = make_model()
    model(*global_batch(0, MB * GAS * 2)).backward()
    return float(torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None]).norm())


def test_training_api_matches_one_process() -> None:
    ref_losses, ref_state = reference_losses(STEPS, MB, GAS, 2, CLIP)
    ref_norm = _reference_norm()
    for r in run_distributed(_all_modes, 2, timeout=240):
        for name, got in r.items():
            if name in ("norms", "func", "misuse"):
                continue
            if name.endswith("_second"):
                assert abs(3 * got["norm0"] - ref_norm) < 1e-5 * ref_norm and got["steps"] == STEPS, (name, got)
                continue
            torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6,
                                       msg=name)
            for k, v in ref_state.items():
                torch.testing.assert_close(got["state"][k], v, rtol=1e-5, atol=1e-6, msg=f"{name}: {k}")
            assert abs(got["norm0"] - ref_norm) < 1e-5 * ref_norm, (name, got["norm0"], ref_norm)
            per_step = MB * 2 * (1 if name.startswith("coalesce") else GAS)  # coalesce: gas 1, the batch counts
            assert got["steps"] == STEPS and got["samples"] == STEPS * per_step, (name, got["samples"])
        assert abs(r["norms"]["sum"] - 2 * r["norms"]["mean"]) < 1e-5 * r["norms"]["mean"], r["norms"]
        errors, steps = r["misuse"]
        assert "inside coalesce_grad_reduction" in errors[0] and "cannot be nested" in errors[1] and steps == 1, r
        for got_func, want in r["func"]:
            if want is None:
                assert got_func is None  # the reducer never saw a micro-step
            else:
                torch.testing.assert_close(got_func, want)


def test_misuse_is_refused() -> None:
    import pytest

    from zerospeed.config import ConfigError, load_config

    cfg = load_config({"train_batch_size": 8, "gradient_allreduce_op": "SUM", "managed_gradient_accumulation": False})
    assert cfg.gradient_allreduce_op == "sum" and not cfg.managed_gradient_accumulation
    with pytest.raises(ConfigError, match="gradient_allreduce_op"):
        load_config({"train_batch_size": 8, "gradient_allreduce_op": "max"})
