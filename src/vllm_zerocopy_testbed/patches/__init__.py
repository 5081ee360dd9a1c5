"""The two zero-copy paths under test and the compiled-graph in-flight cap, each switchable between
upstream, off and testbed."""

from __future__ import annotations

from dataclasses import dataclass

from vllm_zerocopy_testbed.config import PatchMode, TestbedConfig
from vllm_zerocopy_testbed.patches import broadcast, detach, inflight


@dataclass(frozen=True)
class ActiveModes:
    """The modes in force in this process."""

    broadcast: PatchMode
    detach: PatchMode
    inflight: PatchMode

    def __str__(self) -> str:
        return f"broadcast={self.broadcast.value} detach={self.detach.value} inflight={self.inflight.value}"


def apply_modes(config: TestbedConfig) -> ActiveModes:
    """Apply ``config``'s modes in this process and return what is now in force."""
    broadcast.apply(config.broadcast)
    detach.apply(config.detach)
    inflight.apply(config.inflight)
    return active_modes()


def active_modes() -> ActiveModes:
    """Return the modes in force in this process, read back from vLLM itself."""
    return ActiveModes(broadcast=broadcast.active_mode(), detach=detach.active_mode(),
                       inflight=inflight.active_mode())
