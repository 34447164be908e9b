"""Run as a script by test_programmatic_launch_cuda.py, once per ELASTISERVE_PDL value: a small random Llama on a DPS
engine with CUDA graphs decodes greedily in full mode, then with every layer in fast mode; prints JSON with the
tokens and a SHA-256 of every logits tensor the steps computed (bytes, so a one-bit difference shows)."""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from tiny_models import random_fp16_model, small_llama_config

from elastiserve.engine.config import EngineConfig
from elastiserve.engine.llm_engine import LLMEngine
from elastiserve.engine.sampling import SamplingParams
from elastiserve.platforms import current_platform


def main() -> None:
    layers = 3
    model = random_fp16_model(small_llama_config(layers, 512), device="cuda")
    config = EngineConfig(model="tiny", device="cuda", policy="dps", block_size=16, max_num_seqs=8,
                          max_model_len=512, kv_cache_budget=16 << 20, graph_capture_after=1)
    engine = LLMEngine(config, model=model, eos_token_ids=())
    digest = hashlib.sha256()
    compute_logits = engine.runner.model.compute_logits

    def hashed(hidden):
        logits = compute_logits(hidden)
        digest.update(logits.detach().float().cpu().numpy().tobytes())
        return logits

    engine.runner.model.compute_logits = hashed
    prompts = [[(5 * i + s) % 97 for i in range(n)] for s, n in ((1, 21), (2, 40), (3, 7))]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    try:
        full = [r.token_ids for r in engine.generate(prompts, params)]
        engine.force_fast_layers(frozenset(range(layers)))
        fast = [r.token_ids for r in engine.generate(prompts, params)]
        graphs = len(engine.runner.graphs.graphs) if engine.runner.graphs is not None else 0
    finally:
        engine.close()
    print(json.dumps({"pdl": current_platform().programmatic_launch, "full": full, "fast": fast,
                      "logits_sha256": digest.hexdigest(), "graphs": graphs}))


if __name__ == "__main__":
    main()
