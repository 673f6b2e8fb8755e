"""Models that ship with zerospeed: a small byte-level GPT for the demo, tests and benchmarks."""

from zerospeed.models.gpt import GPT, GPTConfig, bench, demo, tiny

PRESETS = {"tiny": tiny, "demo": demo, "bench": bench}

__all__ = ["GPT", "GPTConfig", "PRESETS", "bench", "demo", "tiny"]
