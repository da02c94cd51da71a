"""The router's KV-block index: what each endpoint holds, counted exactly, under stores, removes, clears, growth,
many endpoints and the cap; checked against a plain dict-of-sets model on random operations."""

from __future__ import annotations

import random

import pytest

from hetsched.errors import InputError
from hetsched.kvcache.index import FIBONACCI, LOW_64, MIN_CAPACITY, KVIndex

A, B, C = "http://a:8000", "http://b:8000", "http://c:8000"


def colliding(count: int, *, homes: int, rng: random.Random) -> list[int]:
    """``count`` distinct hashes whose home slots (in the smallest table) are among the ``homes`` last ones, so
    their probe chains are long and wrap round the table's end."""
    inverse = pow(FIBONACCI, -1, 1 << 64)
    bits = MIN_CAPACITY.bit_length() - 1
    found: set[int] = set()
    while len(found) < count:
        home = MIN_CAPACITY - 1 - rng.randrange(homes)
        product = (home << (64 - bits)) | rng.getrandbits(64 - bits)
        found.add(product * inverse & LOW_64)
    return sorted(found - {0, 1})


def test_matches_counts_each_endpoints_leading_blocks() -> None:
    index = KVIndex()
    index.stored(A, [11, 12, 13, 14])
    index.stored(B, [11, 12])
    index.stored(C, [12, 13, 14])  # the same blocks past a miss do not count
    assert index.matches([11, 12, 13, 14, 15], [A, B, C, "http://unknown"]) == {
        A: 4, B: 2, C: 0, "http://unknown": 0}
    assert index.matches([], [A]) == {A: 0}
    assert index.matches([99, 11], [A]) == {A: 0}
    assert index.matches([11], [A], "CPU") == {A: 0}


def test_media_are_separate() -> None:
    index = KVIndex()
    index.stored(A, [1, 2], "CPU")
    index.stored(A, [1], "GPU")
    assert index.matches([1, 2], [A], "CPU") == {A: 2}
    assert index.matches([1, 2], [A], "GPU") == {A: 1}
    assert (index.blocks(A, "CPU"), index.blocks(A), index.entries) == (2, 1, 3)
    index.removed(A, [1, 2], "CPU")
    assert (index.blocks(A, "CPU"), index.blocks(A), index.entries) == (0, 1, 1)


def test_counts_stay_exact_under_repeated_stores_and_unknown_removes() -> None:
    index = KVIndex()
    index.stored(A, [5, 6, 6, 7])
    index.stored(A, [5, 6])
    assert index.blocks(A) == 3
    index.removed(A, [8, 9, 5, 5])
    index.removed(B, [6])
    index.removed(A, [6], "CPU")
    assert (index.blocks(A), index.blocks(B), index.entries) == (2, 0, 2)
    assert index.matches([6, 7], [A]) == {A: 2}


def test_shared_blocks_stay_while_any_endpoint_holds_them() -> None:
    index = KVIndex()
    index.stored(A, [1, 2, 3])
    index.stored(B, [1, 2])
    assert index.entries == 3
    index.removed(A, [1, 2])
    assert index.entries == 3
    assert index.matches([1, 2, 3], [A, B]) == {A: 0, B: 2}
    index.removed(B, [1])
    assert index.entries == 2
    assert index.matches([1, 2], [A, B]) == {A: 0, B: 0}


def test_clear_drops_every_medium_and_forget_frees_the_slot() -> None:
    index = KVIndex()
    index.stored(A, [1, 2])
    index.stored(A, [3], "CPU")
    index.stored(B, [2])
    index.clear(A)
    assert (index.blocks(A), index.blocks(A, "CPU"), index.blocks(B), index.entries) == (0, 0, 1, 1)
    assert index.matches([2], [A, B]) == {A: 0, B: 1}
    index.stored(A, [1])
    index.forget(A)
    index.stored(C, [7])  # takes A's freed slot: none of A's blocks come with it
    assert index.matches([1], [A, C]) == {A: 0, C: 0}
    assert (index.blocks(C), index.entries) == (1, 2)
    index.forget("http://never-seen")
    index.clear("http://never-seen")


def test_hash_zero_is_a_block_like_any_other() -> None:
    index = KVIndex()
    index.stored(A, [0, 5])
    assert index.matches([0, 5], [A]) == {A: 2}
    assert index.entries == 2
    index.removed(A, [0])
    assert (index.matches([0, 5], [A]), index.entries) == ({A: 0}, 1)


def test_more_than_64_endpoints() -> None:
    index = KVIndex()
    index.stored("http://first", [1, 2, 3])  # the table exists before the masks widen
    urls = [f"http://e{i}:8000" for i in range(150)]
    for i, url in enumerate(urls):
        index.stored(url, [1, 2, 3][: i % 4])
        index.stored(url, [1000 + i], "CPU")
    assert index.matches([1, 2, 3], urls) == {url: i % 4 for i, url in enumerate(urls)}
    assert all(index.matches([1000 + i], [url], "CPU") == {url: 1} for i, url in enumerate(urls))
    for url in urls[::2]:
        index.forget(url)
    assert index.matches([1, 2, 3], urls) == {url: i % 4 if i % 2 else 0 for i, url in enumerate(urls)}
    assert index.blocks(urls[-1]) == 149 % 4
    assert index.entries == 3 + 75


