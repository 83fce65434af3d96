"""Structural checks of `packages/*/src` (issue 30): import cycles, package directions, private
reach-ins, lab notes in docstrings and comments, and the engine's size and imports.

Everything is read from the source with `ast` and `tokenize`; nothing is imported. The checker
functions take the `packages/` directory, so the unit tests at the end run them on small trees
built under `tmp_path`.
"""

from __future__ import annotations

import ast
import functools
import io
import re
import tokenize
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

PACKAGES_DIR = Path(__file__).resolve().parents[1] / "packages"

# docs/architecture.md: a package never imports one to its right; these are its directions.
FORBIDDEN_PACKAGES = {
    "kvstore": {"tpreshard", "lenpredict", "rollout", "trainer", "orchestrator"},
    "tpreshard": {"kvstore", "lenpredict", "rollout", "trainer", "orchestrator"},
    "lenpredict": {"kvstore", "tpreshard", "rollout", "trainer", "orchestrator"},
    "trainer": {"kvstore", "tpreshard", "lenpredict", "rollout", "orchestrator"},
    "rollout": {"trainer", "orchestrator"},
}
FORBIDDEN_THIRD_PARTY = {"lenpredict": {"torch"}}  # pure modelling and planning

ENGINE = "patrl.rollout.engine"
ENGINE_MAX_LINES = 400
ADAPTIVE_PREFIXES = ("patrl.rollout.adaptive", "patrl.rollout.reconfigure", "patrl.rollout.migrate")

# Lab notes in docstrings and comments: timings, measured speed-ups, dates. Seconds only in
# forms that report a measurement (a decimal, a range, or after took/costs/...), so that
# contracts such as "block_size=16 tokens" or "n samples" never match.
_NUM = r"\d+(?:\.\d+)?"
LAB_NOTE_PATTERNS = {
    "sub-second timing": re.compile(rf"\b{_NUM}\s?(?:ms|µs|us|ns)\b"),
    "timing range": re.compile(rf"\b{_NUM}\s?[-–]\s?{_NUM}\s?(?:s|sec|min)\b"),
    "timing": re.compile(r"(?<!every )\b\d+\.\d+\s?s\b"),  # "every 0.1 s" states an interval
    "timing phrase": re.compile(
        rf"\b(?:took|takes|taking|costs?|costing|spent|spends|lasts|lasted|ran in|runs in)"
        rf"\s+(?:about\s+|~)?{_NUM}\s?(?:s|sec|seconds|min|minutes)\b",
        re.IGNORECASE,
    ),
    "measured speed-up": re.compile(
        rf"\b(?:\d+\.\d+|{_NUM}\s?[-–]\s?{_NUM})\s?x\b|\b{_NUM}\s?x\s+(?:faster|slower|speed-?up)"
    ),
    "date": re.compile(r"\b20\d\d-\d\d-\d\d\b"),
}


@dataclass(frozen=True, slots=True)
class Edge:
    """One import: `source` module imports `target` module, at `where` (path:line, context);
    `implicit`: `target` is a package whose `__init__` runs to import a submodule of it."""

    source: str
    target: str
    where: str
    implicit: bool = False


@dataclass(slots=True)
class Graph:
    """Modules of `packages/*/src/patrl/*` by dotted name, their files, and their imports."""

    files: dict[str, Path] = field(default_factory=dict)
    packages: set[str] = field(default_factory=set)  # modules that are an `__init__.py`
    edges: list[Edge] = field(default_factory=list)
    third_party: dict[str, set[str]] = field(default_factory=dict)  # module -> top-level names
    private_uses: list[str] = field(default_factory=list)

    def successors(self) -> dict[str, dict[str, Edge]]:
        out: dict[str, dict[str, Edge]] = {m: {} for m in self.files}
        for edge in self.edges:
            out[edge.source].setdefault(edge.target, edge)
        return out


def module_files(packages_dir: Path) -> Iterator[tuple[str, Path, bool]]:
    """(dotted name, file, is a package `__init__`) of every module under packages/*/src."""
    for path in sorted(packages_dir.glob("*/src/patrl/**/*.py")):
        rel = path.relative_to(_src_root(path)).with_suffix("").parts
        is_package = rel[-1] == "__init__"
        name = ".".join(rel[:-1] if is_package else rel)
        yield name, path, is_package


