"""A reasoning model's reply split into its thinking and its answer (`--reasoning-parser NAME`, vLLM's
names): the thinking goes to `message.reasoning` (`delta.reasoning` when streamed), the rest to
`content`, where tool calls are then looked for.

  * `deepseek_r1` (DeepSeek-R1 and its distills, QwQ, templates that open `<think>` in the prompt):
    everything up to `</think>` is thinking, with or without a `<think>` of its own; a reply that never
    closes its thinking is all thinking.
  * `gpt_oss` (gpt-oss's harmony channels): harmony_reasoning.py.
  * `qwen3` (Qwen3, whose `enable_thinking` chat_template_kwarg decides): a reply that starts with
    `<think>` thinks until `</think>`; any other reply is all answer (thinking was off).

A parser's `reader()` reads one reply as it streams, delta by delta, looking at each character once
(tag_stream.py): a tail that may still become a tag is held back, so that what it has given out is
always a prefix of the final split and the streamed deltas add up to the non-streamed message.
`split` reads a whole reply (or the reply so far) with a fresh reader.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from .harmony_reasoning import HarmonyReasoningParser
from .tool_stream import open_tag_prefix

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


class ReplyReader(Protocol):
    def feed(self, new: str, finished: bool) -> tuple[str, str]:
        """(new reasoning, new content) once `new` is appended to the reply."""


@dataclass(frozen=True)
class ReasoningParser:
    name: str
    thinks_without_open_tag: bool  # deepseek_r1: the template already opened <think>
    keeps_special_tokens: bool = False  # the reply is read with its special tokens (harmony's headers)

    def reader(self) -> ThinkReader:
        return ThinkReader(self.thinks_without_open_tag)

    def split(self, text: str, finished: bool) -> tuple[str, str]:
        """(reasoning, content) of the reply so far; both grow by appending as the reply grows."""
        return self.reader().feed(text, finished)


class ThinkReader:
    """`<think>` ... `</think>` read delta by delta: the start is held until it is or is not `<think>`,
    the thinking's end until it is or is not `</think>`; the answer after it loses its leading blank."""

    def __init__(self, thinks_without_open_tag: bool) -> None:
        self.thinks_without_open_tag = thinks_without_open_tag
        self.phase = "start"  # start | thinking | answer | plain (no thinking at all)
        self.pending = ""  # the reply's start, or the thinking's end, that may still become a tag
        self.answer_started = False

    def feed(self, new: str, finished: bool) -> tuple[str, str]:
        text, self.pending = self.pending + new, ""
        if self.phase == "start":
            if not finished and THINK_OPEN.startswith(text):
                self.pending = text  # may still be the opening tag
                return "", ""
            if text.startswith(THINK_OPEN):
                text, self.phase = text[len(THINK_OPEN):], "thinking"
            else:
                self.phase = "thinking" if self.thinks_without_open_tag else "plain"
        if self.phase == "plain":
            return "", text
        if self.phase == "answer":
            return "", self._answer(text)
        reasoning, closed, rest = text.partition(THINK_CLOSE)
        if closed:
            self.phase = "answer"
            return reasoning, self._answer(rest)
        held = 0 if finished else open_tag_prefix(reasoning, THINK_CLOSE)
        self.pending = reasoning[len(reasoning) - held:]
        return reasoning[:len(reasoning) - held], ""

    def _answer(self, text: str) -> str:
        if not self.answer_started:  # the template's blank line after </think>
            text = text.lstrip()
            self.answer_started = bool(text)
        return text


REASONING_PARSERS = {"deepseek_r1": ReasoningParser("deepseek_r1", True), "qwen3": ReasoningParser("qwen3", False),
                     "gpt_oss": HarmonyReasoningParser()}


@dataclass
class ReasoningStream:
    """One streamed choice's reply, read as it comes: `feed` takes each delta of the reply's text."""
    parser: ReasoningParser | HarmonyReasoningParser
    read: int = 0  # characters of the reply fed so far
    reader: ReplyReader = field(init=False)
    _content: str = ""
    _new_content: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.reader = self.parser.reader()

    def feed(self, new: str, finished: bool) -> tuple[str, str]:
        """(new reasoning, new content) once `new` is appended to the reply."""
        self.read += len(new)
        reasoning, content = self.reader.feed(new, finished)
        if content:
            self._new_content.append(content)
        return reasoning, content

    @property
    def content(self) -> str:
        """The whole content so far (the tool-call stream reads it whole)."""
        if self._new_content:
            self._content += "".join(self._new_content)
            self._new_content.clear()
        return self._content

    def update(self, text: str, finished: bool) -> tuple[str, str]:
        """(new reasoning, the whole content so far) of the reply so far; reads only what was not fed yet."""
        reasoning, _ = self.feed(text[self.read:], finished)
        return reasoning, self.content
