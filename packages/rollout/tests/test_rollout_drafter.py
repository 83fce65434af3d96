"""The drafter: n-gram drafts from a prompt's group, its history and the prompt itself."""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass, field

import pytest

from patrl.rollout.drafter import Draft, Drafter, NgramIndex


@dataclass
class Sample:
    seq_id: int
    prompt_token_ids: list[int]
    output_token_ids: list[int] = field(default_factory=list)
    prompt_key: str | None = "p"

    def context(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids


PROMPT = [100, 101, 102, 103]


def test_a_sample_drafts_from_its_siblings_continuation() -> None:
    d = Drafter(max_draft=3, min_n=2, max_n=3)
    a, b = Sample(0, PROMPT, [5, 6, 7, 8, 9]), Sample(1, PROMPT, [1, 6, 7])
    d.observe(a)
    d.observe(b)
    assert d.propose(1, b.context(), 8) == Draft([8, 9], "group")  # a's stream ends at 9
    assert d.propose(1, b.context(), 1) == Draft([8], "group")
    # the first token of a response: the prompt's tail is the lead-in of every stream
    c = Sample(2, PROMPT)
    d.observe(c)
    assert d.propose(2, c.context(), 3) == Draft([1, 6, 7], "group")  # the latest start


def test_longer_matches_win_then_the_order_of_sources() -> None:
    d = Drafter(max_draft=2, min_n=1, max_n=3, sources=("group", "history", "prompt"))
    prompt = [7, 8, 9, 50, 7, 8, 60]
    a = Sample(0, prompt, [1, 2, 9, 70])  # "9 70" in the group, "8 9 50" in the prompt
    d.observe(a)
    b = Sample(1, prompt, [3, 8, 9])
    d.observe(b)
    # "8 9" (n = 2) is in the prompt only; "9" (n = 1) is in the group too: longer wins
    assert d.propose(1, b.context(), 2) == Draft([50, 7], "prompt")
    only_group = Drafter(max_draft=2, min_n=1, max_n=3, sources=("group",))
    only_group.observe(a)
    only_group.observe(b)
    assert only_group.propose(1, b.context(), 2) == Draft([70], "group")


def test_a_sample_never_drafts_from_its_own_end_but_does_from_its_earlier_tokens() -> None:
    d = Drafter(max_draft=4, min_n=2, max_n=2)
    s = Sample(0, [1, 2], [3, 4, 5])
    d.observe(s)
    assert d.propose(0, s.context(), 4) == Draft([], None)
    s.output_token_ids += [3, 4]
    d.observe(s)
    assert d.propose(0, s.context(), 4) == Draft([5, 3, 4], "group")


def test_history_outlives_the_group_and_is_bounded() -> None:
    d = Drafter(max_draft=4, min_n=2, max_n=2, history_size=2, history_prompts=2)
    for i, out in enumerate([[1, 2, 3], [1, 2, 4], [1, 2, 5]]):
        s = Sample(i, PROMPT, out)
        d.observe(s)
        d.finish(i, out, remember=True)
    assert d.num_groups() == 0
    assert d.history["p"] == [[1, 2, 4], [1, 2, 5]]  # the two latest
    s = Sample(9, PROMPT, [1, 2])
    d.observe(s)
    assert d.propose(9, s.context(), 4) == Draft([5], "history")  # the latest one wins
    d.finish(9, [1, 2, 6], remember=False)  # an abort or an export: not history
    assert d.history["p"] == [[1, 2, 4], [1, 2, 5]]
    for key in ("q", "r"):
        other = Sample(20, PROMPT, [0], prompt_key=key)
        d.observe(other)
        d.finish(20, [0], remember=True)
    assert list(d.history) == ["q", "r"]  # at most two prompts, least recent dropped


def test_a_continued_sample_is_one_stream_tool_tokens_included() -> None:
    """A kept turn's continuation (the same seq id, a prompt of the conversation so far)
    stays its group's sample: the appended tool tokens and the next turn's output extend its
    stream, a sibling drafts across them, and the finished conversation is remembered
    whole, once."""
    d = Drafter(max_draft=4, min_n=2, max_n=2)
    a = Sample(0, PROMPT, [1, 2, 3], prompt_key=None)
    d.observe(a)  # turn 1 ends, kept: the engine does not finish it in the drafter
    d.continue_sample(0, [40, 41])  # the tool's ids
    turn2 = Sample(0, [*PROMPT, 1, 2, 3, 40, 41], [7, 8, 9], prompt_key=None)
    d.observe(turn2)  # known by its id: indexed from its new output's start
    sibling = Sample(1, [*PROMPT, 1, 2, 3, 40, 41], [], prompt_key=None)
    b = Sample(1, PROMPT, [1, 2, 3], prompt_key=None)
    d.observe(b)
    d.continue_sample(1, [40, 41])
    d.observe(sibling)
    assert d.num_groups() == 1  # both conversations in the first turn's group
    assert d.propose(1, sibling.context(), 4) == Draft([7, 8, 9], "group")  # across 40 41
    d.finish(0, turn2.output_token_ids, remember=True)
    assert d.history[tuple(PROMPT)] == [[1, 2, 3, 40, 41, 7, 8, 9]]
    d.continue_sample(5, [1])  # not here: nothing
    d.drop(1)
    assert d.num_groups() == 0 and len(d.history[tuple(PROMPT)]) == 1


def test_without_a_prompt_key_the_prompt_tokens_are_the_key() -> None:
    d = Drafter(max_draft=4, min_n=2, max_n=2)
    s = Sample(0, PROMPT, [1, 2, 3], prompt_key=None)
    d.observe(s)
    d.finish(0, [1, 2, 3], remember=True)
    t = Sample(1, list(PROMPT), [1, 2], prompt_key=None)
    d.observe(t)
    assert d.propose(1, t.context(), 4) == Draft([3], "history")


def test_state_dict_round_trips_the_history() -> None:
    d = Drafter(max_draft=4)
    for i, key in enumerate(["p", None]):
        s = Sample(i, PROMPT, [1, 2, 3], prompt_key=key)
        d.observe(s)
        d.finish(i, [1, 2, 3], remember=True)
    state = d.state_dict()
    assert state["history"] == [["p", [[1, 2, 3]]], [PROMPT, [[1, 2, 3]]]]
    e = Drafter(max_draft=4)
    e.load_state_dict(state)
    assert e.history == d.history


def test_draft_length_follows_acceptance() -> None:
    d = Drafter(max_draft=4, min_n=1, max_n=1)
    s = Sample(0, [1], [2, 3, 4, 5, 6, 1])
    d.observe(s)
    assert len(d.propose(0, s.context(), 10).tokens) == 4
    d.record(0, Draft([2, 3, 4, 5], "group"), accepted=1, emitted=2)
    assert d.propose(0, s.context(), 10) == Draft([2, 3], "group")  # one past the accepted
    d.record(0, Draft([2, 3], "group"), accepted=2, emitted=3)
    assert len(d.propose(0, s.context(), 10).tokens) == 3  # a whole draft: one more
    stats = d.counts.stats()
    assert stats["spec_acceptance"] == pytest.approx(3 / 6)
    assert stats["spec_tokens_per_step"] == pytest.approx(5 / 2)
    assert stats["spec_accepted_share/group"] == 1.0
    fixed = Drafter(max_draft=4, min_n=1, max_n=1, adaptive=False)
    fixed.observe(s)
    fixed.record(0, Draft([2], "group"), accepted=0, emitted=1)
    assert len(fixed.propose(0, s.context(), 10).tokens) == 4


def test_the_index_probes_one_entry_per_n_whatever_the_group_size() -> None:
    """A lookup reads one dict entry per n and a slice of the draft length: the table holds
    one (stream, position) per n-gram, the latest, however many streams repeat it."""
    index = NgramIndex(2, 2)
    for _ in range(100):
        index.add_stream([1, 2, 3, 4])
    assert len(index.table) == 2  # (1, 2) and (2, 3): (3, 4) was never followed
    assert index.table[(1, 2)] == (99, 2)
    assert index.lookup([9, 1, 2], 2, 5) == [3, 4]


def test_bad_settings_name_the_value() -> None:
    with pytest.raises(ValueError, match="draft sources must be a non-empty subset"):
        Drafter(max_draft=2, sources=("group", "bogus"))
    with pytest.raises(ValueError, match="prompt_lookup_min <= prompt_lookup_max, got 3, 2"):
        Drafter(max_draft=2, min_n=3, max_n=2)


def test_a_step_speculates_where_its_injected_cost_says_it_pays() -> None:
    """Weight-bound (a step costs the same whatever its tokens): drafting always pays.
    Compute-bound (cost in proportion to tokens): never, a draft is accepted in part. Both
    (a fixed cost plus a per-token one): in the small-batch tail, not at large batch."""
    weights = Drafter(max_draft=4, step_cost=lambda seqs, tokens, context: 1.0)
    compute = Drafter(max_draft=4, step_cost=lambda seqs, tokens, context: float(tokens))
    both = Drafter(max_draft=4, step_cost=lambda seqs, tokens, context: 10.0 + tokens)
    assert weights.acceptance() == 0.5  # the prior: one in two
    assert weights.pays([4]) and weights.pays([4] * 64)
    assert not compute.pays([4]) and not compute.pays([1] * 8)
    assert both.pays([4]) and both.pays([4] * 2)
    assert not both.pays([4] * 64)
    assert both.pays([0] * 64)  # nothing drafted: nothing to decide
    # a history of rejections lowers the expected gain until the tail no longer pays either
    s = Sample(0, PROMPT, [1, 2, 3])
    both.observe(s)
    for _ in range(20):
        both.record(0, Draft([9, 9, 9, 9], "group"), accepted=0, emitted=1)
    assert both.acceptance() < 0.02
    assert not both.pays([4])
    assert Drafter(max_draft=4).pays([4] * 1000)  # no cost model: the batch-size rule alone


def test_a_profiles_step_cost_speculates_in_the_tail_and_never_at_large_batch() -> None:
    """The default cost from a latency profile (no verify rows: extra query tokens priced as
    decode sequences): a GPU-like step, flat up to batch 64 and compute-bound past it, drafts
    at batch 2 and 8 and stays off at 256, where the same drafts cost more than they add."""
    from patrl.lenpredict import LatencyModel
    from patrl.rollout.spec_cost import profile_step_cost
    from patrl_testkit.profiles import profile_from

    def gpu_like(tp: int, batch: int, context: int) -> float:
        return 0.01 + 1e-4 * max(0, batch - 64) + 1e-9 * context

    cost = profile_step_cost(LatencyModel.fit(profile_from(gpu_like, tp_sizes=(1,))), 1)
    drafter = Drafter(max_draft=4, step_cost=cost)
    assert drafter.pays([4, 4], 200) and drafter.pays([4] * 8, 800)
    assert not drafter.pays([4] * 256, 25600) and not drafter.pays([1] * 256, 25600)
    with pytest.raises(KeyError, match="tp=2"):
        profile_step_cost(LatencyModel.fit(profile_from(gpu_like, tp_sizes=(1,))), 2)


def test_a_profiles_step_cost_is_the_latency_models_verify_time() -> None:
    """`profile_step_cost` evaluates the fit in plain Python; its twin is `verify_time`, with
    and without verify rows, on a fit with knees."""
    from patrl.lenpredict import LatencyModel, VerifyRow
    from patrl.rollout.spec_cost import profile_step_cost
    from patrl_testkit.profiles import profile_from

    def knees(tp: int, batch: int, context: int) -> float:
        return 0.01 + 1e-4 * max(0, batch - 8) - 5e-5 * max(0, batch - 64) + 1e-9 * context

    plain = profile_from(knees, tp_sizes=(1,))
    rows = [
        VerifyRow(tp=1, batch=b, query_len=q, context_tokens=c, seconds=knees(1, b, c) + 3e-4 * q)
        for b in (1, 4, 16)
        for q in (2, 5)
        for c in (100, 1000)
    ]
    for profile in (plain, plain.model_copy(update={"verify": rows})):
        latency = LatencyModel.fit(profile)
        cost = profile_step_cost(latency, 1)
        for b, q, c in ((1, 1, 50), (3, 3, 900), (2, 10, 300), (40, 200, 8000), (200, 900, 10**5)):
            assert cost(b, q, c) == pytest.approx(latency.verify_time(1, b, q, c), rel=1e-9)


def test_may_pay_rules_out_only_steps_no_drafts_could_pay() -> None:
    """Slow twin: every vector of draft lengths up to each sample's draft length, through
    `pays`. Over random costs (a fixed verify price, a per-token one, a knee), acceptances and
    draft lengths: `may_pay` is False only where every vector fails `pays`, and it is False
    where a fixed verify price dwarfs what low acceptance can win."""
    rng = random.Random(0)
    ruled_out = 0
    for trial in range(300):
        fixed, per_token = rng.choice([0.0, 0.5, 2.0]), rng.choice([0.0, 0.05, 0.5])
        knee = rng.choice([1, 3, 100])

        def cost(seqs: int, tokens: int, context: int, f=fixed, v=per_token, k=knee) -> float:
            extra = tokens - seqs
            return 1.0 + 0.1 * seqs + (f + v * extra + 0.3 * max(0, extra - k) if extra else 0)

        d = Drafter(max_draft=3, step_cost=cost)
        samples = [Sample(i, PROMPT, [1, 2, 3 + i]) for i in range(rng.randint(1, 3))]
        for s in samples:
            d.observe(s)
            accepted = rng.randint(0, 3)
            draft = Draft([7] * 3, "group")
            for _ in range(rng.randint(0, 4)):
                d.record(s.seq_id, draft, accepted=accepted, emitted=accepted + 1)
        ids = [s.seq_id for s in samples]
        lens = [range(d.draft_length(i) + 1) for i in ids]
        any_pays = any(d.pays(list(v)) for v in itertools.product(*lens) if sum(v))
        if not d.may_pay(ids):
            ruled_out += 1
            assert not any_pays, trial
    assert ruled_out > 20
    assert Drafter(max_draft=4).may_pay([1, 2])  # no cost model: never ruled out
    dear = Drafter(max_draft=4, step_cost=lambda s, t, c: 1.0 + (2.0 if t > s else 0.0))
    for i in range(4):
        dear.observe(Sample(i, PROMPT, [1, 2]))
    assert not dear.may_pay([0, 1, 2, 3])  # a gain of at most 4 / 2 against 4 x 2 more


def eager_table(
    appends: list[tuple[int, list[int]]], min_n: int, max_n: int
) -> dict[tuple[int, ...], tuple[int, int]]:
    """Slow twin of `NgramIndex.table`: every token indexed as it is appended."""
    streams: dict[int, list[int]] = {}
    table: dict[tuple[int, ...], tuple[int, int]] = {}
    for stream, tokens in appends:
        s = streams.setdefault(stream, [])
        for token in tokens:
            p = len(s)
            for n in range(min_n, min(max_n, p) + 1):
                table[tuple(s[p - n : p])] = (stream, p)
            s.append(token)
    return table


def test_deferred_indexing_makes_the_table_indexing_on_arrival_makes() -> None:
    """Random appends to several streams (few distinct tokens: n-grams recur across them,
    so the order of indexing decides which occurrence is latest), lookups between them."""
    rng = random.Random(1)
    for _ in range(50):
        index = NgramIndex(2, 4)
        appends: list[tuple[int, list[int]]] = []
        for step in range(60):
            if rng.random() < 0.1 or not index.streams:
                tokens = [rng.randrange(4) for _ in range(rng.randrange(0, 6))]
                appends.append((index.add_stream(tokens), tokens))
                continue
            stream = rng.randrange(len(index.streams))
            tokens = [rng.randrange(4) for _ in range(rng.randrange(0, 3))]
            index.extend(stream, tokens)
            appends.append((stream, tokens))
            if step % 7 == 0:
                assert index.table == eager_table(appends, 2, 4)
        assert index.table == eager_table(appends, 2, 4)
