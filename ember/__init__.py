"""Ember: a small, fast LLM inference engine with a vLLM-compatible API."""

from ember.config import EngineArgs
from ember.engine.async_llm import AsyncLLM
from ember.engine.engine import LLMEngine
from ember.engine.llm import LLM
from ember.engine.output import CompletionOutput, RequestOutput
from ember.logger import init_logging
from ember.sampling.params import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "AsyncLLM", "LLMEngine", "EngineArgs", "SamplingParams", "RequestOutput", "CompletionOutput"]

init_logging()
