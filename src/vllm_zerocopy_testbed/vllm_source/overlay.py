"""The overlay: another vLLM's Python files over the installed one's compiled parts, built once per content."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

from packaging.version import Version

from vllm_zerocopy_testbed.config import TestbedConfig
from vllm_zerocopy_testbed.vllm_source.base import installed, installed_package
from vllm_zerocopy_testbed.vllm_source.checkout import checkout_files, checkout_version, compiled_changes
from vllm_zerocopy_testbed.vllm_source.files import CACHE, COMPILED, MANIFEST, lacking, version_of
from vllm_zerocopy_testbed.vllm_source.requirements import (DEPS, checkout_requires, install_requirements,
                                                            missing_requirements, unmet_requirements,
                                                            wheel_requires)
from vllm_zerocopy_testbed.vllm_source.spec import VLLM_ENV, Spec, VllmSourceError, parse_spec
from vllm_zerocopy_testbed.vllm_source.status import installed_note, requirements_note
from vllm_zerocopy_testbed.vllm_source.wheels import check_platform, release_wheel, wheel_compiled, wheel_files

KEEP_OVERLAYS = 16  # ~50 MB each (the compiled parts are links): a bisect makes one per step


@dataclass
class Overlay:
    """An overlay ready to use: put ``path`` first on ``PYTHONPATH`` (``env()`` does)."""

    spec: str
    kind: str
    origin: str  # where the files came from: the wheel or the checkout
    version: str  # the source's own version
    base: str  # the compiled parts' distribution and version
    hash: str  # of every overlaid file (path and bytes): names the code that ran
    files: int
    compiled_note: str  # what the overlay cannot carry ("" when nothing)
    path: str = ""
    lacks: list[str] = field(default_factory=list)  # paths under test the source does not have
    unmet: list[str] = field(default_factory=list)  # its requirements this environment does not satisfy
    installed: list[str] = field(default_factory=list)  # its requirements installed for it (deps/site)
    e2e_blocker: str = ""  # why this code cannot serve here at all ("" when it can)

    def env(self, env: dict[str, str] | None = None) -> dict[str, str]:
        """``env`` (default: this process's) with the overlay first on ``PYTHONPATH``, then what was
        installed for it."""
        env = dict(os.environ if env is None else env)
        site = Path(self.path) / DEPS / "site" if self.path else None
        extra = str(site) if site is not None and site.is_dir() else ""
        env["PYTHONPATH"] = os.pathsep.join(p for p in (self.path, extra, env.get("PYTHONPATH", "")) if p)
        return env

    def describe(self) -> str:
        """One line: which vLLM this is, from where, and its hash."""
        note = f"; {self.compiled_note}" if self.compiled_note else ""
        return (f"vLLM {self.version} ({self.kind} {self.origin}, overlay {self.hash}, compiled parts {self.base}{note})"
                + installed_note(self.installed) + requirements_note(self.unmet)
                + (f"; {self.e2e_blocker}" if self.e2e_blocker else ""))


def _digest(files: dict[str, bytes], base: str) -> str:
    """The overlay's hash: of ``base`` and every file's path and bytes."""
    h = hashlib.sha256(base.encode())
    for rel in sorted(files):
        h.update(rel.encode() + b"\0" + hashlib.sha256(files[rel]).digest())
    return h.hexdigest()[:16]


def prepare(spec: Spec | str, cache: Path = CACHE) -> Overlay:
    """Build (once per distinct content) the overlay for ``spec`` and return it."""
    spec = parse_spec(spec) if isinstance(spec, str) else spec
    base_dist, base_version = installed()
    base = f"{base_dist} {base_version}"
    blocker = ""
    if spec.kind == "checkout":
        root = Path(spec.value)
        files = checkout_files(root)
        version = checkout_version(root, files, base_version)
        changed = compiled_changes(root, base_version)
        if changed is None:
            note = (f"cannot tell whether its C++/CUDA differs from {base} (no git tag v{base_version} in the "
                    "checkout): an overlay carries Python only")
        elif changed:
            note = (f"C++/CUDA changed since v{base_version} ({', '.join(changed[:6])}"
                    f"{', ...' if len(changed) > 6 else ''}): NOT carried, those changes need a build")
            blocker = (f"no server: its C++/CUDA changed since v{base_version} ({len(changed)} files) and an "
                       f"overlay runs {base}'s compiled parts instead")
        else:
            note = ""
        origin = str(root)
        requires = checkout_requires(root)
    else:
        wheel = Path(spec.value) if spec.kind == "wheel" else release_wheel(spec.value, cache)
        check_platform(wheel, spec)
        files = wheel_files(wheel)
        version = version_of(files) or spec.value
        own = [Path(n).name for n in wheel_compiled(wheel)]
        note = ""
        if version != base_version:
            note = (f"its own C++ ({len(own)} compiled modules) is not carried: the kernels are {base}'s")
        origin = str(wheel)
        requires = wheel_requires(wheel)
    if not files.get("vllm/__init__.py"):
        raise VllmSourceError(f"{spec}: no vllm/__init__.py among its files")
    if not version_of(files):
        files["vllm/_version.py"] = (f"# written by vllm_zerocopy_testbed.vllm_source: the checkout has none\n"
                                     f"__version__ = version = {version!r}\n"
                                     f"version_tuple = {tuple(Version(version).release)!r}\n").encode()
    digest = _digest(files, f"{base}\0{spec.kind}\0{origin}")  # the manifest names where the code came from
    overlay = Overlay(spec=str(spec), kind=spec.kind, origin=origin, version=version, base=base, hash=digest,
                      files=len(files), compiled_note=note, lacks=lacking(files),
                      e2e_blocker=blocker or _e2e_blocker(files))
    target = cache / "overlays" / digest
    overlay.path = str(target)
    manifest = target / MANIFEST
    if not manifest.is_file():
        _write(target, files, overlay)
        _prune(target.parent, keep=KEEP_OVERLAYS)
    # Its own requirements that this environment lacks are installed beside it (never over it).
    overlay.installed, why = install_requirements(target, missing_requirements(requires))
    overlay.unmet = unmet_requirements(requires, overlay.installed, why)
    if manifest.is_file():
        wanted = json.dumps(asdict(overlay), indent=1)
        if manifest.read_text() != wanted:  # same files, newer facts about them (written by an older testbed)
            scratch = manifest.with_name(f".{MANIFEST}.{os.getpid()}")
            scratch.write_text(wanted)
            scratch.rename(manifest)
        manifest.touch()  # in use: the last to be pruned
    return overlay


# On x86 the CPU platform of 0.34.0 and later refuses to start without triton-cpu, which vLLM's
# requirements/cpu.txt takes from GitHub releases: it is on no package registry. The testbed's CPU
# platform plugin passes that gate with torch stand-ins for the kernels (``kernels``); without the
# plugin (TESTBED_CPU_PLATFORM=off) nothing can.
_TRITON_CPU = (b"vllm/platforms/cpu.py", b"requires Triton (triton-cpu)")


def _e2e_blocker(files: dict[str, bytes]) -> str:
    """Why this code cannot start a server here, read from its files ("" when nothing is known)."""
    import importlib.util
    import platform

    rel, needle = _TRITON_CPU
    if needle in files.get(rel.decode(), b"") and platform.machine() in ("x86_64", "AMD64"):
        triton = importlib.util.find_spec("triton")
        has_cpu = triton is not None and triton.submodule_search_locations and any(
            (Path(p) / "backends" / "cpu").is_dir() for p in triton.submodule_search_locations)
        if not has_cpu and not TestbedConfig.from_env().cpu_platform:
            return ("no server: its CPU platform requires triton-cpu on x86 (vllm/platforms/cpu.py), which "
                    "vLLM takes from GitHub releases, not from a package registry; the testbed's CPU platform "
                    "plugin supplies the kernels (TESTBED_CPU_PLATFORM=on, the default)")
    return ""


def _prune(folder: Path, keep: int) -> None:
    """Remove all but the ``keep`` most recently used overlays in ``folder``."""
    used = sorted((p for p in folder.iterdir() if (p / MANIFEST).is_file()),
                  key=lambda p: (p / MANIFEST).stat().st_mtime, reverse=True)
    for stale in used[keep:]:
        shutil.rmtree(stale, ignore_errors=True)


def _write(target: Path, files: dict[str, bytes], overlay: Overlay) -> None:
    """Write ``files``, links to the installed compiled parts and the manifest, then rename them into ``target``."""
    target.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        for rel, data in files.items():
            dest = scratch / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_bytes(data)
        for compiled in installed_package().glob("*"):
            if compiled.is_file() and COMPILED.search(compiled.name):
                dest = scratch / "vllm" / compiled.name
                try:
                    os.link(compiled, dest)
                except OSError:  # another file system: a link keeps 400 MB from being copied
                    dest.symlink_to(compiled)
        (scratch / MANIFEST).write_text(json.dumps(asdict(overlay), indent=1))
        shutil.rmtree(target, ignore_errors=True)
        scratch.rename(target)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def from_env(env: dict[str, str] | None = None) -> Overlay | None:
    """The overlay ``TESTBED_VLLM`` names (built if needed), or None when it names none."""
    env = os.environ if env is None else env
    text = env.get(VLLM_ENV, "").strip()
    return prepare(text) if text else None


def for_server(env: dict[str, str] | None = None) -> Overlay | None:
    """``from_env``, refusing code that cannot serve here: called before any cluster or server starts."""
    overlay = from_env(env)
    if overlay is not None and overlay.e2e_blocker:
        raise VllmSourceError(f"VLLM={overlay.spec}: vLLM {overlay.version}: {overlay.e2e_blocker} "
                              "(its component suites run: make test-component VLLM=...)")
    return overlay
