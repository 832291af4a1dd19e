"""Issue #44 finding 7: a streamed reply's reasoning parser reads each delta once, not the whole reply again
at every delta (that was quadratic, on the event loop: 32,000 deltas cost 5.5 s with gpt_oss). Wall time
would be a flaky measure; these count the characters of the reply's text the parser touches per delta, and
check that tags split across deltas (down to one character each) are still found."""
from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from kubeinfer.engine.entrypoints.openai.harmony_reasoning import HarmonyReader
from kubeinfer.engine.entrypoints.openai.reasoning_parsers import REASONING_PARSERS, ThinkReader
from kubeinfer.engine.entrypoints.openai.serving_chat import ChatFormat

LONG = 3000  # characters of thinking and of answer: 6,000+ deltas of 1 to 3 characters
REPLIES = {
    "deepseek_r1": "<think>" + "x < y " * (LONG // 6) + "</think>\n\n" + "y" * LONG,
    "qwen3": "<think>" + "a</thi" * (LONG // 6) + "</think>\n" + "b<think>" * (LONG // 8),
    "gpt_oss": ("<|channel|>analysis<|message|>" + "think <| " * (LONG // 9) + "<|end|><|start|>assistant"
                "<|channel|>final<|message|>" + "z" * LONG + "<|return|>"),
}
MOST_HELD = 16  # no tag is longer: the tail a reader may hold back between deltas


class Scanned:
    characters = 0


class CountingStr(str):
    """A reply's text that counts the characters of every operation that reads it."""

    def _count(self) -> None:
        Scanned.characters += len(self)

    def __getitem__(self, key):
        self._count()
        return super().__getitem__(key)

    def __contains__(self, item) -> bool:
        self._count()
        return super().__contains__(item)


for _name in ("find", "rfind", "index", "partition", "rpartition", "split", "startswith", "endswith", "lstrip",
              "rstrip", "strip", "replace", "count", "splitlines", "encode"):
    def _counted(self, *args, _method=getattr(str, _name), **kwargs):
        self._count()
        return _method(self, *args, **kwargs)
    setattr(CountingStr, _name, _counted)


@dataclass
class Completion:
    text: str = ""
    finish_reason: str | None = None
    stop_reason: str | None = None
    token_ids: list[int] = field(default_factory=list)
    logprobs: None = None


def deltas_of(text: str) -> list[str]:
    sizes, out, at = (1, 2, 3), [], 0
    while at < len(text):
        out.append(text[at:at + sizes[len(out) % 3]])
        at += len(out[-1])
    return out


@pytest.mark.parametrize("name", sorted(REPLIES))
def test_each_streamed_delta_is_read_once(name):
    """Through chat's streamed chunks as the server makes them: the parser touches the new text (and a held
    tail), never the whole reply so far; the deltas still add up to the non-streamed split."""
    parser, reply = REASONING_PARSERS[name], REPLIES[name]
    fmt = ChatFormat("m", False, reasoning=parser)
    completion, reasoning, content, worst = Completion(), "", "", 0
    deltas = deltas_of(reply)
    for number, delta in enumerate(deltas):
        text_from = len(completion.text)
        completion.text = CountingStr(completion.text + delta)
        completion.finish_reason = "stop" if number == len(deltas) - 1 else None
        Scanned.characters = 0
        chunk = fmt.chunk("id", 0, CountingStr(delta), completion, 0, text_from)
        worst = max(worst, Scanned.characters - len(delta))
        if chunk is not None:
            reasoning += chunk["choices"][0]["delta"].get("reasoning", "")
            content += chunk["choices"][0]["delta"].get("content", "")
        reader = fmt.reasoning_streams[0].reader
        assert len(reader.pending) <= MOST_HELD, (number, len(reader.pending))
    assert worst <= MOST_HELD, f"{worst} characters read beyond a delta"
    assert (reasoning, content) == parser.split(reply, True)
    assert reasoning and content


@pytest.mark.parametrize("name,reply,expected", [
    ("deepseek_r1", "<think>thought</think>\n\nanswer", ("thought", "answer")),
    ("qwen3", "<think>a</thi</think>\n\nb<think>c", ("a</thi", "b<think>c")),
    ("gpt_oss", "  <|start|>assistant<|channel|>analysis<|message|>a<|end|><|start|>assistant<|channel|>final"
                "<|message|>b<|return|>", ("a", "b")),
    ("gpt_oss", "<|channel|>commentary to=functions.f<|message|>{}<|call|><|channel|>final<|message|>ok",
     ("", "ok")),
    ("gpt_oss", "plain <|ret<|end|>urn|> text<|return|>", ("", "plain  text")),  # as str.replace, tag by tag
])
def test_tags_split_across_one_character_deltas_are_found(name, reply, expected):
    parser = REASONING_PARSERS[name]
    reader = parser.reader()
    assert isinstance(reader, (ThinkReader, HarmonyReader))
    pieces = [reader.feed(char, False) for char in reply] + [reader.feed("", True)]
    assert ("".join(p[0] for p in pieces), "".join(p[1] for p in pieces)) == expected == parser.split(reply, True)
