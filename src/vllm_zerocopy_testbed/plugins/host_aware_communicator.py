"""A CPU communicator that uses /dev/shm only when every rank of a group shares it.

Stock ``CpuCommunicator`` takes its shared-memory path whenever the ranks agree
on a segment name built from port and ranks, without checking that they can
see the same /dev/shm: two containers (or two hosts) then fail with ``open shm
in SHMManager failed``. We add the identity of the /dev/shm mount to the check;
groups that span mounts use gloo over TCP.
"""

from __future__ import annotations

import os
import socket
from functools import lru_cache

import torch
from vllm.distributed.device_communicators.cpu_communicator import CpuCommunicator
from vllm.logger import init_logger

from vllm_zerocopy_testbed.observe.log import testbed_logger

logger = init_logger(__name__)


@lru_cache(maxsize=1)
def shm_namespace() -> str:
    """Return an identity shared exactly by processes that see the same /dev/shm."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot_id = f.read().strip()
    except OSError:
        boot_id = "?"
    try:
        stat = os.stat("/dev/shm")
        mount = f"{stat.st_dev}:{stat.st_ino}"
    except OSError:
        mount = "no-dev-shm"
    return f"{socket.gethostname()}/{boot_id}/{mount}"


def _node_ip() -> str:
    import sys

    if "ray" in sys.modules:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    return socket.gethostbyname(socket.gethostname())


@lru_cache(maxsize=1)
def log_rank_once() -> None:
    """Log this process's global rank and node once: where each rank runs, for any executor."""
    # Our own handler: vLLM's loggers are not shown by every executor's Ray workers.
    testbed_logger().info("testbed rank pid=%d rank=%d node=%s", os.getpid(), torch.distributed.get_rank(),
                          _node_ip())


class HostAwareCpuCommunicator(CpuCommunicator):
    """``CpuCommunicator`` whose shm fast path requires one /dev/shm for the group."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        log_rank_once()

    def _all_group_ranks_share_shm_group_name(self) -> bool:
        # Every rank evaluates the same chain of checks, so the collectives match.
        if not super()._all_group_ranks_share_shm_group_name():
            return False
        namespaces: list[str] = [""] * self.world_size
        torch.distributed.all_gather_object(namespaces, shm_namespace(), group=self.device_group)
        shared = len(set(namespaces)) == 1
        logger.info(
            "testbed communicator %s ranks=%s: %s",
            self.unique_name,
            self.ranks,
            "shared /dev/shm" if shared else "ranks span hosts, gloo over TCP",
        )
        return shared
