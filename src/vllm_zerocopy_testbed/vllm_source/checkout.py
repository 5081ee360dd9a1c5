"""A source checkout: its files, its version (git), and whether its C++/CUDA changed since a release tag."""

from __future__ import annotations

import subprocess
from pathlib import Path

from vllm_zerocopy_testbed.vllm_source.files import COMPILED, SKIP, version_of

# What a checkout's C++/CUDA build is made from: a change here needs a build, not an overlay.
_BUILD_INPUTS = ("csrc", "cmake", "CMakeLists.txt", "setup.py", "requirements/build.txt")


def checkout_files(root: Path) -> dict[str, bytes]:
    """The checkout's ``vllm/`` files other than compiled ones and caches: relative path -> bytes."""
    files = {}
    for path in sorted((root / "vllm").rglob("*")):
        rel = path.relative_to(root).as_posix()
        if path.is_file() and not COMPILED.search(rel) and not SKIP.search(rel):
            files[rel] = path.read_bytes()
    return files


def git(root: Path, *args: str) -> str | None:
    """``git -C root args``'s output, or None where git is missing, fails or takes over a minute."""
    try:
        proc = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return proc.stdout.strip() if proc.returncode == 0 else None


def checkout_version(root: Path, files: dict[str, bytes], base: str) -> str:
    """The checkout's own ``_version.py`` if it has one, else ``<base>+g<commit>[.dirty]`` or ``<base>+checkout``."""
    own = version_of(files)
    if own:
        return own
    commit = git(root, "rev-parse", "--short=10", "HEAD")
    if commit is None:
        return f"{base}+checkout"
    dirty = ".dirty" if git(root, "status", "--porcelain", "--", "vllm") else ""
    return f"{base}+g{commit}{dirty}"


def compiled_changes(root: Path, base: str) -> list[str] | None:
    """A checkout's changed build inputs since the ``v<base>`` tag (committed or not); None: cannot tell."""
    present = [p for p in _BUILD_INPUTS if (root / p).exists()]
    if not present:
        return []  # a tree of Python files only (e.g. a release's sources): nothing compiled to carry
    if git(root, "rev-parse", "--verify", "--quiet", f"v{base}^{{commit}}") is None:
        return None
    committed = git(root, "diff", "--name-only", f"v{base}", "--", *present) or ""
    return sorted({line for line in committed.splitlines() if line})
