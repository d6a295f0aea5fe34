"""Functions a reader can hold in mind: no function in the listed packages runs longer than their limit.

Measured from the `def` line to the function's last line (its docstring and
comments included), over each package's modules, its tests and migrations
left out. A package joins by a line in LIMITS.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# package -> the most lines one of its functions may have: the router's hot path is held tighter than the rest.
LIMITS = {
    "router": 50,
    **dict.fromkeys(
        [
            "hub",
            "catalog",
            "inventory",
            "keys",
            "reconciler",
            "dashboard",
            "agentlink",
            "runner",
            "agent",
            "llmgw_site",
        ],
        59,
    ),
}
SKIPPED_FOLDERS = {"tests", "migrations"}


def functions_over(package: str, limit: int, root: Path = ROOT) -> list[str]:
    """`path:line name (N lines)` for every function of `package` (a folder in `root`) longer than `limit` lines."""
    found = []
    for path in sorted((root / package).rglob("*.py")):
        if SKIPPED_FOLDERS & set(path.relative_to(root).parts):
            continue
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                length = (node.end_lineno or node.lineno) - node.lineno + 1
                if length > limit:
                    found.append(f"{path.relative_to(root)}:{node.lineno} {node.name} ({length} lines)")
    return found


@pytest.mark.parametrize(("package", "limit"), sorted(LIMITS.items()))
def test_no_function_is_longer_than_its_packages_limit(package, limit):
    assert functions_over(package, limit) == []


def test_a_long_function_is_found_and_tests_are_left_out(tmp_path):
    package = tmp_path / "pkg"
    (package / "tests").mkdir(parents=True)
    body = "".join(f"    x{i} = {i}\n" for i in range(5))
    (package / "mod.py").write_text(f"def short():\n    pass\n\n\nasync def long():\n{body}")
    (package / "tests" / "test_mod.py").write_text(f"def long_test():\n{body}")
    assert functions_over("pkg", 5, tmp_path) == ["pkg/mod.py:5 long (6 lines)"]
