"""The KubeRay manifests: what compose runs, and pod templates Kubernetes' own schema accepts.

The RayCluster CRD's schema is not on a package registry this project reaches, so the
RayCluster's own fields are checked here against what KubeRay needs (docs/multihost.md has
the `kubectl apply --dry-run=server` step that checks them against the installed CRD), and
its pod templates against Kubernetes' core schema (kubernetes-validate, offline).
"""

from __future__ import annotations

import copy

import kubernetes_validate
import pytest
import yaml

from vllm_zerocopy_testbed.cluster.kuberay import compose_services, manifest_text, path_for

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]

PROFILES = ("cpu", "gpu")
K8S_VERSION = "1.30"


def _templates(manifest: dict) -> list[dict]:
    spec = manifest["spec"]
    return [spec["headGroupSpec"]["template"], *(g["template"] for g in spec["workerGroupSpecs"])]


def _validate_pod_template(template: dict) -> None:
    kubernetes_validate.validate({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"},
                                  "template": template}, K8S_VERSION, strict=True)


@pytest.mark.parametrize("profile", PROFILES)
def test_the_committed_manifest_is_what_compose_renders(profile: str) -> None:
    assert path_for(profile).read_text() == manifest_text(profile), (
        f"{path_for(profile)} is stale: python -m vllm_zerocopy_testbed.cluster.kuberay --write")


@pytest.mark.parametrize("profile", PROFILES)
def test_pod_templates_pass_the_kubernetes_schema(profile: str) -> None:
    manifest = yaml.safe_load(path_for(profile).read_text())
    for template in _templates(manifest):
        _validate_pod_template(template)


def test_a_broken_pod_template_is_rejected() -> None:
    template = copy.deepcopy(_templates(yaml.safe_load(path_for("cpu").read_text()))[0])
    template["spec"]["containers"][0]["ports"][0]["containerPort"] = "six-three-seven-nine"
    with pytest.raises(kubernetes_validate.ValidationError):
        _validate_pod_template(template)
    del template["spec"]["containers"][0]["name"]
    with pytest.raises(kubernetes_validate.ValidationError):
        _validate_pod_template(template)


@pytest.mark.parametrize("profile", PROFILES)
def test_the_raycluster_runs_the_testbed_scripts_with_the_compose_settings(profile: str) -> None:
    manifest = yaml.safe_load(path_for(profile).read_text())
    assert manifest["apiVersion"] == "ray.io/v1" and manifest["kind"] == "RayCluster"
    assert manifest["metadata"]["annotations"]["ray.io/overwrite-container-cmd"] == "true"
    head = manifest["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    [group] = manifest["spec"]["workerGroupSpecs"]
    worker = group["template"]["spec"]["containers"][0]
    assert head["command"] == ["testbed-head"] and worker["command"] == ["testbed-worker"]
    assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
    assert {p["name"] for p in head["ports"]} >= {"gcs-server", "dashboard", "api"}
    services = compose_services(profile)
    for container, service in ((head, services["head"]), (worker, services["worker"])):
        env = {e["name"]: e["value"] for e in container["env"]}
        assert container["image"] == services["head"]["image"]
        for key, value in service["environment"].items():
            assert env.get(key) == str(value), (container["name"], key)
    worker_env = {e["name"]: e["value"] for e in worker["env"]}
    assert worker_env["TESTBED_HEAD_HOST"] == f"{manifest['metadata']['name']}-head-svc"
    if profile == "gpu":
        assert head["resources"]["limits"]["nvidia.com/gpu"] == services["head"]["environment"]["TESTBED_GPUS_PER_NODE"]


@pytest.mark.parametrize("profile", PROFILES)
def test_the_head_probes_keep_the_compose_healthcheck_timing(profile: str) -> None:
    """Kubernetes checks as often, gives up after as many misses, and waits for a first start as
    long as compose does (interval 2s x 7 retries, start_period 600 s)."""
    head = yaml.safe_load(path_for(profile).read_text())["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    check = compose_services(profile)["head"]["healthcheck"]
    ready, startup = head["readinessProbe"], head["startupProbe"]
    assert f"{ready['periodSeconds']}s" == check["interval"]
    assert ready["failureThreshold"] == int(check["retries"])
    assert ready["periodSeconds"] * ready["failureThreshold"] <= 15  # a stalled head leaves within ~15 s
    assert startup["periodSeconds"] * startup["failureThreshold"] == 600 == 60 * int(check["start_period"].split("m")[0])
