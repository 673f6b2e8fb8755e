"""torch.compile'd decode regions: same tokens as eager and as Hugging Face generate; eager fallback on failure."""

import shutil

import pytest
import torch

import zerospeed
from zerospeed.inference.sampling import SamplingParams
from zerospeed.inference.serving import ServingEngine
from zerospeed.models.gpt import GPT, tiny

transformers = pytest.importorskip("transformers")

from .hf_tiny import V, gpt2 as _gpt2, llama as _llama


class CountingBackend:
    """A torch.compile backend that records every graph it is handed and runs it as is."""

    def __init__(self):
        self.graphs = 0

    def __call__(self, gm, example_inputs):
        self.graphs += 1
        return gm.forward


def _failing_backend(gm, example_inputs):
    raise RuntimeError("no C++ compiler here")


@pytest.mark.skipif(not any(shutil.which(c) for c in ("g++", "c++", "clang++")),
                    reason="Inductor needs a C++ compiler (the eager fallback is tested below)")
@pytest.mark.parametrize("build", [_gpt2, _llama], ids=["gpt2", "llama"])
def test_inductor_decode_equals_hf_generate(build):
    model = build()
    ids = torch.randint(0, V, (3, 6), generator=torch.Generator().manual_seed(1))
    ref = model.generate(ids, max_new_tokens=10, do_sample=False)
    eng = zerospeed.init_inference(model, dtype="fp32", replace_with_kernel_inject=True)
    assert eng.is_compiled
    out = eng.generate(ids, max_new_tokens=10)
    assert torch.equal(out, ref)
    assert [r.active for r in eng.adapter.regions] == [True, True, True]  # no fallback happened


def test_regions_go_through_the_backend_and_share_graphs_across_layers():
    model = GPT(tiny(), seed=2).eval()
    eager = zerospeed.init_inference(model, dtype="fp32").generate(torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]]),
                                                                   max_new_tokens=6)
    backend = CountingBackend()
    eng = zerospeed.init_inference(model, dtype="fp32")
    eng.compile(backend=backend)
    out = eng.generate(torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]]), max_new_tokens=6)
    assert torch.equal(out, eager)
    eng.generate(torch.tensor([[9, 8, 7], [6, 5, 4], [3, 2, 1]]), max_new_tokens=4)
    # at most a static and a dynamic-shape graph per region, shared by every layer
    n = backend.graphs
    assert 3 <= n <= 6, n
    eng.generate(torch.tensor([[1, 2, 3, 4, 5, 6, 7]] * 5), max_new_tokens=3)
    assert backend.graphs == n  # new batch and prompt sizes: no recompilation
    assert torch.equal(eng(torch.tensor([[1, 2, 3]]))[0], model(torch.tensor([[1, 2, 3]]))[0])


def test_failed_compile_falls_back_to_eager_with_a_warning():
    model = _gpt2()
    ids = torch.randint(0, V, (2, 5), generator=torch.Generator().manual_seed(3))
    ref = model.generate(ids, max_new_tokens=6, do_sample=False)
    eng = zerospeed.init_inference(model, dtype="fp32")
    eng.compile(backend=_failing_backend)
    with pytest.warns(RuntimeWarning, match="running it eagerly"):
        out = eng.generate(ids, max_new_tokens=6)
    assert torch.equal(out, ref)
    assert [r.active for r in eng.adapter.regions] == [False, False, False]


def test_compiled_serving_engine_matches_eager_under_continuous_batching():
    model = _llama()
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, V, (n,), generator=g).tolist() for n in (1, 11, 4, 17, 6)]
    cfg = {"state_manager": {"max_ragged_batch_size": 8, "max_ragged_sequence_count": 4, "max_tracked_sequences": 8,
                             "max_context": 64, "kv_block_size": 4, "memory_config": {"mode": "allocate", "size": 40}}}
    params = [SamplingParams(max_tokens=n) for n in (6, 3, 8, 4, 5)]
    eager = [r.output for r in ServingEngine(model, cfg).generate(prompts, params)]
    backend = CountingBackend()
    eng = ServingEngine(model, cfg)
    eng.adapter.compile(backend=backend)
    assert [r.output for r in eng.generate(prompts, params)] == eager and backend.graphs > 0


def test_serving_engine_compile_flag_compiles_the_regions():
    cfg = {"state_manager": {"memory_config": {"mode": "allocate", "size": 8}, "kv_block_size": 4}}
    assert ServingEngine(GPT(tiny()), cfg).adapter.regions == []
    regions = ServingEngine(GPT(tiny()), cfg, compile=True).adapter.regions
    assert len(regions) == 3 and all(r.active for r in regions)
