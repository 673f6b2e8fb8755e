"""Thin modules for DeepSpeed names that frameworks reach (transformers, Accelerate, Lightning) through
``import deepspeed`` (``zerospeed alias install``), added to their DeepSpeed paths by
``_aliases.ALIAS_ADDITIONS``. Each re-exports zerospeed's own objects under DeepSpeed's names; no logic."""
