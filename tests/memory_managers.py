"""A memory manager of a user's own, for the tests of `memory=`: the `HalfReservation` that
docs/extending.md writes (whose block tests/test_docs.py runs), taken from the page so that the tests
and the reader use the one class."""
from __future__ import annotations

import ast
import re
from pathlib import Path

PAGE = Path(__file__).resolve().parents[1] / "docs" / "extending.md"
PYTHON_BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def class_of_page(name: str) -> type:
    """The class `name` that a python block of the page defines, built from that block's imports and
    its definition alone (the rest of the block, its runs, is the page's own)."""
    for block in PYTHON_BLOCK.findall(PAGE.read_text()):
        body = ast.parse(block).body
        if any(isinstance(n, ast.ClassDef) and n.name == name for n in body):
            kept = [n for n in body if isinstance(n, (ast.Import, ast.ImportFrom))
                    or isinstance(n, ast.ClassDef) and n.name == name]
            namespace = {"__name__": __name__}
            exec(compile(ast.Module(kept, type_ignores=[]), str(PAGE), "exec"), namespace)
            return namespace[name]
    raise AssertionError(f"no python block of {PAGE} defines class {name}")


HalfReservation = class_of_page("HalfReservation")
