"""Pins the simulator end to end on the bundled Azure conversation window: all five presets run and print one table;
`combined` beats `dps` and `elastickv` at no more BASE exposure / FP8 time (and loses to `dps` where a BASE step
costs 4.5 ms once); DPS makes few long mode windows; the ElasticKV ablations, run in the paper's closed-loop
high-pressure setting, move exposure / TPOT / TTFT in the paper's directions where the byte-costed transition model
reproduces them, and eager promotion costs P90 TTFT under the paper's F_post (the rest is explained in the package
README); with the engine's admission and the measured step model all three of the paper's directions hold at once on
the Azure window; fidelity transitions cost step time; steady load does not flap; replicas and the pool stay consistent.
Numbers come from the shipped H200 step model (see data/README.md) unless a test pins its own."""

from dataclasses import replace

import pytest

from elastiserve.control.config import PRESETS, preset
from elastiserve.control.metrics import format_table
from elastiserve.control.sim_replica import ReplicaConfig
from elastiserve.control.simulate import ABLATIONS, ablation, main, with_f_post
from elastiserve.control.simulator import SimConfig, capacity_sweep, simulate
from elastiserve.control.step_model import StepModel, load_step_model
from elastiserve.control.workloads import Request, gamma_arrivals, load_trace, synthetic, with_arrivals
from elastiserve.platforms import ConfigError

pytestmark = [pytest.mark.cpu, pytest.mark.cuda]

SIM = SimConfig(replica=ReplicaConfig(native_blocks=4096, units_per_layer=32, max_num_seqs=128))
# The ablation tests check mechanisms (what promotion and the demotion trigger buy), so they pin one step model
# instead of the shipped calibration, which changes with every GPU measurement: these are the anchor-derived
# coefficients (HBM 4.3 TB/s, fp16 GEMM ~660 TFLOP/s) the paper-direction margins below were set against.
ANCHOR_STEP_MODEL = StepModel(
    host_overhead_s=0.0015, weight_read_full_s=0.003735, weight_read_fast_s=0.001867, compute_per_token_full_s=2.43e-5,
    compute_per_token_fast_s=1.43e-5, kv_read_per_token_s=3.05e-8, base_read_fraction=0.5, demote_batch_s=0.0005,
    restore_per_unit_s=4.2e-5, device="H200 anchors (derived)")
# The H200 engine's measured coefficients as shipped since session 7 (data/step_model_h200_llama31_8b.json), pinned here
# for the same reason. Unlike the anchors, a step that reads BASE pairs costs more than an all-TARGET one (base_step_s
# 2.3 ms, a BASE token 0.58x a TARGET one): what the paper's watermark TPOT (+15 %) says of its hardware too.
MEASURED_STEP_MODEL = StepModel(
    host_overhead_s=0.00025, weight_read_full_s=0.004765, weight_read_fast_s=0.003412,
    compute_per_token_full_s=2.28e-5, compute_per_token_fast_s=1.17e-5, kv_read_per_token_s=3.746e-8,
    base_read_fraction=0.58, demote_batch_s=0.0012, restore_per_unit_s=4.2e-5, base_step_s=0.0023,
    padded_row_kv_fraction=1.03, weight_read_unnested_s=0.004966, compute_per_token_unnested_s=2e-5,
    device="H200 engine fit (session 7)")
PAPER_SIM = SimConfig(replica=ReplicaConfig(native_blocks=2560, units_per_layer=32, max_num_seqs=128,
                                            max_num_batched_tokens=2048), max_concurrency=38)


@pytest.fixture(scope="module")
def bursty():
    """Azure window rows 0..1200 replayed 5x faster: pressure beyond the FP16 budget for most of the run."""
    requests = load_trace("azure-window", 0, 1200, time_scale=0.2)
    return {name: simulate(requests, name, SIM) for name in PRESETS}


def _ablations(requests, sim, step_model=ANCHOR_STEP_MODEL, names=tuple(ABLATIONS), f_post="committed",
               engine_admission=False):
    configs = [preset("elastickv")] + [ablation(name) for name in names]
    configs = [with_f_post(c, f_post) for c in configs]
    if engine_admission:
        configs = [c.with_engine_admission() for c in configs]
    return {c.name: simulate(requests, c, sim, step_model) for c in configs}