def _src_root(path: Path) -> Path:
    """The `src` directory above a module file."""
    for parent in path.parents:
        if parent.name == "src":
            return parent
    raise ValueError(f"{path} is not under a src/ directory")


def build_graph(packages_dir: Path) -> Graph:
    """Parse every module and record its imports: `import x`, `from x import y` (y a submodule
    when one exists, else x), relative imports, imports in functions and under TYPE_CHECKING,
    and `importlib.import_module("...")` with a literal name.

    Importing `a.b.c` also runs the `__init__` of `a` and `a.b`; those ancestors count as
    imported too, except the importer's own ancestors, which are always initialised (or
    initialising) before it runs. An explicit import of an ancestor (`from patrl.rollout import
    X` inside `patrl.rollout.engine`) does count: the ancestor's `__init__` re-exports its
    submodules, so that is a cycle a partial initialisation can break on.
    """
    graph = Graph()
    for name, path, is_package in module_files(packages_dir):
        graph.files[name] = path
        if is_package:
            graph.packages.add(name)
    for name, path in graph.files.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        _ImportVisitor(graph, name, path.relative_to(packages_dir.parent)).visit(tree)
    return graph


class _ImportVisitor(ast.NodeVisitor):
    """Records one module's imports into a Graph, with where each one is."""

    def __init__(self, graph: Graph, module: str, path: Path) -> None:
        self.graph = graph
        self.module = module
        self.path = path
        self.context: list[str] = []
        self.aliases: dict[str, str] = {}  # local name -> patrl module it is bound to
        graph.third_party.setdefault(module, set())

    def where(self, node: ast.AST) -> str:
        scope = f" ({', '.join(self.context)})" if self.context else ""
        return f"{self.path}:{getattr(node, 'lineno', '?')}{scope}"

    def visit_If(self, node: ast.If) -> None:
        test = ast.unparse(node.test)
        if "TYPE_CHECKING" in test:
            self.context.append("TYPE_CHECKING")
            for child in node.body:
                self.visit(child)
            self.context.pop()
            for child in node.orelse:
                self.visit(child)
        else:
            self.generic_visit(node)

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        self.context.append(f"in {node.name}()")
        self.generic_visit(node)
        self.context.pop()

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            target = self.add(alias.name, node)
            if target and alias.asname:
                self.aliases[alias.asname] = target
            elif target:
                self.aliases.setdefault(alias.name.split(".")[0], alias.name.split(".")[0])

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        base = self.resolve_relative(node)
        for alias in node.names:
            submodule = f"{base}.{alias.name}"
            if submodule in self.graph.files:
                self.add(submodule, node)
                self.aliases[alias.asname or alias.name] = submodule
                continue
            target = self.add(base, node)
            if target and _is_private(alias.name):
                self.graph.private_uses.append(
                    f"{self.where(node)}: {self.module} imports {target}.{alias.name}"
                )

    def visit_Call(self, node: ast.Call) -> None:
        func = ast.unparse(node.func)
        literal = node.args and isinstance(node.args[0], ast.Constant)
        if func.endswith("import_module") and literal:
            value = node.args[0].value  # type: ignore[attr-defined]
            if isinstance(value, str) and not value.startswith("."):
                self.add(value, node)
        self.generic_visit(node)

    def visit_Attribute(self, node: ast.Attribute) -> None:
        owner = self.module_of(node.value)
        if owner is not None and owner != self.module and _is_private(node.attr):
            self.graph.private_uses.append(
                f"{self.where(node)}: {self.module} uses {owner}.{node.attr}"
            )
        self.generic_visit(node)

    def module_of(self, node: ast.expr) -> str | None:
        """The patrl module an expression such as `m` or `patrl.a.b` names, if any."""
        if isinstance(node, ast.Name):
            return self.aliases.get(node.id) if node.id != "patrl" else None
        if isinstance(node, ast.Attribute):
            dotted = ast.unparse(node)
            head = dotted.split(".")[0]
            if head in self.aliases:
                dotted = self.aliases[head] + dotted[len(head) :]
            return dotted if dotted in self.graph.files else None
        return None

    def resolve_relative(self, node: ast.ImportFrom) -> str:
        if not node.level:
            return node.module or ""
        parts = self.module.split(".")
        if self.module not in self.graph.packages:
            parts = parts[:-1]
        parts = parts[: len(parts) - (node.level - 1)]
        return ".".join(parts + ([node.module] if node.module else []))

    def add(self, dotted: str, node: ast.AST) -> str | None:
        """Record an import of `dotted`; return the patrl module it resolves to, if any."""
        if not dotted.startswith("patrl."):
            self.graph.third_party[self.module].add(dotted.split(".")[0])
            return None
        target = dotted
        while target not in self.graph.files and "." in target:
            target = target.rsplit(".", 1)[0]
        if target not in self.graph.files:
            return None
        where = self.where(node)
        own_ancestors = {*_ancestors(self.module), self.module}
        for ancestor in _ancestors(target):
            if ancestor in self.graph.files and ancestor not in own_ancestors:
                self.graph.edges.append(Edge(self.module, ancestor, where + " [parent]", True))
        if target != self.module:
            self.graph.edges.append(Edge(self.module, target, where))
        return target


