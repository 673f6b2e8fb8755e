"""The README's example runs as written (fewer steps), on two ranks."""

import re
from pathlib import Path

from zerospeed.testing import run_distributed

README = Path(__file__).resolve().parents[2] / "README.md"


def _run_example(code: str) -> dict:
    scope: dict = {}
    exec(compile(code, "README.md", "exec"), scope)  # noqa: S102 - our own README
    return scope["engine"].memory_breakdown()


def test_readme_example_runs() -> None:
    code = re.search(r"```python\n(.*?)```", README.read_text(), re.S).group(1)
    code = code.replace("range(100)", "range(2)")
    for mem in run_distributed(_run_example, 2, code, timeout=120):
        assert mem["master"] > 0 and mem["optimizer_state"] > 0
