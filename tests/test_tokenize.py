"""Prompts tokenized as vLLM tokenizes them: a model's tokenizer, its chat template, the text fallback, errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, processors

from hetsched.errors import InputError
from hetsched.kvcache.hashing import text_token_ids
from hetsched.router.openai import ApiKind, OpenAIRequest, parse_request, prompt_text
from hetsched.router.tokenize import PromptTokenizer, TokenizeError, compile_template, prompt_token_ids

WORDS = ["[UNK]", "<s>", "</s>", "<|im_start|>", "<|im_end|>", "user", "assistant", "system", "hello", "world",
         "you", "are", "kind", ",", "!"]
CHATML = ("{{ bos_token }}{% for message in messages %}"
          "{% if message['role'] == 'tool' %}{{ raise_exception('tool messages are not supported') }}{% endif %}"
          "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def write_tokenizer(directory: Path, *, template: str | None = CHATML) -> Path:
    """A word-level tokenizer that adds ``<s>`` as its special token, with a ChatML template."""
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.add_special_tokens(["<s>", "</s>", "<|im_start|>", "<|im_end|>"])
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    config: dict[str, object] = {"bos_token": {"content": "<s>", "special": True}, "eos_token": "</s>"}
    if template is not None:
        config["chat_template"] = template
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


def chat(*messages: tuple[str, str]) -> OpenAIRequest:
    body = {"model": "m", "messages": [{"role": role, "content": content} for role, content in messages]}
    return parse_request(json.dumps(body).encode(), ApiKind.CHAT)


def completion(prompt: object) -> OpenAIRequest:
    return parse_request(json.dumps({"model": "m", "prompt": prompt}).encode(), ApiKind.COMPLETIONS)


@pytest.fixture
def tokenizer(tmp_path: Path) -> PromptTokenizer:
    return PromptTokenizer.load(write_tokenizer(tmp_path / "model"))


def test_a_chat_renders_the_template_and_adds_no_special_tokens(tokenizer: PromptTokenizer) -> None:
    request = chat(("system", "you are kind"), ("user", "hello world!"))
    assert tokenizer.render_chat([{"role": "system", "content": "you are kind"},
                                  {"role": "user", "content": "hello world!"}]) == (
        "<s><|im_start|>system\nyou are kind<|im_end|>\n<|im_start|>user\nhello world!<|im_end|>\n"
        "<|im_start|>assistant\n")
    assert tokenizer.token_ids(request) == [1, 3, 7, 10, 11, 12, 4, 3, 5, 8, 9, 14, 4, 3, 6]  # one <s>: the template's


def test_content_parts_join_as_one_string(tokenizer: PromptTokenizer) -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "hello"},
                                                                    {"type": "text", "text": "world"}]}]}
    request = parse_request(json.dumps(body).encode(), ApiKind.CHAT)
    assert tokenizer.token_ids(request) == tokenizer.token_ids(chat(("user", "hello\nworld")))


def test_a_completion_gets_the_tokenizers_special_tokens(tokenizer: PromptTokenizer) -> None:
    assert tokenizer.token_ids(completion("hello world!")) == [1, 8, 9, 14]
    assert prompt_token_ids(completion("hello world!"), tokenizer) == [1, 8, 9, 14]


def test_token_id_prompts_are_used_as_given(tokenizer: PromptTokenizer) -> None:
    assert prompt_token_ids(completion([7, 8, 900]), tokenizer) == [7, 8, 900]
    assert prompt_token_ids(completion([[5, 6], [7]]), None) == [5, 6]


def test_without_a_tokenizer_the_text_fallback_is_used() -> None:
    request = chat(("user", "hello world!"))
    assert prompt_token_ids(request, None) == text_token_ids(prompt_text(request))
    assert prompt_token_ids(completion("abcdefgh"), None) == text_token_ids("abcdefgh")


def test_tojson_keeps_text_as_written() -> None:
    assert compile_template("{{ x | tojson }}").render(x="é <b>") == '"é <b>"'


def test_a_directory_without_tokenizer_json_is_an_input_error(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="no tokenizer.json in") as caught:
        PromptTokenizer.load(tmp_path, field="--tokenizer")
    assert caught.value.field == "--tokenizer"


def test_a_template_that_does_not_compile_is_refused_at_load(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="does not compile"):
        PromptTokenizer.load(write_tokenizer(tmp_path, template="{% for m in messages %}"))


def test_a_template_that_raises_is_a_tokenize_error(tokenizer: PromptTokenizer) -> None:
    with pytest.raises(TokenizeError, match="tool messages are not supported") as caught:
        tokenizer.token_ids(chat(("tool", "hello")))
    assert caught.value.field == "messages"


def test_a_chat_without_a_template_is_a_tokenize_error(tmp_path: Path) -> None:
    plain = PromptTokenizer.load(write_tokenizer(tmp_path, template=None))
    with pytest.raises(TokenizeError, match="no chat template"):
        plain.token_ids(chat(("user", "hello")))
    assert plain.token_ids(completion("hello")) == [1, 8]


def test_a_chat_template_file_wins_over_the_config(tmp_path: Path) -> None:
    directory = write_tokenizer(tmp_path)
    (directory / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    assert PromptTokenizer.load(directory).token_ids(chat(("user", "hello world"))) == [8, 9]
