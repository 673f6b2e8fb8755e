"""`zerospeed alias install|uninstall --target DIR`: `import deepspeed` resolves to zerospeed, the dist-info
answers importlib.metadata, the real DeepSpeed is never shadowed, uninstall removes only the alias."""

from __future__ import annotations

import importlib
import importlib.metadata
import sys
from pathlib import Path

import pytest

from zerospeed.launcher.cli import main as cli
from zerospeed.testing import run_distributed


def _imports_through_the_alias(site: str) -> dict:
    sys.path.insert(0, site)  # a forked rank: the parent's sys.path and sys.modules stay clean
    importlib.invalidate_caches()

    import deepspeed
    import deepspeed.comm as dist
    from deepspeed.accelerator import get_accelerator
    from deepspeed.pipe import PipelineModule
    from deepspeed.runtime.utils import set_random_seed  # noqa: F401

    import zerospeed
    from zerospeed.pipe import PipelineModule as ours

    try:
        import deepspeed.no_such_module  # noqa: F401
        missing = ""
    except ImportError as exc:
        missing = str(exc)
    return {"version": importlib.metadata.version("deepspeed"), "attr_version": deepspeed.__version__,
            "same": (deepspeed.initialize is zerospeed.initialize, dist is zerospeed.comm, PipelineModule is ours,
                     get_accelerator is zerospeed.get_accelerator),
            "missing": missing}


def test_install_import_uninstall(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli(["alias", "install", "--target", str(tmp_path)]) == 0
    assert "now resolves to zerospeed" in capsys.readouterr().out
    r, = run_distributed(_imports_through_the_alias, 1, str(tmp_path), timeout=60)
    assert r["version"] == r["attr_version"] and r["version"].startswith("0.19.8+zerospeed.")
    assert r["same"] == (True, True, True, True)
    assert "deepspeed.no_such_module" in r["missing"]
    assert cli(["alias", "uninstall", "--target", str(tmp_path)]) == 0
    assert list(tmp_path.iterdir()) == []


def test_refuses_over_the_real_deepspeed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "deepspeed").mkdir()
    (tmp_path / "deepspeed" / "__init__.py").write_text("__version__ = '0.19.8'\n")
    assert cli(["alias", "install", "--target", str(tmp_path)]) == 2
    assert "the real DeepSpeed is installed" in capsys.readouterr().err
    assert cli(["alias", "uninstall", "--target", str(tmp_path)]) == 0  # leaves what it did not write
    assert (tmp_path / "deepspeed" / "__init__.py").read_text() == "__version__ = '0.19.8'\n"
