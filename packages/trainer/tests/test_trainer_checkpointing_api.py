"""Activation checkpointing through either transformers API: `activation_checkpointing_enable`
(5.23 on) or, where a model lacks it, `gradient_checkpointing_enable` (the floor the packages
declare). Either way the model recomputes its layers, non-reentrantly, with the gradients of
the plain model."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import PreTrainedModel

from patrl.trainer.model import parallelize
from patrl_testkit.models import tiny_hf_model

NEW_API = "activation_checkpointing_enable"


def _grads(model: Any) -> dict[str, torch.Tensor]:
    model.train()
    ids = torch.tensor([[3, 7, 11, 5, 9, 2]])
    model(input_ids=ids, labels=ids).loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _without_new_api(model: Any, calls: list[Any]) -> Any:
    """`model` as transformers before 5.23 has it: no `activation_checkpointing_enable`, and a
    `gradient_checkpointing_enable(gradient_checkpointing_kwargs=...)`, whose calls go to
    `calls`. Where this transformers is newer, that call does the new API's work (its own
    `gradient_checkpointing_enable` would reach for the hidden method)."""

    class OldApi(type(model)):  # type: ignore[misc]
        def __getattribute__(self, name: str) -> Any:
            if name == NEW_API:
                raise AttributeError(name)
            return super().__getattribute__(name)

    def enable(gradient_checkpointing_kwargs: dict[str, Any] | None = None) -> None:
        calls.append(gradient_checkpointing_kwargs)
        del model.gradient_checkpointing_enable  # the class's method again, not an override
        newer = getattr(PreTrainedModel, NEW_API, None)
        if newer is None:
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs=gradient_checkpointing_kwargs
            )
        else:
            newer(model, gradient_checkpointing_kwargs)

    model.__class__ = OldApi
    model.gradient_checkpointing_enable = enable
    assert not hasattr(model, NEW_API)
    return model


def _checkpointing(model: Any) -> bool:
    """Whether a layer recomputes (the flag both APIs set, under either version's name)."""
    return any(getattr(m, "gradient_checkpointing", False) for m in model.modules())


@pytest.mark.parametrize("api", ["installed", "without_the_new_api"])
def test_checkpointing_is_on_with_the_plain_models_gradients(api: str) -> None:
    plain = tiny_hf_model("qwen2", seed=4)
    want = _grads(plain)
    model = tiny_hf_model("qwen2", seed=4)
    calls: list[Any] = []
    if api == "without_the_new_api":
        model = _without_new_api(model, calls)
    parallelize(model, None, torch.float32, activation_checkpointing=True)
    assert _checkpointing(model) and not _checkpointing(plain)
    if api == "without_the_new_api":
        assert calls == [{"use_reentrant": False}]
    got = _grads(model)
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6, msg=name)
