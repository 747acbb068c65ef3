"""The custom resources' structural checks (their CRDs are not available offline): strict JSON schemas for
ServiceMonitor (monitoring.coreos.com/v1) and ScaledObject (keda.sh/v1alpha1), with Kubernetes' own types inside them
by reference to kubernetes-validate's definitions, and a script checking an InferenceService against the kserve SDK's
generated models."""

from __future__ import annotations

from typing import Any

DEFS = "https://kubernetes.io/api/_definitions.json#/$defs/"
METADATA = {"$ref": DEFS + "io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"}
STRINGS = {"type": "object", "additionalProperties": {"type": "string"}}


def strict(properties: dict[str, Any], required: tuple[str, ...] = ()) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "required": list(required), "additionalProperties": False}


def resource(api_version: str, kind: str, spec: dict[str, Any]) -> dict[str, Any]:
    return strict(
        {"apiVersion": {"const": api_version}, "kind": {"const": kind}, "metadata": METADATA, "spec": spec},
        ("apiVersion", "kind", "metadata", "spec"),
    )


# ServiceMonitor and ScaledObject: written from the Prometheus
# Operator's and KEDA's API references (a subset of their fields, each typed; anything else is an error). Kubernetes'
# own types inside them come from the strict schemas.
SERVICE_MONITOR = resource(
    "monitoring.coreos.com/v1",
    "ServiceMonitor",
    strict(
        {
            "selector": {"$ref": DEFS + "io.k8s.apimachinery.pkg.apis.meta.v1.LabelSelector"},
            "namespaceSelector": strict({"any": {"type": "boolean"}, "matchNames": {"type": "array"}}),
            "jobLabel": {"type": "string"},
            "targetLabels": {"type": "array", "items": {"type": "string"}},
            "podTargetLabels": {"type": "array", "items": {"type": "string"}},
            "endpoints": {
                "type": "array",
                "minItems": 1,
                "items": strict(
                    {
                        "port": {"type": "string"},
                        "targetPort": {"type": ["string", "integer"]},
                        "path": {"type": "string", "pattern": "^/"},
                        "scheme": {"enum": ["http", "https"]},
                        "interval": {"type": "string", "pattern": r"^(0|(([0-9]+)(ms|s|m|h))+)$"},
                        "scrapeTimeout": {"type": "string", "pattern": r"^(0|(([0-9]+)(ms|s|m|h))+)$"},
                        "honorLabels": {"type": "boolean"},
                        "relabelings": {"type": "array"},
                        "metricRelabelings": {"type": "array"},
                    }
                ),
            },
        },
        ("selector", "endpoints"),
    ),
)
HPA_BEHAVIOR = {"$ref": DEFS + "io.k8s.api.autoscaling.v2.HorizontalPodAutoscalerBehavior"}
PROMETHEUS_TRIGGER = strict(
    {
        "serverAddress": {"type": "string", "pattern": "^https?://"},
        "query": {"type": "string"},
        "threshold": {"type": "string", "pattern": r"^[0-9.]+$"},
        "activationThreshold": {"type": "string"},
        "namespace": {"type": "string"},
        "customHeaders": {"type": "string"},
        "ignoreNullValues": {"enum": ["true", "false"]},
        "unsafeSsl": {"enum": ["true", "false"]},
        "queryParameters": {"type": "string"},
        "authModes": {"type": "string"},
    },
    ("serverAddress", "query", "threshold"),
)
SCALED_OBJECT = resource(
    "keda.sh/v1alpha1",
    "ScaledObject",
    strict(
        {
            "scaleTargetRef": strict(
                {
                    "apiVersion": {"type": "string"},
                    "kind": {"type": "string"},
                    "name": {"type": "string"},
                    "envSourceContainerName": {"type": "string"},
                },
                ("name",),
            ),
            "pollingInterval": {"type": "integer", "minimum": 1},
            "cooldownPeriod": {"type": "integer", "minimum": 0},
            "initialCooldownPeriod": {"type": "integer", "minimum": 0},
            "idleReplicaCount": {"type": "integer", "minimum": 0},
            "minReplicaCount": {"type": "integer", "minimum": 0},
            "maxReplicaCount": {"type": "integer", "minimum": 1},
            "fallback": strict({"failureThreshold": {"type": "integer"}, "replicas": {"type": "integer"}}),
            "advanced": strict(
                {
                    "restoreToOriginalReplicaCount": {"type": "boolean"},
                    "horizontalPodAutoscalerConfig": strict({"name": {"type": "string"}, "behavior": HPA_BEHAVIOR}),
                    "scalingModifiers": {"type": "object"},
                }
            ),
            "triggers": {
                "type": "array",
                "minItems": 1,
                "items": {
                    **strict(
                        {
                            "type": {"type": "string"},
                            "name": {"type": "string"},
                            "metricType": {"enum": ["AverageValue", "Value", "Utilization"]},
                            "useCachedMetrics": {"type": "boolean"},
                            "authenticationRef": strict({"name": {"type": "string"}, "kind": {"type": "string"}}),
                            "metadata": STRINGS,
                        },
                        ("type", "metadata"),
                    ),
                    "if": {"properties": {"type": {"const": "prometheus"}}},
                    "then": {"properties": {"metadata": PROMETHEUS_TRIGGER}},
                },
            },
        },
        ("scaleTargetRef", "triggers"),
    ),
)

