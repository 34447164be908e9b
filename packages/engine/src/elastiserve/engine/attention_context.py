"""The paged ``AttentionContext`` the model calls once per layer, and the seam to ``elastiserve.kernels``' ops.

Each step the runner fills one ``AttentionMetadata`` (views into preallocated buffers, so captured CUDA graphs see
the same storage); ``attend_rotary`` rotates q and k and writes the rotated K and V into the cache in one launch
(``rotary_kv_write``), then runs ``paged_attention`` over the whole context with the step's pair metadata. On the CPU
the kernels' pure-torch references run directly.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from elastiserve.engine.models.layers import RotaryEmbedding


def kernel_ops(device: torch.device) -> SimpleNamespace:
    """rotary_kv_write / paged_attention / kv_demote / kv_promote: the registered ops on a GPU, references on the
    CPU."""
    from elastiserve.kernels import attention, kv_ops, rotary

    if device.type == "cpu":
        return SimpleNamespace(
            rotary_kv_write=rotary.rotary_kv_write_ref,
            paged_attention=attention.paged_attention_ref,
            kv_demote=kv_ops.kv_demote_ref,
            kv_promote=kv_ops.kv_promote_ref,
        )
    ops = torch.ops.elastiserve
    return SimpleNamespace(
        rotary_kv_write=ops.rotary_kv_write,
        paged_attention=ops.paged_attention,
        kv_demote=ops.kv_demote,
        kv_promote=ops.kv_promote,
    )


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # int64 [T]
    block_tables: torch.Tensor  # int32 [B, max_blocks]
    seq_lens: torch.Tensor  # int32 [B]
    query_start_loc: torch.Tensor  # int32 [B + 1]
    max_query_len: int
    path: int
    base_bounds: torch.Tensor | None = None  # int32 [B, 2] for the structured path
    pair_mode: torch.Tensor | None = None  # uint8 [B, max_pairs] for the general path
    padded: bool = False  # a mixed graph's step: the rows past query_start_loc[B] belong to no sequence


class PagedAttentionContext:
    def __init__(self, kv_cache: torch.Tensor, scale: float, ops: SimpleNamespace) -> None:
        self.kv_cache = kv_cache
        self.scale = scale
        self.ops = ops
        self.metadata: AttentionMetadata | None = None

    def valid_tokens(self) -> torch.Tensor | None:
        """[1] int32 on the device: how many leading rows are real tokens, when the step is padded (else None)."""
        meta = self.metadata
        return meta.query_start_loc[-1:] if meta is not None and meta.padded else None

    def attend_rotary(
        self,
        layer_idx: int,
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        rotary: RotaryEmbedding,
    ) -> torch.Tensor:
        meta = self.metadata
        # One launch rotates q and k and caches the rotated k with v; q comes back contiguous, as attention reads it.
        q = self.ops.rotary_kv_write(positions, q, k, v, rotary.cos_table, rotary.sin_table, self.kv_cache, layer_idx,
                                     meta.slot_mapping)  # fmt: skip
        return self.ops.paged_attention(
            q,
            self.kv_cache,
            layer_idx,
            meta.block_tables,
            meta.seq_lens,
            meta.query_start_loc,
            base_bounds=meta.base_bounds,
            pair_mode=meta.pair_mode,
            scale=self.scale,
            max_query_len=meta.max_query_len,
            path=meta.path,
        )
