"""bench_peers / bench_mfu helpers: the loss check fails on disagreement, the doc section is rewritten in place,
and the model FLOPs count is 6·N·T plus the attention term."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.bench_mfu import _count, config, model_flops_per_step
from benchmarks.bench_peers import BEGIN, END, check_losses, write_section
from benchmarks.harness import Result
from zerospeed.models import GPT, GPTConfig


def _result(name: str, loss: float) -> Result:
    return Result(name, 2, 1, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, {}, loss)


def test_check_losses_names_the_outlier() -> None:
    check_losses([_result("torch DDP", 3.0), _result("zerospeed stage 2", 3.0001)], "fp32")
    with pytest.raises(AssertionError, match="zerospeed stage 3"):
        check_losses([_result("torch DDP", 3.0), _result("zerospeed stage 3", 3.01)], "fp32")


def test_write_section_replaces_between_markers(tmp_path: Path) -> None:
    doc = tmp_path / "b.md"
    doc.write_text(f"intro\n{BEGIN}\nold table\n{END}\nafter\n")
    write_section(str(doc), "new table")
    assert doc.read_text() == f"intro\n{BEGIN}\nnew table\n{END}\nafter\n"
    (tmp_path / "none.md").write_text("no markers")
    with pytest.raises(SystemExit):
        write_section(str(tmp_path / "none.md"), "x")


def test_mfu_flops_count() -> None:
    small = GPTConfig(vocab_size=300, block_size=64, n_layer=3, n_head=4, n_embd=64)
    assert _count(small) == GPT(small).num_params()
    n = _count(small)
    assert model_flops_per_step(small, n, 128) == 6 * (n - 64 * 64) * 128 + 12 * 3 * 64 * 64 * 128
    assert 1.0e9 < _count(config(20)) < 1.2e9  # the "~1B" model of the MFU check


def test_gas1_contenders_separate_the_adam_kernel_and_the_heap_trim() -> None:
    """The fused-AdamW DDP row (zerospeed's default kernel on host parameters) is there on CPU; --trim-pairs adds
    stages 2 and 3 with the trim off; every size of the sweep is a preset with its own schedule."""
    from benchmarks.bench_peers import SWEEP, contenders
    from zerospeed.models import PRESETS

    names = [c.name for c in contenders("gas1", "cpu")]
    assert "torch DDP, fused AdamW" in names and not any("no heap trim" in n for n in names)
    assert "torch DDP, fused AdamW" not in [c.name for c in contenders("gas1", "cuda")]
    paired = [c.name for c in contenders("gas1", "cpu", trim_pairs=True)]
    assert [n for n in paired if n not in names] == ["zerospeed stage 2, no heap trim", "zerospeed stage 3, no heap trim"]
    assert set(SWEEP) <= set(PRESETS) and all(len(v) == 3 and min(v) >= 1 for v in SWEEP.values())


def test_rounds_alternate_the_contenders_order_and_pair_ratios_per_round(monkeypatch) -> None:
    """A machine that slows down within a round must not always weigh on the same (later) contenders."""
    from benchmarks import harness
    from benchmarks.contenders import BenchSpec, Contender

    calls: list[str] = []
    clock = iter(range(1, 100))

    def fake_run(spec: BenchSpec, c: Contender) -> harness.Result:  # each run slower than the one before: drift
        calls.append(c.name)
        t = float(next(clock))
        return harness.Result(c.name, 2, 1, t, t, 1.0, 1.0, 1.0, 1.0, {}, 0.0)

    monkeypatch.setattr(harness, "run_contender", fake_run)
    names = ["base", "b", "c"]
    results = harness.run_all(BenchSpec(), [Contender(n, lambda m, s: None) for n in names], baseline="base",
                              repeat=2, log=False)
    assert calls == ["base", "b", "c", "c", "b", "base"]
    assert [r.contender for r in results] == names
    # base ran at 1 and 6, c at 3 and 4: the paired ratios 3/1 and 4/6 have a median of about 1.83
    by = {r.contender: r for r in results}
    assert by["c"].cpu_ratio == pytest.approx((3 / 1 + 4 / 6) / 2)
    assert by["c"].cpu_ratios == pytest.approx([3 / 1, 4 / 6])


def test_table_shows_every_rounds_cpu_ratio() -> None:
    """The median paired ratio hides the spread that decides whether a miss is the machine's: each round's CPU
    ratio is printed beside it."""
    from benchmarks.bench_peers import table
    from benchmarks.contenders import BenchSpec

    base, other = _result("torch DDP", 3.0), _result("zerospeed stage 2", 3.0)
    base.ratio = base.cpu_ratio = 1.0
    base.cpu_ratios = [1.0, 1.0]
    other.ratio, other.cpu_ratio, other.cpu_ratios = 1.01, 1.02, [0.981, 1.059]
    text = table(BenchSpec(preset="7m"), [base, other])
    assert "CPU ÷ DDP per round" in text.splitlines()[2]
    assert "| 1.020 | 0.981 / 1.059 |" in text
