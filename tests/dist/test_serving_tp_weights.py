"""Weight updates into a tensor-parallel serving engine at tp=2 (Gloo ranks): after ``POST /v1/weights`` (or
``update_weights``) each rank holds exactly its shard of the pushed weights (equal, tensor by tensor, to a tp=2
engine built from the new weights) and greedy generation equals that engine's: zerospeed's GPT over HTTP (fused
QKV, tied head), HF Llama with GQA and HF GPT-2 (transposed Conv1D, fused c_attn) in process. A file that does
not fit is 400 and changes nothing on any rank."""

from __future__ import annotations

import pytest
import torch

from zerospeed.models.gpt import GPT, GPTConfig
from zerospeed.testing import run_distributed

transformers = pytest.importorskip("transformers")
pytest.importorskip("fastapi")
pytest.importorskip("httpx")

from ..unit.hf_tiny import V, gpt2 as _gpt2, llama as _llama  # noqa: E402


def _cfg(tp: int) -> dict:
    return {"tensor_parallel": {"tp_size": tp, "tp_grain_size": 8},
            "state_manager": {"max_ragged_batch_size": 16, "max_ragged_sequence_count": 4, "max_tracked_sequences": 16,
                              "max_context": 64, "kv_block_size": 4, "memory_config": {"mode": "allocate", "size": 64}}}


def _gpt(seed: int) -> GPT:
    model = GPT(GPTConfig(vocab_size=256, block_size=64, n_layer=1, n_head=2, n_embd=32), seed=seed)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(8.0)  # sharper logits: varied bytes
    return model


def _perturbed(build):
    model = build()
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.5 * torch.randn(p.shape, generator=g))
    return model


def _same_shards(a, b) -> bool:
    sa, sb = a.model.state_dict(), b.model.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def _run(eng, prompts, n: int):
    """Rank 0: greedy outputs of ``prompts`` then release the worker; a worker: serve until released (None)."""
    from zerospeed import comm
    from zerospeed.inference import SamplingParams

    if comm.get_rank() != 0:
        eng.run_worker()
        return None
    out = [r.output for r in eng.generate(prompts, SamplingParams(max_tokens=n))] if prompts else None
    eng.shutdown()
    return out


def _http_update(path: str, bad: str) -> dict:
    from fastapi.testclient import TestClient

    from zerospeed import comm
    from zerospeed.inference import ServingEngine
    from zerospeed.inference.model_dir import ByteTokenizer, LoadedModel
    from zerospeed.inference.server import ServeOptions, create_app

    tok, old = ByteTokenizer(), _gpt(4)
    eng = ServingEngine(old, _cfg(2), decode=tok.decode)
    out: dict = {}
    if comm.get_rank() != 0:
        eng.run_worker()
    else:
        body = {"prompt": "Hello", "max_tokens": 6, "temperature": 0}
        app = create_app(LoadedModel(old, tok, "tiny", ()), eng, ServeOptions(allow_weight_updates=True))
        with TestClient(app) as c:
            before = c.post("/v1/completions", json=body).json()["choices"][0]["text"]
            r = c.post("/v1/weights", json={"path": path})
            refused = c.post("/v1/weights", json={"path": bad})
            after = c.post("/v1/completions", json=body).json()["choices"][0]["text"]
        out = {"before": before, "reply": (r.status_code, r.json()), "after": after,
               "refused": (refused.status_code, refused.json()["error"]["message"])}
    fresh = ServingEngine(_gpt(9), _cfg(2))
    want = _run(fresh, [list(b"Hello")], 6)
    out.update(version=eng.weights_version, same=_same_shards(eng, fresh),
               want=None if want is None else tok.decode(want[0]))
    return out


def _update(path: str, bad: str) -> dict:
    """HTTP with zerospeed's GPT, then in-process updates of HF Llama (GQA; generated) and GPT-2 (Conv1D; shards
    compared only), each against a tp=2 engine built from the new weights."""
    from zerospeed import comm
    from zerospeed.inference import ServingEngine

    out = {"http": _http_update(path, bad)}
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, V, (n,), generator=g).tolist() for n in (3, 7)]
    for name, build, gen in (("llama", _llama, prompts), ("gpt2", _gpt2, None)):
        eng = ServingEngine(build(), _cfg(2))
        if comm.get_rank() == 0:
            eng.update_weights(_perturbed(build).state_dict())
        after = _run(eng, gen, 4)
        fresh = ServingEngine(_perturbed(build), _cfg(2))
        want, old = _run(fresh, gen, 4), ServingEngine(build(), _cfg(2))
        out[name] = {"after": after, "want": want, "version": eng.weights_version, "same": _same_shards(eng, fresh),
                     "changed": not _same_shards(eng, old)}
    return out


def test_update_weights_into_tp2_server_equals_a_server_of_the_new_weights(tmp_path) -> None:
    from safetensors.torch import save_file

    path, bad = str(tmp_path / "new.safetensors"), str(tmp_path / "bad.safetensors")
    save_file({k: v.contiguous() for k, v in _gpt(9).state_dict().items() if k != "lm_head.weight"}, path)
    save_file({"wte.weight": torch.zeros(3, 3)}, bad)
    _llama(), _gpt2()  # transformers' lazy imports in the parent, not once per forked rank
    r0, r1 = run_distributed(_update, 2, path, bad, timeout=180)
    http = r0["http"]
    assert http["reply"][0] == 200 and http["reply"][1]["version"] == 1, http["reply"]
    assert http["refused"][0] == 400 and "do not fit" in http["refused"][1]
    assert http["after"] == http["want"] != http["before"]
    for r in (r0, r1):  # each rank holds its shard of the new weights; the worker took only the good update
        assert r["http"]["same"] and r["http"]["version"] == 1
        for name in ("llama", "gpt2"):
            assert r[name]["same"] and r[name]["changed"] and r[name]["version"] == 1, (name, r[name])
    assert r0["llama"]["after"] == r0["llama"]["want"]
