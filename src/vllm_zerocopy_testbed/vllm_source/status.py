"""Which vLLM a process imports, and the lines reports and the mode line say it with."""

from __future__ import annotations

import functools
import json
from pathlib import Path

from vllm_zerocopy_testbed.vllm_source.base import installed, installed_version
from vllm_zerocopy_testbed.vllm_source.files import MANIFEST, lacking, package_files, version_of


def manifest_of(package: Path) -> dict | None:
    """The overlay manifest that came with the ``vllm`` package at ``package``, if it is an overlay."""
    for candidate in (package.parent / MANIFEST, package / MANIFEST):  # host overlay; node image
        if candidate.is_file():
            return json.loads(candidate.read_text())
    return None


def running() -> dict:
    """Which vLLM this process imports: version, where from, hash (a copy: callers may keep it)."""
    return dict(_running())


@functools.cache  # the code a process imports does not change under it; the test hooks ask per test
def _running() -> dict:
    """Which vLLM this process imports: version, where from, hash (for reports and the mode line)."""
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.origin:
        return {"version": "none", "origin": "not installed"}
    package = Path(spec.origin).parent
    found = manifest_of(package)
    if found:
        return {"version": found["version"], "origin": f"{found['kind']} {found['origin']}", "hash": found["hash"],
                "base": found["base"], "compiled_note": found["compiled_note"], "lacks": found.get("lacks", []),
                "unmet": found.get("unmet", []), "installed": found.get("installed", [])}
    files = package_files(package)
    base = " ".join(installed())
    return {"version": version_of(files) or installed_version(), "origin": f"installed {base}", "hash": "",
            "base": base, "compiled_note": "", "lacks": lacking(files)}


def running_line() -> str:
    """``0.33.0@<hash>`` for an overlay, ``0.32.0`` for the installed vLLM."""
    info = running()
    return f"{info['version']}@{info['hash']}" if info.get("hash") else info["version"]


def installed_note(installed: list[str]) -> str:
    """``""``, or which of the code's requirements were installed beside it (``deps/site``)."""
    return f"; installed for it: {', '.join(installed)}" if installed else ""


def requirements_note(unmet: list[str]) -> str:
    """``""``, or what of the code's requirements this environment lacks (a server may then not start)."""
    if not unmet:
        return ""
    shown = ", ".join(unmet[:8]) + (f" and {len(unmet) - 8} more" if len(unmet) > 8 else "")
    return (f"; {len(unmet)} of its requirements not met here (an overlay adds what is missing, never replaces "
            f"what is installed): {shown}")


def vllm_line(info: dict) -> str:
    """A report's line for ``running()``'s answer: version, where from, hash, what is not carried."""
    text = f"{info['version']} ({info['origin']}"
    if info.get("hash"):
        text += f", overlay {info['hash']}, compiled parts {info['base']}"
    text += ")"
    if info.get("compiled_note"):
        text += f"; {info['compiled_note']}"
    if info.get("lacks"):
        text += f"; has no {', '.join(info['lacks'])}"
    return text + installed_note(info.get("installed", [])) + requirements_note(info.get("unmet", []))
