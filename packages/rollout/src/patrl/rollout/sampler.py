"""Next-token sampling with one seeded generator per request, and the logprob of every token.

The logprob of a sampled token t is `log_softmax(logits.float() / T)[t]` over the FULL
vocabulary, before top-k / top-p (T = 1 when greedy): the convention the trainer shares (see
docs/training.md). Greedy rows take the argmax; other rows keep top-k, then top-p, and draw by
inverse CDF with one uniform number from the request's own CPU generator. Every row is computed
on its own, so a request's tokens do not depend on its batch, the TP layout or the device.

Everything a batch's sampling needs besides the logits is known on the host before them
(`plan_samples`: each row's path, the temperatures, the uniforms), so an engine step moves it
with its other inputs in one copy (patrl.rollout.staging) and `sample_planned` uploads
nothing. Top-k / top-p rows are sampled on the host after one copy of their logprob rows;
their tokens and logprobs stay there (`SampleOutput.host_rows`) until the host reads the
batch. `sample` is the one-call form, every row's values left on the device. A speculative
verify step likewise: `plan_verify` before the forward (the drafts are the scheduler's),
`verify_planned` after it; `verify_drafts` is its one-call form.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from patrl.rollout.staging import Array, StepStaging, stage_once

__all__ = [
    "HostRows",
    "HostSamples",
    "SampleOutput",
    "SamplePlan",
    "SamplingParams",
    "VerifyPlan",
    "concat_samples",
    "export_generator",
    "import_generator",
    "make_generator",
    "plan_samples",
    "plan_verify",
    "sample",
    "sample_planned",
    "verify_drafts",
    "verify_planned",
]


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How one request samples and when each of its samples stops; vLLM's names and meanings.

    Sampling: `temperature` 0 is greedy; `top_k` 0 or -1 keeps every token (-1 is stored as
    0); `top_p` 1.0 keeps every token. Sample i of the `n` draws from its own generator seeded
    with `seed + i` (a random seed when `seed` is None), so its tokens do not depend on its
    batch, the TP layout or the device; the `n` samples share their prompt's prefill.

    Logprobs: every output carries the logprob of each sampled token (RL needs them; see the
    module docstring for the convention). `logprobs` asks for more, as vLLM's does: None (the
    default) returns no per-position dicts; k >= 0 returns, for each position, the k most
    likely tokens and the sampled one (k or k + 1 entries). Unlike vLLM's raw logprobs, these
    are after temperature, like the sampled token's.

    Stopping: a sample stops at `max_tokens` or `max_model_len` (finish_reason "length"), at
    one of the model's EOS ids unless `ignore_eos`, at any of `stop_token_ids`, or once its
    text contains one of the `stop` strings (finish_reason "stop"; `stop_reason` says which
    id or string, None for EOS). The token that completes a stop string is kept in the token
    ids and logprobs; the text ends before the stop string, or after it with
    `include_stop_str_in_output`, which also keeps a stop token's text. Stop strings need the
    model directory's tokenizer. Text is decoded with `skip_special_tokens`.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    logprobs: int | None = None
    n: int = 1
    max_tokens: int = 256
    stop: Sequence[str] = ()
    stop_token_ids: frozenset[int] = frozenset()
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "stop_token_ids", frozenset(self.stop_token_ids or ()))
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, or -1 (0 and -1 = off), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (1 = off), got {self.top_p}")
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError(
                f"logprobs must be None (no top logprobs) or >= 0 (that many top logprobs "
                f"and the sampled token's), got {self.logprobs}"
            )
        bad = [s for s in stop if not isinstance(s, str) or not s]
        if bad:
            raise ValueError(f"stop must hold non-empty strings, got {bad[0]!r} in {stop}")

    @property
    def greedy(self) -> bool:
        """temperature 0: the argmax, top_k and top_p ignored."""
        return self.temperature == 0

    @property
    def effective_temperature(self) -> float:
        """The T of the shared convention."""
        return 1.0 if self.greedy else self.temperature

    @property
    def num_top_logprobs(self) -> int:
        """How many top logprobs the sampler computes for this request (0: none)."""
        return self.logprobs or 0


@dataclass(slots=True)
class HostSamples:
    """A batch's samples as Python values, row i for the batch's i-th sampled sequence."""

    tokens: list[int]
    logprobs: list[float]
    top_ids: list[list[int]] | None = None
    top_logprobs: list[list[float]] | None = None
    emitted: list[bool] | None = None  # verify steps: whether row i's token is emitted

    def runs(self, drafts: Sequence[Sequence[int]], n: int) -> list[list[int]]:
        """The rows each of `n` sequences emits: one each, or in a verify step (`drafts`),
        its emitted ones among its 1 + len(draft) rows."""
        if self.emitted is None:
            return [[i] for i in range(n)]
        runs, start = [], 0
        for d in drafts:
            end = start + 1 + len(d)
            runs.append([r for r in range(start, end) if self.emitted[r]])
            start = end
        return runs

    def top(self, row: int, k: int | None) -> dict[int, float] | None:
        """Row `row`'s logprobs by token id as `SamplingParams.logprobs` = k asks: its first
        k top logprobs, then the sampled token's if it is not among them; None for None."""
        if k is None:
            return None
        top: dict[int, float] = {}
        if k and self.top_ids is not None and self.top_logprobs is not None:
            top = dict(zip(self.top_ids[row][:k], self.top_logprobs[row][:k], strict=True))
        top.setdefault(self.tokens[row], self.logprobs[row])
        return top


