"""Automatic prefix caching at pair granularity; plain Python, no torch.

A complete TARGET pair (two blocks, ``2 * block_size`` tokens) is registered under a chain hash of every token up
to its end, so a hit implies the whole prefix matches. A new request (or a preempted one coming back) takes the
longest run of cached pairs from its start and prefills only the rest. Entries are reference-counted by the
sequences that use them; an entry nobody uses keeps its blocks (retained, least recently released first out) until
an allocation needs them: ``CachingBlockPool`` counts those blocks as free and evicts them on demand, so pressure,
demotion and admission see the same free count they would without the cache.

Pairs are the unit because they are the unit of demotion: a BASE pair's two logical blocks share one packed block.
A pair that several sequences use is never demoted (one sequence cannot change what the others read); a pair only
its own sequence uses leaves the cache when that sequence demotes it. While weight residuals are evicted (dps,
combined) nothing is retained: a restore needs whole FREE units, and retained blocks scattered over the units would
keep the model in FP8; retention resumes in full precision.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

from elastiserve.engine.errors import EngineError


def pair_hash(parent: bytes | None, tokens: Iterable[int]) -> bytes:
    """The chain hash of a pair: its tokens' ids after its parent pair's hash (128-bit BLAKE2b)."""
    digest = hashlib.blake2b(parent or b"", digest_size=16)
    digest.update(array("q", tokens).tobytes())
    return digest.digest()


def hash_at(seq, pair: int, pair_tokens: int) -> bytes:
    """The chain hash of ``seq``'s pair ``pair``, from its memo ``seq.pair_hashes`` (extended as needed; a
    sequence's token ids only ever grow at the end, so the memo stays valid, across preemptions too)."""
    memo = seq.pair_hashes
    for p in range(len(memo), pair + 1):
        memo.append(pair_hash(memo[-1] if memo else None, seq.token_ids[p * pair_tokens : (p + 1) * pair_tokens]))
    return memo[pair]


def cached_run(cache: PrefixCache, seq, pair_tokens: int) -> int:
    """How many pairs from ``seq``'s start the cache holds, leaving at least one token to compute."""
    limit = (seq.num_tokens - 1) // pair_tokens
    for pair in range(limit):
        if hash_at(seq, pair, pair_tokens) not in cache:
            return pair
    return limit


@dataclass(slots=True)
class CachedPair:
    blocks: tuple[int, int]
    refs: int = 1


class PrefixCache:
    def __init__(self) -> None:
        self._entries: dict[bytes, CachedPair] = {}
        self._retained: OrderedDict[bytes, None] = OrderedDict()  # entries with no user, oldest release first
        self.retain = True  # off while weight residuals are evicted: see ``KVManager.set_cache_retention``
        self.queried_tokens = 0
        self.hit_tokens = 0

    def __contains__(self, key: bytes) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def refs(self, key: bytes) -> int:
        return self._entries[key].refs

    @property
    def num_retained_blocks(self) -> int:
        return 2 * len(self._retained)

    def acquire(self, key: bytes) -> tuple[int, int]:
        """One more user of ``key``'s pair; returns its blocks."""
        entry = self._entries[key]
        if entry.refs == 0:
            del self._retained[key]
        entry.refs += 1
        return entry.blocks

    def insert(self, key: bytes, blocks: tuple[int, int]) -> None:
        """Register a sequence's complete pair; that sequence is its first user."""
        if key in self._entries:
            raise EngineError("prefix cache entry registered twice")
        self._entries[key] = CachedPair(blocks)

    def release(self, key: bytes) -> tuple[int, int] | None:
        """One user fewer. With none left the pair is retained for later requests, or, while retention is off,
        leaves the cache: then its blocks are returned for the caller to free."""
        entry = self._entries[key]
        if entry.refs <= 0:
            raise EngineError("prefix cache entry released more often than acquired")
        entry.refs -= 1
        if entry.refs > 0:
            return None
        if self.retain:
            self._retained[key] = None
            return None
        del self._entries[key]
        return entry.blocks

    def forget(self, key: bytes) -> None:
        """Drop the entry of a pair its only user takes back (to demote it); the blocks stay with that user."""
        refs = self._entries[key].refs
        if refs != 1:
            raise EngineError(f"a cached pair with {refs} users cannot leave the cache")
        del self._entries[key]

    def evict(self, num_blocks: int) -> list[int]:
        """Blocks of retained pairs, least recently released first, at least ``num_blocks`` of them when there are
        that many; their entries are gone."""
        freed: list[int] = []
        while len(freed) < num_blocks and self._retained:
            key, _ = self._retained.popitem(last=False)
            freed.extend(self._entries.pop(key).blocks)
        return freed

    def record_lookup(self, queried_tokens: int, hit_tokens: int) -> None:
        self.queried_tokens += queried_tokens
        self.hit_tokens += hit_tokens


class CachingBlockPool:
    """A ``BlockPool`` whose free count includes the blocks the prefix cache retains, evicted when an allocation
    needs them."""

    def __init__(self, inner, cache: PrefixCache) -> None:  # inner: a BlockPool
        self.inner = inner
        self.cache = cache
        self.num_blocks = inner.num_blocks

    def num_free(self, allow_backed: bool = False) -> int:
        return self.inner.num_free(allow_backed) + self.cache.num_retained_blocks

    def num_allocated(self) -> int:
        return self.inner.num_allocated() - self.cache.num_retained_blocks

    def allocate(self, n: int, allow_backed: bool = False) -> list[int] | None:
        short = n - self.inner.num_free(allow_backed)
        if short > 0:
            if short > self.cache.num_retained_blocks:
                return None
            self.inner.free(self.cache.evict(short))
        return self.inner.allocate(n, allow_backed)

    def free(self, blocks: Iterable[int]) -> None:
        self.inner.free(blocks)

    def drain_stale_layers(self) -> frozenset[int]:
        return self.inner.drain_stale_layers()
