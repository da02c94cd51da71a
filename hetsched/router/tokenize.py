"""Prompts as a vLLM engine tokenizes them, so block hashes computed here match the engine's.

vLLM (0.32) tokenizes a completion's text with the model's special tokens added (``add_special_tokens=True``,
a BOS where the tokenizer's post-processor puts one). A chat is first rendered with the model's chat template
as HF transformers' ``apply_chat_template`` renders it (a sandboxed Jinja environment with ``trim_blocks``,
``lstrip_blocks``, loop controls, ``raise_exception``, a ``tojson`` that keeps non-ASCII text, and the
variables ``messages``, ``add_generation_prompt`` and the special tokens), and the result is tokenized without
adding special tokens: the template writes them. Token-id prompts are used as given.

Without the model's tokenizer, :func:`prompt_token_ids` falls back to
:func:`hetsched.kvcache.hashing.text_token_ids` of the prompt's text, which the router and the simulated worker
share.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

from jinja2 import Template, TemplateError, nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.parser import Parser
from jinja2.runtime import Macro
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from hetsched.errors import InputError
from hetsched.kvcache.hashing import text_token_ids
from hetsched.router.openai import ChatRequest, CompletionRequest, OpenAIRequest, prompt_text
from hetsched.specs.files import parse_json, read_text

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
TEMPLATE_FILE = "chat_template.jinja"
"""Where newer transformers save the chat template (it wins over the config's, as transformers reads it)."""
SPECIAL_TOKENS = ("bos_token", "eos_token")


class TokenizeError(InputError):
    """A prompt the model's tokenizer or chat template refuses; the message says why."""


class _Generation(Extension):
    """transformers' ``{% generation %}`` block, which marks assistant text for training masks: rendered as is."""

    tags = {"generation"}

    def parse(self, parser: Parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Macro) -> str:
        return str(caller())


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    """transformers' ``tojson``: Jinja's own escapes HTML characters, which would change the prompt."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


@lru_cache(maxsize=32)
def compile_template(source: str) -> Template:
    """A chat template compiled once per text, as transformers compiles it."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def _special_token(value: Any) -> str | None:
    """A special token as ``tokenizer_config.json`` writes it: its text, or an AddedToken with ``content``."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _template_text(directory: Path, config: dict[str, Any], *, field: str) -> str | None:
    if (directory / TEMPLATE_FILE).is_file():
        return read_text(directory / TEMPLATE_FILE, field=field)
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: transformers uses "default"
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default", next(iter(named.values()), None))
    if template is not None and not isinstance(template, str):
        raise InputError(f"{directory / CONFIG_FILE}: expected chat_template as text, got "
                         f"{type(template).__name__}", field=field)
    return template


def chat_messages(request: ChatRequest) -> list[dict[str, str]]:
    """The messages as a chat template sees them: role and content as a string (text parts joined by newlines,
    as vLLM's string content format joins them)."""
    messages = []
    for message in request.messages:
        content = message.content
        if isinstance(content, list):
            content = "\n".join(part.text for part in content if part.text is not None)
        messages.append({"role": message.role, "content": content or ""})
    return messages


def given_token_ids(request: OpenAIRequest) -> list[int] | None:
    """A completion's token-id prompt (the first of a batch, as the prompt's length counts it); None for text."""
    if not isinstance(request, CompletionRequest) or not isinstance(request.prompt, list) or not request.prompt:
        return None
    first = request.prompt[0]
    if isinstance(first, str):
        return None
    if isinstance(first, list):
        return list(first)
    return [token for token in request.prompt if isinstance(token, int)]


@dataclass(frozen=True)
class PromptTokenizer:
    """A model's tokenizer and chat template; :meth:`load` loads them from a model directory."""

    tokenizer: Tokenizer
    chat_template: str | None = None
    special_tokens: tuple[tuple[str, str], ...] = ()
    """``bos_token`` and ``eos_token`` where the model names them; the chat template sees them."""
    source: str = ""
    """Where it was loaded from, for messages."""

    @classmethod
    def load(cls, directory: str | Path, *, field: str = "tokenizer") -> PromptTokenizer:
        """Load ``tokenizer.json`` and, if present, ``tokenizer_config.json``'s chat template and special tokens;
        an InputError under ``field`` names the file that is missing or unusable."""
        directory = Path(directory)
        path = directory / TOKENIZER_FILE
        if not path.is_file():
            raise InputError(f"no {TOKENIZER_FILE} in {directory}; expected the directory of a Hugging Face model "
                             f"(the one holding its tokenizer.json)", field=field)
        try:
            tokenizer = Tokenizer.from_str(read_text(path, field=field))
        except InputError:
            raise
        except Exception as exc:  # the tokenizers library raises plain Exceptions for a file it cannot load
            raise InputError(f"{path} is not a tokenizers file: {exc}", field=field) from exc
        config: dict[str, Any] = {}
        config_path = directory / CONFIG_FILE
        if config_path.is_file():
            raw = parse_json(read_text(config_path, field=field), name=str(config_path), field=field)
            if not isinstance(raw, dict):
                raise InputError(f"{config_path}: expected a JSON object", field=field)
            config = raw
        template = _template_text(directory, config, field=field)
        if template is not None:
            try:
                compile_template(template)
            except TemplateError as exc:
                raise InputError(f"the chat template in {directory} does not compile: {exc}", field=field) from exc
        specials = tuple((name, token) for name in SPECIAL_TOKENS if (token := _special_token(config.get(name))))
        return cls(tokenizer, template, specials, str(directory))

    def encode(self, text: str, *, add_special_tokens: bool) -> list[int]:
        try:
            return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)
        except Exception as exc:  # the tokenizers library raises plain Exceptions
            raise TokenizeError(f"the tokenizer of {self.source or 'the model'} failed on the prompt: {exc}",
                                field="prompt") from exc

    def render_chat(self, messages: list[dict[str, str]], *, add_generation_prompt: bool = True) -> str:
        """The chat as the model's template renders it for the engine."""
        if self.chat_template is None:
            raise TokenizeError(f"the tokenizer of {self.source or 'the model'} has no chat template (as vLLM, a "
                                f"chat needs one); send a completion instead", field="messages")
        try:
            return str(compile_template(self.chat_template).render(
                messages=messages, tools=None, documents=None, add_generation_prompt=add_generation_prompt,
                **dict(self.special_tokens)))
        except Exception as exc:  # a template is foreign code: raise_exception, a bad filter, a type error
            raise TokenizeError(f"the chat template refused the messages: {exc}", field="messages") from exc

    def token_ids(self, request: OpenAIRequest) -> list[int]:
        """The prompt's token ids as the engine computes them (see the module docstring)."""
        given = given_token_ids(request)
        if given is not None:
            return given
        if isinstance(request, ChatRequest):
            ids = self.encode(self.render_chat(chat_messages(request)), add_special_tokens=False)
        else:
            ids = self.encode(prompt_text(request), add_special_tokens=True)
        if not ids:
            raise TokenizeError("the prompt is empty once tokenized; the engine needs at least one token",
                                field="messages" if isinstance(request, ChatRequest) else "prompt")
        return ids


def prompt_token_ids(request: OpenAIRequest, tokenizer: PromptTokenizer | None) -> list[int]:
    """The prompt's token ids: the model's own with ``tokenizer``, else the shared text fallback."""
    if tokenizer is not None:
        return tokenizer.token_ids(request)
    given = given_token_ids(request)
    return given if given is not None else text_token_ids(prompt_text(request))
