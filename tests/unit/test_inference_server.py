"""The OpenAI-compatible server, exercised with the official `openai` client on 127.0.0.1 (one thread)."""

import importlib.util
import re
import time

import pytest
import torch

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

from zerospeed.inference.model_dir import load_model_dir, save_gpt_dir  # noqa: E402
from zerospeed.inference.server import create_app  # noqa: E402
from zerospeed.inference.serving import ServingEngine  # noqa: E402
from zerospeed.launcher.serve import engine_config  # noqa: E402
from tests.unit.serve_fixtures import greedy_text, running, tiny_gpt  # noqa: E402


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    d = save_gpt_dir(tiny_gpt(seed=4), tmp_path_factory.mktemp("m") / "tinygpt")
    loaded = load_model_dir(d)
    cfg = engine_config(None, 64)
    cfg["state_manager"].update(max_tracked_sequences=2, max_ragged_sequence_count=2, max_ragged_batch_size=16,
                                kv_block_size=8)
    engine = ServingEngine(loaded.model, cfg, decode=loaded.tokenizer.decode)
    with running(create_app(loaded, engine)) as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=60)
        yield client, loaded, engine, int(base.rsplit(":", 1)[1])


def test_models_health_metrics(server):
    client, loaded, _, port = server
    assert [m.id for m in client.models.list().data] == [loaded.name]
    import httpx

    assert httpx.get(f"http://127.0.0.1:{port}/health").json() == {"status": "ok"}
    assert "zerospeed_kv_blocks_total 64" in httpx.get(f"http://127.0.0.1:{port}/metrics").text


def test_completion_greedy_and_stream_agree(server):
    client, loaded, _, _ = server
    want = greedy_text(loaded, "Hello", 12)
    r = client.completions.create(model=loaded.name, prompt="Hello", max_tokens=12, temperature=0)
    assert r.choices[0].text == want and r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == 5 and r.usage.completion_tokens == 12
    chunks = list(client.completions.create(model=loaded.name, prompt="Hello", max_tokens=12, temperature=0,
                                            stream=True))
    assert "".join(c.choices[0].text for c in chunks) == want
    assert chunks[-1].choices[0].finish_reason == "length" and len(chunks) > 1


def test_chat_and_stop(server):
    client, loaded, _, _ = server
    msgs = [{"role": "user", "content": "Hi"}]
    r = client.chat.completions.create(model=loaded.name, messages=msgs, max_tokens=10, temperature=0,
                                       logprobs=False, user="u1", presence_penalty=0)  # neutral values accepted
    want = greedy_text(loaded, "user: Hi\nassistant:", 10)
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == want
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=loaded.name, messages=msgs, max_tokens=10, temperature=0, stream=True))
    assert want.startswith(streamed) and len(streamed) >= len(want) - 1
    stop = want[3:5]
    r = client.chat.completions.create(model=loaded.name, messages=msgs, max_tokens=10, temperature=0, stop=[stop])
    assert r.choices[0].finish_reason == "stop" and r.choices[0].message.content == want[:want.find(stop)]


def test_bad_input_is_400_with_openai_error(server):
    client, loaded, _, _ = server
    for kwargs, param in [({"temperature": 5}, "temperature"), ({"n": 0}, "n"), ({"logprobs": 6}, "logprobs"), ({"max_tokens": 0}, "max_tokens"),
                          ({"max_tokens": 500}, "prompt")]:
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model=loaded.name, prompt="x", **kwargs)
        assert info.value.status_code == 400 and info.value.body["param"] == param, info.value.body
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="x")


def test_full_queue_is_429_and_cancel_on_disconnect(server):
    client, loaded, engine, _ = server
    real_step, steps = engine.step, []
    engine.step = lambda: (steps.append(1), time.sleep(0.05), real_step())[2]  # slow the engine down
    streams = [client.completions.create(model=loaded.name, prompt="ab", max_tokens=60, temperature=0, stream=True)
               for _ in range(2)]
    firsts = [next(iter(s)) for s in streams]  # both running: the engine tracks its maximum of 2
    assert all(f.choices[0].finish_reason is None for f in firsts)
    with pytest.raises(openai.RateLimitError) as info:
        client.completions.create(model=loaded.name, prompt="x", max_tokens=2)
    assert info.value.status_code == 429
    for s in streams:
        s.close()  # client goes away: the server cancels, blocks return
    deadline = time.time() + 30
    while engine.requests and time.time() < deadline:
        time.sleep(0.05)
    engine.step = real_step
    assert not engine.requests and engine.scheduler.allocator.num_free == 64
    assert len(steps) < 40  # cancelled long before their 60 tokens


def test_serve_command_line(tmp_path, capsys):
    from zerospeed.launcher.cli import main

    assert main(["serve", str(tmp_path / "missing")]) == 2
    assert "no config.json" in capsys.readouterr().err
    cfg = tmp_path / "ds.json"
    cfg.write_text('{"manager": {"max_context": 128}}')
    assert engine_config(str(cfg), 7) == {"state_manager": {"max_context": 128,
                                                            "memory_config": {"mode": "allocate", "size": 7}}}


def test_hugging_face_model_dir_served(tmp_path):
    """A GPT-2 directory with a tokenizer (built offline): the API's greedy text equals HF generate's."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    vocab = {chr(48 + i): i for i in range(64)}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="0"))
    tk.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tk.decoder = decoders.Fuse()
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=tk)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=64, n_positions=32, n_embd=32, n_layer=1, n_head=2, initializer_range=0.3,
        eos_token_id=None, bos_token_id=None)).eval()
    model.save_pretrained(tmp_path / "g2")
    tok.save_pretrained(tmp_path / "g2")
    loaded = load_model_dir(tmp_path / "g2")
    ids = tok.encode("ABCD")
    ref = model.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False)[0, len(ids):].tolist()
    engine = ServingEngine(loaded.model, engine_config(None, 16), decode=loaded.tokenizer.decode)
    from fastapi.testclient import TestClient

    with TestClient(create_app(loaded, engine)) as http:
        r = http.post("/v1/completions", json={"prompt": "ABCD", "max_tokens": 6, "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == tok.decode(ref) and len(set(ref)) > 1
        bad = http.post("/v1/completions", json={"max_tokens": 6})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt"
        if importlib.util.find_spec("outlines_core"):  # structured output over a Hugging Face vocabulary
            r = http.post("/v1/completions", json={"prompt": "ABCD", "max_tokens": 6, "guided_regex": "[A-C]{3}9"})
            assert r.status_code == 200 and re.fullmatch("[A-C]{3}9", r.json()["choices"][0]["text"]), r.text
