"""Weight sync from a training engine into a running `zerospeed serve` app (RL with a separate generation server):
a world-2 ZeRO-3 engine trains a step and calls push_weights(engine, url); the served greedy completion changes to
the pushed weights' own greedy output. The route is off unless enabled, refuses a file that does not fit, and an
in-process ServingEngine takes the same call."""

from __future__ import annotations

import pytest
import torch

httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

import zerospeed  # noqa: E402
from zerospeed.inference import init_inference  # noqa: E402
from zerospeed.inference.model_dir import load_model_dir, save_gpt_dir  # noqa: E402
from zerospeed.inference.server import ServeOptions, create_app  # noqa: E402
from zerospeed.inference.serving import ServingEngine  # noqa: E402
from zerospeed.launcher.serve import engine_config  # noqa: E402
from zerospeed.runtime.weight_sync import push_weights  # noqa: E402
from zerospeed.testing import run_distributed  # noqa: E402

from ..unit.serve_fixtures import running, tiny_gpt  # noqa: E402

def _engine(loaded) -> ServingEngine:
    cfg = engine_config(None, 32)
    cfg["state_manager"].update(max_tracked_sequences=2, max_ragged_sequence_count=2, max_ragged_batch_size=16,
                                kv_block_size=8)
    return ServingEngine(loaded.model, cfg, decode=loaded.tokenizer.decode, prefix_caching=True)


def _complete(base: str, prompt: str) -> str:
    r = httpx.post(f"{base}/v1/completions", json={"model": "m", "prompt": prompt,
                                                                    "max_tokens": 10, "temperature": 0}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def _greedy(model, prompt: str) -> str:
    ids = torch.tensor([list(prompt.encode())])
    out = init_inference(model, dtype="fp32").generate(ids, max_new_tokens=10)
    return bytes(out[0, ids.shape[1]:].tolist()).decode(errors="replace")


def _train_and_push(url: str, path: str) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
           "zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": True}}
    engine = zerospeed.initialize(model=tiny_gpt(seed=7), config=cfg)[0]
    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(zerospeed.comm.get_rank()))
    _, loss = engine(x, x)
    engine.backward(loss)
    engine.step()
    return push_weights(engine, url, path)


@pytest.fixture
def served(tmp_path):
    loaded = load_model_dir(save_gpt_dir(tiny_gpt(seed=4), tmp_path / "served"))
    engine = _engine(loaded)
    app = create_app(loaded, engine, ServeOptions(served_model_names=["m"], allow_weight_updates=True))
    with running(app) as base:
        yield base, engine, loaded


def test_push_weights_changes_the_served_greedy_output(served, tmp_path) -> None:
    base, engine, _ = served
    before = _complete(base, "Hello")
    path = str(tmp_path / "pushed.safetensors")
    replies = run_distributed(_train_and_push, 2, base, path, timeout=180)
    assert replies[0] == replies[1] and replies[0]["version"] == 1 and replies[0]["updated"] > 0
    from safetensors.torch import load_file

    trained = tiny_gpt(0)
    trained.load_state_dict(load_file(path), strict=False)  # the tied head is stored once
    want = _greedy(trained.eval(), "Hello")
    after = _complete(base, "Hello")
    assert after == want and after != before
    bad = tmp_path / "bad.safetensors"
    from safetensors.torch import save_file

    save_file({"wte.weight": torch.zeros(3, 3)}, str(bad))
    r = httpx.post(f"{base}/v1/weights", json={"path": str(bad)}, timeout=60)
    assert r.status_code == 400 and "do not fit" in r.json()["error"]["message"] and engine.weights_version == 1
    assert _complete(base, "Hello") == want  # nothing changed


def test_weight_route_is_off_by_default_and_in_process_push(tmp_path) -> None:
    from fastapi.testclient import TestClient

    loaded = load_model_dir(save_gpt_dir(tiny_gpt(seed=4), tmp_path / "served"))
    engine = _engine(loaded)
    client = TestClient(create_app(loaded, engine))
    r = client.post("/v1/weights", json={"path": str(tmp_path / "x.safetensors")})
    assert r.status_code == 403 and "--enable-weight-updates" in r.json()["error"]["message"]
    new = tiny_gpt(seed=9)
    assert engine.update_weights(new.state_dict()) > 0 and engine.weights_version == 1
    (req,) = engine.generate([list(b"Hello")], _greedy_params())
    assert bytes(req.output).decode(errors="replace") == _greedy(tiny_gpt(seed=9).eval(), "Hello")
    from safetensors.torch import save_file

    path = tmp_path / "w.safetensors"
    save_file({k: v.contiguous() for k, v in new.state_dict().items() if k != "lm_head.weight"}, str(path))
    on = TestClient(create_app(loaded, engine, ServeOptions(allow_weight_updates=True)))
    r = on.post("/v1/weights", json={"path": str(path)})  # the file holds the tied weight once
    assert r.status_code == 200 and r.json()["version"] == 2, r.text


def _greedy_params():
    from zerospeed.inference.sampling import SamplingParams

    return SamplingParams(max_tokens=10, temperature=0.0)
