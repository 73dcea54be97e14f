"""The headless engine: models, loading, caches, sampler, scheduler, engine thread.

Nothing here imports a UI, web or CLI framework (an import-linter contract enforces it), so the
engine runs bare on a GPU machine. Everything outside the engine talks to it through `EngineClient`
and the names exported here (a second contract keeps the surfaces off the engine's sub-packages);
`kapitsa.opener` is the one module outside that starts an engine.
"""

from kapitsa.engine.client import EngineClient
from kapitsa.engine.text.token_checks import check_token_ids
from kapitsa.engine.types import (
    EngineStats,
    ErrorEvent,
    Event,
    FinishEvent,
    GenerationRequest,
    ModelInfo,
    SamplingParams,
    TokenEvent,
    TokenLogprob,
    Usage,
)

__all__ = [
    "EngineClient",
    "EngineStats",
    "ErrorEvent",
    "Event",
    "FinishEvent",
    "GenerationRequest",
    "ModelInfo",
    "SamplingParams",
    "TokenEvent",
    "TokenLogprob",
    "Usage",
    "check_token_ids",
]
