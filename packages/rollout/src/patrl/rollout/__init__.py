"""patrl.rollout: the generation engine (continuous batching on paged KV, TP layers, sampler)
and adaptive TP, which drives an engine from outside. `Engine(EngineConfig(model=DIR))` with
`generate` / `chat` and `SamplingParams` is the library entry point, as vLLM's `LLM` is; see
patrl.rollout.engine for an example."""

from patrl.rollout.adaptive import (
    AdaptiveEngine,
    KVCost,
    OracleLengths,
    ReconfigReport,
    TPController,
    TPDecisionRecord,
    cut_and_migrate,
    make_engine,
    reconfigure,
)
from patrl.rollout.config import EngineConfig, SpeculativeConfig
from patrl.rollout.engine import Engine
from patrl.rollout.loader import load_model, load_weights
from patrl.rollout.models import build_model
from patrl.rollout.outputs import CompletionOutput, RequestOutput, SequenceState
from patrl.rollout.plot import plot_timeline
from patrl.rollout.rollout_engine import RolloutEngine
from patrl.rollout.sampler import SamplingParams
from patrl.rollout.tp_policy import AdaptiveTP, StaticTP

__all__ = [
    "AdaptiveEngine",
    "AdaptiveTP",
    "CompletionOutput",
    "Engine",
    "EngineConfig",
    "KVCost",
    "OracleLengths",
    "ReconfigReport",
    "RequestOutput",
    "RolloutEngine",
    "SamplingParams",
    "SequenceState",
    "SpeculativeConfig",
    "StaticTP",
    "TPController",
    "TPDecisionRecord",
    "build_model",
    "cut_and_migrate",
    "load_model",
    "load_weights",
    "make_engine",
    "plot_timeline",
    "reconfigure",
]