# The InferenceService against the kserve SDK's models, in KEV_DEPLOY_VENV's Python: every key must be a field of
# its model (attribute_map), every value of the field's type (openapi_types), recursively; prints the errors as JSON.
KSERVE_CHECK = r"""
import json, re, sys
import kserve.models as kserve_models
import kubernetes.client.models as k8s_models

def model(name):
    return getattr(kserve_models, name, None) or getattr(k8s_models, name)

def check(value, kind, path, errors):
    # The SDKs spell containers two ways: list[X] / dict(str, X) (kserve) and List[X] / Dict[str, X] (kubernetes).
    listed = re.fullmatch(r"[Ll]ist\[(.*)\]", kind)
    mapped = re.fullmatch(r"dict\(str, (.*)\)|Dict\[str, (.*)\]", kind)
    if listed:
        if not isinstance(value, list):
            return errors.append(f"{path}: a list expected, got {type(value).__name__}")
        for i, item in enumerate(value):
            check(item, listed.group(1), f"{path}[{i}]", errors)
    elif mapped:
        if not isinstance(value, dict):
            return errors.append(f"{path}: a mapping expected, got {type(value).__name__}")
        for key, item in value.items():
            check(item, mapped.group(1) or mapped.group(2), f"{path}.{key}", errors)
    elif kind in ("str", "bytes", "datetime", "date"):
        if not isinstance(value, str):
            errors.append(f"{path}: a string expected, got {value!r}")
    elif kind == "int":
        if not isinstance(value, int) or isinstance(value, bool):
            errors.append(f"{path}: an integer expected, got {value!r}")
    elif kind == "float":
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            errors.append(f"{path}: a number expected, got {value!r}")
    elif kind == "bool":
        if not isinstance(value, bool):
            errors.append(f"{path}: a boolean expected, got {value!r}")
    elif kind == "object":
        pass
    else:
        cls = model(kind)
        if not isinstance(value, dict):
            return errors.append(f"{path}: a {kind} object expected, got {value!r}")
        fields = {json_name: attr for attr, json_name in cls.attribute_map.items()}
        for key, item in value.items():
            if key not in fields:
                errors.append(f"{path}.{key}: not a field of {kind}")
            else:
                check(item, cls.openapi_types[fields[key]], f"{path}.{key}", errors)

errors = []
for obj in json.load(sys.stdin):
    check(obj, "V1beta1InferenceService", obj["kind"] + "/" + obj["metadata"]["name"], errors)
print(json.dumps(errors))
"""
