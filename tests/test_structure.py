"""Packages by purpose (docs/design.md, "Packages and their order"): checked on the source, so a folder does not
grow back into a pile of modules told apart by name prefixes, and no module grows past what a reader holds."""

from collections import Counter

from tests.test_layers import ROOT, source_modules

# About fifteen modules side by side is what a reader can survey; more wants sub-packages by purpose.
MAX_MODULES_PER_PACKAGE = 16
# A module's length follows its purpose, but past this it holds several.
MAX_MODULE_LINES = 500
# Three modules of one package sharing a name prefix (engine_*, mock_*) are a sub-package waiting to be made.
MAX_SHARED_PREFIX = 2


def packages() -> dict[str, list[str]]:
    """Package -> the names of the modules it holds directly (packages below it and __init__ aside)."""
    held: dict[str, list[str]] = {}
    for module, path in source_modules():
        if path.name == "__init__.py":
            held.setdefault(module, [])
        else:
            held.setdefault(module.rpartition(".")[0], []).append(path.stem)
    return held


def crowded(held: dict[str, list[str]]) -> list[str]:
    return [
        f"{package}: {len(names)} modules" for package, names in held.items() if len(names) > MAX_MODULES_PER_PACKAGE
    ]


def prefixed(held: dict[str, list[str]]) -> list[str]:
    found = []
    for package, names in held.items():
        prefixes = Counter(name.split("_")[0] for name in names if "_" in name)
        found += [f"{package}: {n} modules named {p}_*" for p, n in prefixes.items() if n > MAX_SHARED_PREFIX]
    return found


def folders_with_tests() -> dict[str, list[str]]:
    """Test folder -> the test modules and helpers it holds directly (conftest.py and __init__.py aside)."""
    held: dict[str, list[str]] = {}
    for path in sorted(ROOT.glob("*/**/*.py")):
        parts = path.relative_to(ROOT).parts
        if parts[0] in (".venv", "bench") or "tests" not in parts or path.name in ("__init__.py", "conftest.py"):
            continue
        held.setdefault("/".join(parts[:-1]), []).append(path.stem)
    return held


def test_no_package_holds_more_modules_than_a_reader_surveys():
    assert crowded(packages()) == []


def test_no_test_folder_holds_more_modules_than_a_reader_surveys():
    folders = folders_with_tests()
    assert {"tests", "tests/e2e", "router/tests", "router/tests/forwarding"} <= set(folders)
    assert crowded(folders) == []


def test_no_module_is_longer_than_its_purpose_needs():
    long = [
        f"{path.relative_to(ROOT)}: {lines} lines"
        for _, path in source_modules()
        if (lines := len(path.read_text().splitlines())) > MAX_MODULE_LINES
    ]
    assert long == []


def test_no_name_prefix_stands_in_for_a_sub_package():
    assert prefixed(packages()) == []


def test_the_checks_catch_a_crowded_package_and_a_prefix():
    held = {"agent": [f"m{i}" for i in range(17)], "engines": ["engine_a", "engine_b", "engine_c", "load"]}
    assert crowded(held) == ["agent: 17 modules"]
    assert prefixed(held) == ["engines: 3 modules named engine_*"]
