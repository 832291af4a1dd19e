"""Upstream fixes for the transformers releases whose references differ from the models' definitions.

The tests check the engine against transformers' greedy tokens. Releases before these fixes compute other tokens
on our tiny test models (found on the GPU image's transformers 5.17, reproduced on the CPU):

- Gemma 2, fixed in 5.21 (`Gemma2PreTrainedModel._supports_sdpa = False`, "sdpa does not support softcapping"):
  before it, `from_pretrained` picks SDPA by default, and SDPA silently drops `attn_logit_softcapping`. Eager
  attention (the default from 5.21) caps the scores.
- gpt-oss, fixed in 5.19: `GptOssExperts` hard-codes `alpha = 1.702` and `limit = 7.0`, ignoring the config's
  `swiglu_alpha` and `swiglu_limit` (our test model sets the limit to 1.5 so that the clamps bite).

On those releases `apply()` (called by conftest.py) gives the reference the fixed behaviour, so that the tests
check the engine against the model's definition rather than against a bug. On fixed releases it does nothing,
and imports nothing. (MXFP4 dequantized to bfloat16 whatever the dtype, fixed in 5.23, is handled where
tests/engine/test_gpt_oss.py loads it.)
"""
from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from packaging.version import Version

GEMMA2_SDPA_DROPS_SOFTCAP = Version("5.21")  # the first release that no longer does
GPT_OSS_IGNORES_SWIGLU_CONFIG = Version("5.19")
MXFP4_DEQUANTIZES_TO_BF16 = Version("5.23")


def transformers_version() -> Version:
    try:
        return Version(version("transformers"))
    except PackageNotFoundError:
        return Version("0")


def apply() -> list[str]:
    """Patch what this transformers release gets wrong; returns the names of the fixes applied."""
    installed, applied = transformers_version(), []
    if Version("5") <= installed < GEMMA2_SDPA_DROPS_SOFTCAP:
        from transformers.models.gemma2 import modeling_gemma2

        modeling_gemma2.Gemma2PreTrainedModel._supports_sdpa = False
        applied.append("gemma2-eager-softcap")
    if Version("5") <= installed < GPT_OSS_IGNORES_SWIGLU_CONFIG:
        from transformers.models.gpt_oss import modeling_gpt_oss

        experts = modeling_gpt_oss.GptOssExperts
        hard_coded_init = experts.__init__

        def init_from_config(self, config, *args, **kwargs):
            hard_coded_init(self, config, *args, **kwargs)
            self.alpha = getattr(config, "swiglu_alpha", self.alpha)
            self.limit = getattr(config, "swiglu_limit", self.limit)

        experts.__init__ = init_from_config
        applied.append("gpt-oss-swiglu-config")
    return applied
