"""The way back to a rollout's opening layout, owed after an adaptive rollout moved away.

The return is paid lazily: for free at the next full weight sync (from the full tensors a fold
kept, else by building the model at that layout from the synced tensors), or else by a
reconfigure when the next rollout starts (`settle`). A LoRA engine's sync brings adapters only,
from which no model can be built: without kept full tensors its return waits for `settle`.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

import torch

from patrl.rollout.adaptive.reconfig import reconfigure
from patrl.rollout.engine import Engine
from patrl.rollout.layers.lora import has_lora
from patrl.rollout.loader import load_weights, weight_keys
from patrl.rollout.models import build_model
from patrl.rollout.models.causal_lm import CausalLM
from patrl.tpreshard import ParallelLayout, restore_full_


class WayBack:
    """The layout `engine` owes a return to (`owed`, None: none), and the ways to pay it."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.owed: ParallelLayout | None = None

    def later(self, layout: ParallelLayout) -> None:
        """Go back to `layout` at the next full `load_weights`, or else at `settle`; until
        then the engine works on at its current layout."""
        self.owed = None if layout == self.engine.layout else layout

    def settle(self) -> float:
        """Pay the return now (every rank of the world at once); seconds it took."""
        if self.owed is None:
            return 0.0
        start = time.perf_counter()
        target, self.owed = self.owed, None
        reconfigure(self.engine, target, "recompute")
        return time.perf_counter() - start

    def load_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int
    ) -> float:
        """`Engine.load_weights`, paying an owed return on the way when the engine is idle (no
        gather, no collective): then `named_tensors` must be every weight unless the fold kept
        the full tensors (a partial load raises and changes nothing). A LoRA engine without
        them loads its adapters where it is and still owes the return. Seconds the return took."""
        engine = self.engine
        if self.owed is None or engine.has_unfinished():
            engine.load_weights(named_tensors, version)
            return 0.0
        start = time.perf_counter()
        layout = self.owed
        restored = layout.tp_size == 1 and restore_full_(engine.model, layout) is not None
        if not restored and has_lora(engine.model):
            engine.load_weights(named_tensors, version)
            return 0.0
        model = None if restored else self._built_at(layout, named_tensors)
        # at `layout` from here on, whatever the load below does (as a load at any layout, one
        # that raises midway leaves the weights it loaded)
        engine.rebuild(layout, model)
        self.owed = None
        if restored:
            load_weights(engine.model, named_tensors)  # into the kept full tensors, in place
        spent = time.perf_counter() - start
        engine.weight_version = version
        engine.cache.blocks.reset_prefix_cache()
        return spent

    def _built_at(
        self, layout: ParallelLayout, named_tensors: Iterable[tuple[str, torch.Tensor]]
    ) -> CausalLM:
        """A new model at `layout` from every weight; raises, the engine unchanged, on fewer."""
        current = self.engine.model
        model = build_model(
            current.config,
            layout,
            attention=self.engine.config.attention_backend,
            dtype=next(current.parameters()).dtype,
            device=self.engine.device,
        )
        missing = weight_keys(model) - load_weights(model, named_tensors)
        if missing:
            raise ValueError(
                f"load_weights brought {len(missing)} fewer weights than the model has (e.g. "
                f"{sorted(missing)[:3]}); after an adaptive rollout it must bring all of them, "
                f"as it rebuilds the model at tp={layout.tp_size}; the engine is unchanged"
            )
        return model
