"""The node image's copy of an overlay: its Python files and the wheels of what it needs."""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict
from pathlib import Path

from vllm_zerocopy_testbed.vllm_source.files import COMPILED, MANIFEST
from vllm_zerocopy_testbed.vllm_source.overlay import Overlay
from vllm_zerocopy_testbed.vllm_source.requirements import DEPS


def stage_for_image(folder: Path, overlay: Overlay | None) -> None:
    """Put ``overlay``'s files (not its compiled links: the image has its own) into ``folder`` for the
    node image's build; with None, leave it holding nothing to overlay. Rewritten only on a change."""
    manifest = folder / MANIFEST
    wanted = json.dumps(asdict(overlay), indent=1) if overlay else ""
    if (manifest.read_text() if manifest.is_file() else "") == wanted and folder.is_dir():
        return
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    (folder / "README").write_text("Staged by vllm_zerocopy_testbed.vllm_source for the node image (VLLM=).\n")
    if overlay is None:
        return
    source = Path(overlay.path)
    for path in (source / "vllm").rglob("*"):
        rel = path.relative_to(source)
        if path.is_file() and not COMPILED.search(path.name):
            (folder / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, folder / rel)
    # Its requirements installed beside it here are installed into the image's venv (no network).
    wheels = sorted((source / DEPS / "wheels").glob("*.whl"))
    if wheels:
        (folder / "wheels").mkdir()
        for wheel in wheels:
            shutil.copyfile(wheel, folder / "wheels" / wheel.name)
    manifest.write_text(wanted)
