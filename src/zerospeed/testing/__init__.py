"""Test utilities shipped with zerospeed so users can test their own models the same way."""

from .harness import DistributedTestError, run_distributed

__all__ = ["DistributedTestError", "run_distributed"]
