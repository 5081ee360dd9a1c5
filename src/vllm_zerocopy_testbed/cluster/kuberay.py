"""KubeRay ``RayCluster`` manifests for the CPU and GPU profiles, rendered from the compose files.

The pods run what the containers run: the node image, ``testbed-head`` / ``testbed-worker``
as their command (``ray.io/overwrite-container-cmd``: the testbed's scripts start Ray with
its settings, then the head waits for the workers and serves), and the environment that
``docker compose config`` resolves for each service, so a knob changed in ``compose/.env``
changes both. ``deploy/kuberay/raycluster-{cpu,gpu}.yaml`` are this module's output
(``python -m vllm_zerocopy_testbed.cluster.kuberay --write``); a unit test keeps them equal
and validates their pod templates against Kubernetes' own schema (docs/multihost.md).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import yaml

from vllm_zerocopy_testbed.config import REPO_ROOT
from vllm_zerocopy_testbed.host_config import ClusterSettings, parse_duration

DEPLOY_DIR = REPO_ROOT / "deploy" / "kuberay"
RAY_VERSION = "2.60.0"
# Ports of the head pod (KubeRay's head service exposes the head container's named ports).
HEAD_PORTS = {"gcs-server": 6379, "dashboard": 8265, "client": 10001, "api": 8000}
# Compose-only settings that mean nothing in a pod (the cluster network's name is fixed there).
_NOT_IN_PODS = {"TESTBED_HEAD_HOST"}


def compose_services(profile: str) -> dict[str, Any]:
    """``docker compose config`` of the profile (defaults from compose/.env; no engine needed)."""
    from vllm_zerocopy_testbed.cluster.compose import ComposeCluster

    # compose/.env's defaults only: the committed manifests must not depend on the caller's environment.
    settings = ClusterSettings.from_env({"TESTBED_PROFILE": profile, "TESTBED_DASHBOARD": "1"})
    proc = ComposeCluster(settings).compose("config", "--format", "json", timeout=60)
    return json.loads(proc.stdout)["services"]


def _env(service: dict[str, Any], extra: dict[str, str]) -> list[dict[str, str]]:
    values = {k: str(v) for k, v in (service.get("environment") or {}).items() if k not in _NOT_IN_PODS}
    values.update(extra)
    return [{"name": k, "value": v} for k, v in sorted(values.items())]


def _container(name: str, service: dict[str, Any], command: str, gpus: int, env: dict[str, str]) -> dict[str, Any]:
    cpu = {"requests": {"cpu": "1", "memory": "6Gi"}, "limits": {"cpu": "1", "memory": "8Gi"}}
    resources = ({"requests": {"cpu": "4", "memory": "32Gi", "nvidia.com/gpu": str(gpus)},
                  "limits": {"memory": "64Gi", "nvidia.com/gpu": str(gpus)}} if gpus else cpu)
    return {
        "name": name,
        "image": service["image"],
        "imagePullPolicy": "IfNotPresent",
        "command": [command],
        "env": _env(service, env),
        "resources": resources,
        "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}],
    }


def _probe(service: dict[str, Any]) -> dict[str, Any]:
    """The service's compose healthcheck as a Kubernetes exec probe (head: warmed up and answering)."""
    kind, *test = service["healthcheck"]["test"]
    command = ["sh", "-c", test[0]] if kind == "CMD-SHELL" else test
    check = service["healthcheck"]
    return {"exec": {"command": command}, "periodSeconds": _seconds(check.get("interval", "5s")),
            "timeoutSeconds": _seconds(check.get("timeout", "5s")),
            "failureThreshold": int(check.get("retries", 3))}


def _seconds(duration: str) -> int:
    """A compose duration (``2s``, ``10m0s``, as ``docker-compose config`` writes it) in whole seconds."""
    return round(parse_duration(duration, name="compose duration"))


def render(profile: str) -> dict[str, Any]:
    """The ``RayCluster`` for ``profile`` (``cpu`` or ``gpu``)."""
    services = compose_services(profile)
    head, worker = services["head"], services["worker"]
    name = f"vllm-zerocopy-testbed-{profile}"
    gpus = int(head["environment"].get("TESTBED_GPUS_PER_NODE", 0)) if profile == "gpu" else 0
    shm_limit = f"{int(head['shm_size']) // 2**30}Gi"  # compose config gives bytes
    volumes = [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": shm_limit}}]

    head_container = _container("ray-head", head, "testbed-head", gpus, {})
    head_container["ports"] = [{"name": n, "containerPort": p} for n, p in HEAD_PORTS.items()]
    head_container["readinessProbe"] = _probe(head)
    # As compose's start_period: the first start may take that long (a cold compile cache).
    probe = head_container["readinessProbe"]
    start_s = _seconds(head["healthcheck"].get("start_period", "600s"))
    head_container["startupProbe"] = {**probe, "failureThreshold": -(-start_s // probe["periodSeconds"])}
    # The worker script finds the head by name: KubeRay's head service.
    worker_container = _container("ray-worker", worker, "testbed-worker", gpus,
                                  {"TESTBED_HEAD_HOST": f"{name}-head-svc"})
    worker_container["readinessProbe"] = _probe(worker)
    workers = int(head["environment"]["TESTBED_WORKERS"])
    return {
        "apiVersion": "ray.io/v1",
        "kind": "RayCluster",
        "metadata": {
            "name": name,
            "labels": {"app.kubernetes.io/name": "vllm-zerocopy-testbed", "testbed/profile": profile},
            # The containers' own commands (the testbed's scripts) run, not KubeRay's `ray start`.
            "annotations": {"ray.io/overwrite-container-cmd": "true"},
        },
        "spec": {
            "rayVersion": RAY_VERSION,
            "enableInTreeAutoscaling": False,
            "headGroupSpec": {
                "serviceType": "ClusterIP",
                "rayStartParams": {},
                "template": {"spec": {"containers": [head_container], "volumes": volumes}},
            },
            "workerGroupSpecs": [{
                "groupName": "workers",
                "replicas": workers,
                "minReplicas": workers,
                "maxReplicas": workers,
                "rayStartParams": {},
                "template": {"spec": {"containers": [worker_container], "volumes": volumes}},
            }],
        },
    }


HEADER = ("# Generated by `python -m vllm_zerocopy_testbed.cluster.kuberay --write` from compose/ (do not edit:\n"
          "# change compose/.env and regenerate). KubeRay >= 1.1 (ray.io/overwrite-container-cmd);\n"
          "# the image must be in a registry your nodes pull from. docs/multihost.md.\n")


class _Dumper(yaml.SafeDumper):
    def ignore_aliases(self, data: Any) -> bool:  # plain YAML: no &id001 anchors for shared parts
        return True


def manifest_text(profile: str) -> str:
    return HEADER + yaml.dump(render(profile), Dumper=_Dumper, sort_keys=False, width=120)


def path_for(profile: str) -> Path:
    return DEPLOY_DIR / f"raycluster-{profile}.yaml"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Render the KubeRay RayCluster manifests from compose/.")
    parser.add_argument("--write", action="store_true", help=f"write them under {DEPLOY_DIR.relative_to(REPO_ROOT)}")
    args = parser.parse_args(argv)
    for profile in ("cpu", "gpu"):
        if args.write:
            DEPLOY_DIR.mkdir(parents=True, exist_ok=True)
            path_for(profile).write_text(manifest_text(profile))
            print(f"wrote {path_for(profile).relative_to(REPO_ROOT)}")
        else:
            print(manifest_text(profile), end="---\n")


if __name__ == "__main__":
    main()
