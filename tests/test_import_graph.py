"""The project's run-time import graph, read from the sources with ``ast``, keeps its shape.

Every ``import`` and ``from ... import`` in kvgate/gateway/, kvgate/engine/, kvgate/protocol/ and kvgate/schemas/ counts,
at any nesting level (a function-level import runs too), except inside ``if TYPE_CHECKING:``.
``from pkg import name`` is an edge to ``pkg`` and, where ``pkg/name.py`` or ``pkg/name/``
exists, to ``pkg.name`` as well (in ``pkg/__init__.py`` itself, ``from pkg import sub`` is an
edge to ``pkg.sub`` alone); ``import a.b.c`` is an edge to ``a.b.c`` alone: the implicit
edge every submodule has to its parent package's ``__init__`` is left out (it would make each
package that re-exports its submodules a cycle). The rules:

a. no cycle: no strongly connected component of two modules or more, no self-import;
b. a front door imports neither the other nor the fleet backend: ``kvgate.gateway.mcp`` imports no
   ``kvgate.gateway.openai`` or ``kvgate.gateway.upstream``, ``kvgate.gateway.openai`` no ``kvgate.gateway.mcp`` or
   ``kvgate.gateway.upstream``;
c. ``kvgate.gateway.auth`` imports neither front door (``kvgate.gateway.mcp``, ``kvgate.gateway.openai``);
d. ``protocol`` and ``schemas`` import no torch, no triton and no ``engine`` module, directly
   or through any chain of project modules;
e. a package whose ``__init__`` re-exports lazily (a module ``__getattr__``: ``engine``,
   ``kvgate.engine.attention``, ``kvgate.engine.models``) is never imported from inside itself: its modules
   import the module that defines a name. The lazy table is invisible to rule a, so an
   ``from engine import X`` inside the engine could close a cycle this test cannot see;
f. the fleet's parts know the fleet only through ``kvgate.gateway.upstream.choice.Route``: none of
   ``kvgate.gateway.upstream.call``, ``.proxies``, ``.choice`` or ``.membership`` imports
   ``kvgate.gateway.upstream.fleet``, not even under ``if TYPE_CHECKING:`` (a type-only import is
   still a dependency on the whole backend), and no cycle runs through ``kvgate.gateway.upstream``
   with type-only imports counted too.

A package ``P`` "imports ``Q``" here when any module ``P`` or ``P.*`` has an edge to ``Q`` or
``Q.*``. The ``test_checker_*`` tests run the checker on small synthetic sources.
"""

from __future__ import annotations

import ast
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("kvgate/gateway", "kvgate/engine", "kvgate/protocol", "kvgate/schemas")


@dataclass(frozen=True)
class Source:
    module: str  # dotted name; a package's __init__ is the package's name
    path: str  # as messages print it
    text: str
    is_package: bool = False


@dataclass(frozen=True)
class Edge:
    source: str
    target: str
    path: str
    line: int

    def __str__(self) -> str:
        return f"{self.source} -> {self.target} ({self.path}:{self.line})"


@dataclass
class Graph:
    edges: dict[str, list[Edge]] = field(default_factory=dict)  # every project module's
    lazy_packages: set[str] = field(default_factory=set)

    @property
    def modules(self) -> set[str]:
        return set(self.edges)

    def all_edges(self) -> Iterator[Edge]:
        for module in sorted(self.edges):
            yield from self.edges[module]


def project_sources(root: Path = ROOT, packages: Iterable[str] = PACKAGES) -> list[Source]:
    sources = []
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            is_package = parts[-1] == "__init__"
            module = ".".join(parts[:-1] if is_package else parts)
            relative = path.relative_to(root).as_posix()
            sources.append(Source(module, relative, path.read_text(), is_package))
    return sources


def _is_type_checking(test: ast.expr) -> bool:
    """``TYPE_CHECKING`` or ``typing.TYPE_CHECKING`` (any ``x.TYPE_CHECKING``)."""
    if isinstance(test, ast.Name):
        return test.id == "TYPE_CHECKING"
    return isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"


def _is_not_type_checking(test: ast.expr) -> bool:
    return (
        isinstance(test, ast.UnaryOp)
        and isinstance(test.op, ast.Not)
        and _is_type_checking(test.operand)
    )


