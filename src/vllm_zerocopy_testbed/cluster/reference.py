"""The single-process reference: the same model and flags as the cluster, in one process.

The e2e checkers compare the cluster's answers with this server's (tokens must be
identical) and measure latency budgets relative to it, in the same run.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import ContextManager

from vllm_zerocopy_testbed.cluster.api_server import ApiServerProcess
from vllm_zerocopy_testbed.cluster.interface import Service, free_port
from vllm_zerocopy_testbed.node.serve import serve_argv
from vllm_zerocopy_testbed.config import process_env
from vllm_zerocopy_testbed.host_config import ClusterSettings
from vllm_zerocopy_testbed.model import TinyModelSpec, build, model_dir, spec_for
from vllm_zerocopy_testbed.workload.warmup import warm_up

HOST = "127.0.0.1"


class ReferenceServer(Service):
    """One vLLM API server (PP=1, TP=1, no Ray) on 127.0.0.1; a context manager. With ``tp`` > 1,
    vLLM's multiprocessing executor with that TP on this host (tests/e2e/test_arena.py)."""

    def __init__(self, settings: ClusterSettings | None = None, up_timeout: float = 600.0,
                 spec: TinyModelSpec | None = None, port: int | None = None, tp: int = 1,
                 env: dict[str, str] | None = None, name: str = "reference server") -> None:
        """``spec``: the model variant the cluster serves (the node image builds the same ones; by
        default the one ``TESTBED_MODEL`` names there);
        ``port``: a free one unless named: two runs on one machine each have their own;
        ``env``: more environment for the server's processes (``TESTBED_ARENA=upstream``)."""
        self.settings = settings or ClusterSettings.from_env()
        self.port = port or free_port(HOST)
        self.spec = spec or spec_for(self.settings["TESTBED_MODEL"])
        self.tp = tp
        self.env = env or {}
        self.up_timeout = up_timeout
        self._server = ApiServerProcess(name, f"testbed-{name.replace(' ', '-')}-")

    @property
    def base_url(self) -> str:
        return f"http://{HOST}:{self.port}/v1"

    @property
    def label(self) -> str:
        return f"{self._server.name} (:{self.port})"

    def up(self) -> float:
        """Start the server, wait (bounded) for ``/health`` and one warm-up answer; return seconds."""
        start = time.monotonic()
        directory = model_dir(self.spec)
        build(directory, self.spec)
        values = {**self.settings.values, "TESTBED_MODEL": str(directory)}
        argv = serve_argv(replace(self.settings, values=values), host=HOST, port=self.port, single_process=True,
                          local_tp=self.tp if self.tp > 1 else None)
        # The cluster's settings (VLLM_CPU_KVCACHE_SPACE above all: without it vLLM-CPU
        # reserves 92% of the host's memory and refuses to start when less is free), and one
        # thread per process, unbound: the cluster's nodes have one core each.
        env = {**process_env(), **self.settings.values, "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1",
               **self.env}
        self._server.start(argv, env)
        url = self.base_url.removesuffix("/v1")
        self._server.wait_healthy(url, self.up_timeout)
        warm_up(url, self.settings["TESTBED_SERVED_MODEL"], timeout=max(1.0, start + self.up_timeout - time.monotonic()),
                logprobs=True, model_dir=directory)
        return time.monotonic() - start

    def pause(self) -> None:
        """Stop the whole server (SIGSTOP to its process group): idle, it still polls (10.5% of a
        core, measured), between the cluster's pinned ranks; ``awake`` runs it for one request."""
        self._server.pause()

    def awake(self) -> ContextManager[None]:
        """Run the server for the block; paused again after it if it was paused before."""
        return self._server.awake()

    def down(self) -> None:
        """Stop the server's process group (bounded) and remove the /dev/shm files and the temp
        directory (the executor's file store) it left: its own only (``ApiServerProcess``)."""
        self._server.stop()

    def leftovers(self) -> list[str]:
        """Return what the server left behind after ``down``: its process, /dev/shm files, temp directory."""
        return self._server.leftover()

    def logs(self, tail: int | None = None) -> str:
        return self._server.logs(tail)
