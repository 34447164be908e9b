"""Step-time model for the simulator: time of one forward pass from batch shape and precision mode.

    t = host_overhead + max(weight read, batch_tokens x compute per token)
        + prefill attention per key x keys the prefill tokens attend to
        + context KV read x (1 + padded_row_kv_fraction x padding rows / sequences)
        + base_step (a batch that reads any BASE pair)
        + demotion kernel (launch/metadata + bytes / kernel bandwidth) + unpack of landed promotions (same form)

with weight read and compute interpolated between full and fast by the fraction of fast layers (a policy that keeps
plain fp16 weights uses the ``*_unnested_*`` coefficients instead: on the H200 at 58a40e6 the nested full-mode batch-1
decode step took 0.96x the plain fp16 one and fast mode 0.68x), and BASE context tokens read at
``base_read_fraction`` of a TARGET token. A decode-only step runs the CUDA graph of the next captured batch size
(``padded_batch``, the engine's ``graph_batch_sizes``), and each padding row costs ``padded_row_kv_fraction`` of the
batch's mean KV read per sequence: on the H200 at a full pool, 32 running sequences took 10.9-11.0 ms and 33-36
(padded to 48) 13.1-13.2 ms at the same context, and the fit gives 1.03 (a padding row costs a mean row). A fixed
cost per row fits those steps as well but predicts 14.4 ms for the engine benchmark's 64 rows at 512 tokens each,
measured 6.15 ms; this form predicts 6.45 ms. A step with a prefill chunk runs eagerly, unpadded. ``base_step_s`` is
what a step pays once when its batch reads any BASE pair, whatever their number (mixed-fidelity attention setup and
host bookkeeping); 0 in older JSONs. Fidelity transitions are costed from
bytes, not fitted: a demoted pair reads its two blocks and writes the packed block and the low-byte staging (4
blocks of HBM traffic), an unpacked promotion reads the packed block and the staged low bytes and writes two blocks
(4 blocks too), both at ``transition_kernel_bytes_per_s`` (the measured ``kv_demote`` rate, BENCHMARKS.md); a
promotion's host->device copy moves one block of low bytes at ``h2d_bytes_per_s`` (the replica queues it on its H2D
copy engine, see ``sim_replica``); the per-batch demotion cost ``demote_batch_s`` (launch, metadata and the host's
ranking) is fitted from engine steps. Coefficients are data (a JSON carrying the device and commit they came from,
and which ones are still assumptions).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from importlib import resources
from pathlib import Path

from elastiserve.platforms import ConfigError

# Packaged coefficient sets by device, Llama-3.1-8B shapes (data/README.md says where each number came from).
PACKAGED_STEP_MODELS = {"h200": "step_model_h200_llama31_8b.json", "h100": "step_model_h100_llama31_8b.json"}
DEFAULT_STEP_MODEL = PACKAGED_STEP_MODELS["h200"]
# A BASE token reads half the bytes of a TARGET one, but the engine's mixed-fidelity decode paths can cost more per
# token than its native path (session 6's pooled fit said 1.40x; with a per-step BASE constant the H200 runs give
# 0.17-1.04x, see the JSON's provenance), so the fraction may exceed 1.
MAX_BASE_READ_FRACTION = 4.0
GRAPH_SIZES_BELOW_16 = (1, 2, 4, 8)  # then multiples of 16 (elastiserve.engine.graphs.graph_batch_sizes)
TRANSITION_BLOCKS_MOVED = 4  # HBM bytes of one pack or unpack, in blocks (ARCHITECTURE.md, KV fidelity)
OPTIONAL_KEYS = {"residual_units_per_layer", "device", "commit", "provenance", "promote_batch_s", "block_bytes",
                 "h2d_bytes_per_s", "transition_kernel_bytes_per_s", "weight_read_unnested_s",
                 "compute_per_token_unnested_s", "base_step_s", "padded_row_kv_fraction",
                 "prefill_attention_per_key_s"}


@dataclass(frozen=True, slots=True)
class StepModel:
    host_overhead_s: float
    weight_read_full_s: float
    weight_read_fast_s: float
    compute_per_token_full_s: float
    compute_per_token_fast_s: float
    kv_read_per_token_s: float
    base_read_fraction: float
    demote_batch_s: float
    restore_per_unit_s: float
    base_step_s: float = 0.0  # once per step whose batch reads any BASE pair
    padded_row_kv_fraction: float = 0.0  # of the mean sequence's KV read, per CUDA-graph padding row; 0: none
    prefill_attention_per_key_s: float = 0.0  # per (prefill token, key it attends to) pair; 0: not fitted
    promote_batch_s: float = 0.0005
    block_bytes: int = 2 * 1024 * 1024
    h2d_bytes_per_s: float = 55e9
    transition_kernel_bytes_per_s: float = 3.93e12
    residual_units_per_layer: int = 104
    weight_read_unnested_s: float | None = None  # plain fp16 weights (static-fp16, elastickv); None: the full values
    compute_per_token_unnested_s: float | None = None
    device: str = "unknown"
    commit: str = "unknown"
    provenance: str = ""

    def __post_init__(self) -> None:
        numbers = [getattr(self, f.name) for f in fields(self) if f.type in ("float", "int", "float | None")]
        numbers = [x for x in numbers if x is not None]
        if any(x < 0 for x in numbers):
            raise ConfigError("step-model coefficients must be >= 0")
        if not 0 < self.base_read_fraction <= MAX_BASE_READ_FRACTION:
            raise ConfigError(f"base_read_fraction must lie in (0, {MAX_BASE_READ_FRACTION}]")
        if self.padded_row_kv_fraction > MAX_BASE_READ_FRACTION:
            raise ConfigError(f"padded_row_kv_fraction must lie in [0, {MAX_BASE_READ_FRACTION}]")
        if self.block_bytes < 1 or self.h2d_bytes_per_s <= 0 or self.transition_kernel_bytes_per_s <= 0:
            raise ConfigError("block_bytes and the transfer bandwidths must be > 0")

    @property
    def demote_per_pair_s(self) -> float:
        """Pack kernel per pair: read two blocks, write the packed block and one block of low bytes."""
        return TRANSITION_BLOCKS_MOVED * self.block_bytes / self.transition_kernel_bytes_per_s

    @property
    def unpack_per_pair_s(self) -> float:
        """Unpack kernel per promoted pair: read the packed block and the staged low bytes, write two blocks."""
        return TRANSITION_BLOCKS_MOVED * self.block_bytes / self.transition_kernel_bytes_per_s

    @property
    def promote_copy_per_pair_s(self) -> float:
        """Host->device copy of one pair's low bytes (2 x n bytes for n elements per block: one block's bytes)."""
        return self.block_bytes / self.h2d_bytes_per_s

    def step_time(
        self,
        batch_tokens: int,
        context_tokens: int,
        base_context_tokens: int = 0,
        fast_fraction: float = 0.0,
        demoted_pairs: int = 0,
        unpacked_pairs: int = 0,
        nested: bool = True,
        padded_rows: int = 0,
        prefill_keys: int = 0,
    ) -> float:
        """Seconds for one step. ``fast_fraction`` is the fraction of decoder layers in fast (FP8) mode;
        ``nested=False`` is a policy that keeps plain fp16 weights (it never has fast layers); ``padded_rows`` is the
        CUDA-graph batch of a decode-only step of ``batch_tokens`` sequences (``padded_batch``; 0: no graph);
        ``prefill_keys`` sums, over the step's prefill tokens, the keys each attends to (``prefill_key_count``)."""
        if padded_rows and padded_rows < batch_tokens:
            raise ConfigError(f"a graph of {padded_rows} rows cannot hold {batch_tokens} sequences")
        if batch_tokens <= 0:
            return 0.0
        f = min(1.0, max(0.0, fast_fraction))
        full_read, full_compute = self.weight_read_full_s, self.compute_per_token_full_s
        if not nested:
            f = 0.0
            full_read = self.weight_read_unnested_s if self.weight_read_unnested_s is not None else full_read
            if self.compute_per_token_unnested_s is not None:
                full_compute = self.compute_per_token_unnested_s
        weights = (1 - f) * full_read + f * self.weight_read_fast_s
        compute = batch_tokens * ((1 - f) * full_compute + f * self.compute_per_token_fast_s)
        target_tokens = context_tokens - base_context_tokens
        kv = self.kv_read_per_token_s * (target_tokens + self.base_read_fraction * base_context_tokens)
        if padded_rows:
            kv *= 1 + self.padded_row_kv_fraction * (padded_rows - batch_tokens) / batch_tokens
        kv += self.base_step_s if base_context_tokens > 0 else 0.0
        demotion = (self.demote_batch_s + self.demote_per_pair_s * demoted_pairs) if demoted_pairs else 0.0
        unpack = (self.promote_batch_s + self.unpack_per_pair_s * unpacked_pairs) if unpacked_pairs else 0.0
        attention = self.prefill_attention_per_key_s * prefill_keys
        return self.host_overhead_s + max(weights, compute) + attention + kv + demotion + unpack

    def base_tpot(self, context_tokens: int = 1024) -> float:
        """T_base of the DPS SLO: an unloaded single-request decode step of the plain fp16 baseline, one value for
        every policy of a comparison."""
        return self.step_time(1, context_tokens, nested=False, padded_rows=1)


