"""`zerospeed serve` as vLLM users expect: API key, several served names, strict bodies, a request that fails
fails alone (issue 31 items 8 and 13), n > 1, seeds, usage in streams. The official `openai` client on
127.0.0.1 against one server (one thread)."""

import threading
import time

import pytest
import torch

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from zerospeed.inference.model_dir import load_model_dir, save_gpt_dir  # noqa: E402
from zerospeed.inference.server import ServeOptions, create_app  # noqa: E402
from zerospeed.inference.serving import ServingEngine  # noqa: E402
from zerospeed.launcher.serve import engine_config  # noqa: E402
from zerospeed.inference import init_inference  # noqa: E402
from tests.unit.serve_fixtures import free_port, greedy_text, running, tiny_gpt  # noqa: E402

KEY = "sk-test-123"


def _engine(loaded, blocks=64):
    cfg = engine_config(None, blocks)
    cfg["state_manager"].update(max_tracked_sequences=8, max_ragged_sequence_count=8, max_ragged_batch_size=32,
                                kv_block_size=8)
    return ServingEngine(loaded.model, cfg, decode=loaded.tokenizer.decode)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    loaded = load_model_dir(save_gpt_dir(tiny_gpt(), tmp_path_factory.mktemp("m") / "tiny"))
    engine = _engine(loaded)
    app = create_app(loaded, engine, ServeOptions(served_model_names=("tiny", "tiny-alias"), api_key=KEY))
    with running(app) as base:
        yield openai.OpenAI(base_url=f"{base}/v1", api_key=KEY, max_retries=0, timeout=30), loaded, engine, base


def test_api_key_and_served_names(served):
    client, loaded, _, base = served
    bad = openai.OpenAI(base_url=f"{base}/v1", api_key="wrong", max_retries=0, timeout=30)
    with pytest.raises(openai.AuthenticationError) as info:
        bad.completions.create(model="tiny", prompt="Hi", max_tokens=2)
    assert info.value.status_code == 401 and info.value.body["code"] == "invalid_api_key"
    for route in ("/v1/models", "/v1/completions", "/v1/chat/completions"):  # no key at all
        r = httpx.request("GET" if route == "/v1/models" else "POST", base + route, json={})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", route
    assert httpx.get(f"{base}/health").status_code == 200  # open without a key
    assert httpx.get(f"{base}/metrics").status_code == 200
    assert [m.id for m in client.models.list().data] == ["tiny", "tiny-alias"]
    r = client.completions.create(model="tiny-alias", prompt="Hi", max_tokens=4, temperature=0)
    assert r.model == "tiny-alias" and r.choices[0].text == greedy_text(loaded, "Hi", 4)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model=loaded.name + "x", prompt="Hi", max_tokens=2)


def test_wedging_requests_fail_alone(served):
    """Issue 31 item 8: seed >= 2**64 names `seed`, a tiny temperature is greedy, the server keeps serving."""
    client, loaded, engine, _ = served
    for seed in (2**64, -(2**63) - 1):
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model="tiny", prompt="ab", max_tokens=3, temperature=1.0, seed=seed)
        assert info.value.body["param"] == "seed", info.value.body
    want = greedy_text(loaded, "ab", 6)
    r = client.completions.create(model="tiny", prompt="ab", max_tokens=6, temperature=1e-45)
    assert r.choices[0].text == want
    r = client.completions.create(model="tiny", prompt="ab", max_tokens=6, temperature=0)
    assert r.choices[0].text == want and not engine.requests


def test_malformed_bodies_get_openai_errors(served):
    """Issue 31 item 13: surrogates, bad UTF-8, deep JSON and unknown parameters are 400s with OpenAI's body."""
    _, _, engine, base = served
    hdr = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    cases = [(b'{"model": "tiny", "prompt": "\\ud800", "max_tokens": 2}', "prompt"),
             (b'{"model": "tiny", "prompt": "a\xff\xfe", "max_tokens": 2}', None),
             (b"[" * 100_000 + b"]" * 100_000, None),
             (b'{"prompt": {"a": ' * 2000 + b"1" + b"}" * 2000, None),
             (b'{"model": "tiny", "prompt": "ab", "max_tokenz": 3}', "max_tokenz"),
             (b'{"model": "tiny", "messages": [{"role": "user", "content": "\\udfff"}]}', "messages")]
    for i, (raw, param) in enumerate(cases):
        route = "/v1/chat/completions" if b"messages" in raw else "/v1/completions"
        r = httpx.post(base + route, content=raw, headers=hdr, timeout=30)
        assert r.status_code == 400, (i, r.status_code, r.text[:200])
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["param"] == param, (i, err)
    assert "did you mean 'max_tokens'" in httpx.post(base + "/v1/completions", content=cases[4][0], headers=hdr
                                                     ).json()["error"]["message"]
    assert not engine.requests


