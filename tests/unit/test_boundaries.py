"""DESIGN boundaries: only comm/ imports torch.distributed; inference does not import zero or runtime."""

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "zerospeed"


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_only_comm_imports_torch_distributed() -> None:
    offenders = []
    for path in SRC.rglob("*.py"):
        rel = path.relative_to(SRC)
        if rel.parts[0] == "comm":
            continue
        for name in _imports(path):
            if name == "torch.distributed" or name.startswith("torch.distributed."):
                offenders.append(f"{rel}: {name}")
    assert not offenders, offenders


def test_inference_does_not_import_training() -> None:
    inference = SRC / "inference"
    if not inference.exists():
        return
    for path in inference.rglob("*.py"):
        for name in _imports(path):
            assert ".zero" not in name and ".runtime" not in name, f"{path}: {name}"


def test_files_stay_small() -> None:
    big = [f"{p.relative_to(SRC)}: {n}" for p in SRC.rglob("*.py") if (n := len(p.read_text().splitlines())) > 600]
    assert not big, big
