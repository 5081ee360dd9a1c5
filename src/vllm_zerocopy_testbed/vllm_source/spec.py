"""What ``VLLM=`` names: a release, a wheel file or a source checkout."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from packaging.version import InvalidVersion, Version

VLLM_ENV = "TESTBED_VLLM"


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
