"""Adaptive TP: a driver that changes an engine's layout while it generates (PAT)."""

from patrl.rollout.adaptive.control_stats import ControlStats, TPDecisionRecord, critical_path
from patrl.rollout.adaptive.controller import TPController, opening_layout
from patrl.rollout.adaptive.driver import AdaptiveEngine, make_engine
from patrl.rollout.adaptive.length_groups import LengthGroups
from patrl.rollout.adaptive.migrate import cut_and_migrate
from patrl.rollout.adaptive.oracle import OracleLengths
from patrl.rollout.adaptive.protocols import Lengths, Planner, StepPrices
from patrl.rollout.adaptive.reconfig import KVChoice, KVCost, KVPolicy, ReconfigReport, reconfigure
from patrl.rollout.adaptive.setup import make_planner
from patrl.rollout.adaptive.stepped import SteppedRollout
from patrl.rollout.adaptive.switch_plan import SwitchPlan
from patrl.rollout.adaptive.way_back import WayBack

__all__ = [
    "AdaptiveEngine",
    "ControlStats",
    "KVChoice",
    "KVCost",
    "KVPolicy",
    "LengthGroups",
    "Lengths",
    "OracleLengths",
    "Planner",
    "ReconfigReport",
    "StepPrices",
    "SteppedRollout",
    "SwitchPlan",
    "TPController",
    "TPDecisionRecord",
    "WayBack",
    "critical_path",
    "cut_and_migrate",
    "make_engine",
    "make_planner",
    "opening_layout",
    "reconfigure",
]
