"""patrl.rollout: the generation engine (continuous batching on paged KV, TP layers, sampler)."""

from patrl.rollout.config import EngineConfig
from patrl.rollout.engine import Engine
from patrl.rollout.loader import load_model, load_weights
from patrl.rollout.models import build_model
from patrl.rollout.outputs import CompletionOutput, RequestOutput, SequenceState
from patrl.rollout.reconfigure import KVCost, ReconfigReport
from patrl.rollout.sampler import SamplingParams

__all__ = [
    "CompletionOutput",
    "Engine",
    "EngineConfig",
    "KVCost",
    "ReconfigReport",
    "RequestOutput",
    "SamplingParams",
    "SequenceState",
    "build_model",
    "load_model",
    "load_weights",
]
