"""A vLLM's own requirements: which this environment does not meet, and pip to install the missing
ones beside an overlay."""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from packaging.utils import canonicalize_name

DEPS = "deps"  # <overlay>/deps/{wheels,site}: wheels of what it lacks here, and them installed
_DEPS_MANIFEST = "installed.json"
_PIP_TIMEOUT_S = 600


def wheel_requires(wheel: Path) -> list[str]:
    """The wheel's own ``Requires-Dist`` lines (its METADATA)."""
    with zipfile.ZipFile(wheel) as archive:
        meta = next((n for n in archive.namelist() if n.endswith(".dist-info/METADATA")), None)
        text = archive.read(meta).decode(errors="replace") if meta else ""
    return [line.partition(":")[2].strip() for line in text.splitlines() if line.startswith("Requires-Dist:")]


def checkout_requires(root: Path) -> list[str]:
    """A checkout's run-time requirements (``requirements/common.txt`` and ``cpu.txt``), where it has them."""
    lines = []
    for name in ("common.txt", "cpu.txt"):
        path = root / "requirements" / name
        if path.is_file():
            lines += [l.split("#")[0].strip() for l in path.read_text().splitlines()
                      if l.strip() and not l.startswith(("#", "-"))]
    return [l for l in lines if l]


# Needed by a CUDA build only: a CPU run neither has nor needs them.
# The CUDA wheel's Requires-Dist is common.txt plus cuda.txt; these are cuda.txt's own (0.26-0.34;
# tilelang, nvtx, fastsafetensors, instanttensor, tokenspeed-mla, humming-kernels arrived in 0.33).
_GPU_ONLY = re.compile(r"^(nvidia-.*|cupy.*|flashinfer.*|pynvvideocodec|torchaudio|torchvision|torchcodec|triton.*|"
                       r"apache-tvm-ffi|deep-gemm|quack-kernels|xformers|nixl.*|cuda-.*|tilelang|nvtx|"
                       r"fastsafetensors|instanttensor|tokenspeed-mla|humming-kernels)$")


def _requirements(lines: list[str]) -> list:
    """The parsed requirements that apply to a CPU run of this interpreter (markers evaluated, no extras)."""
    from packaging.requirements import InvalidRequirement, Requirement

    found = []
    for line in lines:
        try:
            req = Requirement(line)
        except InvalidRequirement:
            continue
        if _GPU_ONLY.match(canonicalize_name(req.name)) or (
                req.marker is not None and not req.marker.evaluate({"extra": ""})):
            continue
        found.append(req)
    return found


def _overlay_deps(path: str) -> bool:
    """Whether ``path`` is an overlay's ``deps/site``: on the path of a process run over an overlay
    (make's VRUN), never part of what this environment has (counting it made a later ``prepare``
    drop the overlay's requirements, and the node image its copy)."""
    return path.rstrip(os.sep).endswith(os.sep + os.path.join(DEPS, "site"))


@functools.cache
def own_versions() -> dict[str, str]:
    """Every distribution this environment has (overlay deps not counted): canonical name -> version,
    the first on ``sys.path`` winning as in an import. Read once per process: ~300 distributions."""
    from importlib.metadata import distributions

    found: dict[str, str] = {}
    for dist in distributions(path=[p for p in sys.path if not _overlay_deps(p)]):
        if dist.metadata["Name"]:
            found.setdefault(canonicalize_name(dist.metadata["Name"]), dist.version)
    return found


def unmet_requirements(lines: list[str], installed: list[str] = (), why: str = "") -> list[str]:
    """The requirements (no extras; markers for this interpreter) this environment does not satisfy,
    past ``installed`` (the ``name==version`` pins ``install_requirements`` added beside it); a missing
    one carries ``why`` they could not be added."""
    added = {canonicalize_name(pin.partition("==")[0]) for pin in installed}
    unmet = []
    for req in _requirements(lines):
        have = own_versions().get(canonicalize_name(req.name))
        if have is None:
            if canonicalize_name(req.name) not in added:
                unmet.append(f"{req.name} (missing{'; ' + why if why else ''})")
            continue
        if req.specifier and not req.specifier.contains(have, prereleases=True):
            unmet.append(f"{req.name}{req.specifier} ({have} installed)")
    return unmet


