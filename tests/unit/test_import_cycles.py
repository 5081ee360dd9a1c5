"""The testbed's packages import one another in one direction only: no cycle between them.

A package is a first-level child of ``vllm_zerocopy_testbed`` (``plugins``, ``patches``, ``node``,
``workload``, ...; a top-level module such as ``config`` counts as one). Every import counts,
function-local ones too: an import moved into a function to dodge a cycle is still the cycle.
grimp (the graph behind import-linter) reads the sources without importing them.
"""

from __future__ import annotations

import graphlib

import grimp
import pytest

pytestmark = pytest.mark.unit

PACKAGE = "vllm_zerocopy_testbed"


def _child(module: str) -> str:
    """The first-level child of ``PACKAGE`` that ``module`` belongs to (``PACKAGE`` itself for its ``__init__``)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else PACKAGE


def package_imports() -> dict[tuple[str, str], list[str]]:
    """Every import from one child package into another: (importer, imported) -> the import lines."""
    graph = grimp.build_graph(PACKAGE, cache_dir=None)
    edges: dict[tuple[str, str], list[str]] = {}
    for module in sorted(graph.modules):
        for imported in sorted(graph.find_modules_directly_imported_by(module)):
            edge = (_child(module), _child(imported))
            # The root package's __init__ is loaded before any child: it is no edge of the graph.
            if edge[0] == edge[1] or PACKAGE in edge:
                continue
            lines = edges.setdefault(edge, [])
            for detail in graph.get_import_details(importer=module, imported=imported):
                line = f"{module}:{detail['line_number']}: {detail['line_contents'].strip()}"
                if line not in lines:  # one statement importing several modules is one line
                    lines.append(line)
    return edges


def cycles(edges: dict[tuple[str, str], list[str]]) -> list[list[str]]:
    """The import cycles among the packages, each as [a, b, ..., a] (a imports b ...); one edge of each is
    set aside before the next is looked for, so every cycle the graph holds shows at least once."""
    remaining = set(edges)
    found = []
    while True:
        sorter = graphlib.TopologicalSorter()
        for importer, imported in remaining:
            sorter.add(importer, imported)  # what a package imports comes before it
        try:
            sorter.prepare()
            return found
        except graphlib.CycleError as exc:
            cycle = list(exc.args[1])
            if (cycle[0], cycle[1]) not in remaining:
                cycle.reverse()
            found.append(cycle)
            remaining.discard((cycle[0], cycle[1]))


def test_the_packages_import_each_other_without_a_cycle() -> None:
    edges = package_imports()
    assert ("plugins", "patches") in edges, "the graph misses an import every plugin load makes"
    found = cycles(edges)
    lines = []
    for cycle in found:
        lines.append(" -> ".join(cycle))
        for importer, imported in zip(cycle, cycle[1:]):
            lines += [f"    {importer} -> {imported}: {where}" for where in edges.get((importer, imported), [])]
    assert not found, "import cycles between packages (move the shared code where both can import it):\n" + "\n".join(
        lines)


# What vLLM's own processes load (the plugins vLLM discovers, what they patch and register, their logging):
# none of it may reach the host's tooling, whose imports (compose arithmetic, e2e policy) a worker never needs.
VLLM_SIDE = ("plugins", "patches", "kernels", "observe", "config")


def test_what_vllm_processes_load_never_imports_the_hosts_tooling() -> None:
    graph = grimp.build_graph(PACKAGE, cache_dir=None)
    chains = {}
    for part in VLLM_SIDE:
        chain = graph.find_shortest_chain(importer=f"{PACKAGE}.{part}", imported=f"{PACKAGE}.host_config",
                                          as_packages=part != "config")
        if chain:
            chains[part] = " -> ".join(chain)
    assert not chains, "vLLM-side code imports the host's tooling:\n" + "\n".join(
        f"  {part}: {chain}" for part, chain in chains.items())
