"""Per-request logits processing (penalties, logit_bias, min_tokens, ignore_eos) and logprobs, against a
reference loop over the model's full forward, and through the HTTP API (completions and chat, echo)."""

import pytest
import torch

from zerospeed.inference.logits_process import LogitsOptions
from zerospeed.inference.sampling import SamplingParams
from zerospeed.inference.serving import ServingEngine
from zerospeed.models.gpt import GPT, GPTConfig


def _model():
    model = GPT(GPTConfig(block_size=64, n_layer=1, n_head=2, n_embd=32), seed=6).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(8.0)
    return model


def _engine(model, eos=()):
    return ServingEngine(model, {"state_manager": {"memory_config": {"mode": "allocate", "size": 32},
                                                   "kv_block_size": 8}}, eos_token_ids=eos)


@torch.no_grad()
def _reference(model, prompt, n, rep=1.0, freq=0.0, pres=0.0, bias=()):
    ids, out, lps = list(prompt), [], []
    for _ in range(n):
        row = model(torch.tensor([ids]))[0][0, -1].float()
        for t in set(ids):
            row[t] = row[t] / rep if row[t] > 0 else row[t] * rep
        for t in set(out):
            row[t] -= freq * out.count(t) + pres
        for t, b in bias:
            row[t] += b
        tok = int(row.argmax())
        lps.append(float(torch.log_softmax(row, -1)[tok]))
        ids.append(tok)
        out.append(tok)
    return out, lps


def test_penalties_and_bias_match_reference():
    model = _model()
    prompt = [5, 9, 5, 12]
    plain, _ = _reference(model, prompt, 10)
    cases = [dict(rep=1.8), dict(freq=1.5), dict(pres=2.0), dict(bias=((7, 100.0),)),
             dict(rep=1.3, freq=0.7, pres=0.4, bias=((plain[0], -100.0),))]
    for kw in cases:
        want, want_lp = _reference(model, prompt, 10, **kw)
        assert want != plain, kw  # the processing changes the output: the comparison means something
        opts = LogitsOptions(kw.get("rep", 1.0), kw.get("freq", 0.0), kw.get("pres", 0.0), kw.get("bias", ()),
                             logprobs=2)
        eng = _engine(model)
        uid = eng.add_request(prompt, SamplingParams(max_tokens=10, process=opts))
        events = []
        while eng.has_work:
            events += [e for e in eng.step() if e.uid == uid]
        assert [e.token for e in events] == want, kw
        assert [e.logprob.logprob for e in events] == pytest.approx(want_lp, abs=1e-4)
        assert all(e.logprob.top[0][0] == e.token and len(e.logprob.top) == 2 for e in events)  # greedy = best


def test_min_tokens_and_ignore_eos():
    model = _model()
    first = _reference(model, [3, 4], 1)[0][0]
    eng = _engine(model, eos=(first,))
    assert [len(r.output) for r in eng.generate([[3, 4]], SamplingParams(max_tokens=6))] == [1]  # eos at once
    r = eng.generate([[3, 4]], SamplingParams(max_tokens=6, process=LogitsOptions(min_tokens=3)))[0]
    assert len(r.output) >= 3 and first not in r.output[:3]
    r = eng.generate([[3, 4]], SamplingParams(max_tokens=6, ignore_eos=True))[0]
    assert len(r.output) == 6 and r.output[0] == first
    with pytest.raises(ValueError, match="repetition_penalty"):
        LogitsOptions(repetition_penalty=0)