def _runtime_nodes(nodes: Iterable[ast.AST]) -> Iterator[ast.AST]:
    """Every node that runs at run time: all of them but the bodies under TYPE_CHECKING."""
    for node in nodes:
        yield node
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            children: Iterable[ast.AST] = [node.test, *node.orelse]
        elif isinstance(node, ast.If) and _is_not_type_checking(node.test):
            children = [node.test, *node.body]
        else:
            children = ast.iter_child_nodes(node)
        yield from _runtime_nodes(children)


def _base(source: Source, node: ast.ImportFrom) -> str | None:
    """The module a ``from ... import`` reads from, relative imports resolved."""
    if node.level == 0:
        return node.module
    package = source.module.split(".") if source.is_package else source.module.split(".")[:-1]
    if node.level - 1 > len(package) - 1:
        return None  # beyond the top-level package: Python refuses it too
    parts = package[: len(package) - (node.level - 1)]
    if node.module:
        parts.append(node.module)
    return ".".join(parts)


def _defines_getattr(tree: ast.Module) -> bool:
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == "__getattr__":
            return True
        if isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                names = target.elts if isinstance(target, ast.Tuple) else [target]
                if any(isinstance(n, ast.Name) and n.id == "__getattr__" for n in names):
                    return True
    return False


def build_graph(sources: Iterable[Source], type_only_too: bool = False) -> Graph:
    """The import graph of ``sources``: run-time imports, or with ``type_only_too`` those
    under ``if TYPE_CHECKING:`` as well."""
    sources = list(sources)
    known = {source.module for source in sources}
    graph = Graph()
    for source in sources:
        tree = ast.parse(source.text, filename=source.path)
        if source.is_package and _defines_getattr(tree):
            graph.lazy_packages.add(source.module)
        edges = graph.edges.setdefault(source.module, [])
        for node in ast.walk(tree) if type_only_too else _runtime_nodes(tree.body):
            if isinstance(node, ast.Import):
                edges.extend(
                    Edge(source.module, alias.name, source.path, node.lineno)
                    for alias in node.names
                )
            elif isinstance(node, ast.ImportFrom):
                base = _base(source, node)
                if base is None or base == "__future__":
                    continue
                submodules = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in known]
                # A package's own `from . import sub` only loads `sub`: the package is the one
                # running; reading a *name* from its half-run self is a self-import.
                if base != source.module or len(submodules) < len(node.names):
                    edges.append(Edge(source.module, base, source.path, node.lineno))
                edges.extend(Edge(source.module, m, source.path, node.lineno) for m in submodules)
    return graph


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _strongly_connected(graph: Graph) -> list[list[str]]:
    """Tarjan's algorithm over the project modules (iterative: no recursion limit)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def successors(module: str) -> list[str]:
        return sorted({e.target for e in graph.edges[module] if e.target in graph.edges})

    for start in sorted(graph.edges):
        if start in index:
            continue
        work = [(start, iter(successors(start)))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            module, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[module])
                if low[module] == index[module]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == module:
                            break
                    components.append(sorted(component))
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(successors(child))))
            elif child in on_stack:
                low[module] = min(low[module], index[child])
    return components


def _shortest_path(
    graph: Graph, start: str, is_goal: Callable[[str], bool], allowed: set[str]
) -> list[Edge] | None:
    """The fewest edges from `start` to a goal through the modules in `allowed`."""
    came: dict[str, Edge | None] = {start: None}
    frontier = [start]
    while frontier:
        following = []
        for module in frontier:
            for edge in graph.edges.get(module, ()):
                if is_goal(edge.target):
                    path = [edge]
                    while (back := came[path[-1].source]) is not None:
                        path.append(back)
                    return path[::-1]
                if edge.target in allowed and edge.target not in came:
                    came[edge.target] = edge
                    following.append(edge.target)
        frontier = following
    return None


def _chain(edges: list[Edge]) -> str:
    return "\n    ".join(str(edge) for edge in edges)


def cycles(graph: Graph) -> list[str]:
    """Rule a: each self-import, and for each larger component one shortest cycle through it
    and every import within it (any one of them removed may not be enough)."""
    found = [
        f"{edge.source} imports itself ({edge.path}:{edge.line})"
        for edge in graph.all_edges()
        if edge.target == edge.source
    ]
    for component in _strongly_connected(graph):
        if len(component) > 1:
            members = set(component)
            cycle = _shortest_path(graph, component[0], component[0].__eq__, members)
            assert cycle is not None
            inside = [e for e in graph.all_edges() if e.source in members and e.target in members]
            found.append(
                f"import cycle through {', '.join(component)}:\n    {_chain(cycle)}\n"
                f"  every import within it:\n    {_chain(inside)}"
            )
    return found


def forbidden_imports(graph: Graph, importer: str, imported: Iterable[str]) -> list[str]:
    """Rules b and c: the direct edges from `importer` (or below) to any of `imported`."""
    imported = tuple(imported)
    return [
        f"{importer} must not import {target}: {edge}"
        for edge in graph.all_edges()
        if _within(edge.source, importer)
        for target in imported
        if _within(edge.target, target)
    ]


def reaches(graph: Graph, importer: str, forbidden: Iterable[str]) -> list[str]:
    """Rule d: for each module of `importer` (or below) and each of `forbidden` it reaches
    (or a module below it), directly or through project modules: the shortest chain."""
    found = []
    for start in sorted(m for m in graph.edges if _within(m, importer)):
        for package in forbidden:

            def is_goal(module: str, package: str = package) -> bool:
                return _within(module, package)

            allowed = {m for m in graph.modules if not is_goal(m)}
            chain = _shortest_path(graph, start, is_goal, allowed)
            if chain is not None:
                found.append(f"{start} reaches {chain[-1].target}:\n    {_chain(chain)}")
    return found


def imports_of_lazy_packages(graph: Graph) -> list[str]:
    """Rule e: edges from inside a lazily re-exporting package to the package itself."""
    return [
        f"{edge.source} imports the lazy package {edge.target}: import the defining module "
        f"instead ({edge.path}:{edge.line})"
        for edge in graph.all_edges()
        if edge.target in graph.lazy_packages and _within(edge.source, edge.target)
    ]


def _report(violations: list[str]) -> str:
    return f"{len(violations)} violation(s):\n" + "\n".join(violations)


_PROJECT: Graph | None = None


def project_graph() -> Graph:
    global _PROJECT
    if _PROJECT is None:
        _PROJECT = build_graph(project_sources())
    return _PROJECT


# --- the project ------------------------------------------------------------------------------


def test_the_project_sources_are_found() -> None:
    graph = project_graph()
    for module in (
        "kvgate.engine",
        "kvgate.engine.llm",
        "kvgate.engine.attention.backend",
        "kvgate.protocol",
        "kvgate.schemas",
    ):
        assert module in graph.modules
    assert {
        "kvgate.engine",
        "kvgate.engine.attention",
        "kvgate.engine.models",
    } <= graph.lazy_packages


def test_a_no_import_cycles_even_for_types() -> None:
    violations = cycles(build_graph(project_sources(), type_only_too=True))
    assert not violations, _report(violations)


def test_b_front_doors_import_neither_each_other_nor_the_fleet_backend() -> None:
    graph = project_graph()
    violations = forbidden_imports(
        graph, "kvgate.gateway.mcp", ["kvgate.gateway.openai", "kvgate.gateway.upstream"]
    )
    violations += forbidden_imports(
        graph, "kvgate.gateway.openai", ["kvgate.gateway.mcp", "kvgate.gateway.upstream"]
    )
    assert not violations, _report(violations)


def test_c_auth_imports_no_front_door() -> None:
    violations = forbidden_imports(
        project_graph(), "kvgate.gateway.auth", ["kvgate.gateway.mcp", "kvgate.gateway.openai"]
    )
    assert not violations, _report(violations)


def test_d_protocol_and_schemas_import_no_torch_triton_or_engine() -> None:
    graph = project_graph()
    violations = [
        found
        for package in ("kvgate.protocol", "kvgate.schemas")
        for found in reaches(graph, package, ["torch", "triton", "kvgate.engine"])
    ]
    assert not violations, _report(violations)


def test_e_a_lazy_package_is_not_imported_from_inside() -> None:
    violations = imports_of_lazy_packages(project_graph())
    assert not violations, _report(violations)


def test_f_the_fleets_parts_import_no_fleet_and_close_no_cycle_even_for_types() -> None:
    graph = build_graph(project_sources(), type_only_too=True)
    violations = [
        found
        for part in ("call", "proxies", "choice", "membership")
        for found in forbidden_imports(
            graph, f"kvgate.gateway.upstream.{part}", ["kvgate.gateway.upstream.fleet"]
        )
    ]
    violations += [
        found
        for found in cycles(graph)
        if found.startswith("import cycle through kvgate.gateway.upstream.")
    ]
    assert not violations, _report(violations)


PUBLIC = ["kvgate.engine.llm", "kvgate.engine.async_llm", "kvgate.engine.output_processor"]
ENGINE_LAYERS = {  # each layer of the engine and what it must never import, types included
    "kvgate.engine.attention": [
        "kvgate.engine.core",
        "kvgate.engine.process",
        "kvgate.engine.loading",
        "kvgate.engine.models",
    ],
    "kvgate.engine.sampling": [
        "kvgate.engine.core",
        "kvgate.engine.process",
        "kvgate.engine.loading",
        "kvgate.engine.models",
    ],
    "kvgate.engine.tokenization": [
        "kvgate.engine.core",
        "kvgate.engine.process",
        "kvgate.engine.loading",
        "kvgate.engine.models",
    ],
    "kvgate.engine.spec_decode": [
        "kvgate.engine.core",
        "kvgate.engine.process",
        "kvgate.engine.loading",
        "kvgate.engine.models",
        *PUBLIC,
    ],
    "kvgate.engine.models": [
        "kvgate.engine.core",
        "kvgate.engine.process",
        "kvgate.engine.loading",
        *PUBLIC,
    ],
    "kvgate.engine.loading": ["kvgate.engine.core", "kvgate.engine.process", *PUBLIC],
    "kvgate.engine.core": ["kvgate.engine.process", *PUBLIC],
    "kvgate.engine.process": [
        "kvgate.engine.llm",
        "kvgate.engine.async_llm",
    ],  # its client builds the outputs
    "kvgate.engine": [
        "kvgate.gateway",
        "kvgate.protocol",
        "kvgate.schemas",
    ],  # the engine knows nothing of HTTP or MCP
}


def test_g_the_engines_layers_import_downward_only_even_for_types() -> None:
    graph = build_graph(project_sources(), type_only_too=True)
    violations = [
        found
        for layer, below in ENGINE_LAYERS.items()
        for found in forbidden_imports(graph, layer, below)
    ]
    violations += [
        found for found in cycles(graph) if found.startswith("import cycle through kvgate.engine")
    ]
    assert not violations, _report(violations)


# --- the checker, on synthetic sources --------------------------------------------------------


def graph_of(modules: Mapping[str, str], packages: Iterable[str] = ()) -> Graph:
    """A graph of in-memory modules; `packages` names those that are package __init__s."""
    packages = set(packages)
    return build_graph(
        Source(name, f"{name.replace('.', '/')}.py", text, name in packages)
        for name, text in modules.items()
    )


def targets(graph: Graph, module: str) -> set[str]:
    return {edge.target for edge in graph.edges[module]}


def test_checker_finds_a_cycle_with_each_import_and_its_line() -> None:
    graph = graph_of(
        {
            "p.a": "import os\nimport p.b\n",
            "p.b": "from p.c import thing\n",
            "p.c": "def f():\n    from p import a\n",
            "p.d": "import p.a\n",
        },
        packages=["p"],
    )
    (found,) = cycles(graph)
    assert "p.a, p.b, p.c" in found
    assert "p.a -> p.b (p/a.py:2)" in found
    assert "p.b -> p.c (p/b.py:1)" in found
    assert "p.c -> p.a (p/c.py:2)" in found  # a function-level import counts
    assert "p.d" not in found


def test_checker_finds_a_self_import() -> None:
    (found,) = cycles(graph_of({"p": "from p import x\n"}, packages=["p"]))
    assert found == "p imports itself (p.py:1)"


def test_checker_passes_an_acyclic_graph() -> None:
    graph = graph_of({"p.a": "import p.b\nimport p.c\n", "p.b": "import p.c\n", "p.c": ""})
    assert cycles(graph) == []


def test_checker_ignores_type_checking_imports_only() -> None:
    source = (
        "import typing\n"
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    import p.b\n"
        "else:\n"
        "    import p.c\n"
        "if typing.TYPE_CHECKING:\n"
        "    from p.d import x\n"
        "if not TYPE_CHECKING:\n"
        "    import p.e\n"
        "else:\n"
        "    import p.f\n"
        "def g():\n"
        "    if TYPE_CHECKING:\n"
        "        import p.g\n"
        "    import p.h\n"
    )
    graph = graph_of({"p.a": source})
    assert targets(graph, "p.a") == {"typing", "p.c", "p.e", "p.h"}
    # so a cycle closed only under TYPE_CHECKING is none; one closed at run time is one
    ok = graph_of({"p.a": "if TYPE_CHECKING:\n    import p.b\n", "p.b": "import p.a\n"})
    assert cycles(ok) == []
    every = build_graph([Source("p.a", "p/a.py", source)], type_only_too=True)
    assert targets(every, "p.a") == {"typing", *(f"p.{m}" for m in "bcdefgh")}
    bad = graph_of({"p.a": "if TYPE_CHECKING:\n    pass\nimport p.b\n", "p.b": "import p.a\n"})
    assert len(cycles(bad)) == 1


def test_checker_resolves_from_imports_and_relative_imports() -> None:
    graph = graph_of(
        {
            "p": "from . import sub\nfrom .sub.leaf import name\n",
            "p.sub": "",
            "p.sub.leaf": "from .. import other, missing\nfrom . import sibling\nfrom ..q import *\n",
            "p.sub.sibling": "",
            "p.other": "from p.sub import leaf, value\nimport p.sub.leaf as leaf2\nfrom torch import nn\n",
            "p.q": "",
        },
        packages=["p", "p.sub"],
    )
    assert targets(graph, "p") == {"p.sub", "p.sub.leaf"}  # `from . import sub`: no self-edge
    assert targets(graph, "p.sub.leaf") == {"p", "p.other", "p.sub", "p.sub.sibling", "p.q"}
    # no implicit edge to a parent package: `import p.sub.leaf` is an edge to p.sub.leaf alone
    assert targets(graph, "p.other") == {"p.sub", "p.sub.leaf", "torch"}


def test_checker_finds_forbidden_direct_imports() -> None:
    graph = graph_of(
        {
            "g.mcp.endpoint": "from g.openai.errors import E\n",
            "g.mcp.tools": "import g.shared\n",
            "g.openai.errors": "",
            "g.openaix": "",
            "g.mcp.other": "import g.openaix\n",  # a sibling sharing a prefix is not under it
            "g.shared": "import g.openai.errors\n",  # indirect: rule b is about direct imports
        }
    )
    assert forbidden_imports(graph, "g.mcp", ["g.openai"]) == [
        "g.mcp must not import g.openai: g.mcp.endpoint -> g.openai.errors (g/mcp/endpoint.py:1)"
    ]
    assert forbidden_imports(graph, "g.openai", ["g.mcp"]) == []


def test_checker_finds_forbidden_modules_reached_through_project_modules() -> None:
    graph = graph_of(
        {
            "kvgate.protocol.rules": "import json\nimport kvgate.protocol.helpers\n",
            "kvgate.protocol.helpers": "def f():\n    import shared.util\n",
            "shared.util": "import torch.nn.functional as F\n",
            "kvgate.protocol.clean": "import json\n",
            "kvgate.schemas.tools": "from kvgate.engine import SamplingParams\n",
            "kvgate.engine": "",
        },
        packages=["kvgate.engine"],
    )
    found = reaches(graph, "kvgate.protocol", ["torch", "kvgate.engine"])
    assert len(found) == 2  # kvgate.protocol.rules and kvgate.protocol.helpers both reach torch
    assert found[0].startswith("kvgate.protocol.helpers reaches torch.nn.functional:")
    assert (
        "kvgate.protocol.rules -> kvgate.protocol.helpers (kvgate/protocol/rules.py:2)" in found[1]
    )
    assert "kvgate.protocol.helpers -> shared.util (kvgate/protocol/helpers.py:2)" in found[1]
    assert "shared.util -> torch.nn.functional (shared/util.py:1)" in found[1]
    assert reaches(graph, "kvgate.schemas", ["torch", "kvgate.engine"]) == [
        "kvgate.schemas.tools reaches kvgate.engine:\n    kvgate.schemas.tools -> kvgate.engine (kvgate/schemas/tools.py:1)"
    ]


def test_checker_finds_a_lazy_package_imported_from_inside() -> None:
    lazy = "import typing\nif typing.TYPE_CHECKING:\n    from e.a import A\n"
    graph = graph_of(
        {
            "e": lazy + "__getattr__, __dir__ = make()\n",
            "e.a": "from e import B\n",
            "e.b": "import e.a\n",
            "f": "def __getattr__(name):\n    pass\n",
            "f.x": "",
            "outside": "from e import A\n",  # from outside, the lazy surface is the point
        },
        packages=["e", "f"],
    )
    assert graph.lazy_packages == {"e", "f"}
    assert cycles(graph) == []  # the lazy table hides e -> e.a ...
    assert imports_of_lazy_packages(graph) == [  # ... so this is what catches e.a -> e
        "e.a imports the lazy package e: import the defining module instead (e/a.py:1)"
    ]
