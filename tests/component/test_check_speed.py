"""make check's speed step, one side's benchmark process: what it leaves behind."""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest

from vllm_zerocopy_testbed import vllm_source
from vllm_zerocopy_testbed.check import speed
from vllm_zerocopy_testbed.check.resolve import Side

pytestmark = [pytest.mark.component, pytest.mark.timeout(180)]


def test_a_benchmark_process_binds_its_ipc_sockets_in_the_folder_it_was_given_and_leaves_none(tmp_path) -> None:
    """vLLM's readers bind ZMQ IPC sockets under VLLM_RPC_BASE_PATH and leave them when their process
    is ended: each check left four in /tmp. The speed step gives its processes a folder of its own."""
    version = vllm_source.installed_version()
    rpc_dir = tempfile.mkdtemp(prefix="testbed-ipc-test-")
    child = speed.Child(Side("base", version, "installed", version), tmp_path / "speed.log", rpc_dir)
    try:
        child.ask({"op": "open", "topology": "local-1", "timeout": 60})
        bound = os.listdir(rpc_dir)
    finally:
        child.close()
        shutil.rmtree(rpc_dir, ignore_errors=True)  # the speed step's to remove; here the test's
    assert bound, f"no IPC socket in {rpc_dir}: the readers bound theirs elsewhere"
