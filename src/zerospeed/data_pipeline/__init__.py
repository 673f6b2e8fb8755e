"""Data efficiency (DeepSpeed's ``runtime/data_pipeline`` and ``progressive_layer_drop``): curriculum
schedules, the curriculum data sampler, random layerwise token dropping, progressive layer drop and dynamic batching."""

from .curriculum_scheduler import CurriculumScheduler
from .progressive_layer_drop import ProgressiveLayerDrop, pld_keep_probability
from .random_ltd import (
    RandomLayerTokenDrop,
    bert_sample_tokens,
    convert_to_random_ltd,
    gpt_sample_tokens,
    remove_random_ltd_state_dict,
    save_without_random_ltd,
)
from .indexed import read_indexed, write_indexed, write_metric_index
from .random_ltd_scheduler import RandomLTDScheduler
from .sampler import CurriculumSampler
from .dynamic_batching import (
    get_dataloader_and_lr_scheduler_for_variable_batch_size,
    get_dataloader_and_lr_scheduler_for_variable_batch_size_deepspeed,
)
from .variable_batch import batch_by_seqlens, dataloader_for_variable_batch_size
from .variable_lr import VariableBatchSizeLR, lr_scheduler_for_variable_batch_size, scale_lr

__all__ = ["CurriculumScheduler", "ProgressiveLayerDrop", "RandomLTDScheduler", "RandomLayerTokenDrop",
           "bert_sample_tokens", "convert_to_random_ltd", "gpt_sample_tokens", "pld_keep_probability",
           "remove_random_ltd_state_dict", "save_without_random_ltd", "CurriculumSampler", "read_indexed",
           "write_indexed", "write_metric_index", "batch_by_seqlens", "dataloader_for_variable_batch_size",
           "VariableBatchSizeLR", "lr_scheduler_for_variable_batch_size", "scale_lr",
           "get_dataloader_and_lr_scheduler_for_variable_batch_size",
           "get_dataloader_and_lr_scheduler_for_variable_batch_size_deepspeed"]