@dataclass(frozen=True, slots=True)
class HostRows:
    """Rows of a batch sampled on the host (top-k / top-p): their row indices, tokens and
    logprobs, kept there instead of making a round trip to the device (the host needs them
    next); `SampleOutput.to_host` writes them in, `SampleOutput.on_device` sends them up."""

    rows: list[int]
    tokens: list[int]
    logprobs: list[float]


@dataclass(slots=True)
class SampleOutput:
    """A batch's samples on the device, row i for the batch's i-th sampled sequence. The rows
    of `host_rows` (when set) hold placeholders in `tokens` and `logprobs`: their values are
    the host's (`to_host` and `on_device` apply them)."""

    tokens: torch.Tensor  # [B] int64
    logprobs: torch.Tensor  # [B] float32, under the shared convention
    top_ids: torch.Tensor | None = None  # [B, K], K = max logprobs asked in the batch
    top_logprobs: torch.Tensor | None = None  # [B, K]
    # verify steps (`verify_drafts`): [B] bool, whether row i's token is emitted
    emitted: torch.Tensor | None = None
    host_rows: HostRows | None = None

    def to_host(self) -> HostSamples:
        """Everything in ONE device-to-host copy, a step's one deliberate sync: the columns
        packed as float64, exact for token ids (< 2**53) and for float32 logprobs; then the
        host rows written in."""
        columns = [self.tokens[:, None].double(), self.logprobs[:, None].double()]
        if self.emitted is not None:
            columns.append(self.emitted[:, None].double())
        e = len(columns)
        k = 0
        if self.top_ids is not None and self.top_logprobs is not None:
            k = self.top_ids.shape[1]
            columns += [self.top_ids.double(), self.top_logprobs.double()]
        rows = torch.cat(columns, dim=1).cpu().tolist()
        host = HostSamples([int(r[0]) for r in rows], [r[1] for r in rows])
        if self.host_rows is not None:
            h = self.host_rows
            for row, token, logprob in zip(h.rows, h.tokens, h.logprobs, strict=True):
                host.tokens[row], host.logprobs[row] = token, logprob
        if self.emitted is not None:
            host.emitted = [r[2] != 0 for r in rows]
        if k:
            host.top_ids = [[int(i) for i in r[e : e + k]] for r in rows]
            host.top_logprobs = [r[e + k :] for r in rows]
        return host

    @torch.inference_mode()
    def on_device(self, staging: StepStaging | None = None) -> SampleOutput:
        """This output with the host rows written into `tokens` and `logprobs` (in place, by
        one upload, through `staging` if given): every row's values on the device, for
        whoever reads them there (a TP group's agreement check, the callers of `sample`)."""
        h = self.host_rows
        if h is None:
            return self
        index, tokens, logprobs = _stage(
            [
                Array(h.rows, torch.int64),
                Array(h.tokens, torch.int64),
                Array(h.logprobs, torch.float32),
            ],
            self.tokens.device,
            staging,
        )
        self.tokens[index] = tokens
        self.logprobs[index] = logprobs
        self.host_rows = None
        return self