def _ancestors(module: str) -> list[str]:
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(2, len(parts))]


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _package(module: str) -> str:
    return module.split(".")[1]


# ----------------------------------------------------------------------------- checks


def find_cycles(graph: Graph) -> list[str]:
    """Every strongly connected set of modules, each with a shortest cycle through each of its
    members and where each edge of those cycles is written."""
    succ = graph.successors()
    out = []
    for component in _strongly_connected(succ):
        members = sorted(component)
        if len(members) == 1 and members[0] not in succ[members[0]]:
            continue
        cycles: dict[tuple[str, ...], None] = {}
        for start in members:
            cycles[_canonical(_shortest_cycle(succ, start, component))] = None
        lines = [f"cycle among {len(members)} modules: {', '.join(members)}"]
        for cycle in cycles:
            lines.append("  " + " -> ".join((*cycle, cycle[0])))
            for a, b in zip(cycle, (*cycle[1:], cycle[0]), strict=True):
                lines.append(f"      {a} -> {b}: {succ[a][b].where}")
        out.append("\n".join(lines))
    return out


def _strongly_connected(succ: dict[str, dict[str, Edge]]) -> list[set[str]]:
    """Tarjan's algorithm, iterative."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[set[str]] = []
    for root in sorted(succ):
        if root in index:
            continue
        work = [(root, iter(sorted(succ[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = set()
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.add(member)
                        if member == node:
                            break
                    out.append(component)
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(succ[child]))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return out


def _shortest_cycle(succ: dict[str, dict[str, Edge]], start: str, within: set[str]) -> list[str]:
    parent: dict[str, str] = {}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        for child in sorted(succ[node]):
            if child == start:
                path = [node]
                while path[-1] != start:
                    path.append(parent[path[-1]])
                return path[::-1]
            if child in within and child not in parent:
                parent[child] = node
                queue.append(child)
    raise AssertionError(f"{start} is on no cycle")


def _canonical(cycle: list[str]) -> tuple[str, ...]:
    first = cycle.index(min(cycle))
    return tuple(cycle[first:] + cycle[:first])


def direction_violations(graph: Graph) -> list[str]:
    """Imports against docs/architecture.md's directions, and forbidden third-party imports."""
    out = []
    for edge in (e for e in graph.edges if not e.implicit):
        source, target = _package(edge.source), _package(edge.target)
        if target in FORBIDDEN_PACKAGES.get(source, set()):
            out.append(f"{edge.where}: {edge.source} imports {edge.target} ({source} -> {target})")
    for module, names in sorted(graph.third_party.items()):
        for name in sorted(names & FORBIDDEN_THIRD_PARTY.get(_package(module), set())):
            out.append(f"{module} imports {name}")
    return sorted(set(out))


def private_imports(graph: Graph) -> list[str]:
    """`from m import _x` and `m._x` where m is another patrl module."""
    return sorted(set(graph.private_uses))


