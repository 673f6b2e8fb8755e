"""How the test harness starts ranks: forked on Gloo (warm imports), spawned on NCCL, where a child forked after
the parent touched CUDA cannot use it (seen on an H200: every forked NCCL rank failed with "Cannot
re-initialize CUDA in forked subprocess" once a test module had asked for the device's capability)."""

from zerospeed.testing.harness import start_method


def test_gloo_ranks_fork_and_nccl_ranks_spawn() -> None:
    assert start_method("gloo") == "fork"
    assert start_method("nccl") == "spawn"
