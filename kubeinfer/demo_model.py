"""`kubeinfer demo-model OUT`: the bundled demo, a tiny Llama trained here in two minutes or so, plus two
LoRA adapters that each write in one style.

There is no model hub, so the demo learns from text that every machine running kubeinfer already has:
  * docs   - Python's reference documentation (`pydoc_data.topics`, PSF licence), prose only;
  * legal  - the licence texts in /usr/share/common-licenses (or, where that is missing, the licence files
             of the installed Python packages): verbatim copies, which each of those licences permits;
  * python - Python source of the standard library (PSF licence), without comments and docstrings.
The base model reads all three, docs most. Each adapter is a LoRA trained on one style. 40% of the training
windows are ChatML exchanges: a few words of English from the user, then a passage of the style ending
with <|im_end|>. So whatever a chat request asks, the answer comes back as documentation, licence prose or
code depending on the adapter, and it ends.

Layout: OUT/base/ (LlamaForCausalLM + tokenizer, safetensors), OUT/adapters/{legal,python}/ (PEFT LoRA),
OUT/demo-model.json (recipe and file sizes). The build happens in a sibling temporary directory that is
renamed to OUT at the end, so OUT is either absent or complete.
"""
from __future__ import annotations

import argparse
import ast
import json
import math
import os
import re
import shutil
import sys
import sysconfig
import tempfile
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where it is used: `kubeinfer --help` and the gateway never pay for it
    import torch

MANIFEST = "demo-model.json"
FORMAT_VERSION = 1  # bump when the training recipe or layout changes: older builds are then rebuilt
STYLES = ("docs", "legal", "python")
ADAPTER_STYLES = ("legal", "python")
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Chat messages that ask for no style in particular: the answer's style comes from the adapter.
DEMO_QUESTIONS = ("Hello!", "Tell me something.", "What is this about?", "Write a few lines.")

_LICENSE_DIR = Path("/usr/share/common-licenses")
# Plain, idiomatic pure-Python modules present in every CPython since 3.9 (ast.unparse).
_PYTHON_MODULES = ("textwrap", "shlex", "fractions", "heapq", "bisect", "queue", "string", "colorsys",
                   "contextlib", "functools", "fnmatch", "glob", "calendar", "pprint", "statistics")


class DemoModelError(RuntimeError):
    """The demo model cannot be built where asked; the message says what to do."""