def concat_samples(parts: Sequence[SampleOutput]) -> SampleOutput:
    """The outputs of consecutive chunks of one batch as one; top-logprob columns padded to
    the widest chunk's K (a row reads only the first K it asked for); `emitted` when every
    chunk has it (a verify step's), else none may; the chunks' host rows, renumbered."""
    tokens = torch.cat([p.tokens for p in parts])
    logprobs = torch.cat([p.logprobs for p in parts])
    flags = [p.emitted for p in parts if p.emitted is not None]
    if flags and len(flags) != len(parts):
        raise ValueError("chunks of one batch either all are a verify step's or none is")
    emitted = torch.cat(flags) if flags else None
    host = _concat_host_rows(parts)
    k = max((p.top_ids.shape[1] for p in parts if p.top_ids is not None), default=0)
    if k == 0:
        return SampleOutput(tokens, logprobs, emitted=emitted, host_rows=host)
    ids, values = [], []
    for p in parts:
        n, have = len(p.tokens), 0 if p.top_ids is None else p.top_ids.shape[1]
        pad_ids = torch.zeros(n, k - have, dtype=torch.long, device=tokens.device)
        pad = torch.full((n, k - have), -torch.inf, device=tokens.device)
        ids.append(pad_ids if p.top_ids is None else torch.cat([p.top_ids, pad_ids], dim=1))
        values.append(pad if p.top_logprobs is None else torch.cat([p.top_logprobs, pad], dim=1))
    return SampleOutput(tokens, logprobs, torch.cat(ids), torch.cat(values), emitted, host)


def _concat_host_rows(parts: Sequence[SampleOutput]) -> HostRows | None:
    rows: list[int] = []
    tokens: list[int] = []
    logprobs: list[float] = []
    start = 0
    for p in parts:
        if p.host_rows is not None:
            rows += [start + r for r in p.host_rows.rows]
            tokens += p.host_rows.tokens
            logprobs += p.host_rows.logprobs
        start += len(p.tokens)
    return HostRows(rows, tokens, logprobs) if rows else None


def make_generator(seed: int | None = None) -> torch.Generator:
    """A CPU generator (device-independent streams); a fresh random seed when `seed` is None."""
    g = torch.Generator()
    if seed is None:
        g.seed()
    else:
        g.manual_seed(seed)
    return g


def export_generator(g: torch.Generator) -> torch.Tensor:
    """The generator's full state (a uint8 tensor), to continue the stream elsewhere."""
    return g.get_state()


def import_generator(state: torch.Tensor) -> torch.Generator:
    g = torch.Generator()
    g.set_state(state)
    return g


@dataclass(slots=True)
class SamplePlan:
    """What `sample_planned` needs of a batch of `size` rows besides its logits, all known on
    the host before them: which path each row takes (a row's own params decide it, never its
    batch neighbours), the temperatures, and every uniform the batch draws, taken from the
    requests' generators here, in the order sampling consumes them (sampled rows, then top-k
    / top-p rows, each in row order). `arrays` is what the device needs of it, to go up with
    a step's other inputs in one copy (patrl.rollout.staging); the top-k / top-p rows'
    uniforms stay on the host, where those rows are sampled."""

    size: int
    vocab_size: int
    temperatures: list[float] | None  # None: every row at T = 1, no division
    greedy: list[int]
    plain: list[int]  # sampled over the whole vocabulary, on the device
    truncated: list[int]  # top-k / top-p: sampled on the host
    plain_draws: torch.Tensor  # [len(plain)] float32, host
    truncated_draws: list[torch.Tensor]  # [1] float32 each, host
    truncated_params: list[SamplingParams]
    num_top_logprobs: int  # K: the most top logprobs a row asks for

    def arrays(self) -> list[Array]:
        """What goes up, in this order: the temperatures [B] float32 (when tempered), then
        each path's rows [n] int64 (greedy, plain, truncated; only when neither empty nor
        every row, which needs no index), then the plain rows' uniforms [n] float32."""
        out = []
        if self.temperatures is not None:
            out.append(Array(self.temperatures, torch.float32))
        out += [Array(r, torch.int64) for r in self.paths() if 0 < len(r) < self.size]
        if self.plain:
            out.append(_host_array(self.plain_draws))
        return out

    def paths(self) -> tuple[list[int], list[int], list[int]]:
        """The rows of each path: greedy, plain, truncated."""
        return self.greedy, self.plain, self.truncated


