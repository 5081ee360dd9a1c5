"""How many Ray nodes are alive, and a bounded wait for them (also a CLI for containers)."""

from __future__ import annotations

import argparse
import subprocess
import sys
from typing import Callable, Mapping

from vllm_zerocopy_testbed.config import process_env
from vllm_zerocopy_testbed.waits import wait_until

# The GCS's node table, read by a plain GCS client: a driver (``ray.init``) would start a core
# worker and cost ~1 s more of the head's one core on every poll while vLLM starts beside it.
_PROBE = (
    "import sys; from ray._raylet import GcsClient; from ray.core.generated.gcs_pb2 import GcsNodeInfo;"
    "nodes = GcsClient(address=sys.argv[1]).get_all_node_info(timeout=10);"
    "print(sum(1 for n in nodes.values() if n.state == GcsNodeInfo.ALIVE))"
)
# A GCS that does not answer: the probe gives up well within the 30 s bound below; with Ray's
# default reconnect timeout, an address nothing listens on would run into that bound.
_PROBE_ENV = {"RAY_gcs_rpc_server_reconnect_timeout_s": "5"}


def alive_nodes(address: str, env: Mapping[str, str] | None = None) -> int:
    """Return how many nodes the GCS at ``address`` reports alive (0 if it does not answer).

    Asked from a child process so that this one never joins the cluster.
    """
    try:
        out = subprocess.run(
            [sys.executable, "-c", _PROBE, address],
            env={**(process_env() if env is None else dict(env)), **_PROBE_ENV},
            capture_output=True,
            timeout=30,
            text=True,
        )
    except subprocess.TimeoutExpired:
        return 0
    lines = out.stdout.strip().splitlines()
    return int(lines[-1]) if out.returncode == 0 and lines and lines[-1].isdigit() else 0


def wait_for_nodes(
    address: str,
    count: int,
    timeout: float,
    env: Mapping[str, str] | None = None,
    abort: Callable[[], str | None] = lambda: None,
) -> int:
    """Wait until ``count`` nodes are alive; return the count, or raise ``TimeoutError``.

    ``abort`` is asked on every poll; a message from it ends the wait early
    (``RuntimeError``), e.g. when a node process we started has exited.
    """
    seen = 0

    def enough() -> int:
        nonlocal seen
        seen = alive_nodes(address, env)
        return seen if seen >= count else 0

    return wait_until(f"{count} Ray nodes alive at {address}", enough, timeout=timeout, abort=abort,
                      progress=lambda: f"{seen} of {count} alive", poll_s=0.5)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Wait until N Ray nodes are alive.")
    parser.add_argument("--address", required=True)
    parser.add_argument("--count", type=int, required=True)
    parser.add_argument("--timeout", type=float, default=120.0)
    args = parser.parse_args(argv)
    try:
        seen = wait_for_nodes(args.address, args.count, args.timeout)
    except TimeoutError as exc:
        sys.exit(f"testbed: {exc}: are the worker containers up? (make logs)")
    print(f"testbed: {seen} Ray nodes alive")


if __name__ == "__main__":
    main()