def missing_requirements(lines: list[str]) -> list[str]:
    """The requirements whose distribution is not installed at all, as ``name<specifier>``: the ones an
    overlay can add beside this environment without replacing what it has (a torch, say, that the
    compiled parts were built against)."""
    return [f"{req.name}{req.specifier}" for req in _requirements(lines)
            if canonicalize_name(req.name) not in own_versions()]


def pip(*args: str, timeout: float = _PIP_TIMEOUT_S) -> subprocess.CompletedProcess:
    """What ``pip *args`` did, run by this interpreter (a timeout answers as exit status 124)."""
    # pip sees what this environment has, not what an overlay on PYTHONPATH added (_overlay_deps).
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in env.get("PYTHONPATH", "").split(os.pathsep)
                                        if p and not _overlay_deps(p))
    try:
        return subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True, timeout=timeout,
                              env=env)
    except subprocess.TimeoutExpired:
        return subprocess.CompletedProcess(args, 124, "", f"pip {args[0]} took over {timeout:.0f} s")


def pip_error(proc: subprocess.CompletedProcess) -> str:
    """pip's own reason for failing, in one line."""
    lines = [l.strip() for l in (proc.stderr or proc.stdout or "").splitlines() if l.strip()]
    errors = [l for l in lines if l.startswith("ERROR")]
    return (errors or lines or [f"pip exited {proc.returncode}"])[-1][:300]


def install_requirements(folder: Path, missing: list[str]) -> tuple[list[str], str]:
    """Install ``missing`` (and what they need that this environment lacks) into ``folder/deps/site``,
    pinned against everything installed here so nothing installed is shadowed by another version; keep
    the wheels in ``folder/deps/wheels`` for the node image. Once per overlay. Returns the installed
    ``name==version`` pins and "" or why they could not be installed (then nothing is)."""
    deps = folder / DEPS
    done = deps / _DEPS_MANIFEST
    if done.is_file():
        record = json.loads(done.read_text())
        if record["requested"] == missing:
            return record["installed"], ""
        # A checkout's requirements changed (its hash covers vllm/ only): install afresh.
        stale = Path(tempfile.mkdtemp(prefix=f".{DEPS}-stale-", dir=folder))
        deps.rename(stale / DEPS)
        shutil.rmtree(stale, ignore_errors=True)
    if not missing:
        return [], ""
    scratch = Path(tempfile.mkdtemp(prefix=f".{DEPS}-", dir=folder))
    try:
        pins = sorted(f"{name}=={v}" for name, v in own_versions().items())
        (scratch / "installed.txt").write_text("\n".join(pins) + "\n")
        # What pip would add to this environment for them, every installed version held as it is.
        proc = pip("install", "--dry-run", "--quiet", "--only-binary", ":all:", "--report",
                   str(scratch / "report.json"), "-c", str(scratch / "installed.txt"), *missing)
        if proc.returncode != 0:
            return [], f"pip cannot add them beside what is installed: {pip_error(proc)}"
        report = json.loads((scratch / "report.json").read_text())
        adds = sorted(f"{i['metadata']['name']}=={i['metadata']['version']}" for i in report.get("install", []))
        proc = pip("download", "--no-deps", "--only-binary", ":all:", "--quiet", "--dest", str(scratch / "wheels"),
                   *adds)
        if proc.returncode != 0:
            return [], f"download failed: {pip_error(proc)}"
        proc = pip("install", "--no-deps", "--no-index", "--quiet", "--target", str(scratch / "site"),
                   *map(str, sorted((scratch / "wheels").glob("*.whl"))))
        if proc.returncode != 0:
            return [], f"install failed: {pip_error(proc)}"
        (scratch / _DEPS_MANIFEST).write_text(json.dumps({"requested": missing, "installed": adds}, indent=1))
        for name in ("installed.txt", "report.json"):
            (scratch / name).unlink()
        try:
            scratch.rename(deps)
        except OSError:  # another run installed them first: use its folder
            pass
        return json.loads(done.read_text())["installed"], ""
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