def prefill_key_count(computed: int, chunk: int) -> int:
    """Keys attended to by a causal prefill chunk of ``chunk`` tokens after ``computed`` cached ones: token i of the
    chunk sees the cache and itself and the i tokens before it."""
    if computed < 0 or chunk < 0:
        raise ConfigError(f"need computed >= 0 and chunk >= 0, got {computed}, {chunk}")
    return chunk * computed + chunk * (chunk + 1) // 2


def padded_batch(num_seqs: int, max_num_seqs: int) -> int:
    """The CUDA-graph batch the engine pads a decode-only step of ``num_seqs`` sequences to: the next of 1, 2, 4, 8,
    then multiples of 16, with ``max_num_seqs`` itself the largest (``graph_batch_sizes``, which imports torch)."""
    if max_num_seqs < 1 or not 0 <= num_seqs <= max_num_seqs:
        raise ConfigError(f"need 0 <= num_seqs <= max_num_seqs and max_num_seqs >= 1, got {num_seqs}, {max_num_seqs}")
    if num_seqs == 0:
        return 0
    size = next((s for s in GRAPH_SIZES_BELOW_16 if num_seqs <= s), -(-num_seqs // 16) * 16)
    return min(size, max_num_seqs)


def load_step_model(source: Path | str | None = None) -> StepModel:
    """Load coefficients from a packaged set (``source`` a key of ``PACKAGED_STEP_MODELS``, None: the H200's) or a
    JSON file; unknown keys are ignored."""
    packaged = DEFAULT_STEP_MODEL if source is None else PACKAGED_STEP_MODELS.get(str(source))
    if packaged:
        text = (resources.files("elastiserve.control") / "data" / packaged).read_text()
    else:
        path = Path(source)
        if not path.is_file():
            raise ConfigError(f"step model {str(source)!r} is neither a file nor one of {sorted(PACKAGED_STEP_MODELS)}")
        text = path.read_text()
    raw = json.loads(text)
    known = {f.name for f in fields(StepModel)}
    missing = known - set(raw) - OPTIONAL_KEYS
    if missing:
        raise ConfigError(f"step model is missing {sorted(missing)}")
    return StepModel(**{k: v for k, v in raw.items() if k in known})
