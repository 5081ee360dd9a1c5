"""Zero-copy on the wire: a prompt_embeds tensor crosses to remote workers in a frame of its own.

Reads the engine's ``mq-send`` lines (``patches/wiretap.py``). Out of band means
one frame after the pickle stream has exactly the tensor's bytes; in band (the
pre-48442 reducer, mode ``off``) the tensor is inside frame 0.
"""

from __future__ import annotations

import re

from vllm_zerocopy_testbed.checker import Verdict
from vllm_zerocopy_testbed.patches.wiretap import WIRE_PREFIX

_LINE = re.compile(rf"{WIRE_PREFIX} path=(\w+|\?) frames=([\d,]+)")


def sends(logs: str) -> list[tuple[str, list[int]]]:
    """Return every logged large send as ``(path, frame sizes)``."""
    return [(m.group(1), [int(x) for x in m.group(2).split(",")]) for m in _LINE.finditer(logs)]


def check_out_of_band(logs: str, tensor_bytes: int, path: str = "remote") -> Verdict:
    """Fail unless some send on ``path`` carried a frame of exactly ``tensor_bytes`` after frame 0."""
    verdict = Verdict(f"zero-copy ({path})")
    on_path = [sizes for p, sizes in sends(logs) if p == path]
    verdict.figures["sends"] = len(on_path)
    if not on_path:
        verdict.fail(f"no message of >= 512 KiB was sent on the {path} path (is the wire tap installed?)")
    elif not any(tensor_bytes in sizes[1:] for sizes in on_path):
        biggest = max(on_path, key=sum)
        verdict.fail(f"no frame carries the {tensor_bytes}-byte tensor out of band; largest send's frames: "
                     f"{biggest} (in band: the tensor was copied into the pickle stream)")
    return verdict
