"""The reference behaves as the model's definition on every transformers release the tests meet (the GPU image
has 5.17): tests/transformers_fixes.py gives older releases the upstream fixes, and these fail without them."""
import torch


def test_gpt_oss_experts_clamp_at_the_configs_limit():
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    config = GptOssConfig(hidden_size=8, intermediate_size=8, num_local_experts=2, swiglu_limit=1.5)
    config.swiglu_alpha = 1.25
    experts = GptOssExperts(config)
    assert (experts.limit, experts.alpha) == (1.5, 1.25)  # before 5.19: 7.0 and 1.702 whatever the config said


def test_gemma2_attention_defaults_to_eager_which_caps_the_scores():
    from transformers import AutoModelForCausalLM, Gemma2Config

    config = Gemma2Config(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                          num_attention_heads=2, num_key_value_heads=1, head_dim=8, attn_logit_softcapping=3.0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    assert model.config._attn_implementation == "eager"  # before 5.21: "sdpa", which ignores the cap