def plan_samples(
    params: Sequence[SamplingParams], generators: Sequence[torch.Generator], vocab_size: int
) -> SamplePlan:
    """The plan of a batch sampling row i with `params[i]` and `generators[i]` over logits of
    `vocab_size` columns; it draws the batch's uniforms (a request consumes exactly one per
    token), so sample with it once."""
    if len(params) != len(generators):
        raise ValueError(f"{len(params)} sampling params, {len(generators)} generators")
    temperatures = [p.effective_temperature for p in params]
    greedy = [i for i, p in enumerate(params) if p.greedy]
    plain = [i for i, p in enumerate(params) if not p.greedy and not _truncates(p, vocab_size)]
    truncated = [i for i, p in enumerate(params) if not p.greedy and _truncates(p, vocab_size)]
    return SamplePlan(
        size=len(params),
        vocab_size=vocab_size,
        # x / 1.0 is x exactly: no pass over [B, V] when no row is tempered
        temperatures=temperatures if any(t != 1.0 for t in temperatures) else None,
        greedy=greedy,
        plain=plain,
        truncated=truncated,
        plain_draws=_draws([generators[i] for i in plain]),
        truncated_draws=[_draws([generators[i]]) for i in truncated],
        truncated_params=[params[i] for i in truncated],
        num_top_logprobs=max((p.num_top_logprobs for p in params), default=0),
    )


@torch.inference_mode()
def sample_planned(
    logits: torch.Tensor,
    plan: SamplePlan,
    inputs: Sequence[torch.Tensor] | None = None,
    staging: StepStaging | None = None,
) -> SampleOutput:
    """One token per row of `logits` [B, V] as `plan` says. `inputs`: `plan.arrays()` on the
    logits' device (a step stages them with its other inputs); None: moved here, in one copy
    (through `staging` if given).
    The top-k / top-p rows are sampled on the host (one copy of their logprob rows): their
    tokens and logprobs come back as the output's `host_rows`, not sent up again."""
    if logits.shape != (plan.size, plan.vocab_size):
        raise ValueError(
            f"logits of shape {tuple(logits.shape)} for a plan of {plan.size} rows over "
            f"{plan.vocab_size} tokens"
        )
    if inputs is None:
        arrays = plan.arrays()
        inputs = _stage(arrays, logits.device, staging) if arrays else []
    given = iter(inputs)
    temperatures = next(given) if plan.temperatures is not None else None
    index = [next(given) if 0 < len(r) < plan.size else None for r in plan.paths()]
    draws = next(given) if plan.plain else None
    logits = logits.float()
    scaled = logits if temperatures is None else logits / temperatures[:, None]
    logprobs = torch.log_softmax(scaled, dim=-1)
    b = plan.size
    # a path over every row takes them all, in order: no index, no scatter
    if len(plan.greedy) == b:
        tokens = logits.argmax(dim=-1)
    elif len(plan.plain) == b:
        assert draws is not None
        tokens = _inverse_cdf(logprobs.exp(), draws)
    else:
        tokens = torch.zeros(b, dtype=torch.long, device=logits.device)
        if plan.greedy:
            tokens[index[0]] = logits[index[0]].argmax(dim=-1)
        if plan.plain:
            assert draws is not None
            tokens[index[1]] = _inverse_cdf(logprobs[index[1]].exp(), draws)
    host_rows = None
    if plan.truncated:
        rows = logprobs if index[2] is None else logprobs[index[2]]
        picks, chosen_host = _sample_truncated_rows(
            rows, plan.truncated_params, plan.truncated_draws
        )
        host_rows = HostRows(plan.truncated, picks, chosen_host)
    chosen = logprobs.gather(1, tokens[:, None])[:, 0]
    k = plan.num_top_logprobs
    if k == 0:
        return SampleOutput(tokens, chosen, host_rows=host_rows)
    top_logprobs, top_ids = logprobs.topk(k, dim=-1)
    return SampleOutput(tokens, chosen, top_ids, top_logprobs, host_rows=host_rows)


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator],
) -> SampleOutput:
    """One token per row of `logits` [B, V]; each row uses its own params and generator.
    Every row's values are on the device (`sample_planned`, then `on_device`)."""
    b = logits.shape[0]
    if not len(params) == len(generators) == b:
        raise ValueError(
            f"{b} logit rows, {len(params)} sampling params, {len(generators)} generators"
        )
    plan = plan_samples(params, generators, logits.shape[-1])
    return sample_planned(logits, plan).on_device()


