"""What a vLLM's files (relative path -> bytes) say, and where the testbed keeps them.

Which files are compiled parts, which version the files are, which paths under test they lack.
"""

from __future__ import annotations

import re
from pathlib import Path

from vllm_zerocopy_testbed.config import REPO_ROOT

CACHE = REPO_ROOT / ".cache" / "vllm"  # wheels/ downloaded, overlays/<hash> built
MANIFEST = "vllm-overlay.json"  # beside an overlay's vllm/ (in the image: inside it): what it is
# A compiled part of a vLLM wheel: an extension module (the CUDA wheel's differ from the CPU wheel's).
COMPILED = re.compile(r"\.(so|pyd)$")
SKIP = re.compile(r"(^|/)__pycache__(/|$)|\.py[co]$")


# Files whose absence means a path under test is gone from that vLLM (the reports say so).
PATH_FILES = {
    "compiled-graph executor": "vllm/v1/executor/ray_executor.py",
    "tensor arena": "vllm/distributed/device_communicators/shm_tensor_arena.py",
}


_RAY_UTILS = "vllm/v1/executor/ray_utils.py"
_SHM = "vllm/distributed/device_communicators/shm_broadcast.py"


def lacking(files: dict[str, bytes]) -> list[str]:
    """The paths under test that these sources do not have (a release before a fix, or after a removal)."""
    lacks = [name for name, rel in PATH_FILES.items() if rel not in files]
    if b"def detach_zero_copy_from_model_runner_output" not in files.get(_RAY_UTILS, b""):
        lacks.append("Ray output detach")
    if b"def _reduce_tensor" not in files.get(_SHM, b""):
        lacks.append("tensors out of band")
    return lacks


def package_files(package: Path) -> dict[str, bytes]:
    """The files ``lacking`` and ``version_of`` read, from an installed ``vllm`` package."""
    wanted = [*PATH_FILES.values(), _RAY_UTILS, _SHM, "vllm/_version.py"]
    return {rel: (package.parent / rel).read_bytes() for rel in wanted if (package.parent / rel).is_file()}


def version_of(files: dict[str, bytes]) -> str | None:
    """The version ``vllm/_version.py`` among ``files`` says, or None without one."""
    text = files.get("vllm/_version.py", b"").decode(errors="replace")
    match = re.search(r"""^__version__\s*=\s*(?:version\s*=\s*)?['"]([^'"]+)['"]""", text, re.M)
    return match.group(1) if match else None