def lab_notes(packages_dir: Path) -> list[str]:
    """Timings, measured speed-ups and dates in the comments and string statements
    (docstrings) of every module under packages/*/src."""
    out = []
    for _, path, _ in module_files(packages_dir):
        found = []
        for line, text in _comments_and_docstrings(path.read_text()):
            for offset, row in enumerate(text.splitlines()):
                for kind, pattern in LAB_NOTE_PATTERNS.items():
                    for match in pattern.finditer(row):
                        found.append((line + offset, f"{kind} {match.group()!r}: {row.strip()}"))
        shown = path.relative_to(packages_dir.parent)
        out += [f"{shown}:{line}: {note}" for line, note in sorted(found)]
    return out


def _comments_and_docstrings(source: str) -> Iterator[tuple[int, str]]:
    """(first line, text) of every comment and every bare string statement."""
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            yield token.start[0], token.string
    for node in ast.walk(ast.parse(source)):
        if (
            isinstance(node, ast.Expr)
            and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)
        ):
            yield node.lineno, node.value.value


def engine_problems(graph: Graph) -> list[str]:
    """The engine runs one layout: it imports no adaptive-TP module, directly or through
    another module, and stays within ENGINE_MAX_LINES lines."""
    if ENGINE not in graph.files:
        return [f"{ENGINE} not found"]
    out = []
    lines = len(graph.files[ENGINE].read_text().splitlines())
    if lines > ENGINE_MAX_LINES:
        out.append(f"{ENGINE}: {lines} lines > {ENGINE_MAX_LINES}")
    succ = graph.successors()
    parent: dict[str, str] = {ENGINE: ENGINE}
    queue = deque([ENGINE])
    while queue:
        node = queue.popleft()
        for child in sorted(succ[node]):
            if child in parent:
                continue
            parent[child] = node
            queue.append(child)
            if child.startswith(ADAPTIVE_PREFIXES):
                path = [child]
                while path[-1] != ENGINE:
                    path.append(parent[path[-1]])
                hops = [f"{succ[parent[m]][m].where}" for m in path[-2::-1]]
                out.append(f"{ENGINE} imports {child} via {' -> '.join(path[::-1])}: {hops}")
    return out


def _fail_listing(title: str, offenders: list[str]) -> None:
    if offenders:
        pytest.fail(f"{title} ({len(offenders)}):\n" + "\n".join(offenders), pytrace=False)


@functools.cache
def _tree() -> Graph:
    """The graph of this repository's packages, built once for the tests below."""
    return build_graph(PACKAGES_DIR)


# ----------------------------------------------------------------------------- the tree


def test_no_import_cycles() -> None:
    _fail_listing("import cycles", find_cycles(_tree()))


def test_package_directions() -> None:
    _fail_listing(
        "imports against docs/architecture.md's directions", direction_violations(_tree())
    )


def test_no_private_imports() -> None:
    _fail_listing("another module's _private names", private_imports(_tree()))


def test_no_lab_notes_in_src() -> None:
    _fail_listing("timings or dates in src comments/docstrings", lab_notes(PACKAGES_DIR))


def test_engine_runs_one_layout() -> None:
    _fail_listing("engine.py", engine_problems(_tree()))


def test_graph_sees_the_tree() -> None:
    """Guards the checks above against passing on an empty or misread tree."""
    graph = _tree()
    assert {"patrl.rollout", ENGINE, "patrl.kvstore.block_manager"} <= set(graph.files)
    assert any(e.source == ENGINE and e.target.startswith("patrl.kvstore") for e in graph.edges)


# ----------------------------------------------------------------------------- the checkers


def make_tree(root: Path, modules: dict[str, str]) -> Path:
    """packages/<pkg>/src/patrl/<pkg>/... under `root` from {"pkg/x.py": source}."""
    for rel, source in modules.items():
        package = rel.split("/")[0]
        path = root / "packages" / package / "src" / "patrl" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(source)
    return root / "packages"


