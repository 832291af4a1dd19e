"""gpt-oss's replies in its harmony format (`--reasoning-parser gpt_oss`, vLLM's name), read from the reply's
text with its special tokens kept:

    <|channel|>analysis<|message|>THINKING<|end|><|start|>assistant<|channel|>final<|message|>ANSWER<|return|>

Messages on the `analysis` channel are the reasoning; those on `final` (and `commentary` messages addressed to
no tool: preambles) are the content. A reply that does not open with a header is all content. While the reply
streams, a tail that may still become a tag is held back, so that each split is a prefix of the next.
"""
from __future__ import annotations

from dataclasses import dataclass

from .tool_stream import open_tag_prefix

START, CHANNEL, MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
ENDS = ("<|end|>", "<|return|>", "<|call|>")
TAGS = (START, CHANNEL, MESSAGE, *ENDS)


@dataclass(frozen=True)
class HarmonyReasoningParser:
    name: str = "gpt_oss"
    keeps_special_tokens: bool = True  # the channel headers are special tokens

    def split(self, text: str, finished: bool) -> tuple[str, str]:
        """(reasoning, content) of the reply so far; both grow by appending as the reply grows."""
        head = text.lstrip()
        if not finished and any(tag.startswith(head) for tag in (CHANNEL, START)):
            return "", ""  # may still become a header
        if not head.startswith((CHANNEL, START)):  # not harmony: all content
            content = _strip_tags(text)
            return "", content if finished else content[:len(content) - max(open_tag_prefix(content, t) for t in TAGS)]
        reasoning, content = [], []
        for header, body, closed in _messages(text):
            if not closed and not finished:
                body = body[:len(body) - max(open_tag_prefix(body, tag) for tag in TAGS)]
            channel = header.split(" ", 1)[0].strip()
            if channel == "analysis":
                reasoning.append(body)
            elif channel == "final" or (channel == "commentary" and "to=" not in header):
                content.append(body)
        return "".join(reasoning), "".join(content)


def _messages(text: str):
    """(header, body, closed) of each message whose body has begun (its header complete)."""
    at = text.find(CHANNEL)
    while at != -1:
        header_start = at + len(CHANNEL)
        body_at = text.find(MESSAGE, header_start)
        if body_at == -1:
            return  # the header is still being written
        body_start = body_at + len(MESSAGE)
        ends = [i for i in (text.find(tag, body_start) for tag in ENDS) if i != -1]
        end = min(ends) if ends else len(text)
        yield text[header_start:body_at], text[body_start:end], bool(ends)
        at = text.find(CHANNEL, end)


def _strip_tags(text: str) -> str:
    for tag in ENDS:
        text = text.replace(tag, "")
    return text