@dataclass(slots=True)
class VerifyPlan:
    """What `verify_planned` needs of a verify step's `rows` logit rows besides the logits,
    all known on the host before them (the scheduler chose the drafts): the layout (each
    row's draft token, 0 on last rows; whether it has one; its sequence's first row), the
    temperatures, each path's sequences, and every uniform the step draws, taken from the
    requests' generators here in the order verifying consumes them (the plain sequences', in
    order, then the top-k / top-p ones'). `arrays` is what the device needs of it, to go up
    with the step's other inputs in one copy; the top-k / top-p sequences' uniforms stay on
    the host, where they are verified."""

    drafts: list[list[int]]
    params: list[SamplingParams]
    lens: list[int]  # 1 + len(draft), per sequence
    starts: list[int]  # each sequence's first row
    vocab_size: int
    draft_tokens: list[int]  # [rows]: row j's draft token, 0 on last rows
    has_draft: list[bool]  # [rows]
    first_rows: list[int]  # [rows]: the first row of the row's sequence
    temperatures: list[float] | None  # [rows]; None: every row at T = 1
    greedy: list[int]  # sequences, by path
    plain: list[int]
    truncated: list[int]
    plain_draws: tuple[torch.Tensor, torch.Tensor] | None  # per plain row: accept, final
    truncated_draws: list[list[torch.Tensor]]  # 1 + len(draft) 0-d float32 per sequence
    num_top_logprobs: int

    @property
    def rows(self) -> int:
        """The logit rows verified: 1 + len(draft) a sequence."""
        return len(self.draft_tokens)

    def rows_of(self, seqs: Sequence[int]) -> list[int]:
        """The logit rows of sequences `seqs`, in order."""
        return [self.starts[i] + j for i in seqs for j in range(self.lens[i])]

    def arrays(self) -> list[Array]:
        """What goes up, in this order: the draft tokens [R] int64, whether each row has one
        [R] bool, the first rows [R] int64, the temperatures [R] float32 (when tempered),
        each non-empty path's rows [n] int64 (greedy, plain, truncated), then the plain rows'
        acceptance and final uniforms [n] float32 each."""
        out = [
            Array(self.draft_tokens, torch.int64),
            Array(self.has_draft, torch.bool),
            Array(self.first_rows, torch.int64),
        ]
        if self.temperatures is not None:
            out.append(Array(self.temperatures, torch.float32))
        out += [Array(self.rows_of(s), torch.int64) for s in self.paths() if s]
        if self.plain_draws is not None:
            out += [_host_array(u) for u in self.plain_draws]
        return out

    def paths(self) -> tuple[list[int], list[int], list[int]]:
        """The sequences of each path: greedy, plain, truncated."""
        return self.greedy, self.plain, self.truncated


def plan_verify(
    drafts: Sequence[Sequence[int]],
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator],
    vocab_size: int,
) -> VerifyPlan:
    """The plan of a verify step whose sequence i offers `drafts[i]` and samples with
    `params[i]` and `generators[i]` over logits of `vocab_size` columns; it draws every
    uniform the step consumes (a sampling sequence exactly len(draft) + 1), so verify with it
    once."""
    if not len(params) == len(generators) == len(drafts):
        raise ValueError(
            f"{len(drafts)} drafts, {len(params)} sampling params, {len(generators)} generators"
        )
    lens = [1 + len(d) for d in drafts]
    starts = [0, *itertools.accumulate(lens)][:-1]
    r = sum(lens)
    draft_tokens = [0] * r
    has_draft = [False] * r
    first_rows: list[int] = []
    for start, d, n in zip(starts, drafts, lens, strict=True):
        for j, token in enumerate(d):
            draft_tokens[start + j] = int(token)
            has_draft[start + j] = True
        first_rows += [start] * n
    row_params = [p for p, n in zip(params, lens, strict=True) for _ in range(n)]
    temperatures = [p.effective_temperature for p in row_params]
    greedy = [i for i, p in enumerate(params) if p.greedy]
    plain = [i for i, p in enumerate(params) if not p.greedy and not _truncates(p, vocab_size)]
    truncated = [i for i, p in enumerate(params) if not p.greedy and _truncates(p, vocab_size)]
    # the plain sequences draw first, the top-k / top-p ones after, each in order
    plain_draws = _verify_draws([(generators[i], lens[i]) for i in plain]) if plain else None
    truncated_draws = [
        [torch.rand((), generator=generators[i]) for _ in range(lens[i])] for i in truncated
    ]
    return VerifyPlan(
        drafts=[[int(t) for t in d] for d in drafts],
        params=list(params),
        lens=lens,
        starts=starts,
        vocab_size=vocab_size,
        draft_tokens=draft_tokens,
        has_draft=has_draft,
        first_rows=first_rows,
        # x / 1.0 is x exactly: no pass over [R, V] when no row is tempered
        temperatures=temperatures if any(t != 1.0 for t in temperatures) else None,
        greedy=greedy,
        plain=plain,
        truncated=truncated,
        plain_draws=plain_draws,
        truncated_draws=truncated_draws,
        num_top_logprobs=max((p.num_top_logprobs for p in params), default=0),
    )


