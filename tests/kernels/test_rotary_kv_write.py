"""Pins ``elastiserve::rotary_kv_write`` (rotary of q and k fused with the paged KV write) to the two ops it replaces:
the rotated q and every byte of the cache equal ``rotary_embedding`` followed by ``kv_write`` on the same inputs
(non-contiguous q/k/v views of a qkv split, GQA, odd token and head counts, a head dim whose half is not a power of
two, negative slots skipped, a cache whose block stride is wider than a block), and the pure-torch reference (exact
when interpreted on the CPU; on a GPU the products contract to FMAs, within 1e-3 as for ``rotary_embedding``).
Also: typed errors, opcheck, and torch.compile(fullgraph=True)."""

from __future__ import annotations

import pytest
import torch
from elementwise_cases import paged_cache, qkv_split, rotary_tables, rotary_then_kv_write, scattered_slots

from elastiserve.kernels.kv_ops import KVLayoutError
from elastiserve.kernels.rms_norm import ElementwiseShapeError
from elastiserve.kernels.rotary import rotary_kv_write, rotary_kv_write_ref

pytestmark = [pytest.mark.cpu, pytest.mark.cuda]

MAX_POSITIONS, NUM_BLOCKS, NUM_LAYERS, LAYER = 300, 9, 3, 1


def case(device, tokens, q_heads, kv_heads, head_dim, block_size=4, dtype=torch.float16, skip_every=4):
    q, k, v = qkv_split(device, tokens, q_heads, kv_heads, head_dim, dtype=dtype)
    cos, sin = rotary_tables(device, MAX_POSITIONS, head_dim)
    positions = torch.randint(0, MAX_POSITIONS, (tokens,), generator=torch.Generator().manual_seed(tokens))
    cache = paged_cache(device, NUM_BLOCKS, NUM_LAYERS, kv_heads, block_size, head_dim, seed=tokens)
    slots = scattered_slots(device, tokens, NUM_BLOCKS * block_size, skip_every, seed=tokens)
    return positions.to(device), q, k, v, cos, sin, cache, slots


def bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int16)


def assert_matches_reference(got: torch.Tensor, want: torch.Tensor) -> None:
    if got.device.type == "cpu":
        assert torch.equal(bits(got), bits(want))
    else:
        torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("tokens", [1, 5, 13])
@pytest.mark.parametrize("q_heads, kv_heads, head_dim", [(8, 2, 16), (6, 3, 24), (5, 1, 8)])
def test_equals_rotary_then_kv_write(device, tokens, q_heads, kv_heads, head_dim):
    positions, q, k, v, cos, sin, cache, slots = case(device, tokens, q_heads, kv_heads, head_dim)
    assert tokens == 1 or not any(x.is_contiguous() for x in (q, k, v)), "views of one qkv row each"
    inputs_before = [x.clone() for x in (q, k, v)]
    original, unfused_cache, ref_cache = cache.clone(), cache.clone(), cache.clone()

    got_q = rotary_kv_write(positions, q, k, v, cos, sin, cache, LAYER, slots)
    unfused_q = rotary_then_kv_write(positions, q, k, v, cos, sin, unfused_cache, LAYER, slots)
    assert got_q.is_contiguous() and got_q.shape == q.shape
    assert torch.equal(bits(got_q), bits(unfused_q))
    assert torch.equal(bits(cache), bits(unfused_cache)), "every cache byte, written or not, as the two ops leave it"
    assert_matches_reference(got_q, rotary_kv_write_ref(positions, q, k, v, cos, sin, ref_cache, LAYER, slots))
    assert_matches_reference(cache, ref_cache)
    assert all(torch.equal(x, before) for x, before in zip((q, k, v), inputs_before, strict=True))

    kept = slots >= 0
    block_size = cache.shape[4]
    blocks, offsets = slots[kept] // block_size, slots[kept] % block_size
    assert torch.equal(cache[blocks, LAYER, 1, :, offsets], v[kept]), "v is written as it is, unrotated"
    untouched = torch.ones(NUM_BLOCKS * block_size, dtype=torch.bool, device=device)
    untouched[slots[kept]] = False
    by_slot = lambda c: c.permute(0, 4, 1, 2, 3, 5).reshape(NUM_BLOCKS * block_size, -1)  # noqa: E731
    assert torch.equal(bits(by_slot(cache)[untouched]), bits(by_slot(original)[untouched]))
    other_layers = [x for x in range(NUM_LAYERS) if x != LAYER]
    assert torch.equal(bits(cache[:, other_layers]), bits(original[:, other_layers]))


