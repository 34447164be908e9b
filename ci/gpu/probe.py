"""One-shot probe of the GPU machine: versions, fp8 dot support in Triton, cuda-bindings VMM calls."""
import importlib
import json
import sys

import torch
import triton
import triton.language as tl

report = {"python": sys.version, "torch": torch.__version__, "triton": triton.__version__,
          "device": torch.cuda.get_device_name(0)}
for name in ("cuda.bindings", "transformers", "aiohttp", "prometheus_client", "tokenizers", "safetensors", "gguf",
             "openai", "pydantic", "jinja2", "tqdm", "matplotlib", "hypothesis", "pytest_benchmark", "pytest_timeout"):
    try:
        mod = importlib.import_module(name)
        report[name] = getattr(mod, "__version__", "present")
    except Exception as exc:  # a probe records whatever fails
        report[name] = f"missing: {exc.__class__.__name__}"


@triton.jit
def _dot(a_ptr, b_ptr, c_ptr, A_E5: tl.constexpr, B_E5: tl.constexpr):
    offs = tl.arange(0, 32)
    a = tl.load(a_ptr + offs[:, None] * 32 + offs[None, :])
    b = tl.load(b_ptr + offs[:, None] * 32 + offs[None, :])
    a = a.to(tl.float8e5, bitcast=True) if A_E5 else a.to(tl.float8e4nv, bitcast=True)
    b = b.to(tl.float8e5, bitcast=True) if B_E5 else b.to(tl.float8e4nv, bitcast=True)
    tl.store(c_ptr + offs[:, None] * 32 + offs[None, :], tl.dot(a, b))


for a_e5, b_e5 in ((False, False), (True, False), (False, True), (True, True)):
    a = torch.randn(32, 32, device="cuda").to(torch.float8_e5m2 if a_e5 else torch.float8_e4m3fn)
    b = torch.randn(32, 32, device="cuda").to(torch.float8_e5m2 if b_e5 else torch.float8_e4m3fn)
    c = torch.empty(32, 32, device="cuda")
    key = f"dot_{'e5' if a_e5 else 'e4'}x{'e5' if b_e5 else 'e4'}"
    try:
        _dot[(1,)](a.view(torch.uint8), b.view(torch.uint8), c, A_E5=a_e5, B_E5=b_e5)
        ref = a.float() @ b.float()
        report[key] = float((c - ref).abs().max())
    except Exception as exc:
        report[key] = f"failed: {str(exc)[:200]}"
print(json.dumps(report, indent=1))
