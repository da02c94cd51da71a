"""vLLM's prefix-cache block hashes, computed exactly as the engine computes them.

vLLM (v1, the version ``make test-real`` pins) hashes a request's full blocks of ``block_size`` tokens in a
chain: block *i*'s hash is ``H((hash of block i−1, tuple of its token ids, extra keys))``, the first block's
parent being ``NONE_HASH = H(seed)``. ``H`` is SHA-256 over a pickle (``sha256``, the default) or over
canonical CBOR (``sha256_cbor``) of that tuple. The seed is ``PYTHONHASHSEED`` when the engine's environment
sets it, else the fixed ``"vllm-none-hash"``. Extra keys are per block: ``("lora", name, path)`` on every block
of a LoRA request, then ``("cache_salt", salt)`` on the first block only.

KV events carry a hash as its low 64 bits (``int.from_bytes(digest, "big") & (2**64 − 1)``, vLLM's default
``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``), and so does everything here: :meth:`BlockHashing.block_hashes`
returns those ints, the chain itself runs on the full digests.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from hetsched.errors import InputError

DEFAULT_SEED = "vllm-none-hash"
"""The seed of ``NONE_HASH`` when ``PYTHONHASHSEED`` is not set (cryptographic hashes only)."""
LOW_64 = (1 << 64) - 1
BYTES_PER_TOKEN = 4
"""Bytes of UTF-8 text per token id of :func:`text_token_ids` (the router's token estimate uses the same)."""


class HashAlgorithm(StrEnum):
    """vLLM's ``--prefix-caching-hash-algo`` values whose seed can be shared (the ``xxhash`` ones use a random
    per-process seed unless ``PYTHONHASHSEED`` is set, and are left out)."""

    SHA256 = "sha256"
    SHA256_CBOR = "sha256_cbor"


def _sha256_pickle(value: Any) -> bytes:
    return hashlib.sha256(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def _sha256_cbor(value: Any) -> bytes:
    import cbor2  # only engines started with sha256_cbor need it

    return hashlib.sha256(cbor2.dumps(value, canonical=True)).digest()


def external(digest: bytes) -> int:
    """The 64-bit form of a block hash that KV events carry."""
    return int.from_bytes(digest, "big") & LOW_64


@dataclass(frozen=True)
class BlockHashing:
    """How one engine hashes its prefix-cache blocks: its block size, algorithm and seed."""

    block_size: int = 16
    algorithm: HashAlgorithm = HashAlgorithm.SHA256
    seed: str = DEFAULT_SEED
    none_hash: bytes = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise InputError(f"expected a positive number of tokens, got {self.block_size}", field="block_size")
        try:
            object.__setattr__(self, "algorithm", HashAlgorithm(self.algorithm))
        except ValueError:
            raise InputError(f"expected one of {', '.join(HashAlgorithm)}, got {self.algorithm!r}",
                             field="prefix_caching_hash_algo") from None
        object.__setattr__(self, "none_hash", self._hash(self.seed))

    def _hash(self, value: Any) -> bytes:
        return _sha256_pickle(value) if self.algorithm is HashAlgorithm.SHA256 else _sha256_cbor(value)

    def block_hashes(self, token_ids: Sequence[int], *, lora: tuple[str, str] | None = None,
                     cache_salt: str | None = None) -> list[int]:
        """The 64-bit hashes of ``token_ids``' full blocks, first to last (a partial last block has none).

        ``lora`` is the request's adapter (name, path); ``cache_salt`` the salt of the request's first block.
        """
        size = self.block_size
        blocks = len(token_ids) // size
        lora_keys: list[tuple[str, ...]] = [("lora", *lora)] if lora is not None else []
        out: list[int] = []
        parent = self.none_hash
        if self.algorithm is HashAlgorithm.SHA256 and lora is None and cache_salt is None:
            dumps, sha256, protocol = pickle.dumps, hashlib.sha256, pickle.HIGHEST_PROTOCOL
            for start in range(0, blocks * size, size):
                parent = sha256(dumps((parent, tuple(token_ids[start:start + size]), None), protocol)).digest()
                out.append(int.from_bytes(parent, "big") & LOW_64)
            return out
        for index, start in enumerate(range(0, blocks * size, size)):
            keys = lora_keys + ([("cache_salt", cache_salt)] if index == 0 and cache_salt else [])
            parent = self._hash((parent, tuple(token_ids[start:start + size]), tuple(keys) if keys else None))
            out.append(external(parent))
        return out


def text_token_ids(text: str) -> list[int]:
    """Deterministic token ids of ``text`` where no tokenizer is known: one per 4 bytes of its UTF-8 (the last
    zero-padded), the same count the router estimates. The router and the simulated worker both use it, so
    their block hashes agree without a model's tokenizer."""
    data = text.encode()
    if not data:
        return [0]
    padded = data + bytes(-len(data) % BYTES_PER_TOKEN)
    return [int.from_bytes(padded[i:i + BYTES_PER_TOKEN], "little") for i in range(0, len(padded), BYTES_PER_TOKEN)]
