"""Pins the KV cache ops: the paged write lands every token in its slot (negative slots skipped), and a pair
demotion followed by a promotion restores TARGET bit-exactly for all 65,536 fp16 bit patterns (NaN, inf,
subnormals, -0 included), with the packed word and the low bytes exactly as ARCHITECTURE.md defines them.
Triton kernels (interpreted on the CPU) are compared with the pure-torch references bit for bit."""

from __future__ import annotations

import pytest
import torch

from elastiserve.kernels.kv_ops import (
    KVLayoutError,
    base_halves,
    kv_demote,
    kv_demote_ref,
    kv_promote,
    kv_promote_ref,
    kv_write,
    kv_write_ref,
)

pytestmark = [pytest.mark.cpu, pytest.mark.cuda]


def bits_of(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int16).to(torch.int32) & 0xFFFF


def expected_packing(a_bits: torch.Tensor, b_bits: torch.Tensor) -> torch.Tensor:
    """Packed word written independently of the library: high bytes rounded half away from zero, mod 256."""

    def rna(u):
        high, low = u // 256, u % 256
        return (high + (low >= 128).to(torch.int32)) % 256

    return rna(a_bits) * 256 + rna(b_bits)


@pytest.mark.parametrize("block_size, num_heads, head_dim", [(16, 3, 20), (32, 1, 8)])
def test_kv_write_matches_reference_and_skips_negative_slots(device, block_size, num_heads, head_dim):
    torch.manual_seed(0)
    num_blocks, num_layers, layer, tokens = 6, 3, 1, 37
    cache = torch.randn(num_blocks, num_layers, 2, num_heads, block_size, head_dim, device=device).half()
    key = torch.randn(tokens, num_heads, head_dim, device=device).half()
    value = torch.randn(tokens, num_heads, head_dim, device=device).half()
    slots = torch.randperm(num_blocks * block_size, device=device)[:tokens]
    slots[::5] = -1
    original = cache.clone()
    expected = cache.clone()
    kv_write_ref(expected, layer, key, value, slots)
    kv_write(cache, layer, key, value, slots)
    assert torch.equal(bits_of(cache), bits_of(expected))
    written = slots[slots >= 0]
    token = int((slots >= 0).nonzero()[3])
    block, offset = divmod(int(slots[token]), block_size)
    assert torch.equal(cache[block, layer, 0, :, offset], key[token])
    assert torch.equal(cache[block, layer, 1, :, offset], value[token])
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool, device=device)
    untouched[written] = False
    by_slot = cache.permute(0, 4, 1, 2, 3, 5).reshape(num_blocks * block_size, -1)
    original_by_slot = original.permute(0, 4, 1, 2, 3, 5).reshape(num_blocks * block_size, -1)
    assert torch.equal(by_slot[untouched], original_by_slot[untouched])
    other_layers = [x for x in range(num_layers) if x != layer]
    assert torch.equal(cache[:, other_layers], original[:, other_layers])


def all_patterns_cache(device, num_layers=2, num_heads=2, block_size=16, head_dim=32):
    """Pairs whose A blocks hold every fp16 bit pattern once and whose B blocks hold a permutation of them."""
    n = num_layers * 2 * num_heads * block_size * head_dim
    num_pairs = 65536 // n
    shape = (num_layers, 2, num_heads, block_size, head_dim)
    patterns = torch.arange(65536, dtype=torch.int32)
    signed = torch.where(patterns >= 32768, patterns - 65536, patterns).to(torch.int16)
    gen = torch.Generator().manual_seed(1)
    shuffled = signed[torch.randperm(65536, generator=gen)]
    cache = torch.zeros(3 * num_pairs + 1, *shape, dtype=torch.float16)
    blocks_a = torch.arange(num_pairs) * 2 + 1  # interleaved and offset so indexing bugs show
    blocks_b = blocks_a + 1
    cache[blocks_a] = signed.view(torch.float16).reshape(num_pairs, *shape)
    cache[blocks_b] = shuffled.view(torch.float16).reshape(num_pairs, *shape)
    dst_a = torch.arange(num_pairs) + 2 * num_pairs + 1
    dst_b = blocks_b.flip(0)  # fresh blocks may be any free ones, including freed B blocks
    return cache.to(device), blocks_a.to(device), blocks_b.to(device), dst_a.to(device), dst_b.to(device), n


def test_demote_then_promote_is_bit_exact_for_all_fp16_patterns(device):
    cache, blocks_a, blocks_b, dst_a, dst_b, n = all_patterns_cache(device)
    original = cache.clone()
    a_bits = bits_of(original[blocks_a]).reshape(len(blocks_a), n)
    b_bits = bits_of(original[blocks_b]).reshape(len(blocks_a), n)
    low = torch.empty(len(blocks_a), 2 * n, dtype=torch.uint8, device=device)
    kv_demote(cache, blocks_a, blocks_b, low)

    packed_bits = bits_of(cache[blocks_a]).reshape(len(blocks_a), n)
    assert torch.equal(packed_bits, expected_packing(a_bits, b_bits))
    assert torch.equal(low.to(torch.int32), torch.cat([a_bits % 256, b_bits % 256], dim=1))
    assert torch.equal(bits_of(cache[blocks_b]), bits_of(original[blocks_b])), "demotion must not write block B"

    kv_promote(cache, blocks_a, dst_a, dst_b, low)
    assert torch.equal(bits_of(cache[dst_a]), bits_of(original[blocks_a]))
    assert torch.equal(bits_of(cache[dst_b]), bits_of(original[blocks_b]))