@pytest.fixture(scope="module")
def paper_pressure():
    """The paper's ablation setting (App. C.6/C.7), scaled down 4x in length: a closed-loop client at maximum
    concurrency 38 sends fixed-length requests (4096/1024 there, 1024/256 here) into a KV budget of 84 % of the
    38 sequences' peak demand (20 GB of 38 x 5120 tokens x 128 KiB there; 2560 of 38 x 80 blocks here). This is the
    regime the ablation claims are made in: high concurrency, sustained pressure, every step near a full pool. Here
    ElasticKV also lands where the paper's profiled run did: no preemption, ~14 % BASE exposure (paper 14.7 %), about
    as many promotions as demotions (0.87 of them; paper 0.86). The open-loop Azure window is a different regime
    (bursty, heterogeneous lengths, ~6 % exposure): see ``azure_moderate``."""
    requests = [Request(i, 0.0, 1024, 256) for i in range(600)]
    return {name: run.summary() for name, run in _ablations(requests, PAPER_SIM).items()}


@pytest.fixture(scope="module")
def azure_moderate():
    """Azure window 3.3x faster, open loop: bursts with heterogeneous lengths, ~6 % BASE exposure. Demand falls
    after bursts here, which is when promotion has room to pay back its fidelity (it barely can at constant demand)."""
    requests = load_trace("azure-window", 0, 1200, time_scale=0.3)
    return {name: run.summary() for name, run in _ablations(requests, SIM).items()}


@pytest.fixture(scope="module")
def azure_papers_f_post():
    """``azure_moderate`` with the paper's F_post (free blocks after scheduling), where promotion competes with
    queued prompts for freed blocks. No promotion never asks for F_post: its run is the same under either rule."""
    requests = load_trace("azure-window", 0, 1200, time_scale=0.3)
    runs = _ablations(requests, SIM, names=("eager-promotion",), f_post="free")
    return {name: run.summary() for name, run in runs.items()}


def test_all_presets_finish_and_print_one_table(bursty):
    summaries = {name: run.summary() for name, run in bursty.items()}
    print()
    print(format_table([s.row() for s in summaries.values()]))
    for s in summaries.values():
        assert s.finished == s.requests == 1200
    fp16 = summaries["static-fp16"]
    assert fp16.preemptions > 0 and fp16.base_exposure == 0 and fp16.fast_fraction == 0
    # elastickv is left out since the session-7 step model (base_step_s 4.51 ms on every step that reads BASE, fitted
    # from elastickv's H200 steps with the CUDA-graph padding term): 15.2 % against static-fp16's 20.3 % (it was 23.6
    # against 14.3 % with the session-6 model). It still preempts less, asserted below.
    assert all(fp16.attainment <= s.attainment for name, s in summaries.items() if name != "elastickv")
    assert summaries["static-fp8"].fast_fraction == pytest.approx(1.0)
    assert summaries["dps"].base_exposure == 0 and summaries["elastickv"].fast_fraction == 0
    assert summaries["elastickv"].preemptions < fp16.preemptions


def test_combined_beats_dps_and_elastickv(bursty):
    """With the shipped model (a step that reads BASE pairs pays base_step_s = 2.3 ms, fitted on the H200 at 91280f1)
    combined reaches 100 % attainment against dps's 99.6 % and elastickv's 23.8 %, at 0.8 % BASE exposure and less
    FP8 layer-time than dps (81.8 against 82.4 %)."""
    comb, dps, ekv = (bursty[n].summary() for n in ("combined", "dps", "elastickv"))
    for other in (dps, ekv):
        assert comb.attainment > other.attainment or comb.ttft_p90 < other.ttft_p90
    assert comb.base_exposure <= ekv.base_exposure
    assert comb.fp8_layer_fraction <= dps.fp8_layer_fraction
    # Wall time with any layer in FP8: both go fast once and stay there to the end of the window, so this is a tie
    # decided by which one's first eviction came first. FP8 layer-time, asserted above, is what per-layer eviction
    # saves.
    assert comb.fast_fraction <= dps.fast_fraction + 0.005


