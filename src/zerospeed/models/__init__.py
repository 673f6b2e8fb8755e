"""Models that ship with zerospeed: a small byte-level GPT for the demo, tests and benchmarks."""

from zerospeed.models.gpt import GPT, GPTConfig, bench, demo, gpt2_small, mid, tiny

PRESETS = {"tiny": tiny, "demo": demo, "bench": bench, "mid": mid, "gpt2-small": gpt2_small}

__all__ = ["GPT", "GPTConfig", "PRESETS", "bench", "demo", "gpt2_small", "mid", "tiny"]