def test_demote_and_promote_match_references(device):
    cache, blocks_a, blocks_b, _dst_a, dst_b, n = all_patterns_cache(device)
    ref_cache = cache.clone()
    low = torch.empty(len(blocks_a), 2 * n, dtype=torch.uint8, device=device)
    ref_low = torch.empty_like(low)
    kv_demote(cache, blocks_a, blocks_b, low)
    kv_demote_ref(ref_cache, blocks_a, blocks_b, ref_low)
    assert torch.equal(bits_of(cache), bits_of(ref_cache))
    assert torch.equal(low, ref_low)
    # Promote into the packed block itself (dst_a == packed): each element is read before it is written.
    kv_promote(cache, blocks_a, blocks_a, dst_b, low)
    kv_promote_ref(ref_cache, blocks_a, blocks_a, dst_b, ref_low)
    assert torch.equal(bits_of(cache), bits_of(ref_cache))


def test_base_halves_round_half_away_from_zero(device):
    # 0x3C80 = 1.125 is a tie between E5M2 1.0 and 1.25; -0.3 = 0xB4CD rounds to 0xB5 = -0.3125 (not 0xB4).
    a = torch.tensor([0x3C80, 0x3C7F, 0xB4CD - 65536, 0x7BFF], dtype=torch.int32)
    b = torch.tensor([0x0080, 0x8001 - 65536, 0x3555, 0x0000], dtype=torch.int32)
    cache = torch.zeros(3, 1, 2, 1, 2, 1, dtype=torch.float16)
    cache[0] = a.to(torch.int16).view(torch.float16).reshape(cache[0].shape)
    cache[1] = b.to(torch.int16).view(torch.float16).reshape(cache[1].shape)
    cache = cache.to(device)
    low = torch.empty(1, 8, dtype=torch.uint8, device=device)
    kv_demote(cache, torch.tensor([0], device=device), torch.tensor([1], device=device), low)
    half_a, half_b = base_halves(cache[0].flatten())
    assert half_a.cpu().tolist() == [1.25, 1.0, -0.3125, float("inf")]  # 0x7BFF rounds up into inf, restorably
    assert half_b.cpu().tolist() == [2.0**-16, -0.0, 0.3125, 0.0]


def test_layout_errors_are_typed(device):
    cache = torch.zeros(4, 1, 2, 1, 16, 8, dtype=torch.float16, device=device)
    pairs = torch.tensor([0], device=device)
    with pytest.raises(KVLayoutError):
        kv_demote(cache, pairs, pairs + 1, torch.empty(1, 7, dtype=torch.uint8, device=device))
    with pytest.raises(KVLayoutError):
        kv_write(cache.float(), 0, cache[0, 0, 0], cache[0, 0, 0], pairs)


def small_case(device):
    torch.manual_seed(2)
    cache = torch.randn(6, 2, 2, 2, 16, 8, device=device).half()
    key = torch.randn(5, 2, 8, device=device).half()
    slots = torch.tensor([3, -1, 40, 17, 90], device=device)
    low = torch.empty(2, 2 * cache[0].numel(), dtype=torch.uint8, device=device)
    return cache, key, slots, low


def test_opcheck_each_op(device):
    cache, key, slots, low = small_case(device)
    pairs_a, pairs_b = torch.tensor([0, 2], device=device), torch.tensor([1, 3], device=device)
    torch.library.opcheck(torch.ops.elastiserve.kv_write.default, (cache.clone(), 1, key, key * 2, slots))
    torch.library.opcheck(torch.ops.elastiserve.kv_demote.default, (cache.clone(), pairs_a, pairs_b, low.clone()))
    torch.library.opcheck(
        torch.ops.elastiserve.kv_promote.default,
        (cache.clone(), pairs_a, torch.tensor([4, 5], device=device), pairs_b, low.random_(0, 256)),
    )


def test_ops_compile_fullgraph(device):
    cache, key, slots, low = small_case(device)
    pairs_a, pairs_b, fresh = (torch.tensor(x, device=device) for x in ([0, 2], [1, 3], [4, 5]))

    def step(cache, key, slots, low):
        kv_write(cache, 0, key, key, slots)
        kv_demote(cache, pairs_a, pairs_b, low)
        kv_promote(cache, pairs_a, pairs_a, fresh, low)
        return cache.view(torch.int16).to(torch.int64).sum()  # exact in any summation order

    eager_cache = cache.clone()
    expected = step(eager_cache, key, slots, low.clone())
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager" if device.type == "cpu" else "inductor")
    got = compiled(cache, key, slots, low)
    assert torch.equal(bits_of(cache), bits_of(eager_cache))
    assert torch.equal(got, expected)
