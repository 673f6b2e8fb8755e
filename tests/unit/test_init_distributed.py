"""zerospeed.init_distributed takes DeepSpeed's arguments; MPI launches are refused clearly."""

import pytest

import zerospeed
from zerospeed import comm
from zerospeed.config import NotSupportedYetError


def test_dist_init_not_required_is_a_no_op() -> None:
    zerospeed.init_distributed(dist_init_required=False)
    assert not comm.is_initialized()


def test_mpi_launch_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "0")
    with pytest.raises(NotSupportedYetError, match="zerospeed launch"):
        zerospeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=True, distributed_port=29501,
                                   verbose=False)
    assert not comm.is_initialized()
