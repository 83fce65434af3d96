"""Drafts without a draft model: continuations of a sequence's last tokens found in its prompt
group's token streams, the same prompt's earlier responses and the prompt itself.

Per prompt key (a request's `prompt_key`, else its prompt's token ids) the drafter keeps a
group: an n-gram index per source over
- "group": every sample of the prompt in this engine, in flight or finished (a sample's own
  earlier tokens included), each stream led in by the prompt's last `prompt_lookup_max` tokens
  so that the first tokens of a response have a context to match;
- "history": up to `history_size` earlier responses of the prompt, from earlier `generate`
  calls (kept across calls and in `state_dict`, bounded to `history_prompts` prompts, least
  recently used dropped first);
- "prompt": the prompt's own tokens.
An index maps each n-gram (n in [prompt_lookup_min, prompt_lookup_max]) to the latest place it
was followed by a token, so a lookup is one dict probe per n and source and a slice of at most
the draft length: O(draft length), never a scan of the group. Indexing a new token costs one
probe per n. Longer matches win; among equal lengths the sources' order in `sources` decides.

Whether a decode step drafts at all: `speculates` (at most `max_num_seqs` running sequences: the
tail) and, given a `step_cost` (seconds of a step by sequences and query tokens, e.g. from a
latency profile with a query-length axis), `pays` (the tokens the drafts are expected to add,
at the acceptance so far, against what their query tokens cost). A sample's draft length
adapts to its own acceptance (`record`).

Drafts only decide how many tokens a step tries: the engine verifies every one against the
model, so a draft can be stale, wrong or missing without changing any output. Everything here
is a function of the tokens it was shown, in order, so every rank of a TP group proposes the
same drafts; a fold (adaptive TP) makes its merged group's ranks alike again
(`merge_reset`).

A multi-turn conversation is one sample: a turn kept for its continuation stays in its group,
and `continue_sample` appends the tool's tokens to its stream before the next turn's, so a
sample's stream is its whole response (model and tool tokens, as the trainer sees it), its
siblings draft from it, and the finished conversation is remembered whole.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from patrl.rollout.config import SpeculativeConfig

SOURCES = ("group", "history", "prompt")


class StepCost(Protocol):
    """Seconds of a decode step of `num_seqs` sequences carrying `num_tokens` query tokens in
    all over `context_tokens` of context (`profile_step_cost`: a latency profile's verify
    prices; tests inject one). Never less for more query tokens (`may_pay` relies on it)."""

    def __call__(self, num_seqs: int, num_tokens: int, context_tokens: int) -> float: ...


class Sample(Protocol):
    """What the drafter reads of a sample (patrl.rollout.sequence.Seq provides it)."""

    seq_id: int
    prompt_key: str | None
    prompt_token_ids: list[int]
    output_token_ids: list[int]


class NgramIndex:
    """Streams of tokens, appended to one token at a time, and for each n-gram the latest
    (stream, position) it was followed at.

    Indexing waits until a lookup (or `table`) needs it and is then replayed in the order the
    tokens came, so the table is the one indexing each token on arrival makes; a group no
    step ever drafts for (speculation off at its batch sizes, or never paying) costs only
    the appends."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self.streams: list[list[int]] = []
        self._table: dict[tuple[int, ...], tuple[int, int]] = {}
        self._pending: list[tuple[int, int, int]] = []  # (stream, first, end): not indexed

    @property
    def table(self) -> dict[tuple[int, ...], tuple[int, int]]:
        """n-gram -> (stream, position of the token that followed it), up to date."""
        self._catch_up()
        return self._table

    def add_stream(self, tokens: Sequence[int] = ()) -> int:
        """A new stream holding `tokens`; returns its id."""
        self.streams.append([])
        stream = len(self.streams) - 1
        self.extend(stream, tokens)
        return stream

    def extend(self, stream: int, tokens: Sequence[int]) -> None:
        """Append `tokens` to `stream`; each n-gram they complete a follower of is indexed
        before the next lookup."""
        if not tokens:
            return
        s = self.streams[stream]
        first = len(s)
        s.extend(tokens)
        self._pending.append((stream, first, len(s)))

    def _catch_up(self) -> None:
        """Index the pending tokens, in the order they were appended."""
        if not self._pending:
            return
        table, low, high = self._table, self.min_n, self.max_n
        for stream, first, end in self._pending:
            s = self.streams[stream]
            for p in range(max(first, low), end):
                for n in range(low, min(high, p) + 1):
                    table[tuple(s[p - n : p])] = (stream, p)
        self._pending.clear()

    def lookup(self, context: Sequence[int], n: int, limit: int) -> list[int]:
        """Up to `limit` tokens that followed the latest occurrence of `context`'s last `n`
        tokens ([] when it never occurred)."""
        if len(context) < n:
            return []
        hit = self.table.get(tuple(context[len(context) - n :]))  # caught up first
        if hit is None:
            return []
        stream, pos = hit
        return self.streams[stream][pos : pos + limit]


