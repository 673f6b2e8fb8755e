"""Stage-3 ranks that run different forward paths are named, not hung: every rank raises, within the
collective timeout, an error naming the pass and the module where their gather sequences first differ.
Ranks that generate different lengths with ``synced_generate`` stay in step and match a plain model."""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn

from zerospeed.testing import run_distributed

TIMEOUT_S = 4.0  # comms_timeout_s of these runs
COMPILE_TIMEOUT_S = 100.0  # and of the DeepCompile run


class _Net(nn.Module):
    """Four same-size layers, and a branch between two layers of different sizes."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(16, 8)
        self.layers = nn.ModuleList([nn.Linear(8, 8) for _ in range(4)])
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8, bias=False)
        self.head = nn.Linear(8, 16)
        self.skip: int | None = None  # index of a layer this rank skips
        self.exit_after: int | None = None  # index of the layer after which this rank returns
        self.branch = False

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for i, layer in enumerate(self.layers):
            if i != self.skip:
                h = torch.tanh(layer(h))
            if i == self.exit_after:
                return h  # an early exit
        if self.branch:
            h = self.a(h) if int(tokens[0, 0]) == 0 else self.b(h)  # data-dependent
        return self.head(h)


def _engine(deep: bool = False) -> tuple[Any, _Net]:
    import zerospeed

    model = _Net()
    cfg = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
           # compiling takes each rank its own time (seconds, under load) before the first exchange
           "comms_timeout_s": COMPILE_TIMEOUT_S if deep else TIMEOUT_S, "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
           "compile": {"deepcompile": deep}}
    engine, *_ = zerospeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    return engine, model


def _train_step(engine: Any, tokens: torch.Tensor) -> None:
    engine.backward(engine(tokens).float().logsumexp(-1).mean())
    engine.step()


def _diverge(case: str) -> tuple[str, str, float]:
    """Run one diverging scenario; return the error's type, its message and how long it took to come."""
    from zerospeed import comm

    engine, model = _engine(deep=case == "compiled")
    rank = comm.get_rank()
    tokens = torch.tensor([[rank, 2, 3]])
    t0 = time.monotonic()
    try:
        if case == "skip":
            model.skip = 2 if rank == 1 else None
            _train_step(engine, tokens)
        elif case == "exit":
            model.exit_after = 1 if rank == 1 else None
            _train_step(engine, tokens)
        elif case == "compiled":  # DeepCompile: each rank compiles the graph of its own path
            model.skip = 2 if rank == 1 else None
            engine.compile(backend="aot_eager")
            _train_step(engine, tokens)
        elif case == "branch":
            model.branch = True
            _train_step(engine, tokens)
        else:  # generate loops of different lengths, then training (or a barrier) on every rank
            engine.eval()
            with torch.no_grad():
                for _ in range(2 + 2 * rank):
                    engine(tokens)
            if case == "generate":
                engine.train()
                _train_step(engine, tokens)
            else:
                comm.barrier()
    except Exception as exc:  # noqa: BLE001 - the error is the result
        notes = "\n".join(getattr(exc, "__notes__", []))
        return type(exc).__name__, str(exc) + notes, time.monotonic() - t0
    return "no error", "", time.monotonic() - t0


def _check(case: str, limit: float = TIMEOUT_S + 10) -> list[tuple[str, str, float]]:
    results = run_distributed(_diverge, 2, case, timeout=max(120.0, limit + 20))
    for kind, _, elapsed in results:
        assert kind != "no error"
        assert elapsed < limit  # generous: the machine is loaded
    return results


def test_a_rank_that_skips_a_layer_is_named() -> None:
    for rank, (kind, message, _) in enumerate(_check("skip")):
        assert kind == "RanksDivergedError", message
        assert message.startswith(f"rank {rank}: ZeRO-3 ranks diverged (training forward pass 1, gather #4)")
        assert "rank 0: gather #4 of training forward pass 1 for module 'layers.2'" in message
        assert "rank 1: gather #4 of training forward pass 1 for module 'layers.3'" in message
        assert "synced_generate" in message
        assert "outside its module" not in message  # not mistaken for a parameter used elsewhere


def test_an_early_exit_is_named() -> None:
    for kind, message, _ in _check("exit"):
        assert kind == "RanksDivergedError", message
        assert "rank 0: gather #4 of training forward pass 1 for module 'layers.2'" in message
        assert "rank 1: the end of training forward pass 1, after 3 gathers" in message


def test_a_data_dependent_branch_is_named() -> None:
    for kind, message, _ in _check("branch"):
        assert kind == "RanksDivergedError", message
        assert "rank 0: gather #6 of training forward pass 1 for module 'a' ('a.weight', 72 elements)" in message
        assert "rank 1: gather #6 of training forward pass 1 for module 'b' ('b.weight', 64 elements)" in message


def test_ranks_that_compiled_different_graphs_are_named() -> None:
    """DeepCompile checks each compiled graph's whole schedule once, at its start (graph_passes.check_schedule):
    a rank that compiled another path differs there, before any gather of the graph."""
    for kind, message, _ in _check("compiled", limit=COMPILE_TIMEOUT_S):
        assert kind == "RanksDivergedError", message
        assert "the start of a compiled graph" in message, message


def test_generate_loops_of_different_lengths_are_named() -> None:
    for kind, message, _ in _check("generate"):
        assert kind == "RanksDivergedError", message
        assert "rank 0: gather #1 of training forward pass 3 for module 'embed'" in message
        assert "rank 1: gather #1 of no-grad forward pass 3 for module 'embed'" in message


def test_a_rank_whose_peer_never_joins_names_what_it_was_doing() -> None:
    (kind0, message0, _), (kind1, message1, _) = _check("barrier")
    assert kind0 == "CollectiveError" and "'barrier'" in message0  # rank 0 waits in its barrier
    assert kind1 == "RanksDivergedError", message1
    assert "rank 1 was at gather #1 of no-grad forward pass 3 for module 'embed'" in message1
    assert "did not join" in message1


# --- the documented way: synced generation ---------------------------------------------------------------
def _greedy(model: nn.Module, tokens: torch.Tensor, new: int) -> torch.Tensor:
    with torch.no_grad():
        for _ in range(new):
            tokens = torch.cat([tokens, model(tokens)[:, -1].argmax(-1, keepdim=True)], dim=1)
    return tokens


def _synced(eos: int | None) -> tuple[list[list[int]], list[list[int]]]:
    from zerospeed import comm
    from zerospeed.zero import synced_generate

    engine, _ = _engine()
    rank = comm.get_rank()
    prompt = torch.tensor([[1 + rank, 2], [3, 4 + rank]])
    engine.eval()
    out = synced_generate(engine, prompt, max_new_tokens=2 + 3 * rank, eos_token_id=eos)
    engine.train()
    _train_step(engine, prompt)  # the ranks are still in step
    return out.tolist(), prompt.tolist()


def test_synced_generate_keeps_ranks_of_different_lengths_in_step() -> None:
    plain = _Net()
    for rank, (out, prompt) in enumerate(run_distributed(_synced, 2, None, timeout=120)):
        assert len(out[0]) == 2 + 2 + 3 * rank
        assert out == _greedy(plain, torch.tensor(prompt), 2 + 3 * rank).tolist()
