"""``engine.no_sync()``'s refusals (runtime/no_sync.py): stages 2-3, a block inside a block, ``step()`` inside.
Each is a ``NoSyncError``, caught as a ``RuntimeError`` and as an ``AssertionError`` (DeepSpeed asserts)."""

from __future__ import annotations

import pytest

from zerospeed.runtime.no_sync import NoSyncError, check_step, no_sync_block


class _Engine:
    def __init__(self, stage: int) -> None:
        self.stage, self._inside_no_sync = stage, False

    def zero_optimization_stage(self) -> int:
        return self.stage


@pytest.mark.parametrize("stage", [2, 3])
def test_partitioned_gradients_refuse_the_block(stage: int) -> None:
    with pytest.raises(AssertionError, match=f"incompatible with gradient partitioning logic of ZeRO stage {stage}"):
        with no_sync_block(_Engine(stage)):
            pass


def test_nesting_and_step_inside_are_refused_and_the_flag_is_restored() -> None:
    engine = _Engine(1)
    with no_sync_block(engine):
        assert engine._inside_no_sync
        with pytest.raises(RuntimeError, match="reentry is unsupported"):
            with no_sync_block(engine):
                pass
        with pytest.raises(NoSyncError, match=r"illegal to call Engine.step\(\) inside no_sync"):
            check_step(engine)
        assert engine._inside_no_sync  # the refused inner block left the outer one open
    assert not engine._inside_no_sync
    check_step(engine)  # outside the block: allowed
