"""Ember: a small, fast LLM inference engine with a vLLM-compatible API.

The public names load their modules on first use (PEP 562), so `import ember` and `ember --help`
do not pay for importing torch.
"""

import importlib
from typing import Any

from ember.logger import init_logging

__version__ = "0.1.0"
_EXPORTS = {
    "LLM": "ember.llm",
    "AsyncLLM": "ember.frontend.async_llm",
    "LLMEngine": "ember.frontend.engine",
    "EngineArgs": "ember.config",
    "SamplingParams": "ember.sampling.params",
    "StructuredOutputsParams": "ember.sampling.structured",
    "LoRARequest": "ember.lora.request",
    "RequestOutput": "ember.frontend.output",
    "CompletionOutput": "ember.frontend.output",
    "PoolingParams": "ember.pooling.params",
    "PoolerConfig": "ember.pooling.params",
    "EmbeddingRequestOutput": "ember.frontend.output",
    "EmbeddingOutput": "ember.frontend.output",
    "ScoringRequestOutput": "ember.frontend.output",
    "ScoringOutput": "ember.frontend.output",
    "ScoreConfig": "ember.pooling.score",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'ember' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)


init_logging()
