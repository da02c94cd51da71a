"""vLLM's block hashes and KV-event wire format, against values vLLM 0.32.0 itself produced.

The expected hashes come from ``vllm.v1.core.kv_cache_utils.hash_block_tokens`` chained over tokens
1000..1082 in blocks of 16 (after ``init_none_hash`` with each algorithm, ``PYTHONHASHSEED`` unset), as
``maybe_convert_block_hash`` publishes them; the payload is ``msgspec.msgpack.Encoder().encode`` of a
``KVEventBatch`` (``ts=1.5``, rank 0) holding a BlockStored, a BlockRemoved and an AllBlocksCleared.
"""

from __future__ import annotations

import pytest

from hetsched.errors import InputError
from hetsched.kvcache.events import (AllBlocksCleared, BlockRemoved, BlockStored, KVEvent, MalformedEvents, decode,
                                     encode)
from hetsched.kvcache.hashing import BlockHashing, HashAlgorithm, text_token_ids

TOKENS = list(range(1000, 1083))
VLLM_HASHES = {
    HashAlgorithm.SHA256: [7322446309363477352, 17027874615116373601, 2147986591436168966, 12280578781915239197, 13619628191913177295],
    HashAlgorithm.SHA256_CBOR: [3753563854825738204, 2378715151359315973, 4593614550377271087, 935822303561933385, 4980197726310962171],
}
VLLM_LORA_SALT_HASHES = {
    HashAlgorithm.SHA256: [7011492421891693790, 10642182375770174453, 17187626336809529809, 4030479834009599733, 13535356241909557427],
    HashAlgorithm.SHA256_CBOR: [2622957354590935096, 8360770456795382319, 9738541745108284158, 17589069694505261951, 15994988213950613165],
}
VLLM_PAYLOAD = bytes.fromhex(
    "93cb3ff80000000000009388a474797065ab426c6f636b53746f726564ac626c6f636b5f686173686573920102b1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f69647393010203aa626c6f636b5f73697a6510a76c6f72615f6964c0a66d656469756da3475055a96c6f72615f6e616d65c083a474797065ac426c6f636b52656d6f766564ac626c6f636b5f6861736865739102a66d656469756da347505581a474797065b0416c6c426c6f636b73436c656172656400")


@pytest.mark.parametrize("algorithm", list(HashAlgorithm))
def test_block_hashes_equal_vllm_s(algorithm: HashAlgorithm) -> None:
    hashing = BlockHashing(16, algorithm)
    assert hashing.block_hashes(TOKENS) == VLLM_HASHES[algorithm]  # 5 full blocks; the last 3 tokens have none
    assert hashing.block_hashes(TOKENS, lora=("ad", "/p"), cache_salt="salt") == VLLM_LORA_SALT_HASHES[algorithm]


def test_equal_leading_tokens_give_equal_leading_hashes_and_the_seed_changes_them_all() -> None:
    hashing = BlockHashing(16)
    a, b = hashing.block_hashes(TOKENS), hashing.block_hashes(TOKENS[:40] + [7] * 43)
    assert a[:2] == b[:2] and a[2] != b[2]
    assert not set(BlockHashing(16, seed="42").block_hashes(TOKENS)) & set(a)


def test_a_bad_block_size_or_algorithm_is_refused_at_its_field() -> None:
    with pytest.raises(InputError, match="block_size"):
        BlockHashing(0)
    with pytest.raises(InputError, match="prefix_caching_hash_algo.*xxhash"):
        BlockHashing(16, "xxhash")  # type: ignore[arg-type]


def test_text_token_ids_are_one_per_four_bytes() -> None:
    assert len(text_token_ids("abcdefghi")) == 3 and text_token_ids("") == [0]
    assert text_token_ids("abcd") == [int.from_bytes(b"abcd", "little")]


def test_decode_reads_what_vllm_publishes() -> None:
    topic, batch = decode([b"kv", (5).to_bytes(8, "big"), VLLM_PAYLOAD])
    assert topic == b"kv" and batch.sequence == 5 and batch.ts == 1.5 and batch.data_parallel_rank == 0
    assert batch.events == (BlockStored((1, 2), None, (1, 2, 3), 16), BlockRemoved((2,)), AllBlocksCleared())


def test_encode_round_trips_and_bytes_hashes_are_read_as_their_low_64_bits() -> None:
    events: list[KVEvent] = [BlockStored((1 << 63, 5), 9, (1, 2), 16, "CPU"), BlockRemoved((5,), "CPU"), AllBlocksCleared()]
    assert decode(encode(b"", 3, events, ts=2.0))[1].events == tuple(events)
    import msgpack
    raw = msgpack.packb([0.0, [{"type": "BlockRemoved", "block_hashes": [bytes(24) + (7).to_bytes(8, "big")],
                                "medium": None}]])
    assert decode([b"", bytes(8), raw])[1].events == (BlockRemoved((7,)),)
    array_form = msgpack.packb([0.0, [["BlockStored", [4], None, [], 16, None, None]]])  # vLLM before 0.11
    assert decode([b"", bytes(8), array_form])[1].events == (BlockStored((4,), None, (), 16),)


@pytest.mark.parametrize(("frames", "reason"), [
    ([b"", bytes(8)], "frames"),
    ([b"", bytes(4), b"\x90"], "frames"),
    ([b"", bytes(8), b"\xc1"], "msgpack"),
    ([b"", bytes(8), b"\x93\x00"], "msgpack"),
    ([b"", bytes(8), b"\x01"], "schema"),
])
def test_malformed_frames_are_refused_with_their_reason(frames: list[bytes], reason: str) -> None:
    with pytest.raises(MalformedEvents) as caught:
        decode(frames)
    assert caught.value.reason == reason


def test_an_unknown_event_tag_and_a_bad_field_are_refused() -> None:
    import msgpack
    with pytest.raises(MalformedEvents) as caught:
        decode([b"", bytes(8), msgpack.packb([0.0, [{"type": "BlockMoved"}]])])
    assert caught.value.reason == "unknown_tag"
    with pytest.raises(MalformedEvents) as caught:
        decode([b"", bytes(8), msgpack.packb([0.0, [{"type": "BlockStored", "block_hashes": [1], "block_size": 0}]])])
    assert caught.value.reason == "schema"