def test_combined_against_dps_turns_on_the_per_step_base_cost():
    """At the 4.51 ms a BASE step cost at 96b3abf (per-pair host work the engine has cut since) combined falls to
    57.5 % attainment against dps's 99.6 %: each pair demoted to admit one more request slows every step, and the
    slower steps grow the queue and the demotion. It still beats elastickv (15.2 %)."""
    requests = load_trace("azure-window", 0, 1200, time_scale=0.2)
    model = replace(load_step_model(), base_step_s=0.00451, base_read_fraction=0.432, demote_batch_s=0.00111)
    comb, dps, ekv = (simulate(requests, name, SIM, model).summary() for name in ("combined", "dps", "elastickv"))
    assert ekv.attainment < comb.attainment < dps.attainment


def test_dps_makes_few_long_mode_windows(bursty):
    run = bursty["dps"]
    log = run.replicas[0].events
    to_fast, to_full = log.mode_transitions()
    assert 1 <= to_fast <= 2 and to_full <= 2  # the paper: 2 fast and 2 full per trace
    modes = log.time_in_modes(0.0, run.replicas[0].now)
    assert modes["fast"] / to_fast > 10.0  # each fast window lasts many seconds, not a few steps
    assert all(0 < x < 1.0 for x in log.restore_latencies())


def test_elastickv_ablations_in_the_papers_regime(paper_pressure):
    """Paper Tab. 3: watermark demotion raises BASE exposure and P90 TTFT; eager promotion raises P90 TTFT (and
    TPOT); no promotion nearly doubles exposure. With transitions costed from bytes on the H200 (see README, 'ElasticKV
    ablations'), what holds here: the exposure direction of the watermark; eager promotion's churn (about 2.4x the
    demotions and promotions) raising TPOT through the pack/unpack work it puts in steps; and the paper's side note
    that no promotion slightly improves P90 TTFT (in-flight promotions hold two fresh blocks each, so a new request
    waits a step for its prompt blocks). Not reproduced, and so not asserted: the watermark's and eager promotion's
    P90 TTFT (the closed loop runs in waves, each finish frees more blocks than its replacement's prompt takes, so a
    P90 TTFT here is the prefill pipeline, under our F_post or the paper's, and no queue amplifies a transition cost)
    and no-promotion's exposure (demand falls only when a wave finishes, taking its BASE pairs with it)."""
    runs = paper_pressure
    base, watermark, eager, frozen = (runs[n] for n in ("elastickv", "watermark-demotion", "eager-promotion",
                                                         "no-promotion"))
    print()
    print(format_table([s.row() for s in runs.values()]))
    assert all(s.preemptions == 0 and s.finished == s.requests == 600 for s in runs.values())
    assert 0.10 < base.base_exposure < 0.20
    assert 0.8 < base.promoted_pairs / base.demoted_pairs < 0.95
    assert watermark.base_exposure > 1.5 * base.base_exposure
    assert eager.promoted_pairs > 2 * base.promoted_pairs and eager.demoted_pairs > 2 * base.demoted_pairs
    assert eager.tpot_mean > 1.02 * base.tpot_mean
    assert frozen.promoted_pairs == 0 and frozen.base_exposure >= base.base_exposure
    assert frozen.ttft_p90 < base.ttft_p90


def test_no_promotion_raises_exposure_when_demand_falls(azure_moderate):
    """Where demand falls after bursts, promotion pays fidelity back: without it exposure rises ~1.5x (paper ~2x).
    Requests queue here, so eager promotion's churn (more demotion batches and unpacks in steps, more blocks held by
    in-flight promotions) shows in P90 TTFT (+3 %, a small margin; +1 % before promotion was costed)."""
    runs = azure_moderate
    base = runs["elastickv"]
    print()
    print(format_table([s.row() for s in runs.values()]))
    assert base.preemptions == 0 and 0 < base.base_exposure < 0.2
    assert runs["watermark-demotion"].base_exposure > base.base_exposure
    assert runs["no-promotion"].base_exposure > 1.3 * base.base_exposure
    assert runs["eager-promotion"].ttft_p90 > base.ttft_p90


