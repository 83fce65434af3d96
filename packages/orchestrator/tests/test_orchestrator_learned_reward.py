"""A learned reward model in the job: its weighted score joins the rule rewards, its metrics
merge across replicas, the job's RM scores what HF's classifier scores, and its placement
(replicated or FSDP2-sharded) follows reward_model.strategy."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForSequenceClassification

from patrl.orchestrator.config import ConfigError, load_config
from patrl.orchestrator.data import PromptItem
from patrl.orchestrator.distributed import World
from patrl.orchestrator.learned_reward import LearnedReward, rm_placement, rm_weight_bytes
from patrl.orchestrator.rewards import RewardManager, add_model_scores
from patrl.orchestrator.scoring import merge_reward_metrics
from patrl_examples.demo.tokenizer import build_tokenizer
from patrl_testkit.models import save_tiny_reward_model


def one_or_raise(response: str, answer: str) -> float:
    if response.startswith("raise"):
        raise RuntimeError("raised on purpose")
    return 1.0


def test_model_scores_join_the_rule_rewards_by_weight() -> None:
    with RewardManager(
        [("format", 2.0), ("test_orchestrator_learned_reward:one_or_raise", 1.0)], num_workers=0
    ) as manager:
        result = manager.score(["\\boxed{1}", "none", "raise \\boxed{2}"], ["1", "1", "1"])
    rule = list(result.rewards)
    add_model_scores(result, [0.5, -1.0, 3.0], weight=0.25, seconds=0.1)
    # sample 2's rule call raised: it stays 0.
    assert rule == [3.0, 1.0, 0.0]
    assert result.rewards == [3.0 + 0.125, 1.0 - 0.25, 0.0]
    assert result.components["reward_model"] == [0.5, -1.0, 3.0]
    m = result.metrics()
    assert m["reward_model/score/mean"] == pytest.approx(2.5 / 3)
    assert (m["reward_model/score/max"], m["reward_model/score/min"]) == (3.0, -1.0)
    assert m["timing_s/reward_model"] == 0.1
    with pytest.raises(ValueError, match="2 reward-model scores for 3 samples"):
        add_model_scores(result, [1.0, 2.0], weight=1.0)


def test_replica_metrics_merge_max_of_maxima_and_min_of_minima() -> None:
    into: dict[str, float] = {}
    shares = [
        {
            "reward_model/score/max": 1.0,
            "reward_model/score/min": -2.0,
            "reward_model/score/mean": 0.0,
        },
        {
            "reward_model/score/max": 4.0,
            "reward_model/score/min": 0.5,
            "reward_model/score/mean": 1.0,
        },
    ]
    merge_reward_metrics(into, shares)
    assert into == {
        "reward_model/score/max": 4.0,
        "reward_model/score/min": -2.0,
        "reward_model/score/mean": 0.5,
    }
    merge_reward_metrics(into, [{"reward_model/score/max": 2.0, "reward_model/score/min": -3.0}])
    assert (into["reward_model/score/max"], into["reward_model/score/min"]) == (4.0, -3.0)


def test_enable_without_a_path_is_a_config_error() -> None:
    with pytest.raises(
        ConfigError, match=r"reward_model\.enable=true needs reward_model\.model\.path"
    ):
        load_config(None, ["reward_model.enable=true"])


def test_learned_reward_scores_prompt_and_response_as_hf_does(tmp_path: Path) -> None:

    tok = build_tokenizer()
    rm = save_tiny_reward_model(tmp_path / "rm", tok)
    config = load_config(
        None,
        [
            "reward_model.enable=true",
            f"reward_model.model.path={rm}",
            "reward_model.micro_batch_size=2",
        ],
    )
    prompts = ["1+2=?", "7+8=?"]
    items = [
        PromptItem(i, tok(p)["input_ids"], p, "", messages=[{"role": "user", "content": p}])
        for i, p in enumerate(prompts)
    ]
    responses = [tok(r, add_special_tokens=False)["input_ids"] for r in ["3", "15 is it", "x"]]
    samples = [(items[0], responses[0]), (items[1], responses[1]), (items[1], responses[2])]
    learned = LearnedReward(config, tok, World(0, 1, 0, torch.device("cpu")))
    assert learned.encoder.same
    scores, _ = learned.score(samples)
    hf = AutoModelForSequenceClassification.from_pretrained(rm).eval()
    with torch.no_grad():
        want = [
            float(hf(input_ids=torch.tensor([item.prompt_token_ids + resp])).logits[0, 0])
            for item, resp in samples
        ]
    assert scores == pytest.approx(want, abs=1e-5)


def test_placement_follows_the_strategy_and_auto_weighs_the_gpu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    rm = save_tiny_reward_model(tmp_path / "rm", build_tokenizer())
    numel = sum(
        p.numel() for p in AutoModelForSequenceClassification.from_pretrained(rm).parameters()
    )
    assert rm_weight_bytes(str(rm), torch.bfloat16) == 2 * numel
    assert rm_weight_bytes(str(rm), torch.float32) == 4 * numel

    def placement(strategy: str, world: World) -> str:
        config = load_config(
            None,
            [
                "reward_model.enable=true",
                f"reward_model.model.path={rm}",
                f"reward_model.strategy={strategy}",
            ],
        )
        return rm_placement(config, world)[0]

    cpu2 = World(0, 2, 0, torch.device("cpu"))
    assert placement("fsdp", World(0, 1, 0, torch.device("cpu"))) == "replicated"
    assert placement("fsdp", cpu2) == placement("fsdp2", cpu2) == "fsdp"
    assert placement("replicated", cpu2) == placement("auto", cpu2) == "replicated"

    class Props:
        total_memory = 0

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: Props)
    gpu2 = World(0, 2, 0, torch.device("cuda", 0))
    Props.total_memory = 2 * numel * 10 + 1  # bf16 weights just under 10% of the device
    assert placement("auto", gpu2) == "replicated"
    Props.total_memory = 2 * numel * 10 - 1
    assert placement("auto", gpu2) == "fsdp"
    with pytest.raises(ConfigError, match=r"reward_model\.strategy"):
        load_config(None, ["reward_model.strategy=megatron"])