CLEAN = {
    "kvstore/__init__.py": "from patrl.kvstore.cache import Cache\n",
    "kvstore/cache.py": '"""A block cache of 16 tokens a block; block_size=16 tokens."""\n'
    "class Cache:\n    pass\n",
    "rollout/__init__.py": "from .engine import Engine\n",
    "rollout/engine.py": "from patrl.kvstore import Cache\nfrom . import sampler\n\n"
    "class Engine:\n    def run(self):\n        from patrl.rollout.sampler import sample\n"
    "        print(f'{1.5} s')  # the step's time in s\n        return sample\n",
    "rollout/sampler.py": "import torch\n\ndef sample():\n    return torch.zeros(2)\n",
    "lenpredict/__init__.py": "import numpy\n",
}


def test_clean_tree_passes(tmp_path: Path) -> None:
    packages = make_tree(tmp_path, CLEAN)
    graph = build_graph(packages)
    assert find_cycles(graph) == []
    assert direction_violations(graph) == []
    assert private_imports(graph) == []
    assert lab_notes(packages) == []
    assert engine_problems(graph) == []
    assert ("patrl.rollout.engine", "patrl.rollout.sampler") in [
        (e.source, e.target) for e in graph.edges
    ]


def test_cycle_under_type_checking_is_found(tmp_path: Path) -> None:
    packages = make_tree(
        tmp_path,
        {
            "rollout/__init__.py": "",
            "rollout/a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
            "    from patrl.rollout.b import B\n",
            "rollout/b.py": "def f():\n    from .a import A\n",
        },
    )
    cycles = find_cycles(build_graph(packages))
    assert len(cycles) == 1
    assert "patrl.rollout.a -> patrl.rollout.b -> patrl.rollout.a" in cycles[0]
    assert "TYPE_CHECKING" in cycles[0] and "in f()" in cycles[0]


def test_import_of_own_package_init_is_a_cycle(tmp_path: Path) -> None:
    packages = make_tree(
        tmp_path,
        {
            "rollout/__init__.py": "from .engine import Engine\nfrom .config import Config\n",
            "rollout/config.py": "class Config: ...\n",
            "rollout/engine.py": "from patrl.rollout import Config\nfrom patrl.rollout import config\n",
        },
    )
    cycles = find_cycles(build_graph(packages))
    assert (
        len(cycles) == 1 and "patrl.rollout -> patrl.rollout.engine -> patrl.rollout" in cycles[0]
    )


def test_from_import_of_a_submodule_targets_the_submodule(tmp_path: Path) -> None:
    packages = make_tree(
        tmp_path,
        {
            "rollout/__init__.py": "from .engine import Engine\n",
            "rollout/config.py": "",
            "rollout/engine.py": "from patrl.rollout import config\nimport patrl.rollout.config as c\n",
        },
    )
    graph = build_graph(packages)
    assert {e.target for e in graph.edges if e.source == ENGINE} == {"patrl.rollout.config"}
    assert find_cycles(graph) == []


def test_implicit_parent_init_closes_a_cycle(tmp_path: Path) -> None:
    packages = make_tree(
        tmp_path,
        {
            "tpreshard/__init__.py": "from .comm import gather\n",
            "tpreshard/comm.py": "def gather(): ...\n",
            "kvstore/__init__.py": "",
            "kvstore/spec.py": "import patrl.tpreshard.comm\n",
        },
    )
    graph = build_graph(packages)
    targets = {e.target for e in graph.edges if e.source == "patrl.kvstore.spec"}
    assert targets == {"patrl.tpreshard", "patrl.tpreshard.comm"}
    assert any("kvstore -> tpreshard" in v for v in direction_violations(graph))


def test_directions_and_torch_in_lenpredict(tmp_path: Path) -> None:
    packages = make_tree(
        tmp_path,
        {
            "lenpredict/__init__.py": "",
            "lenpredict/model.py": "def f():\n    import torch.nn\n",
            "rollout/__init__.py": "",
            "rollout/engine.py": "from patrl.trainer.losses import loss\n",
            "trainer/__init__.py": "",
            "trainer/losses.py": "def loss(): ...\n",
            "orchestrator/__init__.py": "",
            "orchestrator/main.py": "from patrl.trainer import losses\nfrom patrl.rollout import engine\n",
        },
    )
    violations = direction_violations(build_graph(packages))
    assert len(violations) == 2, violations
    assert any(
        "engine.py:1: patrl.rollout.engine imports patrl.trainer.losses" in v for v in violations
    )
    assert any("patrl.lenpredict.model imports torch" in v for v in violations)


