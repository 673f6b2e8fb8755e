"""Sequence parallelism and tiled long-sequence compute (Arctic Long Sequence Training)."""
