"""Every accepted config key is honoured: read by code, or an accepted hint with its reason.

The walk visits every leaf of the schema (the root model recursively, plus the typed ``optimizer.params``
and ``scheduler.params`` models). A leaf ``section.field`` counts as *read* when some source file of
``zerospeed`` (config/ included, so validators that refuse values count) both

* sees the section: names its class, or uses the name that holds it in its parent (``.offload_optimizer``,
  or a variable or parameter ``fp16``); root keys: names ``ZeroSpeedConfig``; and
* reads the field: an attribute load ``.field``, or passes the whole section on with ``.model_dump()``
  (the class is named in the function that calls it, or in a module-level table beside it), or, in the class itself, a ``@field_validator("field")`` whose body
  raises (the value is restricted to what is implemented).

Limits (this is a static scan by names): a file that sees two sections with the same field name counts a
read of either for both; a read does not prove the value changes behaviour. It does catch the common
failure: a key added to the schema that nothing ever looks at.
"""

from __future__ import annotations

import ast
from functools import lru_cache
from pathlib import Path

import zerospeed
from zerospeed.config.base import Section
from zerospeed.config.hints import ACCEPTED_HINTS
from zerospeed.config.schema import Leaf, all_leaves, leaves
from zerospeed.config.unsupported import NOT_SUPPORTED_YET

SRC = Path(zerospeed.__file__).parent



class _Facts:
    def __init__(self, tree: ast.AST) -> None:
        self.loads: set[str] = set()
        self.names: set[str] = set()
        self.dumped: set[str] = set()  # names passed on whole with .model_dump() (see _dumped_names)
        self.restricted: dict[str, set[str]] = {}  # class name -> fields a raising validator restricts
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute):
                self.names.add(node.attr)
                if isinstance(node.ctx, ast.Load):
                    self.loads.add(node.attr)
            elif isinstance(node, ast.Name):
                self.names.add(node.id)
            elif isinstance(node, ast.arg):
                self.names.add(node.arg)
            elif isinstance(node, ast.ClassDef):
                self.names.add(node.name)
                self.restricted[node.name] = _restricted_fields(node)
        self.dumped = _dumped_names(tree)


def _calls_model_dump(node: ast.AST) -> bool:
    return any(isinstance(n, ast.Attribute) and n.attr == "model_dump" for n in ast.walk(node))


def _dumped_names(tree: ast.AST) -> set[str]:
    """Names used in a function that calls ``.model_dump()``, or at module level (a table of classes) in a
    module whose functions do."""
    out: set[str] = set()
    functions = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    dumping = [f for f in functions if _calls_model_dump(f)]
    for f in dumping:
        out |= {n.id for n in ast.walk(f) if isinstance(n, ast.Name)}
    if dumping and isinstance(tree, ast.Module):
        for stmt in tree.body:
            if not isinstance(stmt, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                out |= {n.id for n in ast.walk(stmt) if isinstance(n, ast.Name)}
    return out


def _restricted_fields(cls: ast.ClassDef) -> set[str]:
    out: set[str] = set()
    for item in cls.body:
        if not isinstance(item, ast.FunctionDef):
            continue
        raises = any(isinstance(n, ast.Raise) for n in ast.walk(item))
        for dec in item.decorator_list:
            if raises and isinstance(dec, ast.Call) and getattr(dec.func, "id", "") == "field_validator":
                out |= {a.value for a in dec.args if isinstance(a, ast.Constant) and isinstance(a.value, str)}
    return out


@lru_cache(maxsize=1)
def _sources() -> dict[Path, _Facts]:
    # compat/ serves DeepSpeed's config objects (their derived fields read hints too): reading a key there
    # implements nothing, so it neither honours a key nor makes a hint "read"
    return {p: _Facts(ast.parse(p.read_text(), str(p))) for p in sorted(SRC.rglob("*.py"))
            if "compat" not in p.relative_to(SRC).parts}


def is_read(leaf: Leaf) -> bool:
    cls = leaf.model.__name__
    for facts in _sources().values():
        if facts.restricted.get(cls, set()) & {leaf.field}:
            return True
        sees = cls in facts.names or (leaf.parent_attr not in (None, "params") and leaf.parent_attr in facts.names)
        if sees and (leaf.field in facts.loads or cls in facts.dumped):
            return True
    return False


def unhonoured(all_: list[Leaf]) -> list[str]:
    return sorted({leaf.key for leaf in all_ if leaf.key not in ACCEPTED_HINTS and leaf.key not in NOT_SUPPORTED_YET
                   and not is_read(leaf)})


def test_every_schema_key_is_read_by_code_or_an_accepted_hint() -> None:
    missing = unhonoured(all_leaves())
    assert not missing, (f"config keys parsed but never read: {missing}. Implement them with DeepSpeed's meaning, "
                         "or (pure performance hints only) list them in zerospeed/config/hints.py with the reason")


def test_the_walk_catches_a_key_nobody_reads() -> None:
    class ProbeSection(Section):
        stage: int = 0  # read in many places
        zz_probe_never_read_anywhere: bool = False

    class ProbeRoot(Section):
        zero_optimization: ProbeSection = ProbeSection()

    found = unhonoured(leaves(ProbeRoot))
    assert found == ["zero_optimization.zz_probe_never_read_anywhere"]


def test_hint_and_not_supported_tables_name_real_keys() -> None:
    keys = {leaf.key for leaf in all_leaves()}
    assert set(ACCEPTED_HINTS) <= keys, sorted(set(ACCEPTED_HINTS) - keys)
    assert not set(ACCEPTED_HINTS) & set(NOT_SUPPORTED_YET)
    for key, reason in ACCEPTED_HINTS.items():
        assert len(reason) > 40, f"{key}: a hint needs its reason"


def test_hint_keys_are_not_read_by_code() -> None:
    """A key the code reads is implemented, not a hint: keep the table honest in both directions."""
    read = [leaf.key for leaf in all_leaves() if leaf.key in ACCEPTED_HINTS and is_read(leaf)]
    assert not read, f"these hints are read by code; drop them from ACCEPTED_HINTS: {read}"


def test_docs_list_every_key_with_its_status() -> None:
    from zerospeed.config.schema import markdown_table

    docs = (SRC.parent.parent / "docs" / "config.md").read_text()
    assert markdown_table() in docs, ("docs/config.md is stale: run "
                                      "`python -m zerospeed.config.schema --write docs/config.md`")
    for leaf in all_leaves():
        assert f"`{leaf.key}" in docs

