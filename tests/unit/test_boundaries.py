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
    assert inference.is_dir()
    for path in inference.rglob("*.py"):
        for name in _imports(path):
            assert ".zero" not in name and ".runtime" not in name, f"{path}: {name}"


def _module_file(name: str) -> Path | None:
    parts = name.split(".")
    if parts[0] != "zerospeed":
        return None
    base = SRC.joinpath(*parts[1:])
    for cand in (base.with_suffix(".py"), base / "__init__.py"):
        if cand.exists():
            return cand
    return None


def _resolve(path: Path, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    pkg = list(path.relative_to(SRC.parent).with_suffix("").parts)
    pkg = pkg[: len(pkg) - node.level]  # drops the module name (or "__init__"), then parent packages
    return ".".join(pkg + ([node.module] if node.module else []))


def test_inference_does_not_reach_training_transitively() -> None:
    """Follow zerospeed imports (relative ones too) from every inference file: no zero/ or runtime/ module."""
    todo = list((SRC / "inference").rglob("*.py"))
    seen: set[Path] = set()
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        rel = path.relative_to(SRC).parts
        assert rel[0] not in ("zero", "runtime"), f"inference reaches {'/'.join(rel)}"
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [_resolve(path, node)] if isinstance(node, ast.ImportFrom) else [])
            for name in names:  # importing a.b.c runs a/__init__ and a/b/__init__ too
                parts = name.split(".")
                for i in range(1, len(parts) + 1):
                    target = _module_file(".".join(parts[:i]))
                    if target is not None:
                        todo.append(target)


def test_files_stay_small() -> None:
    big = [f"{p.relative_to(SRC)}: {n}" for p in SRC.rglob("*.py") if (n := len(p.read_text().splitlines())) > 600]
    assert not big, big


def test_comm_resolves_every_group_it_hands_to_torch() -> None:
    """The engine's group is a RecoverableGroup: every torch.distributed call in comm/ must resolve() it
    (a raw pass-through works for plain groups and fails only once a recoverable one reaches it)."""
    import re
    from pathlib import Path

    import zerospeed.comm

    bad = []
    for path in Path(zerospeed.comm.__file__).parent.glob("*.py"):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"dist\.\w+\(.*\bgroup=group\b", line):
                bad.append(f"{path.name}:{n}: {line.strip()}")
    assert not bad, "torch.distributed called with an unresolved group:\n" + "\n".join(bad)
