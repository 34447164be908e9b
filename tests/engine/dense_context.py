"""DenseAttentionContext: causal attention per sequence without paging or a KV cache, for model tests.

Tokens of several sequences are concatenated along T; ``seq_lens`` says how many belong to each, and every
sequence starts at position 0 (a pure prefill). The model calls ``attend_rotary(layer_idx, positions, q, k, v,
rotary)`` per layer, which rotates q and k and calls ``attend(layer_idx, q, k, v)``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from elastiserve.engine.models import RotaryEmbedding


class DenseAttentionContext:
    def __init__(self, seq_lens: list[int]) -> None:
        self.seq_lens = list(seq_lens)

    def valid_tokens(self) -> None:  # never padded
        return None

    def attend_rotary(self, layer_idx: int, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                      v: torch.Tensor, rotary: RotaryEmbedding) -> torch.Tensor:  # fmt: skip
        q, k = rotary(positions, q, k)
        return self.attend(layer_idx, q, k, v)

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if sum(self.seq_lens) != q.shape[0]:
            raise ValueError(f"seq_lens {self.seq_lens} do not add up to {q.shape[0]} tokens")
        group = q.shape[1] // k.shape[1]
        outputs = []
        for q_seq, k_seq, v_seq in zip(q.split(self.seq_lens), k.split(self.seq_lens), v.split(self.seq_lens)):
            # [T, H, D] -> [H, T, D]; K/V heads repeated for GQA. Math in fp32 so the reference is not the weak link.
            qh = q_seq.transpose(0, 1).float()
            kh = k_seq.transpose(0, 1).float().repeat_interleave(group, dim=0)
            vh = v_seq.transpose(0, 1).float().repeat_interleave(group, dim=0)
            out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True)
            outputs.append(out.transpose(0, 1).to(q.dtype))
        return torch.cat(outputs)


def positions_for(seq_lens: list[int], device: torch.device | str = "cpu") -> torch.Tensor:
    return torch.cat([torch.arange(n, device=device) for n in seq_lens])


def dense_logits(model, sequences: list[list[int]], device: torch.device | str = "cpu") -> torch.Tensor:
    """The model's logits (on the CPU) for each token of ``sequences``, each a fresh prefill from position 0."""
    lens = [len(s) for s in sequences]
    ids = torch.tensor([t for s in sequences for t in s], device=device)
    with torch.no_grad():
        hidden = model(ids, positions_for(lens, device), DenseAttentionContext(lens))
        return model.compute_logits(hidden).cpu()