def test_n_seed_and_stream_usage(served):
    client, _, engine, _ = served
    kw = dict(model="tiny", prompt="xy", max_tokens=8, temperature=1.0)
    a = client.completions.create(n=3, seed=11, **kw)
    b = client.completions.create(n=3, seed=11, **kw)
    assert [c.index for c in a.choices] == [0, 1, 2] and a.usage.completion_tokens == 24
    assert [c.text for c in a.choices] == [c.text for c in b.choices]  # reproducible per request
    assert len({c.text for c in a.choices}) > 1  # choices differ from each other
    chunks = list(client.completions.create(n=3, seed=11, stream=True, stream_options={"include_usage": True}, **kw))
    texts = ["", "", ""]
    for c in chunks[:-1]:
        texts[c.choices[0].index] += c.choices[0].text
    assert texts == [c.text for c in a.choices]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 24
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(stream_options={"include_usage": True}, **kw)  # only with stream=true
    assert info.value.body["param"] == "stream_options"
    assert not engine.requests


def test_stop_token_ids_and_ignore_eos(served):
    client, loaded, _, _ = served
    want = greedy_text(loaded, "Hi", 8)
    ids = init_inference(loaded.model, dtype="fp32").generate(torch.tensor([[72, 105]]), max_new_tokens=8)[0, 2:]
    stop_id = int(ids[3])
    r = client.completions.create(model="tiny", prompt="Hi", max_tokens=8, temperature=0,
                                  extra_body={"stop_token_ids": [stop_id]})
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == ids.tolist().index(stop_id) + 1
    r = client.completions.create(model="tiny", prompt="Hi", max_tokens=8, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].text == want


def test_engine_error_fails_only_that_request(tmp_path, monkeypatch):
    """A request whose sampling raises ends with an "error" event; the others in the same forward finish."""
    import zerospeed.inference.serving as serving
    from zerospeed.inference.sampling import SamplingParams

    loaded = load_model_dir(save_gpt_dir(tiny_gpt(), tmp_path / "tiny"))
    engine = _engine(loaded)

    def boom(logits, params, gen):
        raise RuntimeError("injected")

    monkeypatch.setattr(serving, "sample_next", boom)
    bad = engine.add_request([1, 2, 3], SamplingParams(max_tokens=4, temperature=1.0, seed=1))
    good = engine.add_request([1, 2, 3], SamplingParams(max_tokens=4))
    events = []
    while engine.has_work:
        events += engine.step()
    assert [e for e in events if e.uid == bad] == [serving.TokenEvent(bad, -1, "error")]
    assert "injected" in engine.errors[bad] and len([e for e in events if e.uid == good]) == 4
    assert engine.scheduler.allocator.num_free == 64


def test_dead_engine_loop_reports_and_stops(tmp_path):
    """If the task driving the engine dies: in-flight requests get a 500, /health a 503, the serve loop exits 1."""
    from fastapi.testclient import TestClient

    from zerospeed.launcher.serve import serve_app

    loaded = load_model_dir(save_gpt_dir(tiny_gpt(), tmp_path / "tiny"))
    engine = _engine(loaded)

    def broken_step():
        raise RuntimeError("scheduler bug")

    engine.step = broken_step
    died = []
    with TestClient(create_app(loaded, engine, ServeOptions(on_fatal=died.append))) as http:
        assert http.get("/health").json() == {"status": "ok"}
        r = http.post("/v1/completions", json={"prompt": "ab", "max_tokens": 2})
        assert r.status_code == 500 and "scheduler bug" in r.json()["error"]["message"]
        h = http.get("/health")
        assert h.status_code == 503 and "scheduler bug" in h.json()["message"] and len(died) == 1
        assert http.post("/v1/completions", json={"prompt": "ab", "max_tokens": 2}).status_code == 503
    died.clear()
    with TestClient(create_app(loaded, engine, ServeOptions(on_fatal=died.append))) as http:
        body = http.post("/v1/completions", json={"prompt": "ab", "max_tokens": 2, "stream": True}).text
        events = [e for e in body.split("\n\n") if e]
        assert events[-1] == "data: [DONE]" and '"error"' in events[-2] and "scheduler bug" in events[-2], events
    port, result = free_port(), {}
    thread = threading.Thread(target=lambda: result.setdefault(
        "rc", serve_app(lambda opts: create_app(loaded, engine, opts), "127.0.0.1", port, ServeOptions())))
    thread.start()
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 60
    while True:
        try:
            httpx.get(base + "/health", timeout=5)
            break
        except httpx.TransportError:
            assert time.time() < deadline
            time.sleep(0.05)
    r = httpx.post(base + "/v1/completions", json={"prompt": "ab", "max_tokens": 2}, timeout=30)
    assert r.status_code == 500 and "scheduler bug" in r.json()["error"]["message"]
    thread.join(timeout=30)
    assert result.get("rc") == 1


