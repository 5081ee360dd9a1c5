"""A scratch overlay that serves changed sources for named modules, in every process of a run.

The installed vLLM (venv or image) and this checkout stay untouched: the overlay is a
folder put first on ``PYTHONPATH``. Its ``sitecustomize.py`` (which ``site`` imports at
start-up, in the test process and in every process it spawns: harness readers, Ray
nodes, actors and drivers) puts a finder first on ``sys.meta_path`` that loads the
named modules from the overlay's copies, and logs each load, so a run can prove the
changed code ran instead of trusting that it did.
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path

MANIFEST = "overlay.json"
LOADS = "loads.log"

# Runs at interpreter start-up; stdlib only, and silent unless a named module is imported.
_SITECUSTOMIZE = '''\
"""Written by vllm_zerocopy_testbed.mutants.overlay: serve this folder's sources for the named modules."""
import importlib.abc
import importlib.util
import json
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
with open(os.path.join(_HERE, "{manifest}")) as _f:
    _SOURCES = json.load(_f)


class _OverlayFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        source = _SOURCES.get(name)
        if source is None:
            return None
        with open(os.path.join(_HERE, "{loads}"), "a") as log:
            log.write(f"{{os.getpid()}} {{name}}\\n")
        return importlib.util.spec_from_file_location(name, os.path.join(_HERE, source))


sys.meta_path.insert(0, _OverlayFinder())
'''


class OverlayError(RuntimeError):
    """A change cannot be applied: the source moved on, or the module is not installed."""


def module_source(module: str) -> Path:
    """Return the file ``module`` is imported from, without importing it (nor running its package)."""
    parent, _, _ = module.rpartition(".")
    try:
        spec = importlib.util.find_spec(module)
    except ModuleNotFoundError as exc:
        raise OverlayError(f"{module}: not importable here ({exc}); is the package installed?") from None
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        raise OverlayError(f"{module}: no Python source to change (parent {parent or '-'})")
    return Path(spec.origin)


@dataclass(frozen=True)
class Replacement:
    """One textual change of a module's source: ``old`` must occur exactly once."""

    module: str
    old: str
    new: str

    def apply(self, source: str) -> str:
        count = source.count(self.old)
        if count != 1:
            raise OverlayError(
                f"{self.module}: the text to change occurs {count} times, not once: {self.old.strip()[:80]!r} "
                "(the installed source moved on: update the mutant)"
            )
        return source.replace(self.old, self.new)


def build(folder: Path, changes: list[Replacement]) -> Path:
    """Write an overlay for ``changes`` into ``folder``; return it (put it first on PYTHONPATH).

    Raises ``OverlayError`` if a change does not apply or the changed source does not compile.
    """
    by_module: dict[str, list[Replacement]] = {}
    for change in changes:
        by_module.setdefault(change.module, []).append(change)
    texts: dict[str, str] = {}
    for module, edits in by_module.items():
        text = module_source(module).read_text()
        for edit in edits:
            text = edit.apply(text)
        texts[module] = text
    return build_sources(folder, texts)


def build_sources(folder: Path, texts: dict[str, str]) -> Path:
    """Write an overlay that serves ``texts`` (module name -> its whole changed source) into ``folder``.

    Raises ``OverlayError`` if a changed source does not compile.
    """
    folder.mkdir(parents=True, exist_ok=True)
    sources: dict[str, str] = {}
    for module, text in texts.items():
        name = module.replace(".", "__") + ".py"
        try:
            compile(text, str(folder / name), "exec")
        except SyntaxError as exc:
            raise OverlayError(f"{module}: the changed source does not compile: {exc}") from None
        (folder / name).write_text(text)
        sources[module] = name
    (folder / MANIFEST).write_text(json.dumps(sources, indent=1))
    (folder / "sitecustomize.py").write_text(_SITECUSTOMIZE.format(manifest=MANIFEST, loads=LOADS))
    (folder / LOADS).write_text("")
    return folder


def loads(folder: Path) -> dict[str, int]:
    """Return how many processes imported each changed module from the overlay."""
    counts: dict[str, int] = {}
    for line in (folder / LOADS).read_text().splitlines():
        _, _, module = line.partition(" ")
        counts[module] = counts.get(module, 0) + 1
    return counts
