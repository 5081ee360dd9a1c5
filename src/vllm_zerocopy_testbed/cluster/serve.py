"""The OpenAI API server command line, the same for every backend (one source of flags)."""

from __future__ import annotations

import os
import sys

from vllm_zerocopy_testbed.config import ClusterSettings

# PP on CPU: --enforce-eager leaves stage 2 without intermediate tensors (the CPU
# warm-up that allocates them is skipped); compilation mode 2 with the eager backend
# keeps that warm-up.
_COMPILATION = '{"mode":2,"backend":"eager"}'


def serve_argv(settings: ClusterSettings, host: str, port: int) -> list[str]:
    """Return the argv that serves the model over Ray with the cluster's parallelism."""
    argv = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--host", host, "--port", str(port),
        "--model", settings["TESTBED_MODEL"], "--served-model-name", settings["TESTBED_SERVED_MODEL"],
        "--distributed-executor-backend", "ray",
        "--pipeline-parallel-size", settings["TESTBED_PP"], "--tensor-parallel-size", settings["TESTBED_TP"],
        "--enable-prompt-embeds", "--max-model-len", settings["TESTBED_MAX_MODEL_LEN"],
        "--max-num-seqs", settings["TESTBED_MAX_NUM_SEQS"], "--max-logprobs", "20",
        # logprobs keyed by decoded text collide ("\ufffd" byte fragments): ids keep all of them
        "--return-tokens-as-token-ids",
        "--dtype", "float32", "--seed", "0", "--compilation-config", _COMPILATION,
    ]
    return argv + settings.values.get("TESTBED_SERVE_ARGS", "").split()


def main() -> None:
    """Replace this process with the API server (the head container's last step)."""
    argv = serve_argv(ClusterSettings.from_env(), host="0.0.0.0", port=8000)
    os.execv(argv[0], argv)


if __name__ == "__main__":
    main()
