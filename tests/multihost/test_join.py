"""scripts/join.sh: a head and a worker started the way a user starts them on two hosts.

One machine has one host, so the two nodes are two containers on a docker network this test
creates (``NETWORK=``; on real hosts the default is host networking), each started by the
script alone: ``join.sh head``, then ``join.sh HEAD_ADDRESS``. Then: the head serves
(PP stage 1 on the joined node, read from the head's log), one completion with logprobs and
one with prompt_embeds answer the same through the API. Everything started is removed.
"""

from __future__ import annotations

import os
import subprocess
import time

import pytest
from openai import OpenAI

from vllm_zerocopy_testbed.cluster.placement import parse_placement
from vllm_zerocopy_testbed.config import REPO_ROOT
from vllm_zerocopy_testbed.waits import wait_until
from vllm_zerocopy_testbed.workload.embeds import encode, rows_for, token_ids
from vllm_zerocopy_testbed.workload.warmup import is_healthy

pytestmark = [pytest.mark.multihost, pytest.mark.timeout(900)]

NETWORK, SUBNET = "testbed-join", "172.29.79.0/24"
HEAD_IP, WORKER_IP = "172.29.79.10", "172.29.79.11"
NAMES = ("testbed-join-head", "testbed-join-worker")


def _docker(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["docker", *args], capture_output=True, text=True, timeout=120, check=check)


def _join(role: str, name: str, ip: str, core: str) -> str:
    env = {**os.environ, "NETWORK": NETWORK, "NODE_IP": ip, "NAME": name, "CPUSET": core}
    proc = subprocess.run([str(REPO_ROOT / "scripts" / "join.sh"), role], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


@pytest.fixture
def joined():
    _docker("network", "create", "--subnet", SUBNET, "--label", "vllm-zerocopy-testbed.join=1", NETWORK)
    try:
        out = _join("head", NAMES[0], HEAD_IP, "0") + _join(HEAD_IP, NAMES[1], WORKER_IP, "1")
        yield out
    finally:
        for name in NAMES:
            _docker("rm", "-f", name, check=False)
        _docker("network", "rm", NETWORK, check=False)
    left = _docker("ps", "-a", "--filter", "label=vllm-zerocopy-testbed.join", "--format", "{{.Names}}").stdout
    assert not left.strip(), f"left behind: {left}"


def test_a_head_and_a_joined_worker_serve_pp_across_them(joined: str) -> None:
    print(joined)
    start = time.monotonic()
    root = f"http://{HEAD_IP}:8000"
    wait_until("the joined cluster's /health", lambda: is_healthy(root), timeout=600, poll_s=5,
               log_tail=lambda: _docker("logs", "--tail", "20", NAMES[0], check=False).stderr)
    print(f"healthy {time.monotonic() - start:.0f} s after join.sh")
    log = (lambda p: p.stdout + p.stderr)(_docker("logs", NAMES[0]))
    placement = parse_placement(log, {HEAD_IP: "head", WORKER_IP: "worker"}, HEAD_IP, 2)
    assert {(p.pp_rank, p.node) for p in placement} == {(0, "head"), (1, "worker")}, placement
    client = OpenAI(base_url=f"{root}/v1", api_key="testbed", timeout=120, max_retries=0)
    ids = token_ids(12, seed=3)
    by_ids = client.completions.create(model="tiny-llama", prompt=ids, max_tokens=6, temperature=0, logprobs=2)
    by_embeds = client.completions.create(model="tiny-llama", prompt=None, max_tokens=6, temperature=0, logprobs=2,
                                          extra_body={"prompt_embeds": encode(rows_for(ids))})
    assert by_embeds.choices[0].logprobs.tokens == by_ids.choices[0].logprobs.tokens