@dataclass(slots=True)
class _Group:
    """One prompt's indexes, by source, and how many registered samples are still here."""

    indexes: dict[str, NgramIndex]
    lead_in: list[int]
    live: int = 0


@dataclass(slots=True)
class _Sample:
    key: Hashable
    stream: int  # in the group's "group" index
    indexed: int  # output tokens indexed so far
    draft_len: int  # this sample's current draft length (adapts to its acceptance)


@dataclass(slots=True)
class Draft:
    """Tokens proposed to continue one sample, and the source they came from."""

    tokens: list[int]
    source: str | None = None


@dataclass(slots=True)
class DraftStats:
    """Running totals of speculation: steps, tokens drafted and accepted by source."""

    sample_steps: int = 0  # decode steps of a sample (with or without a draft)
    emitted: int = 0  # tokens those steps produced
    drafted: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SOURCES, 0))
    accepted: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SOURCES, 0))

    def stats(self) -> dict[str, float]:
        """The totals (`spec_sample_steps`, `spec_emitted_tokens`, `spec_drafted_tokens`,
        `spec_accepted_tokens`, and `spec_accepted_tokens/<source>`) and their ratios over
        the engine's life (`speculation_metrics`' names without the prefix)."""
        out = {
            "spec_sample_steps": float(self.sample_steps),
            "spec_emitted_tokens": float(self.emitted),
            "spec_drafted_tokens": float(sum(self.drafted.values())),
            "spec_accepted_tokens": float(sum(self.accepted.values())),
            **{f"spec_accepted_tokens/{s}": float(self.accepted[s]) for s in SOURCES},
        }
        return {**out, **speculation_metrics({}, out, prefix="")}


def speculation_metrics(
    before: dict[str, Any], after: dict[str, Any], prefix: str = "rollout/"
) -> dict[str, float]:
    """Speculation between two `Engine.stats()` (an empty `before`: since the start):
    `spec_acceptance` (accepted / drafted tokens), `spec_tokens_per_step` (tokens a sample's
    decode step produced, on average) and `spec_accepted_share/<source>`; nothing when the
    engine does not speculate."""
    if "spec_drafted_tokens" not in after:
        return {}

    def delta(key: str) -> float:
        return float(after[key]) - float(before.get(key, 0.0))

    drafted, accepted = delta("spec_drafted_tokens"), delta("spec_accepted_tokens")
    steps = delta("spec_sample_steps")
    out = {
        "spec_acceptance": accepted / drafted if drafted else 0.0,
        "spec_tokens_per_step": delta("spec_emitted_tokens") / steps if steps else 0.0,
    }
    for s in SOURCES:
        share = delta(f"spec_accepted_tokens/{s}") / accepted if accepted else 0.0
        out[f"spec_accepted_share/{s}"] = share
    return {prefix + k: v for k, v in out.items()}