def test_growth_and_shrinking_keep_every_entry() -> None:
    rng = random.Random(3)
    blocks = [rng.getrandbits(64) for _ in range(20_000)]
    index = KVIndex()
    for start in range(0, len(blocks), 100):
        index.stored(A, blocks[start:start + 100])
        index.stored(B, blocks[start:start + 100:2])
    assert (index.entries, index.blocks(A), index.blocks(B)) == (20_000, 20_000, 10_000)
    assert index.matches(blocks, [A, B]) == {A: 20_000, B: 1}
    assert all(index.matches([h], [A]) == {A: 1} for h in blocks)
    index.removed(A, blocks[300:])
    index.removed(B, blocks[::2])
    assert (index.entries, index.blocks(A), index.blocks(B)) == (300, 300, 0)
    assert index.matches(blocks[:301], [A]) == {A: 300}
    assert all(index.matches([h], [A]) == {A: 0} for h in blocks[300:])


def test_memory_stays_within_64_bytes_a_block() -> None:
    rng = random.Random(4)
    blocks = [rng.getrandbits(64) for _ in range(30_000)]
    index = KVIndex()
    for start in range(0, len(blocks), 500):
        index.stored(A, blocks[start:start + 500])
        assert index.nbytes <= 64 * index.blocks(A)
    for start in range(0, len(blocks) - 1000, 500):
        index.removed(A, blocks[start:start + 500])
        assert index.nbytes <= 64 * index.blocks(A)


def test_the_cap_clears_the_endpoint_holding_the_most() -> None:
    index = KVIndex(max_blocks=100)
    index.stored(A, range(1, 81))
    index.stored(B, range(81, 96))
    index.stored(B, range(1, 6))  # shared: no new entries
    index.stored("http://d:8000", range(1, 101), "CPU")  # another medium, its own cap
    assert index.take_dropped() == []
    index.stored(C, range(200, 210))
    assert index.take_dropped() == [A]
    assert index.take_dropped() == []
    assert (index.blocks(A), index.blocks(B), index.blocks(C)) == (0, 20, 10)
    assert index.entries == 20 + 10 + 100
    assert index.matches([200, 201], [C]) == {C: 2}


def test_the_cap_may_drop_the_storing_endpoint_and_its_store_goes_on() -> None:
    index = KVIndex(max_blocks=50)
    index.stored(B, range(1000, 1010))
    index.stored(A, range(1, 61))
    assert index.take_dropped() == [A]
    assert index.blocks(A) == 20  # cleared at its 41st new block, then its last 20 stored
    assert index.matches(range(41, 61), [A]) == {A: 20}
    assert index.blocks(B) == 10
    assert index.entries == 30


def test_max_blocks_must_be_positive() -> None:
    with pytest.raises(InputError, match="max_blocks"):
        KVIndex(max_blocks=0)


def test_random_operations_agree_with_a_dict_of_sets() -> None:
    """Long probe chains that wrap round, deletes that shift them back, growth, shrinking, more than 64
    endpoints: every count and match as a dict of sets has them."""
    rng = random.Random(20240601)
    pool = colliding(300, homes=40, rng=rng) + [0] + [rng.getrandbits(64) for _ in range(700)]
    urls = [f"http://e{i}" for i in range(70)]
    media = ("GPU", "CPU")
    model: dict[tuple[str, str], set[int]] = {}
    index = KVIndex(max_blocks=1_000_000)
    for step in range(4000):
        url, medium, roll = rng.choice(urls[:8] if step % 3 else urls), rng.choice(media), rng.random()
        hashes = rng.sample(pool, rng.randint(0, 40))
        if roll < (0.6 if step < 2500 else 0.3):  # the tables grow, then shrink
            index.stored(url, hashes, medium)
            model.setdefault((url, medium), set()).update(hashes)
        elif roll < 0.9:
            held = sorted(model.get((url, medium), set()))
            hashes = rng.sample(held, min(len(held), rng.randint(0, 40))) + hashes[:5]
            index.removed(url, hashes, medium)
            model.get((url, medium), set()).difference_update(hashes)
        elif roll < 0.96:
            index.clear(url)
            for medium_ in media:
                model.pop((url, medium_), None)
        else:
            index.forget(url)
            for medium_ in media:
                model.pop((url, medium_), None)
        if step % 200 == 0 or step == 3999:
            assert index.entries == sum(len(set().union(*(model.get((u, m), set()) for u in urls))) for m in media)
            for medium_ in media:
                held_by = {u: model.get((u, medium_), set()) for u in urls}
                assert all(index.blocks(u, medium_) == len(held_by[u]) for u in urls)
                assert all(index.matches([h], urls, medium_) == {u: int(h in held_by[u]) for u in urls}
                           for h in pool)
                prompt = sorted(held_by[url])[:30] + rng.sample(pool, 3)
                expected = {}
                for u in urls:
                    expected[u] = next((i for i, h in enumerate(prompt) if h not in held_by[u]), len(prompt))
                assert index.matches(prompt, urls, medium_) == expected
    assert index.take_dropped() == []
