"""Speculative decoding: propose a few tokens cheaply, verify them all in one forward pass of the model.

    config              `--speculative-config` / `LLM(speculative_config=...)`, parsed and checked (vLLM's keys)
    ngram               the n-gram (prompt lookup) proposer: continue a match of the sequence's last tokens
    draft_model         a smaller model's greedy guesses, its KV cache paged by the target's block tables
    rejection_sampler   keep the drafts the target model agrees with, exactly (greedy) or in distribution
    speculator          per step: who speculates (batch size, acceptance, step costs), verification, counters
    step_costs          the batch-1 switch: a verify step's measured tokens/s against a plain step's

The core engine asks the speculator for drafts before scheduling (`Sequence.spec_token_ids`; a draft
model's are placeholders, written by `DraftModel.fill` once the scheduler has given their slots), the
scheduler computes them as extra query tokens (on the CPU as one-token queries on the native decode path:
ModelRunner.verify_as_decodes), the model runner hands their logits to `verify`, and the
scheduler keeps the K/V of the accepted ones (`Scheduler.accept_drafts`).
"""
