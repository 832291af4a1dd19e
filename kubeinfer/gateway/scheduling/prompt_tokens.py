"""A request's prompt as the engine's token ids, for the precise prefix scorer.

The gateway has no model hub: it reads the model's own tokenizer files from a directory
(`--tokenizer [MODEL=]DIR`: `tokenizer.json`, `tokenizer_config.json` and, when separate,
`chat_template.jinja`), the directory the engine loads (a shared volume, or a copy of the four small files
in a ConfigMap). Only `tokenizers` (Rust) and `jinja2` are used, not transformers: the gateway image has
no torch. Chat requests are rendered with the model's chat template and encoded without adding special
tokens (the template writes them), completions' prompts with them, as the engine does
(kubeinfer/engine/entrypoints/openai/serving_chat.py). Token ids given as the prompt are used as they are.
A request this cannot tokenize (no tokenizer for its model, a template error) gets None: the picker then
scores it with the approximate index.
"""
from __future__ import annotations

import json
import logging
from datetime import datetime
from pathlib import Path

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

logger = logging.getLogger(__name__)


class PromptTokenizer:
    def __init__(self, directory: str | Path) -> None:
        directory = Path(directory)
        if not (directory / "tokenizer.json").is_file():
            raise ValueError(f"--tokenizer: {directory} has no tokenizer.json")
        self.tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
        config_path = directory / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        template = config.get("chat_template")
        if (directory / "chat_template.jinja").is_file():
            template = (directory / "chat_template.jinja").read_text()
        if isinstance(template, list):  # named templates: the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        self.special = {name: _token_text(config.get(name)) for name in ("bos_token", "eos_token", "unk_token",
                                                                           "pad_token")}
        self.template = _compile(template) if template else None

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def render_chat(self, messages: list[dict]) -> str:
        return self.template.render(messages=[_for_template(m) for m in messages], add_generation_prompt=True,
                                    **self.special)

    def prompt_ids(self, body: dict) -> list[int] | None:
        """The token ids the engine will see for this body, or None when they cannot be known here."""
        if "messages" in body:
            if self.template is None or not isinstance(body["messages"], list):
                return None
            return self.encode(self.render_chat(body["messages"]), add_special_tokens=False)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt:
            prompt = prompt[0] if isinstance(prompt[0], (str, list)) else prompt  # a batch: the first
        if isinstance(prompt, str):
            return self.encode(prompt, add_special_tokens=True)
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return prompt
        return None


class Tokenizers:
    """One tokenizer per model (`MODEL=DIR`), and a default (`DIR`) for the rest (adapters share their base's)."""

    def __init__(self, specs: list[str] | None = None) -> None:
        self.by_model: dict[str, PromptTokenizer] = {}
        self.default: PromptTokenizer | None = None
        for spec in specs or []:
            model, sep, directory = spec.rpartition("=")
            tokenizer = PromptTokenizer(directory)
            if sep:
                self.by_model[model] = tokenizer
            else:
                self.default = tokenizer

    def prompt_ids(self, model: str, body: dict | None) -> list[int] | None:
        tokenizer = self.by_model.get(model, self.default)
        if tokenizer is None or not isinstance(body, dict):
            return None
        try:
            return tokenizer.prompt_ids(body)
        except Exception as error:  # noqa: BLE001 -- a template error is the engine's to report; route approximately
            logger.debug("prompt of a %s request not tokenized: %s", model, error)
            return None


def _token_text(value) -> str | None:
    return value.get("content") if isinstance(value, dict) else value


def _for_template(message) -> dict:
    if not isinstance(message, dict):
        return {}
    content = message.get("content")
    if isinstance(content, list):  # content parts: their text, as the engine's for_template joins them
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
    return {**message, "content": content}


def _raise(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _compile(source: str) -> jinja2.Template:
    """As transformers compiles chat templates: sandboxed, trim_blocks/lstrip_blocks, tojson keeping non-ASCII."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda x, indent=None, separators=None, sort_keys=False: json.dumps(
        x, ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys)
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)
