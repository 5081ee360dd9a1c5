"""The two zero-copy paths under test, each switchable between upstream, off and testbed."""

from __future__ import annotations

from dataclasses import dataclass

from vllm_zerocopy_testbed.config import PatchMode, TestbedConfig
from vllm_zerocopy_testbed.patches import broadcast, detach


@dataclass(frozen=True)
class ActiveModes:
    """The modes in force in this process."""

    broadcast: PatchMode
    detach: PatchMode

    def __str__(self) -> str:
        return f"broadcast={self.broadcast.value} detach={self.detach.value}"


def apply_modes(config: TestbedConfig) -> ActiveModes:
    """Apply ``config``'s modes in this process and return what is now in force."""
    broadcast.apply(config.broadcast)
    detach.apply(config.detach)
    return active_modes()


def active_modes() -> ActiveModes:
    """Return the modes in force in this process, read back from vLLM itself."""
    return ActiveModes(broadcast=broadcast.active_mode(), detach=detach.active_mode())