def test_vllm_command_line(tmp_path, monkeypatch, capsys):
    """vLLM's flags reach the engine and the app; an unknown flag is an error with a did-you-mean."""
    from fastapi.testclient import TestClient

    import zerospeed.launcher.serve as serve_cmd
    from zerospeed.launcher.cli import main

    d = save_gpt_dir(tiny_gpt(), tmp_path / "tiny")
    assert main(["serve", str(d), "--served-model-nam", "x"]) == 2
    assert "Did you mean '--served-model-name'?" in capsys.readouterr().err
    assert main(["serve", str(d), "--kv-cache-memory", "lots"]) == 2
    assert "--kv-cache-memory" in capsys.readouterr().err
    assert main(["serve", str(d), "--speculative-config", '{"model": "draft-dir"}']) == 2
    assert "cannot load the draft model 'draft-dir'" in capsys.readouterr().err
    seen = {}

    def fake_serve_app(make_app, host, port, options):
        with TestClient(make_app(options)) as http:
            seen["models"] = http.get("/v1/models", headers={"Authorization": "Bearer k1"}).json()
            seen["nokey"] = http.get("/v1/models").status_code
            r = http.post("/v1/completions", headers={"Authorization": "Bearer k1"},
                          json={"model": "b", "prompt": "ab", "max_tokens": 3, "temperature": 1.0})
            seen["text"] = r.json()["choices"][0]["text"]
        return 0

    monkeypatch.setattr(serve_cmd, "serve_app", fake_serve_app)
    built = {}
    real_build = serve_cmd.build_engine
    monkeypatch.setattr(serve_cmd, "build_engine", lambda a, c: built.update(e=real_build(a, c)) or built["e"])
    monkeypatch.setenv("ZEROSPEED_API_KEY", "k1")
    argv = ["serve", str(d), "--served-model-name", "a", "b", "--max-model-len", "48", "--max-num-seqs", "3",
            "--max-num-batched-tokens", "20", "--block-size", "4", "--kv-cache-memory", "64KiB", "--seed", "7",
            "--tensor-parallel-size", "1", "--enable-prefix-caching",
            "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}']
    assert main(argv) == 0
    first = seen["text"]
    assert main(argv) == 0 and seen["text"] == first  # --seed: unseeded sampling reproduces across runs
    assert [m["id"] for m in seen["models"]["data"]] == ["a", "b"] and seen["nokey"] == 401
    engine = built["e"][1]
    assert engine.prefix_caching and engine.speculative.num_speculative_tokens == 3
    sm = engine.config.state_manager
    assert (engine.limits.max_context, sm.max_ragged_sequence_count, sm.max_ragged_batch_size,
            sm.kv_block_size) == (48, 3, 20, 4)
    assert engine.cache.num_blocks == 64 * 1024 // (2 * 1 * 2 * 16 * 4 * 4)  # K+V, 1 layer, 2 heads of 16, fp32


def test_metrics_vllm_names(served):
    client, _, _, base = served
    client.completions.create(model="tiny", prompt="abc", max_tokens=5, temperature=0)
    text = httpx.get(f"{base}/metrics").text
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            values[key] = float(value)
    lab = 'model_name="tiny"'
    assert values[f"vllm:num_requests_running{{{lab}}}"] == 0 and values[f"vllm:kv_cache_usage_perc{{{lab}}}"] == 0
    n = values[f"vllm:time_to_first_token_seconds_count{{{lab}}}"]
    assert n >= 1 and values[f'vllm:time_to_first_token_seconds_bucket{{{lab},le="+Inf"}}'] == n
    assert values[f"vllm:inter_token_latency_seconds_count{{{lab}}}"] >= 4
    assert values[f'vllm:request_success_total{{{lab},finished_reason="length"}}'] >= 1
    assert values[f"vllm:generation_tokens_total{{{lab}}}"] >= 5 and f"vllm:prefix_cache_hits_total{{{lab}}}" in values
    assert "# TYPE vllm:time_to_first_token_seconds histogram" in text


def test_structured_output(served):
    """response_format json_schema / json_object and vLLM's guided_* fields: the output parses against its schema."""
    pytest.importorskip("outlines_core")
    import json

    client, _, engine, _ = served
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "level": {"enum": ["low", "high"]}},
              "required": ["ok", "level"]}
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "status?"}],
                                       max_tokens=38, temperature=1.0, seed=3, response_format={
                                           "type": "json_schema", "json_schema": {"name": "s", "schema": schema}})
    doc = json.loads(r.choices[0].message.content)
    assert set(doc) == {"ok", "level"} and isinstance(doc["ok"], bool) and doc["level"] in ("low", "high")
    assert r.choices[0].finish_reason == "stop"
    r = client.completions.create(model="tiny", prompt="pick:", max_tokens=10, temperature=1.0,
                                  extra_body={"guided_choice": ["alpha", "beta"]})
    assert r.choices[0].text in ("alpha", "beta") and r.choices[0].finish_reason == "stop"
    r = client.completions.create(model="tiny", prompt="n:", max_tokens=10, temperature=0,
                                  extra_body={"guided_regex": "[0-9]{3}-[a-c]{2}"})
    import re

    assert re.fullmatch("[0-9]{3}-[a-c]{2}", r.choices[0].text)
    r = client.completions.create(model="tiny", prompt="{", max_tokens=40, temperature=0.7, seed=1,
                                  extra_body={"response_format": {"type": "json_object"}})
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].text), dict)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", prompt="x", max_tokens=3,
                                  extra_body={"guided_regex": "a", "guided_choice": ["b"]})
    assert info.value.body["param"] == "guided_choice"
    assert not engine.requests
