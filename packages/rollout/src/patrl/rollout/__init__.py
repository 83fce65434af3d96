"""patrl.rollout: the generation engine (continuous batching on paged KV, TP layers, sampler)."""

from patrl.rollout.adaptive import OracleLengths, TPController, TPDecisionRecord
from patrl.rollout.config import EngineConfig
from patrl.rollout.engine import Engine
from patrl.rollout.loader import load_model, load_weights
from patrl.rollout.models import build_model
from patrl.rollout.outputs import CompletionOutput, RequestOutput, SequenceState
from patrl.rollout.plot import plot_timeline
from patrl.rollout.reconfigure import KVCost, ReconfigReport
from patrl.rollout.sampler import SamplingParams
from patrl.rollout.tp_policy import AdaptiveTP, StaticTP

__all__ = [
    "AdaptiveTP",
    "CompletionOutput",
    "Engine",
    "EngineConfig",
    "KVCost",
    "OracleLengths",
    "ReconfigReport",
    "RequestOutput",
    "SamplingParams",
    "SequenceState",
    "StaticTP",
    "TPController",
    "TPDecisionRecord",
    "build_model",
    "load_model",
    "load_weights",
    "plot_timeline",
]
