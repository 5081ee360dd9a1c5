"""The OpenAI API server command line, the same for every backend (one source of flags)."""

from __future__ import annotations

import os
import sys

from vllm_zerocopy_testbed.config import process_env
from vllm_zerocopy_testbed.host_config import ClusterSettings

# PP on CPU: --enforce-eager leaves stage 2 without intermediate tensors (the CPU
# warm-up that allocates them is skipped); compilation mode 2 with the eager backend
# keeps that warm-up.
_COMPILATION = '{"mode":2,"backend":"eager"}'


def serve_argv(settings: ClusterSettings, host: str, port: int, *, single_process: bool = False,
               local_tp: int | None = None) -> list[str]:
    """Return the argv that serves the model over Ray with the cluster's parallelism.

    ``single_process`` serves the same model with the same flags in one process
    (PP=1, TP=1, no Ray): the e2e suites' reference. ``local_tp`` serves it on this host
    with vLLM's multiprocessing executor and that TP (PP=1): the shm tensor arena's home.
    """
    if local_tp is not None:
        parallel = ["--distributed-executor-backend", "mp", "--pipeline-parallel-size", "1",
                    "--tensor-parallel-size", str(local_tp)]
    elif single_process:
        parallel = ["--distributed-executor-backend", "uni", "--pipeline-parallel-size", "1",
                    "--tensor-parallel-size", "1"]
    else:
        parallel = ["--distributed-executor-backend", "ray", "--pipeline-parallel-size", settings["TESTBED_PP"],
                    "--tensor-parallel-size", settings["TESTBED_TP"]]
    argv = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--host", host, "--port", str(port),
        "--model", settings["TESTBED_MODEL"], "--served-model-name", settings["TESTBED_SERVED_MODEL"],
        *parallel,
        # A cached prefix changes how a repeat is computed (~1e-6 in a logprob at 4k tokens,
        # measured), not what the transport carries: off, so repeats must match to the bit.
        "--no-enable-prefix-caching",
        "--enable-prompt-embeds", "--max-model-len", settings["TESTBED_MAX_MODEL_LEN"],
        "--max-num-seqs", settings["TESTBED_MAX_NUM_SEQS"], "--max-logprobs", "20",
        # logprobs keyed by decoded text collide ("\ufffd" byte fragments): ids keep all of them
        "--return-tokens-as-token-ids",
        "--dtype", "float32", "--seed", "0", "--compilation-config", _COMPILATION,
    ]
    if settings.device_profile == "gpu":
        argv += ["--gpu-memory-utilization", settings.values.get("TESTBED_GPU_MEMORY_UTILIZATION", "0.3")]
    return argv + settings.values.get("TESTBED_SERVE_ARGS", "").split()


def serve_env(settings: ClusterSettings) -> dict[str, str]:
    """Return the environment the API server needs beyond the settings: the executor's switches."""
    return settings.executor.vllm_env()


def main() -> None:
    """Replace this process with the API server (the head container's last step)."""
    settings = ClusterSettings.from_env()
    argv = serve_argv(settings, host="0.0.0.0", port=8000)
    os.execve(argv[0], argv, process_env(**serve_env(settings)))


if __name__ == "__main__":
    main()
