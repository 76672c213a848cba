"""The page pool: reference counts, the LRU queue of cached pages, chained prefix hashes."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvc.runtime.kv.page_pool import PagePool, PoolExhausted


def fill(pool: PagePool, tokens: list[int]) -> list[int]:
    """Allocates pages for `tokens` and registers the full ones, as the scheduler would."""
    pages = pool.allocate(pool.pages_for(len(tokens)))
    for page, h in zip(pages, pool.prefix_hashes(tokens)):
        assert pool.register(page, h)
    return pages


# ---- reference counts and the free list ----------------------------------------------------


def test_free_pages_go_first_in_first_out_in_bulk():
    # a long prompt's pages are taken by slices; the list drops its taken prefix past 4096 pages, and the
    # order stays: never-used pages first, then pages in the order they were given back
    pool = PagePool(10000, 16)
    first = pool.allocate(6000)
    assert first == list(range(6000))
    pool.free(first[:3000])  # given back last to first: page 2999 first
    second = pool.allocate(5000)
    assert second == list(range(6000, 10000)) + list(range(2999, 1999, -1))
    assert pool.num_free == 2000 and pool.allocate(2000) == list(range(1999, -1, -1))
    pool.free(second)
    pool.check_invariants()


def test_allocate_and_free_keep_counts():
    pool = PagePool(4, 2)
    a = pool.allocate(3)
    assert len(set(a)) == 3 and pool.num_used == 3 and pool.num_free == 1
    assert all(pool.ref_count(p) == 1 for p in a)
    assert pool.can_allocate(1) and not pool.can_allocate(2)
    with pytest.raises(PoolExhausted):
        pool.allocate(2)
    pool.check_invariants()
    pool.free(a)
    assert pool.num_free == 4 and pool.num_used == 0
    pool.check_invariants()


def test_double_free_is_refused():
    pool = PagePool(2, 2)
    (page,) = pool.allocate(1)
    pool.free([page])
    with pytest.raises(ValueError, match="freed more often"):
        pool.free([page])


def test_shared_page_frees_on_last_reference():
    pool = PagePool(4, 2)
    pages = fill(pool, [1, 2, 3, 4, 5])  # two full pages + one partial
    hits = pool.match_prefix([1, 2, 3, 4, 9])
    assert hits == pages[:2]
    assert [pool.ref_count(p) for p in pages] == [2, 2, 1]
    pool.free(pages)
    assert [pool.ref_count(p) for p in pages] == [1, 1, 0]
    assert pool.num_used == 2
    pool.free(hits)
    assert pool.num_used == 0 and pool.num_cached == 2
    pool.check_invariants()


def test_register_needs_a_page_in_use_and_first_writer_wins():
    pool = PagePool(4, 2)
    a, b = pool.allocate(2)
    h = pool.page_hash(None, [7, 8])
    assert pool.register(a, h)
    assert pool.register(a, h)  # again: no-op
    assert not pool.register(b, h)  # same content computed twice: b stays unnamed
    with pytest.raises(ValueError, match="another prefix"):
        pool.register(a, pool.page_hash(None, [7, 9]))
    pool.free([a, b])
    assert pool.num_cached == 1 and not pool.is_registered(b)
    with pytest.raises(ValueError, match="not in use"):
        pool.register(b, pool.page_hash(None, [1, 1]))
    pool.check_invariants()


# ---- LRU queue of cached pages -------------------------------------------------------------


def test_cached_pages_are_evicted_oldest_first_and_only_when_needed():
    pool = PagePool(4, 2)
    a = fill(pool, [1, 1])
    b = fill(pool, [2, 2])
    pool.free(a)  # cached first: the oldest
    pool.free(b)
    assert pool.num_cached == 2 and pool.num_free == 4
    fresh = pool.allocate(2)  # the two never-used pages come first: no eviction yet
    assert set(fresh).isdisjoint(a + b) and pool.num_cached == 2
    (evicted,) = pool.allocate(1)
    assert [evicted] == a and not pool.is_registered(evicted)
    assert pool.lookup([1, 1, 0]) == [] and pool.lookup([2, 2, 0]) == b
    pool.check_invariants()


def test_a_hit_takes_a_page_off_the_lru_queue_and_refreeing_makes_it_newest():
    pool = PagePool(2, 2)
    a = fill(pool, [1, 1])
    b = fill(pool, [2, 2])
    pool.free(a)
    pool.free(b)
    assert pool.match_prefix([1, 1, 5]) == a  # a: in use again, not evictable
    assert pool.num_free == 1 and pool.num_cached == 1
    pool.free(a)  # now a is newer than b
    assert pool.allocate(1) == b
    pool.check_invariants()


def test_a_sequence_releases_its_chain_tail_first():
    pool = PagePool(3, 2)
    pages = fill(pool, [1, 2, 3, 4, 5, 6])
    pool.free(pages)
    # the tail goes first; the head, still reachable, stays longest
    assert pool.allocate(1) == [pages[2]]
    assert pool.lookup([1, 2, 3, 4, 5, 6, 7]) == pages[:2]


# ---- chained hashes ------------------------------------------------------------------------


def test_same_prefix_same_hashes_and_an_earlier_difference_changes_all_later():
    pool = PagePool(8, 2)
    x = pool.prefix_hashes([1, 2, 3, 4, 5, 6])
    assert x == pool.prefix_hashes([1, 2, 3, 4, 5, 6, 7])  # the partial page is not hashed
    assert len(x) == 3 and len(set(x)) == 3
    y = pool.prefix_hashes([9, 2, 3, 4, 5, 6])
    assert all(a != b for a, b in zip(x, y))  # pages 2 and 3 hold the same tokens
    z = pool.prefix_hashes([1, 2, 3, 9, 5, 6])
    assert z[0] == x[0] and z[1] != x[1] and z[2] != x[2]


def test_salt_and_page_size_change_hashes():
    tokens = [1, 2, 3, 4]
    plain = PagePool(4, 2).prefix_hashes(tokens)
    assert PagePool(4, 2, salt=b"").prefix_hashes(tokens) == plain
    assert all(a != b for a, b in zip(plain, PagePool(4, 2, salt=b"other model").prefix_hashes(tokens)))
    with pytest.raises(ValueError, match="only full pages"):
        PagePool(4, 2).page_hash(None, [1])


def test_hashes_are_stable_across_processes():
    # The child loads the module by path (it needs only the standard library), with another
    # PYTHONHASHSEED: Python's own hash() would differ, blake2b must not.
    code = (
        "import importlib.util, sys\n"
        "spec = importlib.util.spec_from_file_location('page_pool', sys.argv[1])\n"
        "m = sys.modules['page_pool'] = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(m)\n"
        "print(m.PagePool(2, 3, salt=b's').prefix_hashes([5, 6, 7, 8, 9, 10])[-1].hex())\n"
    )
    path = sys.modules[PagePool.__module__].__file__
    child = subprocess.run(
        [sys.executable, "-c", code, path],
        capture_output=True, text=True, check=True, env={"PYTHONHASHSEED": "123"},
    )
    here = PagePool(2, 3, salt=b"s").prefix_hashes([5, 6, 7, 8, 9, 10])[-1].hex()
    assert child.stdout.strip() == here


# ---- prefix matching -----------------------------------------------------------------------


def test_match_stops_at_first_miss_and_never_covers_the_whole_prompt():
    pool = PagePool(8, 2)
    pages = fill(pool, [1, 2, 3, 4, 5, 6])
    assert pool.lookup([1, 2, 3, 4, 5, 6, 7]) == pages
    assert pool.lookup([1, 2, 3, 4, 5, 6]) == pages[:2]  # the last token must be computed
    assert pool.lookup([1, 2, 3, 4]) == pages[:1]
    assert pool.lookup([1, 2]) == []
    assert pool.lookup([1, 2, 0, 0, 5, 6, 7]) == pages[:1]  # page 3 matches alone, not chained
    refs = [pool.ref_count(p) for p in pages]
    assert refs == [1, 1, 1]  # lookup changes nothing


def test_a_prefix_block_hits_whole_blocks_only():
    """`prefix_block` 4 tokens over pages of 2: a hit is a whole number of 2-page blocks, on every layer."""
    pool = PagePool(8, 2, prefix_block=4)
    pages = fill(pool, [1, 2, 3, 4, 5, 6])
    assert pool.lookup([1, 2, 3, 4, 5, 6, 7]) == pages[:2]  # three pages match: one whole block
    assert pool.lookup([1, 2, 3, 9]) == []  # one page of a block
    assert pool.lookup_layers([1, 2, 3, 4, 5, 6, 7], 1) == [pages[:2]]
    with pytest.raises(ValueError, match="multiple of the page size"):
        PagePool(8, 2, prefix_block=3)


def test_stats_count_tokens_of_queries_and_hits():
    pool = PagePool(8, 4)
    pages = fill(pool, list(range(8)))
    assert pool.match_prefix(list(range(10))) == pages  # 10 queried, 8 hit
    assert pool.match_prefix([9] * 6) == []  # 6 queried, 0 hit
    stats = pool.stats()
    assert (stats["query_tokens"], stats["hit_tokens"]) == (16, 8)
    assert stats["hit_rate"] == pytest.approx(0.5)


def test_caching_off_finds_nothing():
    pool = PagePool(4, 2, enable_prefix_caching=False)
    pages = pool.allocate(2)
    assert not pool.register(pages[0], pool.page_hash(None, [1, 2]))
    pool.free(pages)
    assert pool.match_prefix([1, 2, 3]) == [] and pool.num_cached == 0
    assert pool.stats()["query_tokens"] == 0


def test_invariant_check_catches_corruption():
    pool = PagePool(4, 2)
    pages = fill(pool, [1, 2])
    pool._refs[pages[0]] = 0  # neither free nor cached now
    with pytest.raises(AssertionError, match="in 0 of"):
        pool.check_invariants()
