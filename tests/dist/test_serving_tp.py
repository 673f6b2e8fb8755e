"""Tensor-parallel serving engine at tp=2 on Gloo ranks: continuous batching over sharded heads gives tp=1's
greedy tokens (GPT-2, Llama with GQA, zerospeed's GPT), each rank holding half the KV heads; the HTTP server
drives the tp=2 engine; a size that does not split is an error."""

from __future__ import annotations

import copy

import pytest
import torch

from zerospeed.models.gpt import GPT, GPTConfig
from zerospeed.testing import run_distributed

transformers = pytest.importorskip("transformers")

from ..unit.hf_tiny import V, gpt2 as _gpt2, llama as _llama  # noqa: E402


def _gpt():
    return GPT(GPTConfig(vocab_size=V, block_size=64, n_layer=2, n_head=4, n_embd=32), seed=0).eval()


def _cfg(tp: int = 1) -> dict:
    return {"tensor_parallel": {"tp_size": tp, "tp_grain_size": 8},
            "state_manager": {"max_ragged_batch_size": 8, "max_ragged_sequence_count": 4, "max_tracked_sequences": 16,
                              "max_context": 64, "kv_block_size": 4, "memory_config": {"mode": "allocate", "size": 64}}}


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, V, (n,), generator=g).tolist() for n in (3, 11, 1, 17, 6, 9)]


def _serve(build) -> dict:
    from zerospeed import comm
    from zerospeed.inference import SamplingParams, ServingEngine

    rank = comm.get_rank()
    model = build()
    params = [SamplingParams(max_tokens=n) for n in (7, 3, 12, 5, 9, 4)]
    ref = ServingEngine(copy.deepcopy(model), _cfg()) if rank == 0 else None
    eng = ServingEngine(model, _cfg(2))
    out = {"kv_heads": eng.cache.k.shape[1], "heads": eng.adapter.num_heads}
    if rank == 0:
        want = [r.output for r in ref.generate(_prompts(), params)]
        got = [r.output for r in eng.generate(_prompts(), params)]
        eng.shutdown()
        out.update(equal=got == want, tokens=got, forwards=eng.forwards, free=eng.scheduler.allocator.num_free)
    else:
        out["forwards"] = eng.run_worker()
    return out


@pytest.mark.parametrize("build,heads,kv", [(_gpt2, 2, 2), (_llama, 2, 1), (_gpt, 2, 2)], ids=["gpt2", "llama", "gpt"])
def test_tp2_serving_equals_tp1(build, heads, kv) -> None:
    r0, r1 = run_distributed(_serve, 2, build, timeout=120)
    assert r0["equal"], r0["tokens"]
    assert r0["forwards"] == r1["forwards"] > len(_prompts())  # every rank ran every forward (chunked prefill)
    assert (r0["heads"], r0["kv_heads"]) == (r1["heads"], r1["kv_heads"]) == (heads, kv)
    assert r0["free"] == 64  # all blocks back


def _errors() -> list[str]:
    from zerospeed.inference import ServingEngine, init_inference

    msgs = []
    for make in (lambda: ServingEngine(_llama(), _cfg(4)),  # world of 2
                 lambda: ServingEngine(_llama(), {**_cfg(2), "tensor_parallel": {"tp_size": 2}}),  # grain 64 > 16
                 lambda: ServingEngine(init_inference(_gpt(), dtype="fp32"), _cfg(2)),
                 lambda: ServingEngine(_llama(), _cfg()).run_worker()):
        try:
            make()
            msgs.append("no error")
        except (ValueError, RuntimeError) as exc:
            msgs.append(str(exc))
    return msgs