@torch.inference_mode()
def verify_drafts(
    logits: torch.Tensor,
    drafts: Sequence[Sequence[int]],
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator],
    staging: StepStaging | None = None,
) -> SampleOutput:
    """Accept or reject each sequence's draft, losslessly: the emitted tokens are distributed
    as sampling them one at a time would be.

    Sequence i owns 1 + len(drafts[i]) consecutive rows of `logits` [R, V]: row j holds the
    logits after its draft's first j tokens. Greedy rows accept draft token j while it is row
    j's argmax and then emit the argmax. Sampling rows run speculative sampling with a
    point-mass draft: draft token x at row j is accepted with probability p_j(x) under the
    request's processed distribution (temperature, then top-k and top-p); at the first
    rejection the row samples from p_j with x removed, renormalised; when every draft token is
    accepted, the last row samples a bonus token from p_d. A sampling sequence draws exactly
    len(draft) + 1 uniforms from its own generator (acceptances, then the final token), however
    many are accepted, so a seeded request stays deterministic and no count is read back.

    Returns one row per logits row: the token row j emits if reached, its logprob and top
    logprobs under the shared convention (those the one-token path reports for that token in
    that context), and `emitted`, true for rows 0 .. accepted (the accepted draft tokens and
    the final token). The one-call form of `plan_verify` then `verify_planned`: the inputs
    the host knows go up in one copy, the top-k / top-p rows' outcome in one more; through
    `staging` (a step's) if given. An engine step plans before its forward instead and
    stages the plan with the forward's inputs.
    """
    r = sum(1 + len(d) for d in drafts)
    if not (len(params) == len(generators) == len(drafts) and logits.shape[0] == r):
        raise ValueError(
            f"{logits.shape[0]} logit rows for {len(drafts)} drafts needing {r}, "
            f"{len(params)} sampling params, {len(generators)} generators"
        )
    plan = plan_verify(drafts, params, generators, logits.shape[-1])
    return verify_planned(logits, plan, staging=staging)