def test_private_names_are_found(tmp_path: Path) -> None:
    packages = make_tree(
        tmp_path,
        {
            "orchestrator/__init__.py": "",
            "orchestrator/sync_loop.py": "def _save(): ...\ndef save(): ...\n_save()\n",
            "orchestrator/async_loop.py": "from patrl.orchestrator.sync_loop import _save, save\n"
            "from . import sync_loop as s\nimport patrl.orchestrator.sync_loop\n"
            "s._save()\npatrl.orchestrator.sync_loop._save()\ns.__name__\n",
        },
    )
    found = private_imports(build_graph(packages))
    assert len(found) == 3, found
    assert all("patrl.orchestrator.sync_loop._save" in f for f in found)


def test_lab_notes_in_docstrings_and_comments_are_found(tmp_path: Path) -> None:
    source = (
        '"""Samples tokens.\n\nOn 2026-11-24 this took 12 ms a step; 0.19-0.20 s, vs 0.27 s.\n"""\n'
        "# TP=2 runs one sequence 1.4-1.5x faster; 3.7x overall\n"
        "def f(block_size=16):\n"
        '    """16 tokens a block, n samples, 2 layers, 8xH100, 2x the heads."""\n'
        '    label = "took 12 ms"  # a string in code is not a note\n'
        "    return f'{label} 0.5 s'\n"
        "# costs about 3 s; polled every 0.1 s\n"
    )
    packages = make_tree(tmp_path, {"rollout/__init__.py": "", "rollout/sampler.py": source})
    found = lab_notes(packages)
    kinds = sorted(f.split(": ")[1].split(" '")[0] for f in found)
    assert kinds == [
        "date",
        "measured speed-up",
        "measured speed-up",
        "sub-second timing",
        "timing",
        "timing",
        "timing phrase",
        "timing range",
    ], found
    assert all(":3:" in f or ":5:" in f or ":10:" in f for f in found), found


def test_engine_checks(tmp_path: Path) -> None:
    packages = make_tree(
        tmp_path,
        {
            "rollout/__init__.py": "",
            "rollout/engine.py": "from .runner import Runner\n" + "x = 1\n" * 400,
            "rollout/runner.py": "from patrl.rollout.adaptive.driver import Driver\n",
            "rollout/adaptive/__init__.py": "",
            "rollout/adaptive/driver.py": "class Driver: ...\n",
        },
    )
    problems = engine_problems(build_graph(packages))
    assert len(problems) == 3, problems
    assert "401 lines > 400" in problems[0]
    assert (
        "via patrl.rollout.engine -> patrl.rollout.runner -> patrl.rollout.adaptive" in problems[1]
    )
    assert "patrl.rollout.adaptive.driver" in problems[2]


def test_relative_and_literal_dynamic_imports_resolve(tmp_path: Path) -> None:
    packages = make_tree(
        tmp_path,
        {
            "rollout/__init__.py": "from . import engine\n",
            "rollout/layers/__init__.py": "from ..sampler import sample\nfrom . import _impl\n",
            "rollout/layers/_impl.py": "",
            "rollout/sampler.py": "def sample(): ...\n",
            "rollout/engine.py": "import importlib\n"
            "def load():\n    return importlib.import_module('patrl.rollout.layers._impl')\n",
        },
    )
    graph = build_graph(packages)
    edges = {(e.source, e.target) for e in graph.edges if not e.implicit}
    assert ("patrl.rollout.layers", "patrl.rollout.sampler") in edges
    assert ("patrl.rollout.layers", "patrl.rollout.layers._impl") in edges
    assert ("patrl.rollout.engine", "patrl.rollout.layers._impl") in edges
    assert ("patrl.rollout.engine", "patrl.rollout.layers") in {
        (e.source, e.target) for e in graph.edges if e.implicit
    }
    assert private_imports(graph) == []  # a private submodule is a module, not a name
    assert find_cycles(graph) == []