def test_papers_f_post_makes_eager_promotion_cost_ttft(azure_moderate, azure_papers_f_post):
    """Paper Tab. 3: eager promotion raises P90 TTFT most. Under our F_post a promotion never takes blocks that
    admitted or queued prompts are committed to, so eager promotion can only cost TTFT through its transition work
    (+3 %, above). Under the paper's F_post it takes freed blocks before a queued prompt gets them, which the reserve
    R_t alone protects, and eager promotion has no reserve: +29 % P90 TTFT (1.30 vs 1.01 s). The same competition
    costs ElasticKV itself 2.3x the P90 TTFT of our rule (while holding exposure to 1.7 %), so dropping promotion
    lowers P90 TTFT by 61 % (paper: 'slightly') and raises exposure 4.8x (paper: 'nearly doubles')."""
    ours, frozen = azure_moderate["elastickv"], azure_moderate["no-promotion"]
    base, eager = azure_papers_f_post["elastickv"], azure_papers_f_post["eager-promotion"]
    print()
    print(format_table([s.row() for s in (base, eager, frozen)]))
    assert base.preemptions == eager.preemptions == 0
    assert eager.ttft_p90 > 1.15 * base.ttft_p90
    assert base.ttft_p90 > 2 * ours.ttft_p90 and base.base_exposure < 0.5 * ours.base_exposure
    assert frozen.ttft_p90 < 0.6 * base.ttft_p90 and frozen.base_exposure > 3 * base.base_exposure


@pytest.fixture(scope="module")
def azure_engine_admission():
    """The Azure window 3.1x faster, with the engine's admission (admissions count in the demand, base-floor bound)
    and the measured step model, under both F_post rules (no promotion and the watermark barely promote, so they run
    once, under the paper's)."""
    requests = load_trace("azure-window", 0, 1200, time_scale=0.32)
    papers = _ablations(requests, SIM, MEASURED_STEP_MODEL, f_post="free", engine_admission=True)
    ours = _ablations(requests, SIM, MEASURED_STEP_MODEL, names=("eager-promotion",), engine_admission=True)
    return {rule: {name: run.summary() for name, run in runs.items()} for rule, runs in
            (("free", papers), ("committed", ours))}


def test_ablations_with_the_engines_admission_and_measured_steps(azure_engine_admission):
    """All three of the paper's directions (Tab. 3) at once. The engine counts queued prompts in the demand it demotes
    for, so ElasticKV itself makes room for them, and the watermark's headroom no longer admits sooner (without that,
    as in ``azure_moderate``, it lowers P90 TTFT). What is left of the watermark is its cost: it holds ~10x the BASE
    pairs, every step that reads them pays the measured BASE step cost, so TPOT (+16 %; paper +15 %) and P90 TTFT
    (+33 %; paper +21 %) rise. Eager promotion raises P90 TTFT under either F_post (+9 % under the paper's, +5 % under
    ours; paper +57 %); no promotion raises exposure far more than the paper's 2x (7.9 % against 1.0 %), and P90
    TTFT with it. This holds in a band of load (package README, time scales 0.28-0.34): the watermark's P90 TTFT is
    above ElasticKV's from 0.30 to 0.33 (equal at 0.30 under the paper's F_post), the pool is rarely short from 0.34,
    and at 0.28 and below its headroom admits bursts sooner again. With the anchor step model (BASE at half a TARGET
    token's cost, no per-step cost) the watermark's BASE makes steps faster and its P90 TTFT does not rise."""
    runs, ours = azure_engine_admission["free"], azure_engine_admission["committed"]
    base, watermark, eager, frozen = (runs[n] for n in ("elastickv", "watermark-demotion", "eager-promotion",
                                                         "no-promotion"))
    print()
    print(format_table([s.row() for s in (*runs.values(), *ours.values())]))
    assert all(s.preemptions == 0 and s.finished == s.requests for s in (*runs.values(), *ours.values()))
    assert watermark.base_exposure > 2 * base.base_exposure
    assert watermark.ttft_p90 > 1.2 * base.ttft_p90 and watermark.tpot_mean > 1.1 * base.tpot_mean
    assert eager.ttft_p90 > 1.05 * base.ttft_p90
    assert ours["eager-promotion"].ttft_p90 > 1.03 * ours["elastickv"].ttft_p90
    assert frozen.base_exposure > 2 * base.base_exposure and frozen.ttft_p90 > base.ttft_p90