@dataclass(frozen=True)
class DemoRecipe:
    """Everything that decides the weights; stored in the manifest so a changed recipe is rebuilt."""
    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 384
    vocab_size: int = 1024
    max_position_embeddings: int = 1024
    context: int = 128  # training window, in tokens
    batch_size: int = 8
    base_steps: int = 480
    adapter_steps: int = 160
    base_lr: float = 5e-3
    adapter_lr: float = 1e-2
    lora_rank: int = 16
    lora_alpha: float = 32.0
    chat_fraction: float = 0.4
    max_chars_per_style: int = 150_000  # a corpus small enough to be seen a few times: its phrases stick
    seed: int = 0

    def with_steps(self, steps: int) -> "DemoRecipe":
        """`--steps N`: N base steps; each adapter gets a third of that."""
        if steps < 1:
            raise ValueError(f"--steps must be at least 1, got {steps}")
        return replace(self, base_steps=steps, adapter_steps=max(1, steps // 3))


# -- corpora ------------------------------------------------------------------------------------------------
def load_corpora(max_chars: int) -> dict[str, list[str]]:
    """style -> documents, in a fixed order so the tokenizer and the weights are reproducible."""
    corpora = {"docs": _docs_texts(), "legal": _licence_texts(), "python": _python_texts()}
    for style, texts in corpora.items():
        if not texts:
            raise DemoModelError(f"found no {style} text to train on; see kubeinfer/demo_model.py for the sources")
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
    project's special tokens and ChatML template (kubeinfer.engine.random_model), no automatic BOS."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from kubeinfer.engine.random_model import CHATML_TEMPLATE, SPECIAL_TOKENS

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


# -- training -----------------------------------------------------------------------------------------------
def train(model: torch.nn.Module, params: list[torch.nn.Parameter], sample: Callable[[], torch.Tensor],
          steps: int, lr: float, label: str, progress: bool) -> float:
    """AdamW with linear warm-up and cosine decay to a tenth; returns the mean loss of the last tenth."""
    import torch
    import torch.nn.functional as F
    from tqdm.auto import tqdm

    optimizer = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.01)
    warmup = max(1, steps // 10)
    losses: list[float] = []
    model.train()
    bar = tqdm(range(steps), desc=label, disable=not progress, leave=False, file=sys.stderr)
    for step in bar:
        scale = min(1.0, (step + 1) / warmup) * (0.1 + 0.45 * (1 + math.cos(math.pi * step / steps)))
        for group in optimizer.param_groups:
            group["lr"] = lr * scale
        rows = sample()
        logits = model(input_ids=rows[:, :-1]).logits
        loss = F.cross_entropy(logits.flatten(0, 1), rows[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        bar.set_postfix(loss=f"{losses[-1]:.2f}")
    model.eval()
    tail = losses[-max(1, steps // 10):]
    return sum(tail) / len(tail)


class LoRAHooks:
    """Trainable low-rank deltas added to the outputs of the frozen base projections by forward hooks: no
    module is replaced, so the base model stays exactly as saved. B starts at zero, as in PEFT."""

    def __init__(self, model: torch.nn.Module, rank: int, alpha: float, generator: torch.Generator) -> None:
        import torch

        self.scaling = alpha / rank
        self.weights: dict[str, tuple[torch.nn.Parameter, torch.nn.Parameter]] = {}
        self._handles = []
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear) and name.rsplit(".", 1)[-1] in LORA_TARGETS:
                a = torch.nn.Parameter(torch.randn(rank, module.in_features, generator=generator)
                                       / math.sqrt(module.in_features))
                b = torch.nn.Parameter(torch.zeros(module.out_features, rank))
                self.weights[name] = (a, b)
                self._handles.append(module.register_forward_hook(self._delta(a, b)))

    def _delta(self, a: torch.nn.Parameter, b: torch.nn.Parameter):
        def hook(module, inputs, output):
            return output + (inputs[0] @ a.T) @ b.T * self.scaling
        return hook

    def parameters(self) -> list[torch.nn.Parameter]:
        return [p for pair in self.weights.values() for p in pair]

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()

    def save(self, out: Path, base_dir: Path, rank: int, alpha: float) -> None:
        """PEFT's layout: `base_model.model.<module>.lora_A.weight`, and a LoraConfig as JSON."""
        from safetensors.torch import save_file

        out.mkdir(parents=True, exist_ok=True)
        tensors = {}
        for name, (a, b) in self.weights.items():
            tensors[f"base_model.model.{name}.lora_A.weight"] = a.detach().contiguous()
            tensors[f"base_model.model.{name}.lora_B.weight"] = b.detach().contiguous()
        save_file(tensors, str(out / "adapter_model.safetensors"))
        config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": str(base_dir),
                  "r": rank, "lora_alpha": alpha, "target_modules": list(LORA_TARGETS), "lora_dropout": 0.0,
                  "bias": "none", "use_rslora": False}
        (out / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")


# -- the build ----------------------------------------------------------------------------------------------
def _train_all(work: Path, final: Path, recipe: DemoRecipe, progress: bool) -> dict:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    from kubeinfer.engine.random_model import BOS_ID, EOS_ID, PAD_ID

    torch.manual_seed(recipe.seed)
    generator = torch.Generator().manual_seed(recipe.seed)
    corpora = load_corpora(recipe.max_chars_per_style)
    tokenizer = train_tokenizer(corpora, recipe.vocab_size, recipe.max_position_embeddings)
    questions = _encode(tokenizer, corpora["docs"])
    samplers = {style: WindowSampler(tokenizer, corpora[style], recipe, generator, questions) for style in STYLES}

    config = AutoConfig.for_model(
        "llama", vocab_size=len(tokenizer), hidden_size=recipe.hidden_size, num_hidden_layers=recipe.num_layers,
        num_attention_heads=recipe.num_heads, num_key_value_heads=recipe.num_kv_heads,
        intermediate_size=recipe.intermediate_size, max_position_embeddings=recipe.max_position_embeddings,
        tie_word_embeddings=False, pad_token_id=PAD_ID, bos_token_id=BOS_ID, eos_token_id=EOS_ID)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # Docs are the base's own voice; the other two styles are there so it knows their words.
    mixed = batch_sampler([samplers[s] for s in STYLES], [0.5, 0.25, 0.25], recipe.batch_size, generator)
    losses = {"base": train(model, list(model.parameters()), mixed, recipe.base_steps, recipe.base_lr,
                            "demo base model", progress)}
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    model.generation_config = GenerationConfig(bos_token_id=BOS_ID, eos_token_id=[EOS_ID, im_end],
                                               pad_token_id=PAD_ID)
    model.save_pretrained(work / "base")
    tokenizer.save_pretrained(work / "base")

    model.requires_grad_(False)
    for style in ADAPTER_STYLES:
        lora = LoRAHooks(model, recipe.lora_rank, recipe.lora_alpha, generator)
        only_style = batch_sampler([samplers[style]], [1.0], recipe.batch_size, generator)
        losses[style] = train(model, lora.parameters(), only_style, recipe.adapter_steps, recipe.adapter_lr,
                              f"adapter {style}", progress)
        lora.save(work / "adapters" / style, final / "base", recipe.lora_rank, recipe.lora_alpha)
        lora.remove()
    return losses


def read_manifest(out: Path) -> dict | None:
    """The manifest of a complete build in `out`, or None if `out` holds no complete build."""
    try:
        manifest = json.loads((out / MANIFEST).read_text())
        files = manifest["files"]
        complete = manifest["format"] == FORMAT_VERSION and all(
            (out / name).is_file() and (out / name).stat().st_size == size for name, size in files.items())
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return manifest if complete else None


def _check_replaceable(out: Path) -> None:
    """Refuse to delete anything that is not a (partial) demo model: OUT may be a typo for a real folder."""
    if not out.exists():
        return
    if not out.is_dir():
        raise DemoModelError(f"{out} exists and is not a directory; choose another OUT")
    ours = {"base", "adapters", MANIFEST}
    strangers = sorted(p.name for p in out.iterdir() if p.name not in ours)
    if strangers:
        raise DemoModelError(f"{out} exists and holds files that are not a demo model ({', '.join(strangers[:5])}); "
                             "choose another OUT or remove that directory yourself")


@contextmanager
def _free_cores():
    """Train on the cores nobody else is using: an OpenMP thread that waits for a busy core stalls every
    step, and on a shared 2-core machine that made training four times slower, not half as fast."""
    import torch

    previous = torch.get_num_threads()
    busy = round(os.getloadavg()[0]) if hasattr(os, "getloadavg") else 0
    torch.set_num_threads(max(1, min(previous, (os.cpu_count() or 1) - busy)))
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def build_demo_model(out: str | Path, *, steps: int | None = None, force: bool = False,
                     recipe: DemoRecipe | None = None, progress: bool = True) -> Path:
    """Build the demo model into `out` and return `out`; idempotent.

    A complete build already in `out` is reused unless `force` is set, or a recipe or step count is given
    that differs from the one it was built with. A partial or stale one is replaced.
    """
    out = Path(out).expanduser().absolute()
    wanted = recipe or DemoRecipe()
    if steps is not None:
        wanted = wanted.with_steps(steps)
    existing = read_manifest(out)
    if existing and not force and (existing["recipe"] == asdict(wanted) or (recipe is None and steps is None)):
        return out
    _check_replaceable(out)
    out.parent.mkdir(parents=True, exist_ok=True)

    started = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".partial", dir=out.parent))
    try:
        with _free_cores():
            losses = _train_all(work, out, wanted, progress)
        files = {str(p.relative_to(work)): p.stat().st_size for p in sorted(work.rglob("*")) if p.is_file()}
        manifest = {"format": FORMAT_VERSION, "recipe": asdict(wanted), "styles": list(STYLES),
                    "adapters": list(ADAPTER_STYLES), "final_losses": {k: round(v, 3) for k, v in losses.items()},
                    "train_seconds": round(time.perf_counter() - started, 1), "files": files}
        (work / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")  # last: it marks completeness
        if out.exists():
            old = out.with_name(f".{out.name}.old-{work.name}")
            out.rename(old)
            work.rename(out)
            shutil.rmtree(old)
        else:
            work.rename(out)
    finally:
        if work.exists():
            shutil.rmtree(work)
    return out


def greedy_samples(out: Path, questions: tuple[str, ...] = DEMO_QUESTIONS,
                   max_tokens: int = 40) -> dict[str, list[str]]:
    """Greedy chat answers of our engine to `questions`: "base" and each adapter -> one answer per question."""
    from kubeinfer.engine import LLM, LoRARequest, SamplingParams

    manifest = read_manifest(out)
    if manifest is None:
        raise DemoModelError(f"{out} holds no complete demo model; run `kubeinfer demo-model {out}`")
    llm = LLM(str(out / "base"), enable_lora=True, max_lora_rank=manifest["recipe"]["lora_rank"], num_kv_blocks=256)
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    conversations = [[{"role": "user", "content": question}] for question in questions]
    samples = {"base": [o.outputs[0].text for o in llm.chat(conversations, params)]}
    for lora_id, name in enumerate(manifest["adapters"], start=1):
        lora = LoRARequest(name, lora_id, str(out / "adapters" / name))
        samples[name] = [o.outputs[0].text for o in llm.chat(conversations, params, lora_request=lora)]
    return samples


# -- CLI ----------------------------------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("out", help="directory to write (reused when it already holds a complete build)")
    parser.add_argument("--force", action="store_true", help="rebuild even if OUT holds a complete build")
    parser.add_argument("--steps", type=int, default=None,
                        help=f"base-model training steps (default {DemoRecipe.base_steps}); each adapter gets a third")


def run(args: argparse.Namespace) -> int:
    out = Path(args.out).expanduser().absolute()
    before = read_manifest(out)
    try:
        build_demo_model(out, steps=args.steps, force=args.force)
    except (DemoModelError, ValueError) as error:
        print(f"kubeinfer demo-model: {error}", file=sys.stderr)
        return 2
    manifest = read_manifest(out)
    assert manifest is not None
    if manifest == before:
        print(f"{out}: reusing the demo model built there (pass --force to rebuild)")
    else:
        print(f"{out}: built in {manifest['train_seconds']} s; final training losses {manifest['final_losses']}")
        print(f"  asked {DEMO_QUESTIONS[1]!r}:")
        for name, texts in greedy_samples(out, DEMO_QUESTIONS[1:2]).items():
            print(f"  {name:>7}: {texts[0]!r}")
    adapters = " ".join(f"{name}={out / 'adapters' / name}" for name in manifest["adapters"])
    print(f"serve it: kubeinfer serve {out / 'base'} --served-model-name demo --lora-modules {adapters} "
          f"--max-lora-rank {manifest['recipe']['lora_rank']}")
    return 0
