"""`zerospeed serve` (the command, in a thread, on 127.0.0.1) answers a nested ``response_format: json_object``
through the official ``openai`` client: the text parses as JSON and nests three levels (issue 37, item 5).

The tiny model is taught one almost-JSON text nested four levels with an invalid end (``true,}``), and, less often,
a valid one that closes at the third: unconstrained, greedy decoding repeats the first and it does not parse;
constrained, the mask keeps the model's own text up to the fourth level (``json_object`` nests at most
``JSON_OBJECT_DEPTH`` = 3 levels) and the model's second choice closes it there.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import pytest
import torch

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")
pytest.importorskip("outlines_core")

from zerospeed.inference.model_dir import save_gpt_dir  # noqa: E402
from zerospeed.inference.structured import JSON_OBJECT_DEPTH  # noqa: E402
from zerospeed.models.gpt import GPT, GPTConfig  # noqa: E402
from tests.unit.serve_fixtures import free_port  # noqa: E402

PROMPT = "J:"
TAUGHT = '{"a": {"b": [1, {"c": true,}]}}'  # four levels, and ",}" is not JSON
ALT = '{"a": {"b": [1, 2]}}'  # the same start, three levels, closed


def _taught_model() -> GPT:
    """TAUGHT with weight 3 and ALT with weight 1: both start alike, and where TAUGHT opens its fourth level ALT
    closes instead. Unconstrained, greedy decoding takes TAUGHT's branch (3 to 1); constrained, the mask forbids
    that '{' and the model's own second choice, learned from ALT, closes the object. Without ALT that choice would
    be whatever an untrained position prefers, which differs between CPUs (seen on an AMD EPYC: a string that
    never closed)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=64, n_layer=1, n_head=2, n_embd=32), seed=3)
    seqs = [(torch.tensor([list((PROMPT + text).encode()) + [0]]), weight)  # byte 0 after it: nothing else to say
            for text, weight in ((TAUGHT, 3.0), (ALT, 1.0))]
    opt = torch.optim.Adam(model.parameters(), lr=3e-2)
    for _ in range(150):
        loss = sum(w * model(seq[:, :-1], seq[:, 1:])[1] for seq, w in seqs)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


def _depth(v: Any) -> int:
    if isinstance(v, dict):
        return 1 + max((_depth(x) for x in v.values()), default=0)
    if isinstance(v, list):
        return 1 + max((_depth(x) for x in v), default=0)
    return 0


def test_nested_json_object_through_zerospeed_serve(tmp_path, monkeypatch):
    import uvicorn

    from zerospeed.launcher.cli import main

    model_dir = save_gpt_dir(_taught_model(), tmp_path / "taught")
    servers: list[Any] = []

    class Recorded(uvicorn.Server):  # the command's own server, recorded so the test can stop it
        def __init__(self, config: Any) -> None:
            super().__init__(config)
            servers.append(self)

    monkeypatch.setattr(uvicorn, "Server", Recorded)
    port = free_port()
    result: dict[str, int] = {}
    argv = ["serve", str(model_dir), "--host", "127.0.0.1", "--port", str(port), "--served-model-name", "tiny"]
    thread = threading.Thread(target=lambda: result.update(rc=main(argv)), daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not (servers and servers[0].started):
        assert time.monotonic() < deadline and thread.is_alive(), "zerospeed serve did not start"
        time.sleep(0.05)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=60)
        free = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=len(TAUGHT), temperature=0)
        assert free.choices[0].text == TAUGHT  # what the model says when nothing constrains it
        with pytest.raises(json.JSONDecodeError):
            json.loads(free.choices[0].text)
        r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=60, temperature=0,
                                      extra_body={"response_format": {"type": "json_object"}})
        text = r.choices[0].text
        assert r.choices[0].finish_reason == "stop", text
        doc = json.loads(text)
        assert _depth(doc) == JSON_OBJECT_DEPTH == 3 and doc["a"]["b"][0] == 1, text
        assert text.startswith('{"a": {"b": [1, ')  # the model's own text, up to the level the bound cuts
    finally:
        servers[0].should_exit = True
        thread.join(timeout=30)
    assert result.get("rc") == 0
