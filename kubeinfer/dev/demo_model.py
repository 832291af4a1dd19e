"""`kubeinfer demo-model OUT`: the bundled demo, a tiny Llama trained here in two minutes or so, plus two
LoRA adapters that each write in one style.

There is no model hub, so the demo learns from text that every machine running kubeinfer already has:
  * docs   - Python's reference documentation (`pydoc_data.topics`, PSF licence), prose only;
  * legal  - the licence texts in /usr/share/common-licenses (or, where that is missing, the licence files
             of the installed Python packages): verbatim copies, which each of those licences permits;
  * python - Python source of the standard library (PSF licence), without comments and docstrings.
The base model reads all three, docs most. Each adapter is a LoRA trained on one style. 40% of the training
windows are ChatML exchanges: a few words of English from the user, then a passage of the style ending
with <|im_end|>. So whatever a chat request asks, the answer comes back as documentation, licence prose or
code depending on the adapter, and it ends.

Layout: OUT/base/ (LlamaForCausalLM + tokenizer, safetensors), OUT/adapters/{legal,python}/ (PEFT LoRA),
OUT/draft/ (a one-layer Llama distilled from the base, for speculative decoding), OUT/demo-model.json
(recipe and file sizes). The build happens in a sibling temporary directory that is
renamed to OUT at the end, so OUT is either absent or complete.
"""
from __future__ import annotations

# The code lives in the kubeinfer.dev.demo package (recipe, corpus, training, build, cli); this module keeps the
# names the rest of kubeinfer and the tests use, and is what `kubeinfer demo-model` loads (add_arguments, run).
from kubeinfer.dev.demo.build import build_demo_model, greedy_samples, read_manifest
from kubeinfer.dev.demo.cli import add_arguments, run
from kubeinfer.dev.demo.corpus import load_corpora
from kubeinfer.dev.demo.recipe import MANIFEST, DemoModelError, DemoRecipe
from kubeinfer.dev.demo.training import LoRAHooks

__all__ = ["MANIFEST", "DemoModelError", "DemoRecipe", "LoRAHooks", "add_arguments", "build_demo_model",
           "greedy_samples", "load_corpora", "read_manifest", "run"]
