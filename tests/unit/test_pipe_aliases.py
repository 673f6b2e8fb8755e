"""DeepSpeed import paths for the pipeline are served from the one alias table (zerospeed/_aliases.py)."""

import importlib


def test_deepspeed_pipeline_paths_import() -> None:
    from zerospeed.pipe import LayerSpec, PipelineModule, ProcessTopology, TiedLayerSpec
    from zerospeed.runtime.pipe.schedule import (BackwardPass, DataParallelSchedule, ForwardPass, InferenceSchedule,
                                                 LoadMicroBatch, OptimizerStep, RecvActivation, RecvGrad, ReduceGrads,
                                                 ReduceTiedGrads, SendActivation, SendGrad, TrainSchedule)
    from zerospeed.runtime.pipe.topology import (PipeDataParallelTopology, PipeModelDataParallelTopology,
                                                 ProcessTopology as Topo2)
    from zerospeed.runtime.utils import partition_balanced, partition_uniform
    from zerospeed.utils import RepeatingLoader
    from zerospeed.parallel.pipeline.module import PipelineModule as Real

    assert PipelineModule is Real and Topo2 is ProcessTopology
    assert partition_uniform(4, 2) == [0, 2, 4] and partition_balanced([1, 1], 2) == [0, 1, 2]
    assert PipeModelDataParallelTopology(2, 2, 2).get_axis_names() == ["pipe", "data", "model"]
    assert [next(RepeatingLoader([1, 2])) for _ in range(1)] == [1]
    assert all(isinstance(c, type) for c in (LayerSpec, TiedLayerSpec, PipeDataParallelTopology, TrainSchedule,
                                             InferenceSchedule, DataParallelSchedule, LoadMicroBatch, ForwardPass,
                                             BackwardPass, SendActivation, RecvActivation, SendGrad, RecvGrad,
                                             ReduceGrads, ReduceTiedGrads, OptimizerStep))


def test_attribute_access_and_one_table() -> None:
    import zerospeed
    from zerospeed import _aliases

    assert zerospeed.pipe.PipelineModule.__name__ == "PipelineModule"
    for alias, target in _aliases.ALIASES.items():
        mod = importlib.import_module(alias)
        reals = [importlib.import_module(t) for t in ((target,) if isinstance(target, str) else target)]
        for n in mod.__all__:
            owner = next(r for r in reals if hasattr(r, n))  # the first target that has the name serves it
            assert getattr(mod, n) is getattr(owner, n), f"{alias}.{n}"


def test_repeating_loader_restarts() -> None:
    from zerospeed.utils import RepeatingLoader

    it = RepeatingLoader([1, 2])
    assert [next(it) for _ in range(5)] == [1, 2, 1, 2, 1]
