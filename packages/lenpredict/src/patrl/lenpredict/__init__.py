"""patrl.lenpredict: response-length and step-latency models, the reconfiguration planner and
the rollout simulator. Pure numpy + pydantic (no torch)."""

from patrl.lenpredict.assignment import (
    assign_prompts,
    longest_processing_time,
    round_robin,
    split_replicas,
)
from patrl.lenpredict.ceiling import (
    Ceiling,
    LockstepFreeSwitch,
    adaptive_ceiling,
    lockstep_free_switch,
)
from patrl.lenpredict.finish_time import RunningSet, shared_prefix
from patrl.lenpredict.latency_model import LatencyModel, held_out_error
from patrl.lenpredict.layout import Layout, layouts_for, usable_tp_sizes
from patrl.lenpredict.length_predictor import LengthPredictor, PredictorConfig
from patrl.lenpredict.length_trace import (
    LengthRecord,
    LongTailSpec,
    PromptGroup,
    group_by_rollout,
    group_by_step,
    long_tail_trace,
    read_lengths,
    write_lengths,
)
from patrl.lenpredict.planner import NEVER, Decision, PlannerConfig, ReconfigPlanner
from patrl.lenpredict.plans import Option, assign_replicas
from patrl.lenpredict.profile_schema import (
    CollectiveRow,
    DecodeRow,
    HardwareInfo,
    ModelInfo,
    PrefillRow,
    Profile,
    ProfileMismatchError,
    SwitchRow,
    VerifyRow,
)
from patrl.lenpredict.rollout_sim import (
    AdaptivePolicy,
    RolloutSimulator,
    SimConfig,
    SimResult,
    StaticPolicy,
    oracle_remaining,
)
from patrl.lenpredict.roofline import (
    H100_SXM_NODE,
    LLAMA31_8B,
    QWEN3_14B,
    NodeSpec,
    roofline_profile,
)
from patrl.lenpredict.speculation import SpeculativeTail, TailStep, effective_step_time

__all__ = [
    "H100_SXM_NODE",
    "LLAMA31_8B",
    "NEVER",
    "QWEN3_14B",
    "AdaptivePolicy",
    "Ceiling",
    "CollectiveRow",
    "Decision",
    "DecodeRow",
    "HardwareInfo",
    "LatencyModel",
    "Layout",
    "LengthPredictor",
    "LengthRecord",
    "LockstepFreeSwitch",
    "LongTailSpec",
    "ModelInfo",
    "NodeSpec",
    "Option",
    "PlannerConfig",
    "PredictorConfig",
    "PrefillRow",
    "Profile",
    "ProfileMismatchError",
    "PromptGroup",
    "ReconfigPlanner",
    "RolloutSimulator",
    "RunningSet",
    "SimConfig",
    "SimResult",
    "SpeculativeTail",
    "StaticPolicy",
    "SwitchRow",
    "TailStep",
    "VerifyRow",
    "adaptive_ceiling",
    "assign_prompts",
    "assign_replicas",
    "effective_step_time",
    "group_by_rollout",
    "group_by_step",
    "held_out_error",
    "layouts_for",
    "lockstep_free_switch",
    "long_tail_trace",
    "longest_processing_time",
    "oracle_remaining",
    "read_lengths",
    "roofline_profile",
    "round_robin",
    "shared_prefix",
    "split_replicas",
    "usable_tp_sizes",
    "write_lengths",
]