def test_logprobs_echo_bias_over_http(tmp_path):
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from zerospeed.inference.model_dir import load_model_dir, save_gpt_dir
    from zerospeed.inference.server import create_app

    loaded = load_model_dir(save_gpt_dir(_model(), tmp_path / "tiny"))
    engine = _engine(loaded.model)
    want, want_lp = _reference(loaded.model, list(b"Hi"), 5)
    with TestClient(create_app(loaded, engine)) as http:
        r = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 5, "temperature": 0, "logprobs": 3,
                                               "echo": False}).json()
        lp = r["choices"][0]["logprobs"]
        assert lp["token_logprobs"] == pytest.approx(want_lp, abs=1e-4) and len(lp["top_logprobs"][0]) == 3
        assert "".join(lp["tokens"]) == r["choices"][0]["text"] and lp["text_offset"][0] == 0
        r = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 5, "temperature": 0, "echo": True})
        assert r.json()["choices"][0]["text"] == "Hi" + loaded.tokenizer.decode(want)
        r = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 4, "temperature": 0,
                                               "logit_bias": {"65": 100}}).json()
        assert r["choices"][0]["text"] == "AAAA"
        msgs = [{"role": "user", "content": "Hi"}]
        r = http.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 4, "temperature": 0,
                                                    "logprobs": True, "top_logprobs": 2}).json()
        content = r["choices"][0]["logprobs"]["content"]
        assert len(content) == 4 and all(len(c["top_logprobs"]) == 2 and c["logprob"] <= 0 for c in content)
        for bad, param in [({"top_logprobs": 2}, "top_logprobs"), ({"frequency_penalty": 3}, "frequency_penalty"),
                           ({"logit_bias": {"x": 1}}, "logit_bias"), ({"min_tokens": 9}, "min_tokens")]:
            r = http.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 4, **bad})
            assert r.status_code == 400 and r.json()["error"]["param"] == param, (bad, r.text)
        chunks = [line for line in http.post("/v1/completions", json={
            "prompt": "Hi", "max_tokens": 5, "temperature": 0, "logprobs": 1, "stream": True}).text.split("\n\n")
            if line.startswith("data: {")]
        import json

        got = [x for c in chunks for x in (json.loads(c[6:])["choices"][0]["logprobs"] or {}).get("token_logprobs", [])]
        assert got == pytest.approx(want_lp, abs=1e-4)
    assert not engine.requests


def test_echo_with_logprobs_reports_the_prompt_tokens(tmp_path):
    """``echo`` + ``logprobs``: the prompt's tokens come first, the first with null logprob and top, each next
    one its log-probability under the model's full forward; then the completion's, offsets running on."""
    pytest.importorskip("fastapi")
    import json

    from fastapi.testclient import TestClient

    from zerospeed.inference.model_dir import load_model_dir, save_gpt_dir
    from zerospeed.inference.server import create_app

    loaded = load_model_dir(save_gpt_dir(_model(), tmp_path / "tiny"))
    prompt = list(b"Hey")
    with torch.no_grad():
        full = torch.log_softmax(loaded.model(torch.tensor([prompt]))[0][0].float(), -1)
    want = [float(full[i - 1, prompt[i]]) for i in range(1, len(prompt))]
    gen, gen_lp = _reference(loaded.model, prompt, 4)
    with TestClient(create_app(loaded, _engine(loaded.model))) as http:
        body = {"prompt": "Hey", "max_tokens": 4, "temperature": 0, "logprobs": 2, "echo": True}
        r = http.post("/v1/completions", json=body).json()["choices"][0]
        lp = r["logprobs"]
        assert r["text"] == "Hey" + loaded.tokenizer.decode(gen)
        assert lp["tokens"][:3] == ["H", "e", "y"] and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        assert lp["token_logprobs"][1:3] == pytest.approx(want, abs=1e-4)
        assert lp["token_logprobs"][3:] == pytest.approx(gen_lp, abs=1e-4) and len(lp["top_logprobs"][1]) == 2
        assert lp["text_offset"] == list(range(7))  # one character per byte token
        chunks = [json.loads(c[6:]) for c in http.post("/v1/completions", json={**body, "stream": True}).text.split(
            "\n\n") if c.startswith("data: {")]
        streamed = [x for c in chunks for x in (c["choices"][0]["logprobs"] or {}).get("token_logprobs", [])]
        assert streamed[0] is None and streamed[1:] == pytest.approx(want + gen_lp, abs=1e-4)
        bad = http.post("/v1/completions", json={**body, "prompt": [1, 999]})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt"
