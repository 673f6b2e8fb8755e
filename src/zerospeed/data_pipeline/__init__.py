"""Data efficiency (DeepSpeed's ``runtime/data_pipeline`` and ``progressive_layer_drop``): curriculum
schedules, the curriculum data sampler, random layerwise token dropping and progressive layer drop."""

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

__all__ = ["CurriculumScheduler", "ProgressiveLayerDrop", "RandomLTDScheduler", "RandomLayerTokenDrop",
           "bert_sample_tokens", "convert_to_random_ltd", "gpt_sample_tokens", "pld_keep_probability",
           "remove_random_ltd_state_dict", "save_without_random_ltd", "CurriculumSampler", "read_indexed",
           "write_indexed", "write_metric_index"]
