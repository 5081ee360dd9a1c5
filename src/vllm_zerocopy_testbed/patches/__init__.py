"""The zero-copy paths under test (tensor broadcast, Ray output detach, the shm tensor arena) and the
compiled-graph in-flight cap, each switchable between upstream, off and testbed."""

from __future__ import annotations

from dataclasses import dataclass

from vllm_zerocopy_testbed.config import PatchMode, TestbedConfig
from vllm_zerocopy_testbed.patches import arena, broadcast, detach, inflight


@dataclass(frozen=True)
class ActiveModes:
    """The modes in force in this process."""

    broadcast: PatchMode
    detach: PatchMode
    inflight: PatchMode
    arena: PatchMode

    def __str__(self) -> str:
        return (f"broadcast={self.broadcast.value} detach={self.detach.value} inflight={self.inflight.value} "
                f"arena={self.arena.value}")


def apply_modes(config: TestbedConfig) -> ActiveModes:
    """Apply ``config``'s modes in this process and return what is now in force."""
    arena.apply(config.arena)  # before broadcast: its enqueue is guarded per the arena's mode
    broadcast.apply(config.broadcast)
    detach.apply(config.detach)
    inflight.apply(config.inflight)
    return active_modes()


def active_modes() -> ActiveModes:
    """Return the modes in force in this process, read back from vLLM itself."""
    return ActiveModes(broadcast=broadcast.active_mode(), detach=detach.active_mode(),
                       inflight=inflight.active_mode(), arena=arena.active_mode())