def test_transition_time_is_paid_in_steps():
    """Both costs reach the step time: with ElasticKV's measured demotion batch (25 ms on A100, Tab. 2) instead of
    our fused kernel's, the watermark's extra demotion batches raise TPOT (its P90 TTFT is still one prefill step,
    as the closed loop never queues a request behind another's prefill). With a PCIe link slow enough
    that one round of promotion copies outlasts a step, the step's upload waits for them and TPOT rises."""
    requests = [Request(i, 0.0, 1024, 256) for i in range(300)]
    slow_demote = replace(ANCHOR_STEP_MODEL, demote_batch_s=0.025)
    base = simulate(requests, "elastickv", PAPER_SIM, slow_demote).summary()
    watermark = simulate(requests, ablation("watermark-demotion"), PAPER_SIM, slow_demote).summary()
    assert watermark.demoted_pairs > base.demoted_pairs
    assert watermark.tpot_mean > 1.05 * base.tpot_mean
    slow_link = replace(ANCHOR_STEP_MODEL, h2d_bytes_per_s=1e9)
    fast_run = simulate(requests, preset("elastickv").with_kv(promotion="eager"), PAPER_SIM, ANCHOR_STEP_MODEL)
    slow_run = simulate(requests, preset("elastickv").with_kv(promotion="eager"), PAPER_SIM, slow_link)
    assert fast_run.replicas[0].h2d_stall_s == 0 < slow_run.replicas[0].h2d_stall_s
    assert slow_run.summary().tpot_mean > fast_run.summary().tpot_mean


def test_light_steady_load_makes_no_transitions():
    requests = synthetic(300, 600, 100, rate=4.0, cv=0.25, seed=1)
    for name in PRESETS:
        s = simulate(requests, name, SIM).summary()
        assert (s.demoted_pairs, s.promoted_pairs, s.preemptions) == (0, 0, 0)
        assert s.transitions == (1 if name == "static-fp8" else 0)


def test_steady_pressure_enters_fast_mode_once():
    # Near the FP16 budget, where fast mode drains the queue and full mode refills it: the restore dwell keeps
    # this from cycling (without it, DPS made 4 fast and 4 full windows here).
    requests = synthetic(700, 1500, 300, rate=14.0, cv=0.25, seed=2)
    for name in ("dps", "combined"):
        run = simulate(requests, name, SIM)
        to_fast, to_full = run.replicas[0].events.mode_transitions()
        assert to_fast == 1 and to_full <= 1


def test_replicas_share_load_and_pools_drain():
    requests = load_trace("azure-window", 0, 1600, time_scale=0.08)
    run = simulate(requests, "combined", SimConfig(replica=SIM.replica, replicas=8))
    counts = [len(rep.records) for rep in run.replicas]
    assert sum(counts) == 1600 and max(counts) - min(counts) < 0.25 * max(counts)
    for rep in run.replicas:
        rep.pool.check()
        assert rep.pool.allocated_count() == 0 and not rep.running and not rep.waiting
    rr = simulate(requests[:80], "dps", SimConfig(replica=SIM.replica, replicas=4, router="round-robin"))
    assert [len(rep.records) for rep in rr.replicas] == [20, 20, 20, 20]


def test_eight_replicas_serve_twelve_thousand_requests():
    """The scale the issue names (8 GPUs, 10,000+ requests) in CI time (~25 s on CI's 2 cores): the bundled Azure
    window's lengths six times over, Gamma arrivals (CV 2) at 150 req/s over 8 replicas, combined. Every request
    finishes, the router spreads them, every replica passes through fast mode under its share of the pressure, and
    every pool drains with its books intact. The full 19,365-request Azure trace on 8 replicas is in BENCHMARKS.md."""
    window = load_trace("azure-window")
    lengths = [(r.prompt_tokens, r.output_tokens) for r in window] * 6
    requests = with_arrivals(lengths, gamma_arrivals(len(lengths), 150.0, 2.0, 7))
    run = simulate(requests, "combined", SimConfig(replica=SIM.replica, replicas=8))
    summary = run.summary()
    assert summary.requests == summary.finished == 12_000 and summary.preemptions == 0
    counts = [len(rep.records) for rep in run.replicas]
    # Least-loaded routing balances queues, not counts: with CUDA-graph padding in the step model a replica just past
    # a graph size steps slower and takes fewer requests (1,304-1,738 per replica, 25 %, since whole layer groups
    # run fast; 17 % before that, 10 % before graph padding).
    assert max(counts) - min(counts) < 0.3 * max(counts)
    for rep in run.replicas:
        assert rep.events.mode_transitions()[0] >= 1
        rep.pool.check()
        assert rep.pool.allocated_count() == 0 and not rep.running and not rep.waiting


