"""Pipeline schedules as pure instruction lists: DeepSpeed's order, buffer counts, and a dry run of every
stage together (sends never block, receives wait, FIFO per channel) that checks each micro-batch is
forwarded and backpropagated exactly once, in dependency order, without deadlock."""

from collections import defaultdict, deque

import pytest

from zerospeed.parallel.pipeline.interleaved import InterleavedSchedule
from zerospeed.parallel.pipeline.partition import partition_balanced, partition_uniform
from zerospeed.parallel.pipeline.schedule import (BackwardPass, DataParallelSchedule, ForwardPass, InferenceSchedule,
                                                  LoadMicroBatch, OptimizerStep, RecvActivation, RecvGrad, ReduceGrads,
                                                  ReduceTiedGrads, SendActivation, SendGrad, TrainSchedule)


def _names(sched) -> list[list[str]]:
    return [[repr(c) for c in step] for step in sched]


def test_train_schedule_matches_deepspeed_two_stages() -> None:
    # DeepSpeed 0.19.8's TrainSchedule(3, 2, stage) printed verbatim.
    s0 = [["LoadMicroBatch(buffer_id=0)", "ForwardPass(buffer_id=0)"], ["SendActivation(buffer_id=0)"],
          ["LoadMicroBatch(buffer_id=1)", "ForwardPass(buffer_id=1)"],
          ["RecvGrad(buffer_id=0)", "SendActivation(buffer_id=1)", "BackwardPass(buffer_id=0)"],
          ["LoadMicroBatch(buffer_id=0)", "ForwardPass(buffer_id=0)"],
          ["RecvGrad(buffer_id=1)", "SendActivation(buffer_id=0)", "BackwardPass(buffer_id=1)"], [],
          ["RecvGrad(buffer_id=0)", "BackwardPass(buffer_id=0)", "ReduceTiedGrads()", "ReduceGrads()",
           "OptimizerStep()"]]
    s1 = [[], ["RecvActivation(buffer_id=0)", "LoadMicroBatch(buffer_id=0)", "ForwardPass(buffer_id=0)"],
          ["BackwardPass(buffer_id=0)"],
          ["SendGrad(buffer_id=0)", "RecvActivation(buffer_id=1)", "LoadMicroBatch(buffer_id=1)",
           "ForwardPass(buffer_id=1)"], ["BackwardPass(buffer_id=1)"],
          ["SendGrad(buffer_id=1)", "RecvActivation(buffer_id=0)", "LoadMicroBatch(buffer_id=0)",
           "ForwardPass(buffer_id=0)"], ["BackwardPass(buffer_id=0)"],
          ["SendGrad(buffer_id=0)", "ReduceTiedGrads()", "ReduceGrads()", "OptimizerStep()"]]
    assert _names(TrainSchedule(3, 2, 0)) == s0
    assert _names(TrainSchedule(3, 2, 1)) == s1


def test_inference_and_data_parallel_schedules() -> None:
    assert _names(InferenceSchedule(2, 2, 1)) == [
        [], ["LoadMicroBatch(buffer_id=0)", "RecvActivation(buffer_id=0)", "ForwardPass(buffer_id=0)"],
        ["LoadMicroBatch(buffer_id=1)", "RecvActivation(buffer_id=1)", "ForwardPass(buffer_id=1)"]]
    steps = list(DataParallelSchedule(2, 1, 0))
    assert steps[-1] == [LoadMicroBatch(0), ForwardPass(0), BackwardPass(0), ReduceGrads(), OptimizerStep()]
    assert InferenceSchedule(8, 4, 1).num_pipe_buffers() == 2 and DataParallelSchedule(8, 1, 0).num_pipe_buffers() == 1


@pytest.mark.parametrize("m,p,expected", [(1, 4, [2, 2, 2, 2]), (8, 4, [4, 3, 2, 2]), (3, 2, [2, 2]),
                                          (2, 8, [2, 2, 2, 2, 2, 2, 2, 2])])
def test_train_buffer_counts(m: int, p: int, expected: list[int]) -> None:
    assert [TrainSchedule(m, p, s).num_pipe_buffers() for s in range(p)] == expected


