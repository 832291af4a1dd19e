"""A reasoning model's reply split into its thinking and its answer (`--reasoning-parser NAME`, vLLM's
names): the thinking goes to `message.reasoning` (`delta.reasoning` when streamed), the rest to
`content`, where tool calls are then looked for.

  * `deepseek_r1` (DeepSeek-R1 and its distills, QwQ, templates that open `<think>` in the prompt):
    everything up to `</think>` is thinking, with or without a `<think>` of its own; a reply that never
    closes its thinking is all thinking.
  * `gpt_oss` (gpt-oss's harmony channels): harmony_reasoning.py.
  * `qwen3` (Qwen3, whose `enable_thinking` chat_template_kwarg decides): a reply that starts with
    `<think>` thinks until `</think>`; any other reply is all answer (thinking was off).

`split` reads a reply so far: while it streams, a tail that may still become a tag is held back, so
that every split is a prefix of the next and the streamed deltas add up to the non-streamed message.
"""
from __future__ import annotations

from dataclasses import dataclass

from .harmony_reasoning import HarmonyReasoningParser
from .tool_stream import open_tag_prefix

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


@dataclass(frozen=True)
class ReasoningParser:
    name: str
    thinks_without_open_tag: bool  # deepseek_r1: the template already opened <think>
    keeps_special_tokens: bool = False  # the reply is read with its special tokens (harmony's headers)

    def split(self, text: str, finished: bool) -> tuple[str, str]:
        """(reasoning, content) of the reply so far; both grow by appending as the reply grows."""
        if not finished and THINK_OPEN.startswith(text):
            return "", ""  # may still be the opening tag
        opened = text.startswith(THINK_OPEN)
        if not opened and not self.thinks_without_open_tag:
            return "", text
        body = text[len(THINK_OPEN):] if opened else text
        reasoning, closed, content = body.partition(THINK_CLOSE)
        if not closed:
            return (reasoning if finished else reasoning[:len(reasoning) - open_tag_prefix(reasoning, THINK_CLOSE)]), ""
        content = content.lstrip()  # the template's blank line after </think>
        return reasoning, content


REASONING_PARSERS = {"deepseek_r1": ReasoningParser("deepseek_r1", True), "qwen3": ReasoningParser("qwen3", False),
                     "gpt_oss": HarmonyReasoningParser()}


@dataclass
class ReasoningStream:
    """What one streamed choice has sent of its reasoning and of its content."""
    parser: ReasoningParser | HarmonyReasoningParser
    sent_reasoning: int = 0

    def update(self, text: str, finished: bool) -> tuple[str, str]:
        """(new reasoning, the whole content so far) of the reply so far."""
        reasoning, content = self.parser.split(text, finished)
        new = reasoning[self.sent_reasoning:]
        self.sent_reasoning = len(reasoning)
        return new, content

