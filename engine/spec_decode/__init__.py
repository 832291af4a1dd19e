"""Speculative decoding: propose a few tokens cheaply, verify them all in one forward pass of the model.

    config              `--speculative-config` / `LLM(speculative_config=...)`, parsed and checked (vLLM's keys)
    ngram               the n-gram (prompt lookup) proposer: continue a match of the sequence's last tokens
    rejection_sampler   keep the drafts the target model agrees with, exactly (greedy) or in distribution
    speculator          per step: who speculates (batch size, acceptance), verification, counters

The core engine asks the speculator for drafts before scheduling (`Sequence.spec_token_ids`), the
scheduler computes them as extra query tokens, the model runner hands their logits to `verify`, and the
scheduler keeps the K/V of the accepted ones (`Scheduler.accept_drafts`).
"""