def _one_kv_head() -> str:
    cfg = transformers.LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=1)
    from zerospeed.inference import ServingEngine

    try:
        ServingEngine(transformers.LlamaForCausalLM(cfg), _cfg(2))
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_tp_errors() -> None:
    msgs = run_distributed(_errors, 2, timeout=60)[0]
    assert "world has 2 ranks" in msgs[0]
    assert "grain" in msgs[1] or "64" in msgs[1], msgs[1]
    assert "InferenceEngine" in msgs[2]
    assert "run_worker() is for ranks 1" in msgs[3]
    assert "key/value heads cannot be split" in run_distributed(_one_kv_head, 2, timeout=60)[0]


def _http() -> dict:
    from fastapi.testclient import TestClient

    from zerospeed import comm
    from zerospeed.inference import ServingEngine, init_inference
    from zerospeed.inference.model_dir import ByteTokenizer, LoadedModel
    from zerospeed.inference.server import create_app

    model = GPT(GPTConfig(vocab_size=256, block_size=64, n_layer=1, n_head=2, n_embd=32), seed=4)
    ids = torch.tensor([list(b"Hello")])
    want = init_inference(copy.deepcopy(model), dtype="fp32").generate(ids, max_new_tokens=8)[0, 5:].tolist()
    tok = ByteTokenizer()
    eng = ServingEngine(model, _cfg(2), decode=tok.decode)
    if comm.get_rank() != 0:
        return {"forwards": eng.run_worker()}
    with TestClient(create_app(LoadedModel(model, tok, "tiny", ()), eng)) as client:
        r = client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 8, "temperature": 0}).json()
        bad = client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": -1}).status_code
        again = client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 8, "temperature": 0}).json()
    return {"text": r["choices"][0]["text"], "again": again["choices"][0]["text"], "want": tok.decode(want),
            "bad": bad, "forwards": eng.forwards}


def test_server_drives_tp2_engine() -> None:
    pytest.importorskip("fastapi")
    pytest.importorskip("httpx")
    r0, r1 = run_distributed(_http, 2, timeout=120)
    assert r0["text"] == r0["again"] == r0["want"] and r0["bad"] == 400
    assert r1["forwards"] == r0["forwards"] > 0  # the worker returned: the app's shutdown released it


def test_serve_command_tp2_forks_a_worker(tmp_path) -> None:
    """`zerospeed serve DIR --tp-size 2 --quant int8` in a subprocess: rank 0 answers HTTP with tp=1's tokens
    (INT8 with groups inside the shards: the same codes on both ranks), and Ctrl-C ends both ranks."""
    import json
    import signal
    import socket
    import subprocess
    import sys
    import time

    httpx = pytest.importorskip("httpx")
    pytest.importorskip("uvicorn")
    from zerospeed.inference import init_inference
    from zerospeed.inference.model_dir import save_gpt_dir

    model = GPT(GPTConfig(vocab_size=256, block_size=64, n_layer=1, n_head=2, n_embd=32), seed=4)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(8.0)  # sharper logits: varied bytes
    d = save_gpt_dir(model, tmp_path / "tiny")
    ids = torch.tensor([list(b"Hello")])
    quant = {"weight": {"num_bits": 8, "q_groups": 2}}
    want = init_inference(model, dtype="fp32", quant=quant).generate(ids, max_new_tokens=8)[0, 5:].tolist()
    (tmp_path / "cfg.json").write_text(json.dumps({"tensor_parallel": {"tp_grain_size": 8}}))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "zerospeed.launcher.cli", "serve", str(d), "--port", str(port),
                             "--tp-size", "2", "--quant", "int8", "--q-groups", "2", "--kv-blocks", "32",
                             "--config", str(tmp_path / "cfg.json")], stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 120
        while True:
            assert proc.poll() is None and time.time() < deadline, proc.stderr.read() if proc.poll() else "timeout"
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60,
                       json={"prompt": "Hello", "max_tokens": 8, "temperature": 0}).json()
        assert r["choices"][0]["text"] == bytes(want).decode("utf-8", errors="replace")
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            assert proc.wait(timeout=60) == 0
        finally:
            proc.kill()