def _dry_run(scheds: list, chunks: int = 1, forward_only: bool = False) -> dict:
    """Execute every stage's instructions; returns per-stage (chunk, micro-batch) forward/backward order."""
    p = len(scheds)
    programs = [[c for step in s for c in step] for s in scheds]
    pcs = [0] * p
    queues: dict = defaultdict(deque)
    bufs: list[dict] = [{} for _ in range(p)]
    loads = [0] * p
    done_f: dict = defaultdict(list)
    done_b: dict = defaultdict(list)
    grads: list[set] = [set() for _ in range(p)]
    last_vs = p * chunks - 1

    def vstage(r, c):
        return c * p + r

    def dest(r, c, forward):
        vs = vstage(r, c) + (1 if forward else -1)
        return vs % p, vs // p

    progress = True
    while progress:
        progress = False
        for r in range(p):
            while pcs[r] < len(programs[r]):
                cmd = programs[r][pcs[r]]
                c = getattr(cmd, "chunk", 0)
                key = (r, c, cmd.kwargs.get("buffer_id"))
                if isinstance(cmd, RecvActivation):
                    q = queues[("act", r, c)]
                    if not q:
                        break
                    bufs[r][key] = q.popleft()
                elif isinstance(cmd, RecvGrad):
                    q = queues[("grad", r, c)]
                    if not q:
                        break
                    assert q.popleft() == bufs[r][key], "gradient arrived for another micro-batch"
                    grads[r].add(key)
                elif isinstance(cmd, LoadMicroBatch):
                    if vstage(r, c) == 0:
                        bufs[r][key] = loads[r]
                    else:
                        assert vstage(r, c) == last_vs
                    loads[r] += 1 if vstage(r, c) == 0 or chunks == 1 or vstage(r, c) == last_vs else 0
                elif isinstance(cmd, ForwardPass):
                    done_f[(r, c)].append(bufs[r][key])
                elif isinstance(cmd, SendActivation):
                    dr, dc = dest(r, c, True)
                    queues[("act", dr, dc)].append(bufs[r][key])
                elif isinstance(cmd, BackwardPass):
                    mb = bufs[r][key]
                    assert mb in done_f[(r, c)]
                    assert vstage(r, c) == last_vs or key in grads[r], "backward before its gradient arrived"
                    grads[r].discard(key)
                    done_b[(r, c)].append(mb)
                elif isinstance(cmd, SendGrad):
                    dr, dc = dest(r, c, False)
                    queues[("grad", dr, dc)].append(bufs[r][key])
                pcs[r] += 1
                progress = True
    stuck = [r for r in range(p) if pcs[r] < len(programs[r])]
    assert not stuck, f"deadlock: stages {stuck} wait at {[programs[r][pcs[r]] for r in stuck]}"
    assert all(not q for q in queues.values()), "messages left unreceived"
    return {"f": done_f, "b": done_b}


@pytest.mark.parametrize("m,p", [(1, 1), (1, 2), (2, 2), (3, 2), (4, 4), (8, 4), (5, 3), (2, 5), (7, 1)])
def test_train_schedule_dry_run(m: int, p: int) -> None:
    out = _dry_run([TrainSchedule(m, p, s) for s in range(p)])
    for s in range(p):
        assert out["f"][(s, 0)] == list(range(m)) and out["b"][(s, 0)] == list(range(m))
        steps = list(TrainSchedule(m, p, s))
        assert len(steps) == 2 * (m + p - 1)
        assert steps[-1][-3:] == [ReduceTiedGrads(), ReduceGrads(), OptimizerStep()]


@pytest.mark.parametrize("m,p", [(1, 2), (3, 3), (6, 4)])
def test_inference_dry_run(m: int, p: int) -> None:
    out = _dry_run([InferenceSchedule(m, p, s) for s in range(p)])
    assert all(out["f"][(s, 0)] == list(range(m)) for s in range(p))


@pytest.mark.parametrize("m,p,v", [(2, 2, 2), (4, 2, 2), (8, 4, 2), (4, 4, 3), (6, 2, 3)])
def test_interleaved_dry_run(m: int, p: int, v: int) -> None:
    scheds = [InterleavedSchedule(m, p, s, chunks=v) for s in range(p)]
    out = _dry_run(scheds, chunks=v)
    for r in range(p):
        for c in range(v):
            assert sorted(out["f"][(r, c)]) == list(range(m)) and sorted(out["b"][(r, c)]) == list(range(m))
    assert scheds[0].num_pipe_buffers() == v * m
    # rank 0 starts its second chunk before the first micro-batch has returned
    first_steps = [c for step in list(scheds[0])[:p + 1] for c in step if isinstance(c, ForwardPass)]
    assert {c.chunk for c in first_steps} == {0, 1}


@pytest.mark.parametrize("m,p,v", [(2, 2, 2), (8, 4, 2)])
def test_interleaved_forward_only_dry_run(m: int, p: int, v: int) -> None:
    scheds = [InterleavedSchedule(m, p, s, chunks=v, forward_only=True) for s in range(p)]
    out = _dry_run(scheds, chunks=v)
    assert all(out["f"][(r, c)] == list(range(m)) and not out["b"][(r, c)] for r in range(p) for c in range(v))


def test_interleaved_needs_divisible_micro_batches() -> None:
    with pytest.raises(ValueError, match="divisible"):
        InterleavedSchedule(3, 2, 0, chunks=2)


def test_partitions_match_deepspeed() -> None:
    # Values printed by deepspeed.runtime.utils for the same inputs (0.19.8).
    assert partition_uniform(10, 4) == [0, 3, 6, 8, 10]
    assert partition_uniform(2, 4) == [0, 1, 2, 2, 2]
    assert partition_balanced([1, 1, 1, 1, 1, 1], 3) == [0, 2, 4, 6]
    assert partition_balanced([100, 1, 1, 1, 1, 100], 2) == [0, 3, 6]
    assert partition_balanced([0, 1, 1, 1, 1, 0], 2) == [0, 3, 6]
    assert partition_balanced([5, 0, 0, 5, 5, 0, 0, 5], 4) == [0, 3, 4, 7, 8]


