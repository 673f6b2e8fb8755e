"""Check zerospeed's sparsity layouts against DeepSpeed 0.19.6's ``sparsity_config.py`` (not a test: it needs
DeepSpeed's source, which 0.19.8 no longer ships). Every class over a grid of heads, lengths, directions and
parameters, random blocks under the same ``random.seed``; prints the cases and any that differ.

    git -C <DeepSpeed clone> show v0.19.6:deepspeed/ops/sparse_attention/sparsity_config.py > /tmp/ds_sc.py
    PYTHONPATH=src python scripts/compare_sparse_layouts.py /tmp/ds_sc.py
"""

from __future__ import annotations

import importlib.util
import random
import sys
from typing import Any

import torch

from zerospeed.sparse_attention import layouts as ours


def cases() -> list[tuple[str, dict[str, Any], int]]:
    out: list[tuple[str, dict[str, Any], int]] = []
    for heads, per_head in [(1, False), (4, False), (4, True)]:
        for seq in [16 * 5, 16 * 8, 16 * 13, 16 * 16]:
            for att in ["bidirectional", "unidirectional"]:
                horizontal = [False, True] if att == "bidirectional" else [False]
                base = dict(num_heads=heads, different_layout_per_head=per_head)
                out.append(("DenseSparsityConfig", base, seq))
                for local, glob in [(4, 1), (4, 2), (3, 1), (6, 3)]:
                    for hor in horizontal:
                        for patterns in [1, 2]:
                            if (patterns > 1 and not per_head) or patterns > local // glob:
                                continue
                            out.append(("FixedSparsityConfig", dict(base, num_local_blocks=local, num_global_blocks=glob,
                                        attention=att, horizontal_global_attention=hor,
                                        num_different_global_patterns=patterns), seq))
                for rnd in [0, 1, 2]:
                    for windows in [[4], [2, 3], [1, 2, 5]]:
                        for starts, ends in [([0], None), ([1, 7], None), ([0, 5], [2, 9])]:
                            for hor in horizontal:
                                out.append(("VariableSparsityConfig", dict(base, num_random_blocks=rnd,
                                            local_window_blocks=windows, global_block_indices=starts,
                                            global_block_end_indices=ends, attention=att,
                                            horizontal_global_attention=hor), seq))
                    for window in [1, 3, 4]:
                        for glob in [1, 2]:
                            if att == "unidirectional" and rnd > 1:
                                continue  # DeepSpeed's random.sample fails on the first rows
                            out.append(("BigBirdSparsityConfig", dict(base, num_random_blocks=rnd,
                                        num_sliding_window_blocks=window, num_global_blocks=glob, attention=att), seq))
                for window in [1, 3, 5]:
                    for starts, ends in [([0], None), ([1, 7], None), ([0, 5], [2, 9])]:
                        out.append(("BSLongformerSparsityConfig", dict(base, num_sliding_window_blocks=window,
                                    global_block_indices=starts, global_block_end_indices=ends, attention=att), seq))
                    if not per_head:
                        out.append(("LocalSlidingWindowSparsityConfig", dict(num_heads=heads,
                                    num_sliding_window_blocks=window, attention=att), seq))
    return out


def main(path: str) -> int:
    spec = importlib.util.spec_from_file_location("ds_sparsity_config", path)
    assert spec is not None and spec.loader is not None
    theirs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(theirs)
    differ = 0
    all_cases = cases()
    for name, kwargs, seq in all_cases:
        random.seed(123)
        a = getattr(theirs, name)(**kwargs).make_layout(seq)
        random.seed(123)
        b = getattr(ours, name)(**kwargs).make_layout(seq)
        if not torch.equal(a, b):
            differ += 1
            print("DIFFERS", name, kwargs, seq)
    print(f"{len(all_cases)} configurations, {differ} differ")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
