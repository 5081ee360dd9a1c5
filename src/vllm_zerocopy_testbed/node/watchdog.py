"""The head node's watchdog: a lost Ray node ends the API server at once, not after 300 s.

Measured (vLLM 0.32, RayExecutorV2, containers): after a worker node dies the
engine logs the dead actor within seconds, yet ``/health`` stays 200 and every
request hangs until ``VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS`` (300 s); then the API
server exits with status 0, so a restart policy never fires. Lowering that
timeout is no cure: the first request's compile takes ~60 s on one core.

This process watches Ray's node and actor tables (as a Ray driver on the head)
and the API server. When fewer nodes than expected are alive for ``grace``
seconds, one of vLLM's Ray worker actors died, or the server exits, it stops the server (its connections reset: every in-flight
request ends with an error) and exits non-zero, so the head container exits
non-zero and ``restart: on-failure`` brings it back. Ray marks a node dead after
its health checks fail (``RAY_health_check_*``, set short on the head).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

from vllm_zerocopy_testbed.observe.log import testbed_logger
from vllm_zerocopy_testbed.waits import WaitTimeout, wait_until

EXIT_NODE_LOST = 3
EXIT_SERVER_GONE = 4


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (an exited child not yet reaped by its parent counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


def stop(pid: int, grace_s: float = 3.0) -> None:
    """SIGTERM the server's process group, SIGKILL it after ``grace_s`` (bounded)."""
    try:
        os.killpg(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        wait_until(f"API server group {pid} to exit after SIGTERM", lambda: not _alive(pid), timeout=grace_s, poll_s=0.2)
    except WaitTimeout:
        pass  # SIGKILL next
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _dead_vllm_workers() -> list[str]:
    """Return the ids of vLLM's Ray worker actors that died (a worker process lost, nodes still up)."""
    from ray._private import state  # the GCS actor table; the state API needs the dashboard

    # RayWorkerProc (the V2 executor) or RayWorkerWrapper (the compiled-graph one)
    return [actor_id[:12] for actor_id, info in state.actors().items()
            if info.get("State") == "DEAD" and info.get("ActorClassName", "").startswith("RayWorker")]


def watch(address: str, nodes: int, server_pid: int, grace_s: float, poll_s: float,
          node_ip: str | None = None, ready_file: str | None = None) -> int:
    """Return the exit status once a node is lost or the server is gone (runs until then)."""
    import ray

    log = testbed_logger()
    for attempt in range(10):  # the GCS answered the node wait just before: retries are for a slow start
        try:
            ray.init(address=address, logging_level="ERROR", log_to_driver=False, _node_ip_address=node_ip)
            break
        except (ConnectionError, RuntimeError) as exc:
            log.warning("testbed watchdog: Ray at %s not reachable yet (%s), retrying", address, exc)
            time.sleep(3)
    else:
        log.error("testbed watchdog: Ray at %s unreachable; stopping the API server", address)
        stop(server_pid)
        return EXIT_NODE_LOST
    lost_since: float | None = None
    log.info("testbed watchdog: watching %d Ray nodes and API server pid %d", nodes, server_pid)
    while True:
        if not _alive(server_pid):
            log.error("testbed watchdog: the API server exited; the head exits non-zero to be restarted")
            return EXIT_SERVER_GONE
        try:
            alive = [n for n in ray.nodes() if n.get("Alive")]
            # Only once the server is warmed up: start-up may legitimately end actors of its own.
            dead_workers = _dead_vllm_workers() if ready_file is None or os.path.exists(ready_file) else []
        except Exception as exc:  # the GCS gone (Ray may also end this process for that: the head script acts then)
            log.error("testbed watchdog: Ray's node table unreadable (%s: %s); stopping the API server",
                      type(exc).__name__, exc)
            stop(server_pid)
            return EXIT_NODE_LOST
        if dead_workers:
            log.error("testbed watchdog: vLLM's Ray worker actors died (%s); stopping the API server so that "
                      "requests fail now and the head restarts", ", ".join(dead_workers))
            stop(server_pid)
            return EXIT_NODE_LOST
        if len(alive) < nodes:
            lost_since = lost_since or time.monotonic()
            if time.monotonic() - lost_since >= grace_s:
                log.error("testbed watchdog: %d of %d Ray nodes alive for %.0f s (alive: %s); stopping the API "
                          "server so that requests fail now and the head restarts",
                          len(alive), nodes, grace_s, [n["NodeManagerAddress"] for n in alive])
                stop(server_pid)
                return EXIT_NODE_LOST
        else:
            lost_since = None
        time.sleep(poll_s)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--address", required=True, help="Ray GCS address (head IP:port)")
    parser.add_argument("--nodes", type=int, required=True, help="Ray nodes the cluster must keep")
    parser.add_argument("--server-pid", type=int, required=True, help="the API server (leader of its process group)")
    parser.add_argument("--grace", type=float, default=2.0, help="seconds a node may be missing before acting")
    parser.add_argument("--poll", type=float, default=1.0)
    parser.add_argument("--node-ip", default=None, help="this node's Ray address (loopback nodes need it)")
    parser.add_argument("--ready-file", default=None, help="watch vLLM's worker actors once this file exists")
    args = parser.parse_args(argv)
    sys.exit(watch(args.address, args.nodes, args.server_pid, args.grace, args.poll, args.node_ip,
                   args.ready_file))


if __name__ == "__main__":
    main()