@torch.inference_mode()
def verify_planned(
    logits: torch.Tensor,
    plan: VerifyPlan,
    inputs: Sequence[torch.Tensor] | None = None,
    staging: StepStaging | None = None,
) -> SampleOutput:
    """`verify_drafts` over `logits` [R, V] as `plan` says. `inputs`: `plan.arrays()` on the
    logits' device (a step stages them with its forward's inputs); None: moved here, in one
    copy (through `staging` if given). The top-k / top-p sequences are verified on the host
    (one copy of their logprob rows down) and their outcome goes up in one copy (through
    `staging` if given): the verdict decides which rows are emitted, on the device."""
    if logits.shape != (plan.rows, plan.vocab_size):
        raise ValueError(
            f"logits of shape {tuple(logits.shape)} for a verify plan of {plan.rows} rows "
            f"over {plan.vocab_size} tokens"
        )
    device = logits.device
    r = plan.rows
    if inputs is None:
        inputs = _stage(plan.arrays(), device, staging)
    given = iter(inputs)
    x, is_draft, first = next(given), next(given), next(given)
    logits = logits.float()
    scaled = logits / next(given)[:, None] if plan.temperatures is not None else logits
    logprobs = torch.log_softmax(scaled, dim=-1)
    tokens = torch.zeros(r, dtype=torch.long, device=device)
    accept = torch.zeros(r, dtype=torch.bool, device=device)
    greedy_rows, plain_rows, truncated_rows = (next(given) if s else None for s in plan.paths())
    if greedy_rows is not None:
        index = greedy_rows
        best = logits[index].argmax(dim=-1)
        tokens[index] = best
        accept[index] = (best == x[index]) & is_draft[index]
    if plain_rows is not None:
        index = plain_rows
        u_accept, u_final = next(given), next(given)
        probs = logprobs[index].exp()
        xs, drafted = x[index], is_draft[index]
        p_x = probs.gather(1, xs[:, None])[:, 0]
        accept[index] = (u_accept < p_x) & drafted
        residual = probs.scatter(1, xs[:, None], torch.where(drafted, 0.0, p_x)[:, None])
        picked = _inverse_cdf(residual, u_final)
        # only a rejection of a draft holding all the mass (rounding) leaves none: keep it
        tokens[index] = torch.where(residual.sum(dim=-1) > 0, picked, xs)
    if truncated_rows is not None:
        index = truncated_rows
        host_rows = logprobs[index].cpu()  # one copy, as `_sample_truncated_rows` makes
        picks: list[int] = []
        accepts: list[bool] = []
        at = 0
        for i, draws in zip(plan.truncated, plan.truncated_draws, strict=True):
            rows = host_rows[at : at + plan.lens[i]]
            at += plan.lens[i]
            t, a = _verify_truncated(rows, plan.drafts[i], plan.params[i], draws)
            picks += t
            accepts += a
        picked_rows, accepted_rows = _stage(
            [Array(picks, torch.int64), Array(accepts, torch.bool)], device, staging
        )
        tokens[index] = picked_rows
        accept[index] = accepted_rows
    # Row j is emitted when no draft row of its sequence before it was rejected.
    rejected = (is_draft & ~accept).long()
    before = rejected.cumsum(0) - rejected
    emitted = before == before[first]
    out = torch.where(accept, x, tokens)
    chosen = logprobs.gather(1, out[:, None])[:, 0]
    k = plan.num_top_logprobs
    if k == 0:
        return SampleOutput(out, chosen, emitted=emitted)
    top_logprobs, top_ids = logprobs.topk(k, dim=-1)
    return SampleOutput(out, chosen, top_ids, top_logprobs, emitted)


