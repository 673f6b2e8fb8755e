"""The ``compile`` section: DeepSpeed's keys and defaults accepted; the keys not built refused by name."""

from __future__ import annotations

import pytest

from zerospeed.accelerator import get_accelerator
from zerospeed.config import ConfigError, load_config
from zerospeed.config.compile import CompileConfig

BASE = {"train_micro_batch_size_per_gpu": 1}
DEFAULTS = {"deepcompile": False, "autoep_non_moe": False, "free_activation": False,
            "free_activation_threshold": 10 * 1024 * 1024, "offload_activation": False,
            "offload_activation_pin_memory": True, "offload_opt_states": False, "double_buffer": True,
            "symmetric_memory": False, "debug_log": False, "offload_parameters": False, "sync_before_reduce": False,
            "sync_after_reduce": False, "sync_before_allgather": False, "sync_after_allgather": False,
            "keep_int_input_tensors": True, "keep_all_input_tensors": False, "passes": None}


def test_section_has_deepspeeds_keys_and_defaults() -> None:
    assert CompileConfig().model_dump() == DEFAULTS


def test_every_key_at_its_default_is_accepted() -> None:
    cfg = load_config({**BASE, "compile": dict(DEFAULTS)})
    assert cfg.compile.deepcompile is False and cfg.compile.double_buffer is True
    assert cfg["compile"] == DEFAULTS  # engine.config["compile"]: as written


def test_no_deepcompile_key_is_refused_any_more() -> None:
    from zerospeed.config.unsupported import DEEPCOMPILE_KEYS, NOT_SUPPORTED_YET

    assert DEEPCOMPILE_KEYS == () and not any(k.startswith("compile.") for k in NOT_SUPPORTED_YET)
    assert load_config({**BASE, "compile": {"deepcompile": True, "symmetric_memory": True}}).compile.symmetric_memory
    with pytest.warns(UserWarning, match=r"compile\.symmetric_memory has no effect without compile\.deepcompile"):
        load_config({**BASE, "compile": {"symmetric_memory": True}})


def test_unknown_and_mistyped_keys() -> None:
    with pytest.raises(ConfigError, match="Did you mean 'deepcompile'"):
        load_config({**BASE, "compile": {"deep_compile": False}})
    with pytest.raises(ConfigError, match=r"compile\.passes"):
        load_config({**BASE, "compile": {"passes": ["z9"]}})


def test_accelerator_compile_backend() -> None:
    acc = type(get_accelerator())()
    assert acc.get_compile_backend() == "inductor"
    acc.set_compile_backend("aot_eager")
    assert acc.get_compile_backend() == "aot_eager"
    assert type(get_accelerator())().get_compile_backend() == "inductor"  # per instance, not global
    with pytest.raises(ValueError, match="not supported"):
        acc.set_compile_backend("no-such-backend")


def test_deepspeed_compiler_helpers_at_their_path() -> None:
    import torch

    from zerospeed.runtime import compiler

    assert compiler.is_compile_supported() and not compiler.is_compiling()
    seen = []

    def probe(x: torch.Tensor) -> torch.Tensor:
        seen.append(compiler.is_compiling())
        return x + 1

    eager_probe = compiler.disable(probe)

    @torch.compile(backend="eager")
    def f(x: torch.Tensor) -> torch.Tensor:
        seen.append(compiler.is_compiling())
        return eager_probe(x * 2)

    assert f(torch.ones(2)).tolist() == [3.0, 3.0]
    assert seen == [True, False]  # traced body, then the disabled function run eagerly
