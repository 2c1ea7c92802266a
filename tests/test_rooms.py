"""The folder tree is the process map (docs/architecture.md, "Rooms"): every import of rollwise's own
modules, lazy ones inside functions included, is read from the source and checked against the rooms.

- A room imports only the rooms beneath it (ROOM_MAY_IMPORT); tools and the command line sit on top.
- No two modules, and no two folders, import each other, directly or around a cycle. A package that
  imports its subpackage counts, so a part never reaches back into the folder that composes it.
- The rooms that run in long-lived processes without a model import no torch (FORBIDDEN_THIRD_PARTY).
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOP_PACKAGES = ("pipeline", "learner", "envs")

# room -> the rooms its modules may import (its own always included)
ROOM_MAY_IMPORT: dict[str, frozenset[str]] = {
    "contracts": frozenset(),
    "transport": frozenset({"contracts"}),
    "envs": frozenset(),
    "supervisor": frozenset({"contracts", "transport", "envs"}),
    "engine": frozenset({"contracts", "transport"}),
    "learner": frozenset({"contracts", "transport", "envs"}),
    "tools": frozenset({"contracts", "transport", "envs", "supervisor", "engine", "learner"}),
    "cli": frozenset({"contracts", "transport", "envs", "supervisor", "engine", "learner", "tools"}),
}
FORBIDDEN_THIRD_PARTY: dict[str, frozenset[str]] = {
    "contracts": frozenset({"torch", "transformers", "peft", "safetensors"}),
    "transport": frozenset({"torch", "transformers", "peft"}),
    "supervisor": frozenset({"torch", "peft"}),
    "envs": frozenset({"torch", "peft"}),
}


def room_of(module: str) -> str:
    parts = module.split(".")
    if parts[0] in ("learner", "envs"):
        return parts[0]
    if module in ("pipeline", "pipeline.cli"):
        return "cli"
    if len(parts) >= 2 and parts[1] in ROOM_MAY_IMPORT:
        return parts[1]
    raise ValueError(f"{module} belongs to no room: put it in one of {sorted(ROOM_MAY_IMPORT)}")


@dataclass(frozen=True)
class Import:
    source: str  # importing module
    target: str  # imported module (or a name inside it, resolved to the module when it is one)
    line: int


def package_of(module: str, modules: Mapping[str, Path]) -> str:
    """The package a module lives in (a package's own __init__ lives in the package itself)."""
    path = modules[module]
    return module if path.name == "__init__.py" else module.rpartition(".")[0]


def discover(root: Path = ROOT) -> dict[str, Path]:
    modules = {}
    for top in TOP_PACKAGES:
        for path in sorted((root / top).rglob("*.py")):
            rel = path.relative_to(root).with_suffix("")
            name = ".".join(rel.parts)
            modules[name.removesuffix(".__init__")] = path
    return modules


def imports_of(module: str, path: Path, modules: Mapping[str, Path]) -> list[Import]:
    """Every `import` and `from ... import` of the file, at any depth (lazy imports included)."""
    found: list[Import] = []
    package = package_of(module, modules)
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [Import(module, alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                full = f"{target}.{alias.name}"
                found.append(Import(module, full if full in modules else target, node.lineno))
    return found


def own_target(target: str, modules: Mapping[str, Path]) -> str | None:
    """The rollwise module an import names (its longest known prefix), None for other packages."""
    if target.split(".")[0] not in TOP_PACKAGES:
        return None
    parts = target.split(".")
    for end in range(len(parts), 0, -1):
        candidate = ".".join(parts[:end])
        if candidate in modules:
            return candidate
    return target


def room_violations(edges: Iterable[Import], modules: Mapping[str, Path]) -> list[str]:
    problems = []
    for edge in edges:
        target = own_target(edge.target, modules)
        source_room = room_of(edge.source)
        if target is None:
            top = edge.target.split(".")[0]
            if top in FORBIDDEN_THIRD_PARTY.get(source_room, frozenset()):
                problems.append(
                    f"{edge.source}:{edge.line} imports {edge.target} (no {top} in {source_room})"
                )
            continue
        target_room = room_of(target)
        if target_room != source_room and target_room not in ROOM_MAY_IMPORT[source_room]:
            problems.append(
                f"{edge.source}:{edge.line} imports {target}: room {source_room} may not import {target_room}"
            )
    return problems


def cycles(graph: Mapping[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one node (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0

    def visit(node: str) -> None:
        nonlocal counter
        index[node] = low[node] = counter
        counter += 1
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def module_graph(edges: Iterable[Import], modules: Mapping[str, Path]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for edge in edges:
        target = own_target(edge.target, modules)
        if target in modules and target != edge.source:
            graph[edge.source].add(target)
    return graph


def folder_graph(edges: Iterable[Import], modules: Mapping[str, Path]) -> dict[str, set[str]]:
    """Package -> the packages its modules import (its own subpackages included)."""
    graph: dict[str, set[str]] = {}
    for edge in edges:
        target = own_target(edge.target, modules)
        if target not in modules:
            continue
        source_pkg, target_pkg = package_of(edge.source, modules), package_of(target, modules)
        if source_pkg != target_pkg:
            graph.setdefault(source_pkg, set()).add(target_pkg)
    return graph


def all_edges(modules: Mapping[str, Path]) -> list[Import]:
    return [edge for module, path in modules.items() for edge in imports_of(module, path, modules)]


# --- the real tree ---------------------------------------------------------------------------------------
def test_every_module_lives_in_a_room() -> None:
    for module in discover():
        room_of(module)  # raises naming the module


def test_rooms_import_only_the_rooms_beneath_them() -> None:
    modules = discover()
    assert room_violations(all_edges(modules), modules) == []


def test_no_two_modules_import_each_other() -> None:
    modules = discover()
    assert cycles(module_graph(all_edges(modules), modules)) == []


def test_no_two_folders_import_each_other() -> None:
    modules = discover()
    assert cycles(folder_graph(all_edges(modules), modules)) == []


def test_file_names_are_distinct() -> None:
    """A name says what a module is wherever it is read: no two modules share a file name (packages'
    __init__ and the `__main__` entry points aside)."""
    seen: dict[str, list[str]] = {}
    for module, path in discover().items():
        if path.name not in ("__init__.py", "__main__.py"):
            seen.setdefault(path.name, []).append(module)
    assert {name: mods for name, mods in seen.items() if len(mods) > 1} == {}


def test_the_daemon_reads_as_its_schedule() -> None:
    """daemon.py is `Supervisor.run` and what it calls directly; machinery lives one call away (wiring,
    lineage, learner_dispatch, fleet_services, status_report, observability.observers). The bound is the
    point at which it last stopped reading top to bottom."""
    lines = len((ROOT / "pipeline/supervisor/daemon.py").read_text().splitlines())
    assert lines < 400, f"pipeline/supervisor/daemon.py has {lines} lines: move machinery out of Supervisor"


# --- sizes: a step reads on one screen (docs/architecture.md, "Variants chosen once") ---------------------
RUNTIME_ROOMS = frozenset({"contracts", "transport", "envs", "supervisor", "engine", "learner"})
MODULE_LINE_LIMIT = 600
# Data, not logic: problem sets and their reference solutions grow with the task, not with the code.
DATA_MODULES = frozenset({"envs.code_tests.problems", "envs.code_tests.reference_solutions"})
HUB_CLASSES = ("LearnerWorker", "Trainer", "GroupScheduler", "_EpisodeRun")
HUB_CLASS_LINE_LIMIT = 300
HUB_METHOD_LINE_LIMIT = 40


def oversized_modules(modules: Mapping[str, Path], limit: int = MODULE_LINE_LIMIT) -> list[str]:
    """Runtime modules over `limit` lines, data modules aside."""
    found = []
    for module, path in sorted(modules.items()):
        if module in DATA_MODULES or room_of(module) not in RUNTIME_ROOMS:
            continue
        lines = len(path.read_text().splitlines())
        if lines > limit:
            found.append(f"{module}: {lines} lines")
    return found


def hub_class_problems(
    modules: Mapping[str, Path],
    names: Iterable[str] = HUB_CLASSES,
    class_limit: int = HUB_CLASS_LINE_LIMIT,
    method_limit: int = HUB_METHOD_LINE_LIMIT,
) -> list[str]:
    """Each named class exists once, spans at most `class_limit` lines, and none of its methods more
    than `method_limit` (decorators and docstrings included)."""
    wanted = set(names)
    seen: dict[str, list[str]] = {name: [] for name in wanted}
    problems = []
    for module, path in sorted(modules.items()):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.ClassDef) or node.name not in wanted:
                continue
            seen[node.name].append(module)
            span = (node.end_lineno or node.lineno) - node.lineno + 1
            if span > class_limit:
                problems.append(f"{module}.{node.name}: {span} lines")
            for item in node.body:
                if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
                    start = min([d.lineno for d in item.decorator_list] + [item.lineno])
                    length = (item.end_lineno or item.lineno) - start + 1
                    if length > method_limit:
                        problems.append(f"{module}.{node.name}.{item.name}: {length} lines")
    problems += [
        f"{name}: defined in {where or 'no module'}" for name, where in seen.items() if len(where) != 1
    ]
    return sorted(problems)


def test_runtime_modules_stay_under_the_line_limit() -> None:
    assert oversized_modules(discover()) == []


def test_hub_classes_read_on_one_screen() -> None:
    assert hub_class_problems(discover()) == []


# --- the checks themselves catch what they must ------------------------------------------------------------
def synthetic_tree(tmp_path: Path, files: dict[str, str]) -> dict[str, Path]:
    for rel, text in files.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return discover(tmp_path)


def test_a_learner_importing_the_supervisor_is_reported(tmp_path: Path) -> None:
    modules = synthetic_tree(
        tmp_path,
        {
            "learner/__init__.py": "",
            "learner/worker.py": "def f():\n    from pipeline.supervisor.daemon import Supervisor\n",
            "pipeline/__init__.py": "",
            "pipeline/supervisor/__init__.py": "",
            "pipeline/supervisor/daemon.py": "import torch\n",
            "envs/__init__.py": "",
        },
    )
    problems = sorted(room_violations(all_edges(modules), modules))
    assert problems == [
        "learner.worker:2 imports pipeline.supervisor.daemon: room learner may not import supervisor",
        "pipeline.supervisor.daemon:1 imports torch (no torch in supervisor)",
    ]


def test_a_part_importing_what_composes_it_and_cycles_are_reported(tmp_path: Path) -> None:
    modules = synthetic_tree(
        tmp_path,
        {
            "pipeline/__init__.py": "",
            "pipeline/supervisor/__init__.py": "",
            "pipeline/supervisor/daemon.py": "from pipeline.supervisor.engines import pool\n",
            "pipeline/supervisor/children.py": "",
            "pipeline/supervisor/engines/__init__.py": "",
            "pipeline/supervisor/engines/pool.py": "from pipeline.supervisor import children\n",
            "pipeline/supervisor/actors/__init__.py": "",
            "pipeline/supervisor/actors/a.py": "from pipeline.supervisor.engines.b import x\n",
            "pipeline/supervisor/engines/b.py": "from pipeline.supervisor.actors import a\nx = 1\n",
            "learner/__init__.py": "",
            "envs/__init__.py": "",
        },
    )
    edges = all_edges(modules)
    assert cycles(module_graph(edges, modules)) == [
        ["pipeline.supervisor.actors.a", "pipeline.supervisor.engines.b"]
    ]
    # engines/pool.py reaches back into the supervisor package, whose daemon imports engines/.
    assert cycles(folder_graph(edges, modules)) == [
        ["pipeline.supervisor", "pipeline.supervisor.actors", "pipeline.supervisor.engines"]
    ]


def test_size_checks_report_long_modules_classes_and_methods(tmp_path: Path) -> None:
    body = "\n".join(f"        x{i} = {i}" for i in range(41))
    modules = synthetic_tree(
        tmp_path,
        {
            "pipeline/__init__.py": "",
            "pipeline/supervisor/__init__.py": "",
            "pipeline/supervisor/big.py": "x = 1\n" * 601,
            "pipeline/tools/__init__.py": "",
            "pipeline/tools/long_bench.py": "x = 1\n" * 900,
            "learner/__init__.py": "",
            "learner/hub.py": (
                f"class Trainer:\n    def step(self):\n{body}\n\n    def ok(self):\n        pass\n"
            ),
            "envs/__init__.py": "",
            "envs/code_tests/__init__.py": "",
            "envs/code_tests/problems.py": "x = 1\n" * 2000,
        },
    )
    assert oversized_modules(modules) == ["pipeline.supervisor.big: 601 lines"]
    assert hub_class_problems(modules, names=("Trainer", "Missing"), class_limit=40) == [
        "Missing: defined in no module",
        "learner.hub.Trainer.step: 42 lines",
        "learner.hub.Trainer: 46 lines",
    ]