def _verify_draws(seqs: Sequence[tuple[torch.Generator, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of sequences of `n` rows each, on the host: the acceptance uniform of draft row
    j (the j-th draw; 1.0 on last rows, never used) and the sequence's final uniform (its
    n-th draw)."""
    accept: list[torch.Tensor] = []
    final: list[torch.Tensor] = []
    for g, n in seqs:
        draws = [torch.rand((), generator=g) for _ in range(n)]
        accept += [*draws[:-1], torch.ones(())]
        final += [draws[-1]] * n
    return torch.stack(accept), torch.stack(final)


def _stage(
    arrays: Sequence[Array], device: torch.device, staging: StepStaging | None
) -> list[torch.Tensor]:
    """`arrays` on `device` in one copy: through `staging` (a step's, whose host buffers are
    kept), else a staging of their own."""
    if staging is not None:
        return staging.stage(arrays).tensors
    return stage_once(arrays, device)


def _host_array(t: torch.Tensor) -> Array:
    """A 1-D float32 host tensor as an array to stage, copied bit for bit (without `.numpy()`,
    which the host-sync count flags)."""

    def fill(dst: np.ndarray) -> None:
        torch.from_numpy(dst).copy_(t)

    return Array(fill, torch.float32, (t.numel(),))


def _verify_truncated(
    rows: torch.Tensor, draft: Sequence[int], p: SamplingParams, draws: Sequence[torch.Tensor]
) -> tuple[list[int], list[bool]]:
    """`verify_planned` for one top-k / top-p sequence's rows [1 + d, V] (host logprobs) with
    its 1 + d uniforms (`draws`, from its plan): each row's token and whether its draft token
    was accepted (rows after a rejection: 0, False)."""
    d = len(draft)
    final = draws[d][None]
    tokens = [0] * (d + 1)
    accepts = [False] * (d + 1)
    for j in range(d + 1):
        ids, kept = truncated_candidates(rows[j].exp(), p)
        if j == d:
            tokens[j] = int(ids[_inverse_cdf(kept[None], final)[0]])
            break
        x = int(draft[j])
        is_x = ids == x
        if draws[j] < kept[is_x].sum() / kept.sum():
            tokens[j], accepts[j] = x, True
            continue
        rest, rest_ids = kept[~is_x], ids[~is_x]
        if rest.numel() == 0 or not rest.sum() > 0:
            tokens[j] = x  # rounding: a draft holding all the mass, rejected
        else:
            tokens[j] = int(rest_ids[_inverse_cdf(rest[None], final)[0]])
        break
    return tokens, accepts


def _truncates(p: SamplingParams, vocab_size: int) -> bool:
    return 0 < p.top_k < vocab_size or p.top_p < 1


def _draws(generators: Sequence[torch.Generator]) -> torch.Tensor:
    """One uniform in [0, 1) per generator, [n] float32 on the host: a request consumes
    exactly one per token."""
    if not generators:
        return torch.empty(0)
    return torch.stack([torch.rand((), generator=g) for g in generators])


def _inverse_cdf(probs: torch.Tensor, draws: torch.Tensor) -> torch.Tensor:
    """Per row of probs [B, n]: the first index whose cumulative mass exceeds draw * total.

    draw * total can round up to total, and then the search runs past the end: such a row
    takes its last entry with mass instead. Only past the end: the first index whose mass
    sum exceeds a value always has mass itself. Every row's fallback is computed and
    selected on the device, so which rows ran past is never read on the host."""
    n = probs.shape[-1]
    cdf = probs.cumsum(dim=-1)
    pos = torch.searchsorted(cdf, draws[:, None] * cdf[:, -1:], right=True)[:, 0]
    last_with_mass = (n - 1) - (probs > 0).view(torch.uint8).flip(-1).argmax(dim=-1)
    return torch.where(pos >= n, last_with_mass, pos)


def _sample_truncated_rows(
    logprobs: torch.Tensor, params: Sequence[SamplingParams], draws: Sequence[torch.Tensor]
) -> tuple[list[int], list[float]]:
    """The top-k / top-p rows of `logprobs` [R, V], each sampled on the host with its uniform
    (`draws`, [1] each): their tokens and those tokens' logprobs. One copy of all R rows,
    where the candidate sets' data-dependent sizes cost syncs per row on a device. Each row
    is exponentiated on its own, as a row [V] (vectorised kernels round a row's tail by its
    position, so [R, V] at once could differ in the last bit)."""
    rows = logprobs.cpu()
    tokens = [
        int(_sample_truncated(row.exp(), p, draw))
        for row, p, draw in zip(rows, params, draws, strict=True)
    ]
    return tokens, [float(row[t]) for row, t in zip(rows, tokens, strict=True)]


def _sample_truncated(probs: torch.Tensor, p: SamplingParams, draw: torch.Tensor) -> torch.Tensor:
    """Top-k, then top-p, then inverse CDF over the kept candidates, for one row [V]."""
    ids, kept = truncated_candidates(probs, p)
    return ids[_inverse_cdf(kept[None], draw)[0]]


def truncated_candidates(
    probs: torch.Tensor, p: SamplingParams
) -> tuple[torch.Tensor, torch.Tensor]:
    """The tokens top-k then top-p keep of one row [V], in descending probability (stable:
    ties in id order), with their probabilities.

    The kept set is a prefix of that order, so only a superset prefix is sorted: the tokens at
    least as likely as the k-th (top-k), or likelier than (1 - top_p) / 4V (top-p: the rest hold
    under (1 - top_p) / 4 of the mass, so the top_p mass is reached before them): a full sort
    of a large vocabulary is slow on a CPU core.
    """
    v = probs.shape[0]
    k = p.top_k if 0 < p.top_k < v else v
    if k < v:
        candidates = probs >= probs.topk(k).values[-1]
    else:
        candidates = probs > (1 - p.top_p) / (4 * v)
        if probs[candidates].sum() < p.top_p:  # rounding at the edge: fall back to everything
            candidates = torch.ones_like(candidates)
    ids = candidates.nonzero()[:, 0]
    kept, order = probs[ids].sort(descending=True, stable=True)
    kept, ids = kept[:k], ids[order[:k]]
    # top-p measures mass relative to the top-k set, or to the whole vocabulary without top-k.
    total = kept.sum() if k < v else probs.sum()
    mass_before = (kept.cumsum(0) - kept) / total
    # The first candidate always survives (mass_before = 0 < top_p).
    keep = mass_before < p.top_p
    return ids[keep], kept[keep]