@pytest.mark.parametrize("m,p", [(4, 2), (8, 2), (8, 4), (16, 4), (3, 3)])
def test_simulated_bubble_equals_theory_for_equal_stages(m: int, p: int) -> None:
    from zerospeed.parallel.pipeline.simulate import simulate

    t = simulate([TrainSchedule(m, p, s) for s in range(p)], [1.0] * p, [2.0] * p)
    assert t.makespan == pytest.approx(3.0 * (m + p - 1))
    assert t.bubble == pytest.approx([(p - 1) / (m + p - 1)] * p)


def test_interleaving_shrinks_the_simulated_bubble() -> None:
    from zerospeed.parallel.pipeline.simulate import simulate

    m, p, v = 8, 4, 2
    plain = simulate([TrainSchedule(m, p, s) for s in range(p)], [1.0] * p, [2.0] * p)
    inter = simulate([InterleavedSchedule(m, p, s, chunks=v) for s in range(p)], [1.0] * p, [2.0] * p, chunks=v)
    assert max(inter.bubble) < max(plain.bubble)
    # a slower last stage makes the others wait: the bubble follows the bottleneck
    slow = simulate([TrainSchedule(m, p, s) for s in range(p)], [1.0, 1.0, 1.0, 2.0], [2.0, 2.0, 2.0, 4.0])
    assert slow.bubble[0] > plain.bubble[0] and slow.bubble[3] < plain.bubble[3]


@pytest.mark.parametrize("m,p", [(8, 2), (16, 2), (16, 4)])
def test_measured_bubble_uses_the_pipeline_span_not_each_stage_own(m: int, p: int) -> None:
    """Stats shaped like the engine's (compute seconds, span to the rank's last compute), from an ideal
    1F1B timeline with equal stages: ``pipeline_bubble`` gives the theory on every stage; a stage's own span
    misses the tail the later stages spend finishing their backwards (the last stage reads too low)."""
    from zerospeed.parallel.pipeline.accounting import PipeStepStats, pipeline_bubble
    from zerospeed.parallel.pipeline.simulate import simulate

    t = simulate([TrainSchedule(m, p, s) for s in range(p)], [1.0] * p, [2.0] * p)
    stats = [PipeStepStats(compute_seconds=b, pipeline_seconds=e, total_seconds=e + 0.5)
             for b, e in zip(t.busy, t.ends)]
    theory = (p - 1) / (m + p - 1)
    assert pipeline_bubble(stats) == pytest.approx([theory] * p)
    assert stats[0].bubble_fraction == pytest.approx(theory)  # the first stage ends last: its span is the pipeline's
    assert stats[-1].bubble_fraction < 0.5 * theory


@pytest.mark.parametrize("m,p", [(1, 1), (1, 2), (2, 2), (3, 2), (16, 2), (4, 4), (8, 4), (5, 3), (2, 5)])
def test_eager_schedule_dry_run(m: int, p: int) -> None:
    from zerospeed.parallel.pipeline.eager import EagerTrainSchedule

    scheds = [EagerTrainSchedule(m, p, s) for s in range(p)]
    out = _dry_run(scheds)
    for s in range(p):
        assert out["f"][(s, 0)] == list(range(m)) and out["b"][(s, 0)] == list(range(m))
        assert list(scheds[s])[-1] == [ReduceTiedGrads(), ReduceGrads(), OptimizerStep()]
        # twice 1F1B's warm-up: every stage but the last runs ahead of its successor's need
        assert scheds[s].warmup() == min(m, 2 * (p - s - 1))
        assert scheds[s].num_pipe_buffers() == max(1, min(m, scheds[s].warmup() + 1))


@pytest.mark.parametrize("m,p", [(8, 2), (16, 2), (16, 4)])
def test_eager_schedule_absorbs_jitter_that_1f1b_accumulates(m: int, p: int) -> None:
    """Equal noiseless stages: both give the textbook bubble. With 5 % jitter per forward/backward (the same
    draws for both), 1F1B's bubble grows well above theory and the eager schedule's stays near it."""
    import random
    import statistics

    from zerospeed.parallel.pipeline.eager import EagerTrainSchedule
    from zerospeed.parallel.pipeline.simulate import simulate

    theory = (p - 1) / (m + p - 1)
    for cls in (TrainSchedule, EagerTrainSchedule):
        t = simulate([cls(m, p, s) for s in range(p)], [1.0] * p, [2.0] * p)
        assert t.bubble == pytest.approx([theory] * p)
    means = {}
    for cls in (TrainSchedule, EagerTrainSchedule):
        rng = random.Random(0)
        runs = [statistics.mean(simulate([cls(m, p, s) for s in range(p)], [1.0] * p, [2.0] * p,
                                         noise=lambda: rng.lognormvariate(0.0, 0.05)).bubble) for _ in range(40)]
        means[cls] = statistics.mean(runs)
    assert means[TrainSchedule] > 1.08 * theory
    assert means[EagerTrainSchedule] < 1.03 * theory
