"""Build ``src/zerospeed/data/corpus.txt``, the demo's training text, from Python's own documentation.

The idea: every Python install already carries plenty of plain English under the PSF License (which allows
redistribution): the language-reference topics behind ``help('if')`` (``pydoc_data.topics``) and the docstrings
of the pure-Python standard library. We read them (the docstrings by parsing source with ``ast``, so nothing is
imported or executed), keep prose-like pieces, and write them in a fixed order up to a byte budget. The output
is committed; this script only documents and reproduces it (run once: ``python scripts/make_corpus.py``).
"""

from __future__ import annotations

import argparse
import ast
import inspect
import sysconfig
from collections.abc import Iterator
from pathlib import Path

SKIP_DIRS = {"test", "tests", "idlelib", "site-packages", "turtledemo", "lib2to3", "__pycache__", "ensurepip"}
DEFAULT_OUT = Path(__file__).resolve().parents[1] / "src" / "zerospeed" / "data" / "corpus.txt"


def reference_topics() -> Iterator[str]:
    """The language-reference sections shown by ``help(topic)``, in sorted topic order."""
    from pydoc_data.topics import topics  # shipped with CPython; plain text

    for name in sorted(topics):
        yield topics[name].strip()


def stdlib_docstrings(min_chars: int) -> Iterator[str]:
    """Module, class and function docstrings of the pure-Python stdlib, in sorted file order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(root.rglob("*.py")):
        if SKIP_DIRS.intersection(path.relative_to(root).parts):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node, clean=False)
                if doc and len(doc) >= min_chars and _looks_like_prose(doc):
                    yield inspect.cleandoc(doc)


def _looks_like_prose(text: str) -> bool:
    """Mostly letters and spaces, few code symbols: keeps English, drops doctest dumps and tables."""
    letters = sum(c.isalpha() or c.isspace() for c in text)
    return letters / len(text) > 0.85 and ">>>" not in text


def build(max_bytes: int, min_chars: int) -> bytes:
    """Concatenate topics then docstrings (blank-line separated, deduplicated) up to ``max_bytes``."""
    seen: set[str] = set()
    out: list[bytes] = []
    size = 0
    for piece in (*reference_topics(), *stdlib_docstrings(min_chars)):
        if piece in seen:
            continue
        seen.add(piece)
        chunk = (piece + "\n\n").encode("utf-8")
        if size + len(chunk) > max_bytes:
            break
        out.append(chunk)
        size += len(chunk)
    return b"".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--max-bytes", type=int, default=1_000_000)
    parser.add_argument("--min-chars", type=int, default=120)
    args = parser.parse_args()
    data = build(args.max_bytes, args.min_chars)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_bytes(data)
    print(f"wrote {len(data):,} bytes to {args.out}")


if __name__ == "__main__":
    main()