def test_cli_prints_one_table(capsys):
    table = main(["--trace", "azure-window", "--window", "0:150", "--presets", "static-fp16,combined"])
    out = capsys.readouterr().out
    assert table in out and len(table.splitlines()) == 3 and "combined" in table
    assert "TTFT mean" in table.splitlines()[0]


def test_cli_evicts_in_the_step_models_layer_granule():
    """Without --units-per-layer the CLI takes the step model's residual_units_per_layer (104, Llama-3.1-8B), as the
    engine's layers are; at 32 each layer frees a third of the blocks and combined ran twice the FP8 layer-time."""
    fixed = ["--fixed", "1024:256:80", "--max-concurrency", "38", "--native-blocks", "2300",
             "--max-num-batched-tokens", "8192", "--presets", "combined", "--engine-admission"]

    def row(extra: list[str]) -> list[str]:
        return main(fixed + extra).splitlines()[1].split()[:-1]  # the last column is the simulator's wall time

    assert load_step_model(None).residual_units_per_layer == 104
    default, coarse, fine = row([]), row(["--units-per-layer", "104"]), row(["--units-per-layer", "32"])
    assert default == coarse and default != fine
    fp8_layer_time = {name: float(r[-3].rstrip("%")) for name, r in (("default", default), ("fine", fine))}
    assert fp8_layer_time["default"] < 0.6 * fp8_layer_time["fine"]  # 37.2 against 75.9 %
    with pytest.raises(ConfigError, match="units_per_layer"):
        main([*fixed, "--units-per-layer", "0"])  # refused, not read as "the default"


def test_cli_takes_a_packaged_step_model_by_device_name(capsys):
    """``--step-model h100`` loads the set fitted to the H100 serving runs; its prefill steps cost more (plain fp16
    2.4e-5 s a token plus attention, where the H200 set has 2.0e-5 s from GEMM timings alone), so prompt-bound TTFT
    rises."""
    fixed = ["--fixed", "4096:16:24", "--max-concurrency", "8", "--native-blocks", "4000",
             "--max-num-batched-tokens", "8192", "--presets", "static-fp16"]

    def ttft_p50(extra: list[str]) -> float:
        return float(main(fixed + extra).splitlines()[1].split()[3].rstrip("s"))

    h200, h100 = ttft_p50([]), ttft_p50(["--step-model", "h100"])
    assert "H100" in capsys.readouterr().out
    assert h100 > 1.2 * h200
    with pytest.raises(ConfigError, match="neither a file nor one of"):
        main([*fixed, "--step-model", "a100"])
    with pytest.raises(ConfigError, match="--queue-fast-hold needs --queue-fast-after"):
        main([*fixed, "--queue-fast-hold", "0.25"])


def test_prefill_fast_brings_combined_to_dps_ttft_with_less_fp8_layer_time():
    """Dense half scale at a closed loop of 38 on the H100 step model (session 47's measured point, where combined
    with the queue rule ran P90 TTFT 0.32 s against dps's 0.31 s): each new prompt arrives as a request ends and runs
    its prefill with half the layers full. ``--prefill-fast`` runs those steps fast: combined's P90 meets dps's
    (0.29 s when written, from 0.37 s) and its FP8 layer-time stays well under dps's (60 % against 100 %)."""
    fixed = ["--fixed", "2048:512:400", "--max-concurrency", "38", "--native-blocks", "4768",
             "--max-num-batched-tokens", "8192", "--presets", "dps,combined", "--engine-admission",
             "--step-model", "h100", "--prefill-fast"]
    rows = {r.split()[0]: r.split() for r in main(fixed).splitlines()[1:]}
    assert set(rows) == {"dps", "combined", "dps+prefill", "combined+prefill"}
    p90 = {name: float(r[4].rstrip("s")) for name, r in rows.items()}
    layer_time = {name: float(r[-4].rstrip("%")) for name, r in rows.items()}
    assert p90["combined"] > p90["dps"] + 0.03  # the gap: 0.37 against 0.29 s
    assert p90["combined+prefill"] <= p90["dps+prefill"] + 0.005 and p90["combined+prefill"] <= p90["dps"] + 0.005
    assert layer_time["combined+prefill"] < 0.7 * layer_time["dps+prefill"]
    assert all(int(r[7]) == 0 for r in rows.values())  # no preemptions: the pool holds the batch in every row


