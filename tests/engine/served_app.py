"""The OpenAI-compatible server under test: ``Served`` runs an engine (the scripted fake or SmolLM2 on the CPU) behind
a real HTTP server with the official ``openai`` client pointed at it. The fixtures ``served`` (both engines, module
scope) and ``fake_served`` are in this folder's conftest.py."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

try:
    import openai
except ImportError:  # the GPU image has no openai client; these cpu-marked tests run where it is installed (CI)
    openai = None

from elastiserve.engine.async_engine import AsyncEngine
from elastiserve.engine.server import BackgroundServer, build_app

MODEL = "test-model"


def real_engine():
    from elastiserve.engine.config import EngineConfig
    from elastiserve.engine.llm_engine import LLMEngine

    return LLMEngine(
        EngineConfig(
            model="smollm2", device="cpu", max_model_len=256, max_num_seqs=4, cpu_kv_blocks=128, policy="static-fp16"
        )
    )


class Served:
    def __init__(self, engine, api_key=None, reasoning_parser=None):
        self.engine = engine
        self.async_engine = AsyncEngine(engine).start()
        self.app = build_app(self.async_engine, engine.tokenizer, model_name=MODEL, api_key=api_key,
                             reasoning_parser=reasoning_parser)
        self.server = BackgroundServer(self.app).__enter__()
        self.url = self.server.base_url
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key=api_key or "none", max_retries=0, timeout=120)

    def close(self):
        self.server.__exit__(None, None, None)
        self.async_engine.shutdown()

    def on_engine(self, fn):
        return self.async_engine.submit(fn).result(30)

    def wait_idle(self, timeout=30.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.on_engine(self.engine.has_unfinished):
                return True
            time.sleep(0.05)
        return False


def post_raw(url, path, body: bytes, headers=None):
    req = urllib.request.Request(url + path, data=body, headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())
