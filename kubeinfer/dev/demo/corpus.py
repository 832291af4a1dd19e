"""The demo's training text (docs, legal and python styles), the BPE tokenizer trained on it, and the
random training windows drawn from it."""
from __future__ import annotations

import ast
import re
import sysconfig
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from kubeinfer.dev.demo.recipe import DemoModelError, DemoRecipe

if TYPE_CHECKING:  # torch is imported where it is used: `kubeinfer --help` and the gateway never pay for it
    import torch

_LICENSE_DIR = Path("/usr/share/common-licenses")
# Plain, idiomatic pure-Python modules present in every CPython since 3.9 (ast.unparse).
_PYTHON_MODULES = ("textwrap", "shlex", "fractions", "heapq", "bisect", "queue", "string", "colorsys",
                   "contextlib", "functools", "fnmatch", "glob", "calendar", "pprint", "statistics")


# -- corpora ------------------------------------------------------------------------------------------------
def load_corpora(max_chars: int) -> dict[str, list[str]]:
    """style -> documents, in a fixed order so the tokenizer and the weights are reproducible."""
    corpora = {"docs": _docs_texts(), "legal": _licence_texts(), "python": _python_texts()}
    for style, texts in corpora.items():
        if not texts:
            raise DemoModelError(f"found no {style} text to train on; see kubeinfer/dev/demo/corpus.py for the sources")
    return {style: _truncate(texts, max_chars) for style, texts in corpora.items()}


def _docs_texts() -> list[str]:
    try:
        from pydoc_data.topics import topics
    except ImportError:
        raise DemoModelError("this Python has no pydoc_data (its documentation topics), which the demo model "
                             "trains on; use a full CPython install") from None
    return [_prose(topics[key]) for key in sorted(topics)]


def _prose(topic: str) -> str:
    """Keep the paragraphs of a documentation topic, not its code samples, grammar rules and tables
    (indented, or drawn with | + = *): they would blur the line between the docs and python styles."""
    lines = [line for line in topic.splitlines()
             if not line.startswith("   ") and not re.fullmatch(r"[\s|+=*-]+", line) and "|" not in line]
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines))


def _licence_texts() -> list[str]:
    if _LICENSE_DIR.is_dir():  # Debian and derivatives; GPL -> GPL-3 and the like are symlinks
        files = sorted(p for p in _LICENSE_DIR.iterdir() if p.is_file() and not p.is_symlink())
        return [p.read_text(encoding="utf-8", errors="replace") for p in files]
    from importlib import metadata  # elsewhere: the licences shipped inside installed packages

    texts: set[str] = set()
    for dist in metadata.distributions():
        for file in dist.files or ():
            if file.name.upper().startswith(("LICENSE", "LICENCE", "COPYING")):
                try:
                    texts.add((file.read_text(encoding="utf-8") or "").strip())
                except (OSError, UnicodeDecodeError):
                    continue
    return sorted(t for t in texts if t)


def _python_texts() -> list[str]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = [stdlib / f"{module}.py" for module in _PYTHON_MODULES]
    return [_code_only(file.read_text(encoding="utf-8")) for file in files if file.is_file()]


def _code_only(source: str) -> str:
    """The module without docstrings and comments (ast.unparse drops those): English there would blur
    the python style into the docs one."""
    tree = ast.parse(source)
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body
                and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)):
            node.body = body[1:] or [ast.Pass()]
    return ast.unparse(tree)


def _truncate(texts: list[str], max_chars: int) -> list[str]:
    kept, total = [], 0
    for text in texts:
        if total >= max_chars:
            break
        kept.append(text[:max_chars - total])
        total += len(kept[-1])
    return kept


# -- tokenizer ----------------------------------------------------------------------------------------------
def train_tokenizer(corpora: dict[str, list[str]], vocab_size: int, max_length: int):
    """Byte-level BPE with GPT-2's split (runs of spaces stay tokens: code's indentation is cheap), the
    project's special tokens and ChatML template (kubeinfer.dev.testing.random_model), no automatic BOS."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from kubeinfer.dev.testing.random_model import CHATML_TEMPLATE, SPECIAL_TOKENS

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([text for texts in corpora.values() for text in texts], trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|eos|>",
                                   pad_token="<|pad|>", additional_special_tokens=["<|im_start|>", "<|im_end|>"],
                                   clean_up_tokenization_spaces=False, model_max_length=max_length)
    fast.chat_template = CHATML_TEMPLATE
    return fast


# -- training data ------------------------------------------------------------------------------------------
class WindowSampler:
    """Random training rows of `context + 1` tokens in one style: plain slices of its text or, with
    probability `chat_fraction`, ChatML exchanges. In those the user says a few words of plain English (a
    snippet of the docs) and the answer is a passage of this style from a line start: whatever the user
    asks, the style of the answer comes from the weights, so an adapter changes it."""

    def __init__(self, tokenizer, texts: list[str], recipe: DemoRecipe, generator: torch.Generator,
                 questions: torch.Tensor | None = None) -> None:
        import torch

        self.stream = _encode(tokenizer, texts)
        if len(self.stream) < recipe.context + 2:
            raise DemoModelError(f"a corpus of {len(self.stream)} tokens is too short for {recipe.context}-token "
                                 "windows")
        newline = torch.tensor(["\n" in tokenizer.decode([i]) for i in range(len(tokenizer))])[self.stream]
        starts = newline[:-recipe.context] & ~newline[1:1 - recipe.context]  # text right after a line break
        self.line_starts = (torch.nonzero(starts).flatten() + 1).tolist() or [0]
        self.questions = self.stream if questions is None else questions
        self.length = recipe.context + 1
        self.chat_fraction = recipe.chat_fraction
        self.generator = generator
        self.user = tokenizer.encode("<|im_start|>user\n")
        self.assistant = tokenizer.encode("<|im_end|>\n<|im_start|>assistant\n")
        self.end = tokenizer.encode("<|im_end|>\n")

    def _randint(self, low: int, high: int) -> int:
        import torch

        return int(torch.randint(low, high, (), generator=self.generator))

    def row(self) -> list[int]:
        import torch

        if float(torch.rand((), generator=self.generator)) >= self.chat_fraction:
            start = self._randint(0, len(self.stream) - self.length)
            return self.stream[start:start + self.length].tolist()
        row: list[int] = []
        while len(row) < self.length:
            asked = self._randint(0, len(self.questions) - 16)
            question = self.questions[asked:asked + self._randint(3, 13)].tolist()
            start = self.line_starts[self._randint(0, len(self.line_starts))]
            answer = self.stream[start:start + self._randint(16, 65)].tolist()
            row += self.user + question + self.assistant + answer + self.end
        return row[:self.length]


def _encode(tokenizer, texts: list[str]) -> torch.Tensor:
    """All texts as one token stream, blank lines between them."""
    import torch

    separator = tokenizer.encode("\n\n")
    ids: list[int] = []
    for encoding in tokenizer.backend_tokenizer.encode_batch(texts):  # the raw tokenizer: no length warning
        ids += encoding.ids + separator
    return torch.tensor(ids)


def batch_sampler(samplers: list[WindowSampler], weights: list[float], batch_size: int,
                  generator: torch.Generator) -> Callable[[], torch.Tensor]:
    """Each row's style is drawn by `weights`, so a mixed corpus is mixed in every batch."""
    import torch

    probabilities = torch.tensor(weights, dtype=torch.float)

    def sample() -> torch.Tensor:
        picks = torch.multinomial(probabilities, batch_size, replacement=True, generator=generator)
        return torch.tensor([samplers[int(i)].row() for i in picks])
    return sample
