"""The flow-control layers kubeinfer ships, one small module each; importing this package registers them by type
name (registry.py). A new layer is one module here, with its `register_layer` decorator, and one import line
below."""
# isort: skip_file -- the layers register in their default order (composition.DEFAULT_LAYERS)
from . import tenants, tokenize, fallback, hold, fair_queue  # noqa: F401
