"""The spec of `InferencePool` in `inference.networking.k8s.io/v1`, as JSON Schema.

Transcribed from the Gateway API Inference Extension's v1 CRD (config/crd/bases/
inference.networking.k8s.io_inferencepools.yaml, v1.0 API): selector.matchLabels, targetPorts
(1..8 ports), endpointPickerRef (name required; port.number for a Service; kind, group, failureMode).
Only the fields' shapes and limits, no descriptions. kubernetes-validate knows no CRDs, hence this.
"""
from __future__ import annotations

LABEL_VALUE = {"type": "string", "maxLength": 63, "pattern": r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$"}
PORT = {"type": "object", "required": ["number"], "additionalProperties": False,
        "properties": {"number": {"type": "integer", "minimum": 1, "maximum": 65535}}}

INFERENCE_POOL_V1 = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "inference.networking.k8s.io/v1"},
        "kind": {"const": "InferencePool"},
        "metadata": {"type": "object"},
        "spec": {
            "type": "object",
            "required": ["selector", "targetPorts", "endpointPickerRef"],
            "additionalProperties": False,
            "properties": {
                "selector": {"type": "object", "required": ["matchLabels"], "additionalProperties": False,
                             "properties": {"matchLabels": {"type": "object", "additionalProperties": LABEL_VALUE}}},
                "targetPorts": {"type": "array", "minItems": 1, "maxItems": 8, "items": PORT},
                "appProtocol": {"enum": ["http", "kubernetes.io/h2c"]},
                "endpointPickerRef": {
                    "type": "object", "required": ["name"], "additionalProperties": False,
                    "properties": {
                        "group": {"type": "string", "maxLength": 253,
                                  "pattern": r"^$|^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"},
                        "kind": {"type": "string", "minLength": 1, "maxLength": 63,
                                 "pattern": r"^[a-zA-Z]([-a-zA-Z0-9]*[a-zA-Z0-9])?$"},
                        "name": {"type": "string", "minLength": 1, "maxLength": 253},
                        "port": PORT,
                        "failureMode": {"enum": ["FailOpen", "FailClose"]},
                    },
                },
            },
        },
    },
}
