"""Tiny models for the end-to-end suite, written as the docs say (`kubeinfer random-model`) into directories the
node mounts: a hostPath PersistentVolume bound to a claim per directory (the kit has no provisioner), and a
`file://` folder under the operator's allowed host-path prefix."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from e2e_cluster import NAMESPACE, ROOT, apply, kubectl

MODEL_ARGS = ["--hidden-size", "64", "--num-layers", "2", "--num-heads", "4", "--num-kv-heads", "2"]
PVS = {"models": "kubeinfer-e2e-models", "adapters": "kubeinfer-e2e-adapters"}


def write_model(path: Path) -> Path:
    """`kubeinfer random-model PATH` (the CLI a user runs), once per directory."""
    if not (path / "config.json").exists():
        subprocess.run([sys.executable, "-m", "kubeinfer.cli", "random-model", str(path), *MODEL_ARGS], check=True,
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    return path


def write_adapter(path: Path, model: Path, seed: int) -> Path:
    """A random LoRA adapter in PEFT's layout for `model` (the test builders' writer; no CLI makes one)."""
    if not (path / "adapter_config.json").exists():
        code = ("import sys; from kubeinfer.dev.testing.random_model import build_random_adapter; "
                "build_random_adapter(sys.argv[1], sys.argv[2], rank=4, seed=int(sys.argv[3]))")
        subprocess.run([sys.executable, "-c", code, str(path), str(model), str(seed)], check=True,
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    return path


def volume(name: str, host_dir: Path) -> None:
    """A hostPath PersistentVolume for host_dir and the claim `name` bound to it (in the release namespace)."""
    pv = PVS[name]
    kubectl("delete", "pv", pv, "--wait=true", "--timeout=60s", namespace=None, check=False, timeout=90)
    apply({"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": pv},
           "spec": {"capacity": {"storage": "1Gi"}, "accessModes": ["ReadWriteOnce"], "storageClassName": "",
                    "persistentVolumeReclaimPolicy": "Retain", "hostPath": {"path": str(host_dir), "type": "Directory"},
                    "claimRef": {"namespace": NAMESPACE, "name": name}}}, namespace=None)
    apply({"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": name},
           "spec": {"accessModes": ["ReadWriteOnce"], "storageClassName": "", "volumeName": pv,
                    "resources": {"requests": {"storage": "1Gi"}}}})


def inference_model(name: str, uri: str, replicas: int = 1, standby: int = 0, adapters: list[dict] | None = None,
                    cpu: str = "200m", env: dict[str, str] | None = None) -> dict:
    spec: dict = {"model": {"uri": uri, "servedName": name},
                  "engine": {"dtype": "float32", "maxModelLen": 256,
                             "resources": {"gpus": 0, "cpu": cpu, "memory": "1Gi"}},
                  "replicas": replicas}
    if env:
        spec["engine"]["env"] = [{"name": k, "value": v} for k, v in env.items()]
    if standby:
        spec["standby"] = {"replicas": standby}
    if adapters:
        spec["adapters"] = adapters
        spec["adapterPool"] = {"maxLorasPerReplica": len(adapters), "maxLoraRank": 8,
                               "replicasPerAdapter": replicas}
    return {"apiVersion": "serving.kubeinfer.io/v1alpha1", "kind": "InferenceModel", "metadata": {"name": name},
            "spec": spec}


def hub_standin(engine_image: str) -> str:
    """The hub stand-in (hub_standin.py) in a pod of the engine image, serving the `models` claim's tiny model as
    every repository; returns its HF_ENDPOINT (the Service's ClusterIP: pods may have no cluster DNS)."""
    script = Path(__file__).with_name("hub_standin.py")
    apply({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "hub-standin"},
           "data": {"hub_standin.py": script.read_text()}})
    labels = {"app": "hub-standin"}
    apply({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "hub-standin", "labels": labels},
           "spec": {"securityContext": {"runAsUser": 1000, "runAsGroup": 1000, "runAsNonRoot": True},
                    "containers": [{"name": "hub", "image": engine_image, "imagePullPolicy": "IfNotPresent",
                                    "command": ["python", "/hub/hub_standin.py", "/models", "8000"],
                                    "ports": [{"containerPort": 8000}],
                                    "readinessProbe": {"tcpSocket": {"port": 8000}, "periodSeconds": 1},
                                    "volumeMounts": [{"name": "script", "mountPath": "/hub"},
                                                     {"name": "models", "mountPath": "/models", "subPath": "tiny",
                                                      "readOnly": True}]}],
                    "volumes": [{"name": "script", "configMap": {"name": "hub-standin"}},
                                {"name": "models", "persistentVolumeClaim": {"claimName": "models",
                                                                             "readOnly": True}}]}},
          {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "hub-standin"},
           "spec": {"selector": labels, "ports": [{"port": 8000, "targetPort": 8000}]}})
    kubectl("wait", "pod/hub-standin", "--for=condition=Ready", "--timeout=120s", timeout=150)
    ip = kubectl("get", "service", "hub-standin", "-o", "jsonpath={.spec.clusterIP}").stdout.strip()
    return f"http://{ip}:8000"
