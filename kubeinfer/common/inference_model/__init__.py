"""One typed reading of the InferenceModel resource, shared by the operator (what to build) and the gateway
(priorities, fallbacks, what to scale up): fields.py holds the values, read.py turns the object's dict into
them with every problem named by its field."""
from __future__ import annotations

from .fields import (Adapter, AdapterPool, Autoscaling, EngineSpec, InferenceModel, Parallelism, Resources, Routing,
                     SourceT)
from .read import EngineChecks, SourceReader, read_inference_model, read_spec, uri_of

__all__ = ["Adapter", "AdapterPool", "Autoscaling", "EngineChecks", "EngineSpec", "InferenceModel", "Parallelism",
           "Resources", "Routing", "SourceReader", "SourceT", "read_inference_model", "read_spec", "uri_of"]