def test_sim_pool_and_sum_state_agree_without_restores(bursty):
    """The bursty DPS run never restores, so the in-simulator pool and the real SumState give the same run."""
    requests = load_trace("azure-window", 0, 1200, time_scale=0.2)
    sim_pool = SimConfig(replica=ReplicaConfig(native_blocks=4096, units_per_layer=32, max_num_seqs=128, pool="sim"))
    a, b = simulate(requests, "dps", sim_pool).summary(), bursty["dps"].summary()
    assert (a.attainment, a.preemptions, a.ttft_p90, a.fast_fraction) == (
        b.attainment, b.preemptions, b.ttft_p90, b.fast_fraction)


def test_capacity_sweep_orders_presets():
    lengths = [(r.prompt_tokens, r.output_tokens) for r in load_trace("azure-window", 0, 300)]
    small = SimConfig(replica=ReplicaConfig(native_blocks=1024, units_per_layer=8, max_num_seqs=64))
    fp16, by_rate = capacity_sweep(lengths, [2.0, 4.0, 8.0], "static-fp16", small)
    comb, _ = capacity_sweep(lengths, [2.0, 4.0, 8.0], "combined", small)
    assert set(by_rate) == {2.0, 4.0, 8.0}
    assert comb > fp16 and by_rate[2.0] >= 0.9


def test_caps_hold_in_simulation():
    """BASE pairs stay under max_base_fraction of resident pairs (so exposure does too), promotions in flight under
    their cap, and preemption takes over when the cap stops demotion."""
    cfg = preset("elastickv").with_kv(max_base_fraction=0.05, max_promotions_in_flight=4)
    requests = load_trace("azure-window", 0, 600, time_scale=0.2)
    run = simulate(requests, cfg, SIM)
    rep = run.replicas[0]
    starts = [e.amount for e in rep.events.events if e.kind == "promote_start"]
    s = run.summary()
    assert 0 < s.base_exposure <= 0.05 and s.preemptions > 0
    assert starts and max(starts) <= 4


def test_closed_loop_client_keeps_concurrency():
    """``max_concurrency`` paces a burst like a benchmark client: never more outstanding, sent as slots free up."""
    requests = [Request(i, 0.0, 200, 30) for i in range(12)]
    run = simulate(requests, "elastickv", SimConfig(replica=SIM.replica, max_concurrency=3))
    recs = run.records
    for t in sorted({r.arrival for r in recs}):
        assert sum(r.arrival <= t < r.finish for r in recs) <= 3
    assert sorted(r.arrival for r in recs)[3] > 0 and all(r.finished for r in recs)
    ttfts = [r.ttft for r in recs]
    assert run.summary().ttft_mean == pytest.approx(sum(ttfts) / len(ttfts), rel=1e-12)
    with pytest.raises(ConfigError):
        SimConfig(max_concurrency=0)


def test_queue_fast_runs_fp8_for_a_prefill_backlog_without_evicting():
    """A prefill-bound burst (200 prompts of 2,000 tokens at 40 req/s, short outputs) that fits the FP16 KV budget:
    dps alone never leaves full mode; with ``queue_fast_s`` it runs FP8 while prompts wait, evicts nothing, and
    the P90 TTFT falls. Mode windows stay few (the hold turns a draining queue into one window, not a flip per step)."""
    requests = synthetic(200, 2000, 16, rate=40.0, cv=1.0, seed=3)
    sim = SimConfig(replica=ReplicaConfig(native_blocks=8192, units_per_layer=32, max_num_seqs=64,
                                          max_num_batched_tokens=2048))
    plain = simulate(requests, preset("dps"), sim, ANCHOR_STEP_MODEL)
    queued = simulate(requests, preset("dps").with_precision(queue_fast_s=0.5), sim, ANCHOR_STEP_MODEL)
    p, q = plain.summary(), queued.summary()
    assert p.fast_fraction == 0.0 and p.ttft_p90 > 4.0  # 4.69 s when written (session 10)
    assert q.fast_fraction > 0.5 and q.ttft_p90 < 0.5 * p.ttft_p90  # 1.34 s, 84.6 % of the time fast
    counts = queued.replicas[0].events.counts()
    assert "evict_residual" not in counts and counts["mode_fast"] <= 3 and q.transitions <= 3
