"""Fast mode's quantizing norms and SiLU-and-mul in the model (``models/layers.py``): with some decoder layers fast
and some full, the logits are bit-for-bit those of the unfused path, where each fp8 GEMM quantizes its own fp16
input; only the fast layers' o_proj still runs the GEMM's own quantizer. The CPU has no fp8 MMA, so there fast
mode is told to take fp8 (the kernels then run interpreted); on an sm90 GPU it does so by itself from 2 rows."""

from __future__ import annotations

import pytest
import torch
import transformers
from dense_context import dense_logits
from tiny_models import tiny_llama_config

from elastiserve.engine.models import build_model, decoder, layers
from elastiserve.engine.nested_weights import nest_weights, set_layer_modes
from elastiserve.kernels import nested_gemm

pytestmark = [pytest.mark.cpu, pytest.mark.cuda]

SEQUENCES = [[int(t) for t in torch.randint(0, 211, (n,), generator=torch.Generator().manual_seed(n))] for n in (23, 7)]
FAST_LAYERS = frozenset({0, 2})  # layer 1 stays full: its norms must not quantize


def logits_of(model, device) -> torch.Tensor:
    return dense_logits(model, SEQUENCES, device)


def count_quantizer_calls(monkeypatch) -> list[int]:
    calls = [0]
    quantize = nested_gemm.quantize_per_token

    def counted(x, fnuz=False):
        calls[0] += 1
        return quantize(x, fnuz)

    monkeypatch.setattr(nested_gemm, "quantize_per_token", counted)
    return calls


def test_fused_quantization_gives_the_unfused_logits(device, monkeypatch):
    config = tiny_llama_config()
    torch.manual_seed(0)
    state = {name: t.half() for name, t in transformers.LlamaForCausalLM(config).state_dict().items()}
    model = build_model(config.to_dict(), dtype=torch.float16, device=device)
    model.load_weights(state.items())
    nest_weights(model)
    set_layer_modes(model, FAST_LAYERS)
    if device.type == "cpu":
        for module in ("elastiserve.kernels.nested_linear", "elastiserve.kernels.nested_gemm"):
            monkeypatch.setattr(f"{module}.fast_mode_for", lambda rows, **_: "fp8")
    assert nested_gemm.fast_mode_for(sum(map(len, SEQUENCES))) == "fp8"
    calls = count_quantizer_calls(monkeypatch)

    fused = logits_of(model, device)
    assert calls[0] == len(FAST_LAYERS), "only o_proj of a fast layer quantizes inside its GEMM"

    calls[0] = 0
    for module in (decoder, layers):  # every fp8 GEMM quantizes its own fp16 input again
        monkeypatch.setattr(module, "takes_fp8_rows", lambda linear, rows: False)
    unfused = logits_of(model, device)
    assert calls[0] == 4 * len(FAST_LAYERS)
    assert torch.equal(fused, unfused)

    set_layer_modes(model, frozenset())  # full mode: no fp8 anywhere, and the logits move
    assert not torch.equal(logits_of(model, device), fused)
