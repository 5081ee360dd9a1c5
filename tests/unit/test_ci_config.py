"""CI definitions: the GPU workflow validates against GitHub's schema and keeps our rules."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from vllm_zerocopy_testbed.config import REPO_ROOT

pytestmark = pytest.mark.unit

WORKFLOW = REPO_ROOT / ".github" / "workflows" / "gpu.yml"


def test_the_gpu_workflow_validates_against_the_github_workflow_schema() -> None:
    checker = Path(sys.executable).with_name("check-jsonschema")
    proc = subprocess.run([str(checker), "--builtin-schema", "vendor.github-workflows", str(WORKFLOW)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _workflow() -> dict:
    return yaml.safe_load(WORKFLOW.read_text())


def test_the_gpu_job_runs_on_a_self_hosted_gpu_runner_with_bounds() -> None:
    job = _workflow()["jobs"]["e2e"]
    assert set(job["runs-on"]) >= {"self-hosted", "gpu"}
    assert job["timeout-minutes"] <= 180
    assert all("timeout-minutes" in step for step in job["steps"] if "run" in step), "every command is bounded"


def test_the_gpu_job_builds_runs_benches_uploads_and_always_tears_down() -> None:
    steps = _workflow()["jobs"]["e2e"]["steps"]
    runs = " ; ".join(step.get("run", "") for step in steps)
    for target in ("make image PROFILE=gpu", "make up PROFILE=gpu", "make e2e PROFILE=gpu", "make bench-quick PROFILE=gpu"):
        assert target in runs, target
    upload = next(s for s in steps if s.get("uses", "").startswith("actions/upload-artifact"))
    down = steps[-1]
    assert upload.get("if") == "always()" and down.get("if") == "always()"
    assert down["run"].startswith("make down PROFILE=gpu")


def test_workflow_inputs_reach_the_shell_as_data() -> None:
    for step in _workflow()["jobs"]["e2e"]["steps"]:
        assert "${{" not in step.get("run", ""), f"expression inside run: {step['name']}"


def test_the_gpu_smoke_script_parses_and_refuses_gpu_steps_without_a_gpu(tmp_path) -> None:
    script = REPO_ROOT / "scripts" / "gpu-smoke.sh"
    assert subprocess.run(["bash", "-n", str(script)], timeout=30).returncode == 0
    if subprocess.run(["sh", "-c", "command -v nvidia-smi"], capture_output=True).returncode == 0:
        pytest.skip("this machine has nvidia-smi")
    proc = subprocess.run([str(script), "e2e"], capture_output=True, text=True, timeout=60,
                          env={"PATH": "/usr/bin:/bin", "SMOKE_OUT": str(tmp_path)})
    assert proc.returncode == 2 and "needs a GPU" in proc.stderr
