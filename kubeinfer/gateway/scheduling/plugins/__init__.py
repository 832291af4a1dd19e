"""The scheduling plugins kubeinfer ships, one small module per concern; importing this package registers them
by type name (registry.py). A new plugin is one module here, with its `register_*` decorator, and one import
line below."""
# isort: skip_file -- the scorers register in the order the known ones are listed (queue first)
from . import admission, load_filters  # noqa: F401 -- filters
from . import load_scorers, lora, prefix, affinity  # noqa: F401 -- scorers
from . import pickers, profile_handler  # noqa: F401