class Drafter:
    """Proposes drafts per sample from its prompt group (see the module docstring).

    `observe` indexes a sample's new tokens (registering it on first sight, so imported and
    resumed samples join their group by their prompt); `propose` drafts; `record` adapts the
    sample's draft length to its acceptance and counts; `finish` leaves the group and, for a
    complete response, remembers it as history; `drop` leaves without remembering (export);
    `continue_sample` extends a kept turn's sample for its next turn.
    """

    def __init__(
        self,
        max_draft: int,
        min_n: int = 2,
        max_n: int = 4,
        sources: Sequence[str] = SOURCES,
        history_size: int = 8,
        history_prompts: int = 4096,
        adaptive: bool = True,
        max_num_seqs: int = 0,
        step_cost: StepCost | None = None,
    ) -> None:
        bad = [s for s in sources if s not in SOURCES]
        if bad or not sources:
            raise ValueError(
                f"draft sources must be a non-empty subset of {SOURCES}, got {sources}"
            )
        if not 1 <= min_n <= max_n:
            raise ValueError(
                f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got {min_n}, {max_n}"
            )
        if max_draft < 1:
            raise ValueError(f"max_draft must be >= 1, got {max_draft}")
        self.max_draft, self.min_n, self.max_n = max_draft, min_n, max_n
        self.sources = tuple(sources)
        self.history_size, self.history_prompts = history_size, history_prompts
        self.adaptive = adaptive
        self.max_num_seqs = max_num_seqs
        self.step_cost = step_cost
        self.history: OrderedDict[Hashable, list[list[int]]] = OrderedDict()
        self.counts = DraftStats()
        self._tally = [0, 0]  # accepted, drafted tokens: what `acceptance` reads
        self._groups: dict[Hashable, _Group] = {}
        self._samples: dict[int, _Sample] = {}

    # ----------------------------------------------------------------- samples

    def observe(self, seq: Sample) -> None:
        """Index the sample's output tokens not seen yet; a sample seen for the first time
        joins the group of its `prompt_key`, else of its prompt's token ids."""
        output = seq.output_token_ids
        sample = self._samples.get(seq.seq_id)
        if sample is None:
            key = history_key(seq.prompt_key, seq.prompt_token_ids)
            group = self._group(key, seq.prompt_token_ids)
            group.live += 1
            stream = group.indexes["group"].add_stream(group.lead_in)
            sample = self._samples[seq.seq_id] = _Sample(key, stream, 0, self.max_draft)
        if len(output) > sample.indexed:
            index = self._groups[sample.key].indexes["group"]
            index.extend(sample.stream, output[sample.indexed :])
            sample.indexed = len(output)

    def has(self, seq_id: int) -> bool:
        return seq_id in self._samples

    def speculates(self, num_seqs: int) -> bool:
        """Whether a decode step of `num_seqs` sequences drafts: at most `max_num_seqs` of
        them (0: always), the tail, where a step reads every weight once whatever its rows."""
        return self.max_num_seqs == 0 or num_seqs <= self.max_num_seqs

    def acceptance(self) -> float:
        """The share of drafted tokens accepted so far (since the last `merge_reset`),
        starting from one in two."""
        accepted, drafted = self._tally
        return (accepted + 1) / (drafted + 2)

    def merge_reset(self) -> None:
        """Forget what the ranks of a merged TP group may hold apart (a fold brings together
        ranks of replicas that drafted for other prompts): the history and the acceptance
        `pays` reads, on every rank of the new group alike. In-flight groups are already
        gone (every sample was exported); imported samples join afresh on first sight, in
        the scheduler's order, the same on every rank. `counts` (metrics) stay."""
        self.history.clear()
        self._tally = [0, 0]

    def pays(self, draft_lens: Sequence[int], context_tokens: int = 0) -> bool:
        """Whether a decode step whose sequences carry drafts of `draft_lens` tokens over
        `context_tokens` of context is expected to emit tokens faster than the step without
        them: (B + expected accepted) / cost(B, B + D, C) > B / cost(B, B, C), a draft of d
        accepting sum_k a^k tokens at the acceptance a so far. Always, without a
        `step_cost`."""
        b, d = len(draft_lens), sum(draft_lens)
        if self.step_cost is None or d == 0:
            return True
        a = self.acceptance()
        gain = sum(sum(a**k for k in range(1, n + 1)) for n in draft_lens)
        cost = self.step_cost
        return (b + gain) * cost(b, b, context_tokens) > b * cost(b, b + d, context_tokens)

    def draft_length(self, seq_id: int) -> int:
        """The most tokens the sample's next draft may hold (its adaptive draft length;
        `max_draft` for a sample not seen yet)."""
        sample = self._samples.get(seq_id)
        return self.max_draft if sample is None else sample.draft_len

    def may_pay(self, seq_ids: Sequence[int], context_tokens: int = 0) -> bool:
        """False when no drafts these samples could propose would make `pays` true, so a step
        need not look for them. Drafts of at most each sample's draft length, D >= 1 tokens
        in all, accept in expectation sum_k a^k a draft: at most a·Dmax (Dmax the draft
        lengths' sum) and at most a / (1 - a) a sample; and they cost at least the step with
        one query token more (`StepCost` never falls with more tokens). So when
        (B + that gain)·cost(B, B) <= B·cost(B, B + 1) every draft is ruled out (exactly:
        `pays` would say no to whatever `propose` found). Always True without a
        `step_cost`."""
        if self.step_cost is None or not seq_ids:
            return True
        most = sum(self.draft_length(seq_id) for seq_id in seq_ids)
        b, cost, a = len(seq_ids), self.step_cost, self.acceptance()
        gain = a * most if a >= 1.0 else min(a * most, b * a / (1.0 - a))
        return (b + gain) * cost(b, b, context_tokens) > b * cost(b, b + 1, context_tokens)

    def propose(self, seq_id: int, context: Sequence[int], limit: int) -> Draft:
        """A draft of at most min(`limit`, the sample's draft length) tokens continuing
        `context` (the sample's tokens; only its last `prompt_lookup_max` are read). The
        sample must have been observed."""
        sample = self._samples[seq_id]
        limit = min(limit, sample.draft_len)
        if limit <= 0:
            return Draft([])
        indexes = self._groups[sample.key].indexes
        tail = context[max(0, len(context) - self.max_n) :]
        for n in range(min(self.max_n, len(tail)), self.min_n - 1, -1):
            for source in self.sources:
                tokens = indexes[source].lookup(tail, n, limit)
                if tokens:
                    return Draft(tokens, source)
        return Draft([])

    def record(self, seq_id: int, draft: Draft, accepted: int, emitted: int) -> None:
        """Count one decode step of a sample that drafted `draft`, had `accepted` of it
        accepted and produced `emitted` tokens; adapt its draft length: one more after a whole
        draft at full length was accepted, else one past what was accepted."""
        self.counts.sample_steps += 1
        self.counts.emitted += emitted
        if not draft.tokens or draft.source is None:
            return
        self.counts.drafted[draft.source] += len(draft.tokens)
        self.counts.accepted[draft.source] += accepted
        self._tally[0] += accepted
        self._tally[1] += len(draft.tokens)
        sample = self._samples.get(seq_id)
        if sample is None or not self.adaptive:
            return
        if accepted == len(draft.tokens) == sample.draft_len:
            sample.draft_len = min(self.max_draft, sample.draft_len + 1)
        elif accepted < len(draft.tokens):
            sample.draft_len = accepted + 1

    def continue_sample(self, seq_id: int, appended: Sequence[int]) -> None:
        """Kept sample `seq_id` (a finished turn, still in its group) goes on as a new turn
        under its id: `appended` (a tool's answer) extends its stream, and the new turn's
        output tokens, counted from zero, follow them. A sample not here is left to join by
        its prompt on first sight."""
        sample = self._samples.get(seq_id)
        if sample is None:
            return
        self._groups[sample.key].indexes["group"].extend(sample.stream, appended)
        sample.indexed = 0

    def finish(self, seq_id: int, output: Sequence[int], remember: bool) -> None:
        """The sample is done here: it leaves its group (its stream stays while the group
        lives) and, with `remember`, its response joins its prompt's history: `output`, led
        by its earlier turns and their appended tokens when it was continued."""
        sample = self._samples.pop(seq_id, None)
        if sample is None:
            return
        if remember:
            index = self._groups[sample.key].indexes["group"]
            index.extend(sample.stream, output[sample.indexed :])
            lead = len(self._groups[sample.key].lead_in)
            self.remember(sample.key, index.streams[sample.stream][lead:])
        group = self._groups[sample.key]
        group.live -= 1
        if group.live == 0:
            del self._groups[sample.key]

    def remember(self, key: Hashable, output: Sequence[int]) -> None:
        """`output`, a complete response to the prompt of `key` (`history_key`), joins its
        history: the newest `history_size` kept, at most `history_prompts` prompts, the least
        recently used dropped first; nothing when history is not a source."""
        if self.history_size <= 0 or "history" not in self.sources:
            return
        responses = self.history.setdefault(key, [])
        self.history.move_to_end(key)
        responses.append(list(output))
        del responses[: max(0, len(responses) - self.history_size)]
        while len(self.history) > self.history_prompts:
            self.history.popitem(last=False)

    def drop(self, seq_id: int) -> None:
        """The sample leaves this engine unfinished (export): forget it, remember nothing."""
        self.finish(seq_id, (), remember=False)

    def num_groups(self) -> int:
        """Prompt groups with a sample here."""
        return len(self._groups)

    # ----------------------------------------------------------- checkpoints

    def state_dict(self) -> dict[str, Any]:
        """The history (the only state that outlives a rollout), as plain lists: keys that are
        token-id tuples become lists."""
        return {
            "history": [
                [list(k) if isinstance(k, tuple) else k, [list(r) for r in v]]
                for k, v in self.history.items()
            ]
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict`'s history (groups in flight are not part of it)."""
        history: OrderedDict[Hashable, list[list[int]]] = OrderedDict()
        for key, responses in state["history"]:
            history[tuple(key) if isinstance(key, list) else key] = [list(r) for r in responses]
        self.history = history

    def merged_state(self, states: Sequence[dict[str, Any]]) -> dict[str, Any]:
        """One `state_dict` of several drafters' (data-parallel replicas', in rank order, one
        per replica): per prompt, every state's responses in order, the newest
        `history_size` kept; prompts in the order the states last used them, at most
        `history_prompts`. Restored on every rank, it lets each replica draft from what any
        replica saw, whatever the layout (one state: that state, unchanged)."""
        merged = Drafter(
            self.max_draft, self.min_n, self.max_n, self.sources, self.history_size,
            self.history_prompts,
        )  # fmt: skip
        for state in states:
            other = Drafter(self.max_draft, self.min_n, self.max_n, self.sources)
            other.load_state_dict(state)
            for key, responses in other.history.items():
                for response in responses:
                    merged.remember(key, response)
        return merged.state_dict()

    # ----------------------------------------------------------------- internals

    def _group(self, key: Hashable, prompt: Sequence[int]) -> _Group:
        group = self._groups.get(key)
        if group is not None:
            return group
        lead_in = list(prompt[max(0, len(prompt) - self.max_n) :])
        indexes = {s: NgramIndex(self.min_n, self.max_n) for s in SOURCES}
        if "prompt" in self.sources:
            indexes["prompt"].add_stream(prompt)
        if key in self.history:
            self.history.move_to_end(key)
        for response in self.history.get(key, ()):
            indexes["history"].add_stream([*lead_in, *response])
        group = self._groups[key] = _Group(indexes, lead_in)
        return group


def draft_totals(drafter: Drafter | None, since: tuple[int, int] = (0, 0)) -> tuple[int, int]:
    """Tokens `drafter` counted drafted and accepted (its `counts`), less `since` (an earlier
    answer: what a step added); (0, 0) without a drafter."""
    if drafter is None:
        return 0, 0
    counts = drafter.counts
    drafted, accepted = sum(counts.drafted.values()), sum(counts.accepted.values())
    return drafted - since[0], accepted - since[1]


def history_key(prompt_key: str | None, prompt_token_ids: Sequence[int]) -> Hashable:
    """The key a sample's group and history go under: its request's `prompt_key`, else its
    prompt's token ids."""
    return prompt_key if prompt_key is not None else tuple(prompt_token_ids)


def new_drafter(config: SpeculativeConfig, step_cost: StepCost | None = None) -> Drafter | None:
    """The drafter `config` asks for, pricing steps with `step_cost` (None: every step of at
    most `max_num_seqs` sequences speculates); None when speculation is off."""
    if not config.enable:
        return None
    return Drafter(
        config.num_speculative_tokens,
        config.prompt_lookup_min,
        config.prompt_lookup_max,
        config.sources,
        config.history_size,
        config.history_prompts,
        config.adaptive_draft_length,
        config.max_num_seqs,
        step_cost,
    )
