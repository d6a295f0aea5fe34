"""The stack of DESIGN "Packages and their order", checked on the source: no import runs from a lower part to a
higher one, the router, the hub and the agent stand alone, and no function-level import hides a cycle."""

import ast
import fnmatch
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Lower numbers are lower in the stack; a package may import its own modules and lower ones.
LAYERS = {
    "hub": 0,
    "nodewire": 0,
    "telemetry": 0,
    "catalog": 0,
    "inventory": 1,
    "keys": 1,
    "teams": 2,  # a team publishes its keys' changes; a key names its team by string only
    "reconciler": 2,
    "dashboard": 3,
    "agentlink": 3,
    "runner": 4,
    "llmgw_site": 5,
    "llmgw": 6,  # the `llmgw` command: it names every process, the agent's included (llmgw.cli: by string)
}
# Packages that stand alone: what each may import besides itself.
ALONE = {
    "hub": set(),
    "router": {"hub", "keys", "telemetry"},  # DESIGN "Packages and their order": the hub, the key rows it reads, traces
    "agent": {"nodewire"},  # runs on GPU nodes, without the control plane
    "mockengine": {"nodewire"},  # a process of its own, started by agents
}
# Who may import a package that stands alone outside the layers: the embedded runner runs a router in its process.
ALONE_USERS = {"router": {"runner"}}
# The embedded runner runs simulated nodes' agents in its process, `manage.py agent` the agent's CLI, and
# `manage.py install_vllm` installs vLLM where agents look for it: nothing else of the control plane uses the agent.
RUNNER_USES_OF_AGENT = {
    "agent.gpus.discovery",
    "agent.runtime",
    "agent.options",
    "agent.cli",
    "agent.link",
    "agent.engines.vllm_command",
}
PROJECT = set(LAYERS) | set(ALONE)


def source_modules():
    for path in sorted(ROOT.glob("*/**/*.py")):
        parts = path.relative_to(ROOT).parts
        if parts[0] not in PROJECT or "tests" in parts or "migrations" in parts:
            continue
        yield ".".join(parts).removesuffix(".py").removesuffix(".__init__"), path


def _resolve(base: str, name: str) -> str:
    """`base.name` if that is a module of the project, else `base` (name is an attribute of it)."""
    candidate = f"{base}.{name}"
    path = ROOT.joinpath(*candidate.split("."))
    return candidate if path.with_suffix(".py").exists() or path.is_dir() else base


def imports(path: Path, module: str):
    """(imported project module, whether inside a function) for every import in the file."""
    tree = ast.parse(path.read_text(), str(path))
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]

    def visit(node, in_function):
        for child in ast.iter_child_nodes(node):
            # AppConfig.ready() is where Django wants signal receivers imported (models load first);
            # that is load order, not a cycle.
            is_function = isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef) and child.name != "ready"
            nested = in_function or is_function
            if isinstance(child, ast.Import):
                for alias in child.names:
                    yield alias.name, nested
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    base = ".".join(package[: len(package) - child.level + 1] + ([base] if base else []))
                for alias in child.names:
                    yield _resolve(base, alias.name), nested
            else:
                yield from visit(child, nested)

    for name, in_function in visit(tree, False):
        if name.split(".")[0] in PROJECT:
            yield name, in_function


def allowed(importer: str, imported: str) -> bool:
    mine, theirs = importer.split(".")[0], imported.split(".")[0]
    if mine == theirs:
        return True
    if theirs == "agent" and mine == "runner":
        return imported in RUNNER_USES_OF_AGENT
    if mine in ALONE:
        return theirs in ALONE[mine]
    if theirs in LAYERS:
        return LAYERS[theirs] <= LAYERS[mine]
    return mine in ALONE_USERS.get(theirs, set())


def test_no_import_runs_up_the_stack():
    wrong = [
        f"{module} imports {name}"
        for module, path in source_modules()
        for name, _ in imports(path, module)
        if not allowed(module, name)
    ]
    assert wrong == []


def test_no_function_level_import_of_a_project_module():
    hidden = [
        f"{module} imports {name} inside a function"
        for module, path in source_modules()
        for name, in_function in imports(path, module)
        if in_function
    ]
    assert hidden == []


def test_the_layer_check_catches_a_violation():
    assert not allowed("inventory.models", "reconciler.models")
    assert not allowed("router.app", "catalog.models")
    assert not allowed("hub.memory", "reconciler.models")
    assert not allowed("agent.runtime", "inventory.models")
    assert not allowed("reconciler.admin", "dashboard.summary")
    assert allowed("reconciler.tick", "hub")
    assert allowed("agentlink.services", "reconciler.agent_reports")
    assert allowed("inventory.models", "nodewire.protocol")
    assert allowed("catalog.memory", "nodewire.weights.headers")
    assert not allowed("catalog.memory", "agent.runtime")
    assert not allowed("dashboard.summary", "router.app")
    assert not allowed("reconciler.demand.tokens", "router.key_cache")
    assert allowed("reconciler.demand.tokens", "keys.models")
    assert allowed("dashboard.metrics", "keys.models")
    assert allowed("keys.scopes", "catalog.models")
    assert not allowed("keys.models", "reconciler.models")
    assert not allowed("catalog.models", "keys.models")
    assert allowed("router.key_cache", "keys.models")
    assert not allowed("router.key_cache", "catalog.models")
    assert not allowed("keys.changes", "router.key_cache")
    assert allowed("runner.embedded", "router.app")
    assert allowed("runner.management.commands.agent", "agent.cli")
    assert allowed("agent.runtime", "nodewire.protocol")
    assert not allowed("nodewire.protocol", "agent.runtime")
    assert not allowed("catalog.memory", "agent.engines.launch")
    assert not allowed("mockengine.server", "agent.engines.launch")
    assert allowed("mockengine.server", "nodewire.engine_env")
    assert not allowed("runner.embedded", "agent.engines.launch")


def import_graph() -> dict[str, set[str]]:
    """Module -> the project modules it imports, wherever the import is (TYPE_CHECKING blocks included)."""
    modules = dict(source_modules())
    return {
        module: {name for name, _ in imports(path, module) if name in modules and name != module}
        for module, path in modules.items()
    }


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for child in graph.get(node, ()):
            if child not in index:
                visit(child)
                low[node] = min(low[node], low[child])
            elif child in stack:
                low[node] = min(low[node], index[child])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_import_cycle_between_modules():
    assert cycles(import_graph()) == []


def test_the_cycle_check_catches_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_model_is_reached_by_app_label_outside_migrations():
    # Reaching a model through the app registry by label is an import the layer check cannot see; migrations
    # need it for their historical models, nothing else does. (Spelled in two parts so this file is no match.)
    call = "apps." + "get_model("
    hidden = [f"{module} reaches a model by app label" for module, path in source_modules() if call in path.read_text()]
    assert hidden == []


def test_every_package_of_the_stack_ships_in_the_wheel():
    """A package the code imports but the wheel leaves out fails only where the wheel is installed: name each."""
    found = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    shipped = [name for name in PROJECT if any(fnmatch.fnmatch(name, pattern) for pattern in found["include"])]
    assert sorted(set(PROJECT) - set(shipped)) == []
