"""``sparse_gradients`` (issue 32 item 8): at stage 0 an embedding's gradient travels as its nonzero rows.

World 2 against one process (``nn.Embedding(sparse=True)``, whose gradients are sparse tensors, and a dense
one), and fewer bytes on the wire than the dense all-reduce when a batch touches few rows.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from zerospeed.testing import run_distributed

VOCAB, DIM, STEPS, MB = 200, 8, 3, 4


class Bag(nn.Module):
    def __init__(self, sparse: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(VOCAB, DIM, sparse=sparse)
        self.head = nn.Linear(DIM, 1)

    def forward(self, ids: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(self.head(self.emb(ids).mean(dim=1)).squeeze(-1), y)


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    ids, y = torch.randint(0, 12, (2 * MB, 3), generator=g), torch.randn(2 * MB, generator=g)
    return ids[rank * MB:(rank + 1) * MB], y[rank * MB:(rank + 1) * MB]


def _reference() -> dict[str, torch.Tensor]:
    model = Bag(sparse=False)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for step in range(STEPS):
        opt.zero_grad()
        ids, y = _batch(step, 0)
        ids2, y2 = _batch(step, 1)
        model(torch.cat([ids, ids2]), torch.cat([y, y2])).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _train() -> dict[str, Any]:
    import zerospeed
    from zerospeed import comm

    out: dict[str, Any] = {}
    for name, sparse_flag, sparse_module in (("sparse", True, True), ("rows", True, False), ("dense", False, False)):
        model = Bag(sparse=sparse_module)
        config = {"train_micro_batch_size_per_gpu": MB, "gradient_clipping": 0.0, "sparse_gradients": sparse_flag,
                  "optimizer": {"type": "Adam", "params": {"lr": 1e-2}}, "zero_optimization": {"stage": 0}}
        engine, *_ = zerospeed.initialize(model=model, model_parameters=model.parameters(), config=config)
        for step in range(STEPS):
            engine.backward(engine(*_batch(step, comm.get_rank())))
            engine.step()
        out[name] = ({k: v.detach().clone() for k, v in model.state_dict().items()}, engine.last_step_comm_volume)
    return out


def test_sparse_embedding_gradients_match_one_process_in_fewer_bytes() -> None:
    ref = _reference()
    for r in run_distributed(_train, 2, timeout=120):
        for name in ("sparse", "rows", "dense"):
            for k, v in ref.items():
                torch.testing.assert_close(r[name][0][k], v, rtol=1e-5, atol=1e-6, msg=f"{name}: {k}")
        dense_volume = r["dense"][1]
        assert r["sparse"][1] < 0.5 * dense_volume and r["rows"][1] < 0.5 * dense_volume, (r["sparse"][1], dense_volume)