def test_int32_positions_and_fp32_inputs(device):
    positions, q, k, v, cos, sin, cache, slots = case(device, 7, 4, 2, 16)
    expected_cache = cache.clone()
    expected_q = rotary_kv_write(positions, q, k, v, cos, sin, expected_cache, LAYER, slots)
    got_q = rotary_kv_write(positions.int(), q, k, v, cos, sin, cache, LAYER, slots)
    assert torch.equal(bits(got_q), bits(expected_q)) and torch.equal(bits(cache), bits(expected_cache))

    # fp32 q/k/v: rotated in fp32 and rounded to the fp16 cache once more, as kv_write does.
    positions, q, k, v, cos, sin, cache, slots = case(device, 7, 4, 2, 16, dtype=torch.float32)
    unfused_cache = cache.clone()
    got_q = rotary_kv_write(positions, q, k, v, cos, sin, cache, LAYER, slots)
    assert got_q.dtype == torch.float32
    assert torch.equal(got_q, rotary_then_kv_write(positions, q, k, v, cos, sin, unfused_cache, LAYER, slots))
    assert torch.equal(bits(cache), bits(unfused_cache))


def test_skipped_and_empty_steps_leave_the_cache_alone(device):
    positions, q, k, v, cos, sin, cache, _ = case(device, 5, 4, 2, 16)
    original = cache.clone()
    unfused_q = rotary_then_kv_write(positions, q, k, v, cos, sin, original.clone(), LAYER, torch.full_like(_, -1))
    got_q = rotary_kv_write(positions, q, k, v, cos, sin, cache, LAYER, torch.full_like(_, -1))
    assert torch.equal(bits(got_q), bits(unfused_q)), "q is rotated even when no token is cached (padding rows)"
    assert torch.equal(bits(cache), bits(original))
    empty = rotary_kv_write(positions[:0], q[:0], k[:0], v[:0], cos, sin, cache, LAYER, _[:0])
    assert empty.shape == (0, 4, 16)
    assert torch.equal(bits(cache), bits(original))


def test_errors_are_typed(device):
    positions, q, k, v, cos, sin, cache, slots = case(device, 3, 4, 2, 16)
    with pytest.raises(ElementwiseShapeError):
        rotary_kv_write(positions, q, k[..., :8], v, cos, sin, cache, LAYER, slots)
    with pytest.raises(ElementwiseShapeError):
        rotary_kv_write(positions.float(), q, k, v, cos, sin, cache, LAYER, slots)
    with pytest.raises(KVLayoutError):
        rotary_kv_write(positions, q, k, v[:, :1], cos, sin, cache, LAYER, slots)
    with pytest.raises(KVLayoutError):
        rotary_kv_write(positions, q, k, v, cos, sin, cache.float(), LAYER, slots)
    with pytest.raises(KVLayoutError):
        rotary_kv_write(positions, q, k, v, cos, sin, cache[:, :, :, :1], LAYER, slots)
    with pytest.raises(KVLayoutError):
        rotary_kv_write(positions, q, k, v, cos, sin, cache, NUM_LAYERS, slots)
    with pytest.raises(KVLayoutError):
        rotary_kv_write(positions, q, k, v, cos, sin, cache, LAYER, slots.int())


def test_opcheck(device):
    positions, q, k, v, cos, sin, cache, slots = case(device, 5, 4, 2, 16)
    torch.library.opcheck(torch.ops.elastiserve.rotary_kv_write.default,
                          (positions, q, k, v, cos, sin, cache.clone(), LAYER, slots))  # fmt: skip


def test_compile_fullgraph(device):
    positions, q, k, v, cos, sin, cache, slots = case(device, 5, 4, 2, 16)

    def step(q, k, v, cache):
        q_out = rotary_kv_write(positions, q * 1.0, k, v, cos, sin, cache, LAYER, slots)
        return q_out, bits(cache).to(torch.int64).sum()  # exact in any summation order

    eager_cache = cache.clone()
    expected = step(q, k, v, eager_cache)
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager" if device.type == "cpu" else "inductor")
    got = compiled(q, k, v, cache)
    assert torch.equal(bits(cache), bits(eager_cache))
    for got_part, want in zip(got, expected, strict=True):
        assert torch.equal(got_part, want)
