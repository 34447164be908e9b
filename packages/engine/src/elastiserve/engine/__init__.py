"""elastiserve serving engine: continuous batching on elastic memory, an OpenAI-compatible server, benchmarks."""

from elastiserve.engine.config import EngineConfig
from elastiserve.engine.errors import EngineError, InvalidRequest, RequestAborted
from elastiserve.engine.llm_engine import LLMEngine
from elastiserve.engine.sampling import SamplingParams

__all__ = ["EngineConfig", "EngineError", "InvalidRequest", "LLMEngine", "RequestAborted", "SamplingParams"]
__version__ = "0.1.0"
