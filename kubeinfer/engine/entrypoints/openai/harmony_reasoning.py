"""gpt-oss's replies in its harmony format (`--reasoning-parser gpt_oss`, vLLM's name), read from the reply's
text with its special tokens kept:

    <|channel|>analysis<|message|>THINKING<|end|><|start|>assistant<|channel|>final<|message|>ANSWER<|return|>

Messages on the `analysis` channel are the reasoning; those on `final` (and `commentary` messages addressed to
no tool: preambles) are the content. A reply that does not open with a header is all content, its end tags
removed. While the reply streams, a tail that may still become a tag is held back, so that what was given out
is always a prefix of the final split; each delta is read once (tag_stream.py), never the whole reply again.
"""
from __future__ import annotations

from dataclasses import dataclass

from .tag_stream import TagStripper, TailHolder, held_tail

START, CHANNEL, MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
ENDS = ("<|end|>", "<|return|>", "<|call|>")
TAGS = (START, CHANNEL, MESSAGE, *ENDS)


@dataclass(frozen=True)
class HarmonyReasoningParser:
    name: str = "gpt_oss"
    keeps_special_tokens: bool = True  # the channel headers are special tokens

    def reader(self) -> HarmonyReader:
        return HarmonyReader()

    def split(self, text: str, finished: bool) -> tuple[str, str]:
        """(reasoning, content) of the reply so far; both grow by appending as the reply grows."""
        return self.reader().feed(text, finished)


class HarmonyReader:
    """One reply read delta by delta. Phases: `start` (leading blanks, then whether a header opens it),
    `plain` (not harmony: the end tags removed), then harmony's `seek` (the next `<|channel|>`), `header`
    (up to `<|message|>`) and `body` (up to an end tag, routed by its header's channel)."""

    def __init__(self) -> None:
        self.phase = "start"
        self.blanks: list[str] = []  # the reply's leading whitespace, kept for a reply that is not harmony
        self.pending = ""  # the reply's first characters after the blanks, or a tail that may become a tag
        self.header: list[str] = []
        self.route: str | None = None  # where the body in progress goes: "reasoning", "content" or None
        self.plain = [*(TagStripper(tag) for tag in ENDS), TailHolder(TAGS)]

    def feed(self, new: str, finished: bool) -> tuple[str, str]:
        if self.phase == "start":
            start = self._start(new, finished)
            if start is None:
                return "", ""
            new = start
        if self.phase == "plain":
            for stage in self.plain:
                new = stage.feed(new, finished)
            return "", new
        return self._harmony(new, finished)

    def _start(self, new: str, finished: bool) -> str | None:
        """The whole reply so far once it is known whether a header opens it; None while it may still."""
        if not self.pending:
            head = new.lstrip()
            self.blanks.append(new[:len(new) - len(head)])
        else:
            head = self.pending + new
        if not finished and any(tag.startswith(head) for tag in (CHANNEL, START)):
            self.pending = head  # may still become a header
            return None
        self.pending = ""
        self.phase = "seek" if head.startswith((CHANNEL, START)) else "plain"
        return "".join(self.blanks) + head

    def _harmony(self, new: str, finished: bool) -> tuple[str, str]:
        text, self.pending = self.pending + new, ""
        out: dict[str | None, list[str]] = {"reasoning": [], "content": [], None: []}
        at = 0
        while True:
            if self.phase == "seek":
                found = text.find(CHANNEL, at)
                if found == -1:
                    self.pending = "" if finished else self._hold(text, at, (CHANNEL,))
                    break
                at, self.phase, self.header = found + len(CHANNEL), "header", []
            elif self.phase == "header":
                found = text.find(MESSAGE, at)
                if found == -1:  # the header is still being written
                    self.pending = self._hold(text, at, (MESSAGE,))
                    self.header.append(text[at:len(text) - len(self.pending)])
                    break
                self.route = route("".join(self.header) + text[at:found])
                at, self.phase = found + len(MESSAGE), "body"
            else:
                ends = [(i, tag) for tag in ENDS if (i := text.find(tag, at)) != -1]
                if ends:
                    end, tag = min(ends)
                    out[self.route].append(text[at:end])
                    at, self.phase = end + len(tag), "seek"
                    continue
                self.pending = "" if finished else self._hold(text, at, TAGS)
                out[self.route].append(text[at:len(text) - len(self.pending)])
                break
        return "".join(out["reasoning"]), "".join(out["content"])

    @staticmethod
    def _hold(text: str, at: int, tags: tuple[str, ...]) -> str:
        """The end of text[at:] that may still become one of tags."""
        rest = text[at:] if len(text) - at < 16 else text[-16:]  # no tag is longer
        held = min(held_tail(rest, tags), len(text) - at)
        return text[len(text) - held:]


def route(header: str) -> str | None:
    """Where a message's body goes, by its header: its channel, and the tool it is addressed to."""
    channel = header.split(" ", 1)[0].strip()
    if channel == "analysis":
        return "reasoning"
    if channel == "final" or (channel == "commentary" and "to=" not in header):
        return "content"
    return None
