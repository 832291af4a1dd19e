"""Pieces for reading a streamed reply once, left to right: each update looks at the new text plus a
tail of at most one tag's length held back from the update before (a tag may be split across deltas),
never at the whole reply again. Re-reading the whole reply at every delta made a long streamed reply
cost time quadratic in its length, on the event loop (issue #44: 32,000 deltas took 5.5 s).
"""
from __future__ import annotations

from .tool_stream import open_tag_prefix


def held_tail(text: str, tags: tuple[str, ...]) -> int:
    """How many trailing characters of `text` could begin one of `tags`."""
    return max(open_tag_prefix(text, tag) for tag in tags)


class TagStripper:
    """Removes every occurrence of one tag from a stream, as `str.replace(tag, "")` does on the whole text:
    matches are found in the text as written (a removal never makes a new match)."""

    def __init__(self, tag: str) -> None:
        self.tag = tag
        self.pending = ""  # the end of the text so far that may still become the tag

    def feed(self, new: str, finished: bool) -> str:
        text, self.pending = self.pending + new, ""
        kept, at = [], 0
        while (found := text.find(self.tag, at)) != -1:
            kept.append(text[at:found])
            at = found + len(self.tag)
        held = 0 if finished else open_tag_prefix(text[at:], self.tag)
        kept.append(text[at:len(text) - held])
        self.pending = text[len(text) - held:]
        return "".join(kept)


class TailHolder:
    """Passes a stream on, holding back a tail that may still become one of `tags`."""

    def __init__(self, tags: tuple[str, ...]) -> None:
        self.tags = tags
        self.pending = ""

    def feed(self, new: str, finished: bool) -> str:
        text = self.pending + new
        held = 0 if finished else held_tail(text, self.tags)
        self.pending = text[len(text) - held:]
        return text[:len(text) - held]
