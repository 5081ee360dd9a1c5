"""prompt_embeds payloads built from the tiny model's own embedding rows.

Rows of the model's embedding table for token ids ``ids`` must give exactly the
answer of ``prompt=ids``: the embeds request has a twin that skips the transport
of a tensor, which makes every size and dtype checkable against token ids.
"""

from __future__ import annotations

import base64
import functools
import io
from pathlib import Path

import torch

from vllm_zerocopy_testbed.model import TinyModelSpec, build, model_dir

HIDDEN = TinyModelSpec.hidden_size
# Bytes per row once the server has cast the rows to the model's dtype (fp32).
WIRE_BYTES_PER_ROW = HIDDEN * 4
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def token_ids(rows: int, seed: int = 0) -> list[int]:
    """Return ``rows`` deterministic token ids (no special tokens: ids 5..509)."""
    return [(seed * 131 + i * 7 + 3) % 505 + 5 for i in range(rows)]


@functools.lru_cache(maxsize=2)
def _embedding_table(directory: Path, spec: TinyModelSpec | None) -> torch.Tensor:
    from safetensors.torch import load_file

    if spec is not None:
        build(directory, spec)  # the image's /model has the same bytes (deterministic builder)
    return load_file(directory / "model.safetensors")["model.embed_tokens.weight"]


def rows_for(ids: list[int], dtype: str = "float32", spec: TinyModelSpec = TinyModelSpec(),
             directory: Path | None = None) -> torch.Tensor:
    """Return the embedding rows of ``spec``'s model (built here once), or of the model already in
    ``directory`` (a node image's), for ``ids`` as ``[len(ids), hidden]`` in ``dtype``."""
    table = _embedding_table(directory, None) if directory is not None else _embedding_table(model_dir(spec), spec)
    return table[ids].to(DTYPES[dtype]).clone()


def encode(tensor: torch.Tensor) -> str:
    """Return the API's ``prompt_embeds`` form: base64 of ``torch.save`` of the tensor."""
    buffer = io.BytesIO()
    torch.save(tensor, buffer)
    return base64.b64encode(buffer.getvalue()).decode()
