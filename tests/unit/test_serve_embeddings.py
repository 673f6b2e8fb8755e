"""``/v1/embeddings`` through the official ``openai`` client (base64, its default) and plain JSON: each vector
is the model's own last-token final-norm hidden state, L2-normalised; bad inputs are 400s naming them."""

import base64

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from zerospeed.inference.model_dir import load_model_dir, save_gpt_dir
from zerospeed.inference.serving import ServingEngine
from zerospeed.models.gpt import GPT, GPTConfig


def _reference(model, ids):
    """The same pooling from the model's own modules (not the adapter): blocks, then ln_f, last token."""
    with torch.no_grad():
        x = model.wte(torch.tensor([ids])) + model.wpe(torch.arange(len(ids))[None])
        for block in model.blocks:
            x = block(x)
        return F.normalize(model.ln_f(x)[0, -1], dim=0)


def test_embeddings_api(tmp_path):
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from zerospeed.inference.server import create_app

    loaded = load_model_dir(save_gpt_dir(GPT(GPTConfig(block_size=32, n_layer=2, n_head=2, n_embd=32), seed=3),
                                         tmp_path / "tiny"))
    engine = ServingEngine(loaded.model, {"state_manager": {"memory_config": {"mode": "allocate", "size": 16},
                                                            "kv_block_size": 8, "max_context": 32}})
    with TestClient(create_app(loaded, engine)) as http:
        r = http.post("/v1/embeddings", json={"input": ["hello", "a"], "model": "tiny"}).json()
        assert [d["index"] for d in r["data"]] == [0, 1] and r["usage"]["prompt_tokens"] == 6
        for d, text in zip(r["data"], ["hello", "a"]):
            assert torch.allclose(torch.tensor(d["embedding"]), _reference(loaded.model, list(text.encode())),
                                  atol=1e-5)
        r = http.post("/v1/embeddings", json={"input": [104, 105], "encoding_format": "base64"}).json()
        vec = np.frombuffer(base64.b64decode(r["data"][0]["embedding"]), dtype="<f4")
        assert np.allclose(vec, _reference(loaded.model, [104, 105]).numpy(), atol=1e-5)
        for body, param in [({"input": ""}, "input"), ({"input": []}, "input"), ({"input": [[1], []]}, "input"),
                            ({"input": "x" * 40}, "input"), ({"input": [300]}, "input"),
                            ({"input": "x", "dimensions": 8}, "dimensions"), ({"input": "x", "model": "nope"}, "model"),
                            ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
                            ({"input": "x", "temperature": 1}, "temperature")]:
            bad = http.post("/v1/embeddings", json=body)
            assert bad.status_code in (400, 404) and bad.json()["error"]["param"] == param, (body, bad.text)
    assert not engine.requests


def test_embeddings_through_the_openai_client(tmp_path):
    pytest.importorskip("fastapi")
    openai = pytest.importorskip("openai")
    from fastapi.testclient import TestClient

    from zerospeed.inference.server import create_app

    loaded = load_model_dir(save_gpt_dir(GPT(GPTConfig(block_size=32, n_layer=1, n_head=2, n_embd=16), seed=4),
                                         tmp_path / "tiny"))
    engine = ServingEngine(loaded.model, {"state_manager": {"memory_config": {"mode": "allocate", "size": 8},
                                                            "kv_block_size": 8}})
    with TestClient(create_app(loaded, engine)) as http:
        client = openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=http)
        got = client.embeddings.create(model="tiny", input=["hi there"]).data[0].embedding
    assert np.allclose(np.array(got), _reference(loaded.model, list(b"hi there")).numpy(), atol=1e-5)
