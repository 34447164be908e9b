"""Pins the step-time model's transition costs: demotion and promotion unpack are costed from the bytes they move
(4 blocks of HBM traffic per pair at the kernel rate) plus a per-batch launch/metadata cost, a promotion's copy
from one block of low bytes over PCIe; old step-model JSONs (with the former fitted per-pair keys) still load."""

import json
from dataclasses import replace

import pytest

from elastiserve.control.step_model import load_step_model, padded_batch, prefill_key_count
from elastiserve.platforms import ConfigError

pytestmark = [pytest.mark.cpu, pytest.mark.cuda]


def test_per_pair_costs_come_from_block_bytes():
    sm = load_step_model()
    assert sm.block_bytes == 2 * 1024 * 1024
    assert sm.promote_copy_per_pair_s == sm.block_bytes / 55e9  # ~38 us per pair at 55 GB/s
    assert sm.demote_per_pair_s == sm.unpack_per_pair_s == 4 * sm.block_bytes / 3.93e12  # ~2.1 us per pair
    halved = replace(sm, block_bytes=sm.block_bytes // 2)
    assert halved.promote_copy_per_pair_s == pytest.approx(sm.promote_copy_per_pair_s / 2, rel=1e-12)


def test_step_time_pays_demotion_and_unpack():
    sm = load_step_model()
    plain = sm.step_time(37, 40_000)
    demoted = sm.step_time(37, 40_000, demoted_pairs=16)
    unpacked = sm.step_time(37, 40_000, unpacked_pairs=5)
    assert demoted - plain == pytest.approx(sm.demote_batch_s + 16 * sm.demote_per_pair_s, rel=1e-9)
    assert unpacked - plain == pytest.approx(sm.promote_batch_s + 5 * sm.unpack_per_pair_s, rel=1e-9)
    assert sm.step_time(0, 0, unpacked_pairs=5) == 0.0


def test_old_json_loads_and_bad_bandwidth_fails(tmp_path):
    raw = {"host_overhead_s": 0.0015, "weight_read_full_s": 0.0037, "weight_read_fast_s": 0.0019,
           "compute_per_token_full_s": 2.4e-5, "compute_per_token_fast_s": 1.4e-5, "kv_read_per_token_s": 3e-8,
           "base_read_fraction": 0.5, "demote_batch_s": 0.004, "demote_per_pair_s": 5e-4,
           "promote_per_pair_s": 4.2e-5, "restore_per_unit_s": 4.2e-5}
    path = tmp_path / "old.json"
    path.write_text(json.dumps(raw))
    sm = load_step_model(path)
    assert sm.demote_batch_s == 0.004 and sm.h2d_bytes_per_s == 55e9
    with pytest.raises(ConfigError):
        replace(sm, h2d_bytes_per_s=0.0)


def test_plain_fp16_policies_use_the_unnested_coefficients():
    """The shipped model is the H200 engine measurement: the nested full-mode decode step costs other than the plain
    fp16 one, so a policy without nested weights (static-fp16, elastickv) is costed on its own coefficients, never in
    fast mode, and T_base is the plain fp16 single-request step for every policy."""
    sm = load_step_model()
    assert sm.commit != "none" and "measured" in sm.device
    plain = sm.step_time(1, 512, nested=False)
    full = sm.step_time(1, 512)
    assert plain == pytest.approx(sm.host_overhead_s + sm.weight_read_unnested_s + 512 * sm.kv_read_per_token_s)
    # batch-1 steps of h200-llama8b-decode-run5 (58a40e6): nested full 4.593 ms, fast 3.239 ms, static-fp16 4.793 ms
    # (at 6bf4501 nested full took 2.0x the plain step: 13.73 vs 6.88 ms)
    assert 0.93 < full / plain < 0.99
    assert 0.65 < sm.step_time(1, 512, fast_fraction=1.0) / plain < 0.73
    assert sm.step_time(1, 512, fast_fraction=1.0, nested=False) == plain
    assert sm.base_tpot(512) == plain
    prefill = sm.step_time(4096, 0, nested=False)
    assert prefill == pytest.approx(sm.host_overhead_s + 4096 * sm.compute_per_token_unnested_s)
    legacy = replace(sm, weight_read_unnested_s=None, compute_per_token_unnested_s=None)
    assert legacy.step_time(1, 512, nested=False) == legacy.step_time(1, 512)  # older JSONs: one full mode


def test_base_step_is_paid_once_by_a_step_that_reads_base():
    """elastickv's H200 steps with BASE pairs cost a constant more than the per-token terms explain (4.51 ms in the
    session-7 fit with the CUDA-graph padding term); a step without BASE context does not pay it, and a negative
    constant is refused."""
    sm = load_step_model()
    assert sm.base_step_s > 0
    plain = sm.step_time(58, 150_000, nested=False)
    one_pair = sm.step_time(58, 150_000, base_context_tokens=32, nested=False)
    many = sm.step_time(58, 150_000, base_context_tokens=100_000, nested=False)
    per_base_token = sm.kv_read_per_token_s * (sm.base_read_fraction - 1)
    assert one_pair - plain == pytest.approx(sm.base_step_s + 32 * per_base_token, rel=1e-9)
    assert many - one_pair == pytest.approx((100_000 - 32) * per_base_token, rel=1e-9)
    assert replace(sm, base_step_s=0.0).step_time(58, 150_000, base_context_tokens=32, nested=False) < one_pair
    with pytest.raises(ConfigError):
        replace(sm, base_step_s=-1e-3)


def test_padding_rows_scale_the_kv_read_of_a_decode_only_step():
    """A decode-only step replays the CUDA graph of the next captured size (1, 2, 4, 8, then multiples of 16, capped at
    max_num_seqs) and each padding row costs ``padded_row_kv_fraction`` of the mean sequence's KV read: the H200's
    static-fp16 steps at 33-36 sequences (graph 48) took 2.2 ms more than at 32 for the same 150k tokens. Bad
    fractions, sizes and graphs too small for the batch are refused."""
    assert [padded_batch(n, 256) for n in (0, 1, 3, 5, 8, 9, 16, 17, 33, 58)] == [0, 1, 4, 8, 8, 16, 16, 32, 48, 64]
    assert padded_batch(37, 38) == 38 and padded_batch(17, 20) == 20
    sm = load_step_model()
    assert 0.9 < sm.padded_row_kv_fraction < 1.2
    at_32 = sm.step_time(32, 150_000, nested=False, padded_rows=32)
    at_33 = sm.step_time(33, 150_000, nested=False, padded_rows=48)
    kv = 150_000 * sm.kv_read_per_token_s
    assert at_33 - at_32 == pytest.approx(sm.padded_row_kv_fraction * kv * 15 / 33, rel=1e-9)
    assert 1.7e-3 < at_33 - at_32 < 2.7e-3  # measured: 13.1-13.2 vs 10.9-11.0 ms
    assert sm.step_time(32, 150_000, nested=False) == at_32  # no padding rows, no change
    assert replace(sm, padded_row_kv_fraction=0.0).step_time(33, 150_000, nested=False, padded_rows=48) < at_33
    for bad in (-0.1, 4.5):
        with pytest.raises(ConfigError):
            replace(sm, padded_row_kv_fraction=bad)
    with pytest.raises(ConfigError):
        sm.step_time(33, 150_000, padded_rows=32)
    for n, cap in ((5, 4), (-1, 8), (1, 0)):
        with pytest.raises(ConfigError):
            padded_batch(n, cap)


def test_prefill_key_count_is_causal_over_the_cache_and_the_chunk():
    assert prefill_key_count(0, 1) == 1  # the first token sees itself
    assert prefill_key_count(0, 4) == 1 + 2 + 3 + 4
    assert prefill_key_count(10, 3) == 11 + 12 + 13
    assert prefill_key_count(7, 0) == 0
    with pytest.raises(ConfigError):
        prefill_key_count(-1, 4)


def test_packaged_sets_load_by_device_name_and_unknown_names_fail():
    h100, h200 = load_step_model("h100"), load_step_model("h200")
    assert "H100" in h100.device and "H200" in h200.device
    assert load_step_model() == h200  # the default set
    assert h100.prefill_attention_per_key_s > 0 and h200.prefill_attention_per_key_s == 0.0  # H200 not fitted
    with pytest.raises(ConfigError, match="neither a file nor one of"):
        load_step_model("h300")


def test_h100_set_reproduces_the_prefill_steps_it_was_fitted_to():
    """Sessions 44 and 46's H100 runs at 4,096-token prompts, 8,192-token steps (benchmarks/control/results/
    prefill-fit-h100-s46-joint.txt): static-fp16 236.4 ms and dps, all layers fast, 166.4 ms measured medians. Two
    whole prompts a step, about 1,500 blocks of context in use."""
    sm = load_step_model("h100")
    keys = 2 * prefill_key_count(0, 4096)
    context = 1_500 * 16
    plain = sm.step_time(8192, context, nested=False, prefill_keys=keys)
    fast = sm.step_time(8192, context, fast_fraction=1.0, prefill_keys=keys)
    assert plain == pytest.approx(0.2364, rel=0.05)
    assert fast == pytest.approx(0.1664, rel=0.05)
    no_attention = sm.step_time(8192, context, nested=False)
    assert plain - no_attention == pytest.approx(sm.prefill_attention_per_key_s * keys, rel=1e-9)
