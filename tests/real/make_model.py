"""Build the tiny Qwen3 model the real-engine tests serve, with nothing downloaded.

No model can be fetched here, and the tests need an engine's behaviour, not a
model's quality: random bf16 weights in a Qwen3 shape (about 5 M parameters,
so vLLM's CPU build starts and steps fast) and a byte-level BPE tokenizer
trained on the Python standard library's sources, with a ChatML chat template.
Runs in the engine's environment (transformers, tokenizers, torch). The
directory is rebuilt only when this file changed since it was built.

Usage: python tests/real/make_model.py DIR
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
import sysconfig
from pathlib import Path

VOCAB = 8192
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
TRAINING_BYTES = 4 << 20
"""Enough standard-library text for an 8k vocabulary; more only makes training slower."""
STAMP = "BUILT"


def _training_text() -> list[str]:
    """The first few MiB of the standard library's sources, in a fixed order (the same tokenizer every build)."""
    texts, size = [], 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        texts.append(text)
        size += len(text)
        if size >= TRAINING_BYTES:
            break
    return texts


def _tokenizer(out: Path) -> dict[str, int]:
    """Train and save the tokenizer; returns the special tokens' ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(_training_text(), trainer=trainer)
    tokenizer.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 2048, "add_bos_token": False,
        "bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "unk_token": None,
        "chat_template": CHATML}, indent=1))
    return {token: tokenizer.token_to_id(token) for token in SPECIALS}


def _weights(out: Path, ids: dict[str, int]) -> None:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(vocab_size=VOCAB, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=64, intermediate_size=768, tie_word_embeddings=True,
                         max_position_embeddings=4096, bos_token_id=ids["<|endoftext|>"],
                         eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"], torch_dtype="bfloat16")
    torch.manual_seed(0)
    Qwen3ForCausalLM(config).to(torch.bfloat16).save_pretrained(out, safe_serialization=True)


def build(out: Path) -> None:
    """Build into a sibling folder and move it in place, so a half-built model is never served."""
    digest = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()
    if (out / STAMP).is_file() and (out / STAMP).read_text().strip() == digest:
        return
    work = out.with_name(out.name + ".partial")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    _weights(work, _tokenizer(work))
    (work / STAMP).write_text(digest + "\n")
    shutil.rmtree(out, ignore_errors=True)
    work.rename(out)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    build(Path(sys.argv[1]))
