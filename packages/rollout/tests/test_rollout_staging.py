"""One host-to-device copy a step (patrl.rollout.staging): aligned views of one buffer, the
double-buffered host side with its events (torch.cuda.Event stood in on CPU), a context's
staged indices against the torch formulas they replace, and an engine's decode step making
exactly one transfer whatever the sampling params (the sampler's inputs ride in the same
copy), eager and through the CUDA-graph twin; a speculative verify step one too (its verify
plan and padded query layout ride in it), plus one for its top-k / top-p sequences' outcome."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import patrl.rollout.model_runner as model_runner
import patrl.rollout.staging as staging
from patrl.rollout.config import EngineConfig
from patrl.rollout.engine import Engine
from patrl.rollout.layers.attention.context import AttentionContext, HostBatch, table_array
from patrl.rollout.layers.attention.sdpa import SdpaBackend
from patrl.rollout.sampler import (
    SamplingParams,
    make_generator,
    plan_samples,
    plan_verify,
    sample,
    sample_planned,
    verify_drafts,
    verify_planned,
)
from patrl.rollout.staging import ALIGN, Array, CudaCopies, StepStaging, layout
from patrl_testkit.models import save_hf_model, tiny_hf_model
from patrl_testkit.sampling import reference_sample


def test_arrays_come_back_equal_as_aligned_views_of_one_buffer() -> None:
    """Mixed dtypes at odd sizes: each view starts 16-byte aligned in one uint8 buffer and
    holds exactly its values; a function fills its destination itself."""

    def fill(dst: np.ndarray) -> None:
        dst[...] = np.arange(6, dtype=np.int32).reshape(2, 3) * 7

    arrays = [
        Array([1, 2, 3], torch.int32),
        Array([-(2**40), 5], torch.int64),
        Array([True, False, True], torch.bool),
        Array([[0.5, 1.5]], torch.float32, (1, 2)),
        Array(fill, torch.int32, (2, 3)),
        Array(np.array([9], dtype=np.int64), torch.int64),
    ]
    staged = StepStaging("cpu").stage(arrays)
    base = staged.buffer.data_ptr()
    assert staged.buffer.dtype == torch.uint8
    offsets, total = layout([(a.resolved_shape(), a.dtype) for a in arrays])
    assert total <= staged.buffer.numel()
    for t, off in zip(staged.tensors, offsets, strict=True):
        assert t.data_ptr() - base == off and off % ALIGN == 0
    want = [
        torch.tensor([1, 2, 3], dtype=torch.int32),
        torch.tensor([-(2**40), 5]),
        torch.tensor([True, False, True]),
        torch.tensor([[0.5, 1.5]]),
        torch.arange(6, dtype=torch.int32).reshape(2, 3) * 7,
        torch.tensor([9]),
    ]
    for got, expected in zip(staged.tensors, want, strict=True):
        assert got.dtype == expected.dtype and torch.equal(got, expected)
    with pytest.raises(TypeError, match=r"cannot stage torch\.float16"):
        StepStaging("cpu").stage([Array([1.0], torch.float16)])


class _Runtime(CudaCopies):
    """CudaCopies on CPU: plain host buffers (pinning needs CUDA); its events are real
    CudaCopies events, of the stood-in class below."""

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)


class _Event:
    """torch.cuda.Event stood in: records and waits go to `log`, by the event's id."""

    log: list[tuple[str, int]]

    def record(self, stream: Any = None) -> None:
        assert stream == ("stream of", torch.device("cuda", 1))  # the engine's device's
        self.log.append(("record", id(self)))

    def synchronize(self) -> None:
        self.log.append(("wait", id(self)))


def test_a_host_buffer_is_rewritten_only_after_the_event_of_its_last_copy(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Stages alternate between the two host buffers; a buffer's copy records its event, and
    the next stage writing that buffer (two stages later) first waits on it. A stage's
    device tensors are its own: later stages (and a buffer's growth) leave them intact."""
    log: list[tuple[str, int]] = []
    _Event.log = log
    runtime = _Runtime("cuda:1")  # not the current device: events go on its own stream
    st = StepStaging("cpu", capacity=64, runtime=runtime)
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device: ("stream of", device))
    real_move = staging.move

    def move(src: torch.Tensor, device: torch.device, *, copy: bool = False) -> torch.Tensor:
        slot = next(i for i, h in enumerate(st.hosts) if h and h[0].data_ptr() == src.data_ptr())
        log.append(("copy", slot))
        return real_move(src, device, copy=copy)

    monkeypatch.setattr(staging, "move", move)
    kept = []
    for step in range(5):
        n = 100 if step == 3 else 3  # step 3 outgrows its 64-byte buffer
        values = list(range(step, step + n))
        kept.append((values, st.stage([Array(values, torch.int64)]).tensors[0]))
    for values, t in kept:
        assert t.tolist() == values
    slot_of = {id(event): slot for slot, event in runtime.events.items()}
    log[:] = [(what, slot if what == "copy" else slot_of[slot]) for what, slot in log]
    # the first use of each buffer waits on nothing; every later one on its own last copy
    assert log == [
        ("copy", 0), ("record", 0),
        ("copy", 1), ("record", 1),
        ("wait", 0), ("copy", 0), ("record", 0),
        ("wait", 1), ("copy", 1), ("record", 1),
        ("wait", 0), ("copy", 0), ("record", 0),
    ]  # fmt: skip
    assert st.hosts[1] is not None and st.hosts[1][0].numel() == 1024  # 800 bytes, doubled


def reference_indices(
    q_lens: list[int], ctx_lens: list[int], tables: list[list[int]]
) -> list[torch.Tensor]:
    """The torch formulas the staged indices replace: positions, cu_seqlens_q, cu_seqlens_k,
    context lengths, the zero-padded block tables."""
    q = torch.tensor(q_lens)
    ctx = torch.tensor(ctx_lens)
    cu_q = torch.cat([q.new_zeros(1), q.cumsum(0)])
    starts = torch.repeat_interleave(ctx - q - cu_q[:-1], q)
    positions = torch.arange(int(q.sum())) + starts
    cu_k = torch.cat([ctx.new_zeros(1), ctx.cumsum(0)])
    width = max(len(b) for b in tables)
    table = torch.zeros(len(tables), width, dtype=torch.int32)
    for i, b in enumerate(tables):
        table[i, : len(b)] = torch.tensor(b, dtype=torch.int32)
    return [positions, cu_q.int(), cu_k.int(), ctx.int(), table]


class _Cache:
    capacity_tokens = 1 << 20


@pytest.mark.parametrize("seed", range(6))
def test_staged_indices_equal_the_torch_formulas(seed: int) -> None:
    """Random batches (decodes, prefill chunks after cached tokens, mixed; tables of unequal
    and of equal lengths): every staged index equals its torch formula, the slots and the
    written rows survive -1 entries, the extra arrays follow."""
    rng = random.Random(seed)
    b = rng.randint(1, 9)
    q_lens = [1 if seed % 3 == 0 else rng.randint(1, 7) for _ in range(b)]
    ctx_lens = [q + rng.randint(0, 40) for q in q_lens]
    block = 4
    tables = [[rng.randrange(500) for _ in range(-(-c // block))] for c in ctx_lens]
    if seed == 5:
        tables = [t[:1] for t in tables]  # equal lengths: the table's fast path
    slots = [rng.choice([-1, rng.randrange(1000)]) for _ in range(sum(q_lens))]
    host = HostBatch.check(
        q_lens, ctx_lens, slot_mapping=slots, block_tables=tables, kv_cache=_Cache()
    )
    ctx, (ids,) = AttentionContext.staged(
        host, StepStaging("cpu"), [Array(list(range(sum(q_lens))), torch.int64)]
    )
    got = [
        ctx.positions,
        ctx.cu_seqlens_q,
        ctx.cu_seqlens_k,
        ctx.context_lens_tensor(),
        ctx.block_table_tensor(),
    ]
    for g, want in zip(got, reference_indices(q_lens, ctx_lens, tables), strict=True):
        assert g.dtype == want.dtype and torch.equal(g, want)
    kept = [i for i, s in enumerate(slots) if s >= 0]
    assert ctx.slot_mapping is not None and ctx.slot_mapping.tolist() == [slots[i] for i in kept]
    if len(kept) < len(slots):
        assert ctx.write_rows is not None and ctx.write_rows.tolist() == kept
    else:
        assert ctx.write_rows is None
    assert ids.tolist() == list(range(sum(q_lens)))
    assert torch.equal(ctx.last_token_indices(), torch.tensor(host.last_rows()))


def test_a_bucket_table_repeats_its_first_row_on_padding_rows() -> None:
    (t,) = StepStaging("cpu").stage([table_array([[3, 4], [5]], (4, 3))]).tensors
    assert t.tolist() == [[3, 4, 0], [5, 0, 0], [3, 4, 0], [3, 4, 0]]


# ------------------------------------------------------------------ transfers of a step


MIXED = [
    SamplingParams(temperature=0, max_tokens=64, ignore_eos=True),
    SamplingParams(temperature=1.0, n=2, max_tokens=64, ignore_eos=True),
    SamplingParams(temperature=0.7, seed=2, logprobs=3, max_tokens=64, ignore_eos=True),
    SamplingParams(temperature=0, logprobs=2, n=2, max_tokens=64, ignore_eos=True),
    SamplingParams(temperature=0.9, top_k=5, seed=3, max_tokens=64, ignore_eos=True),
    SamplingParams(top_p=0.8, top_k=20, seed=4, logprobs=1, max_tokens=64, ignore_eos=True),
]
"""8 samples: greedy, unseeded at T = 1, seeded and tempered, top-k, top-p with top-k, some
with top logprobs."""

GREEDY = [SamplingParams(temperature=0, n=2, max_tokens=64, ignore_eos=True)] * 4


def step_transfers(
    model_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    graphs: bool,
    params: list[SamplingParams],
) -> tuple[list[int], list[int]]:
    """Host-to-device transfers (`staging.move` calls) of 4 steady decode steps of 8 samples
    of `params`, split into the step's (engine, runner: the forward's inputs, the rows to
    sample, the sampler's inputs) and the sampler's own; with `graphs`, through the
    CUDA-graph twin. Also checks that the sampler took its inputs from the step's copy
    (`sample_planned` handed every array its plan asks for)."""
    config = EngineConfig(
        model=str(model_dir), block_size=4, num_kv_blocks=256, max_model_len=256,
        max_num_seqs=8, tune_host_malloc=False,
    )  # fmt: skip
    engine = Engine(config)
    if graphs:
        engine.runner.graphs = engine.runner._decode_graphs(capture=False)
    for i, p in enumerate(params):
        engine.add_request([3 + i, 17, 42, 5 + i, 9], p)
    while engine.counters.decode_steps < 2:  # every prefill done, decoding in full
        engine.step()
    assert engine.scheduler.num_running_samples() == 8
    counts = {"step": 0, "sampler": 0}
    where = ["step"]
    real_move = staging.move

    def move(*args: Any, **kwargs: Any) -> torch.Tensor:
        counts[where[-1]] += 1
        return real_move(*args, **kwargs)

    staged_inputs: list[tuple[int, int]] = []

    def in_sampler(f: Callable[..., Any]) -> Callable[..., Any]:
        def run(logits: torch.Tensor, plan: Any, inputs: Any = None) -> Any:
            staged_inputs.append((len(plan.arrays()), -1 if inputs is None else len(inputs)))
            where.append("sampler")
            try:
                return f(logits, plan, inputs)
            finally:
                where.pop()

        return run

    monkeypatch.setattr(staging, "move", move)
    monkeypatch.setattr(model_runner, "sample_planned", in_sampler(model_runner.sample_planned))
    forwards = []
    if engine.runner.graphs is not None:
        forward = engine.runner.graphs.forward
        monkeypatch.setattr(
            engine.runner.graphs, "forward", lambda *a: forwards.append(1) or forward(*a)
        )
    steps, sampler = [], []
    for _ in range(4):
        counts.update(step=0, sampler=0)
        decodes = engine.counters.decode_steps
        engine.step()
        assert engine.counters.decode_steps == decodes + 1
        steps.append(counts["step"])
        sampler.append(counts["sampler"])
    monkeypatch.undo()
    assert len(forwards) == (4 if graphs else 0)  # the twin ran every step
    assert len(staged_inputs) == 4
    assert all(want == got for want, got in staged_inputs), staged_inputs
    return steps, sampler


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graph-twin"])
@pytest.mark.parametrize("params", [MIXED, GREEDY], ids=["mixed", "greedy"])
def test_a_steady_decode_step_makes_one_host_to_device_transfer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, graphs: bool, params: list[SamplingParams]
) -> None:
    """A decode step's token ids, positions, cumulative and plain context lengths, slots,
    block tables (with the graphs: padded to the bucket) and the sampler's inputs (the
    temperatures, each sampling path's rows, the uniforms drawn on the requests' CPU
    generators) go up in ONE copy: all are known on the host before the forward starts,
    and the rows to sample need no index at all (every sequence completes, none forks). The
    top-k / top-p rows are sampled on the host after one copy down, and their tokens stay
    there. So a step makes exactly 1 transfer whatever the sampling params, however many
    layers the model has, and the sampler none of its own."""
    counts = {}
    for layers in (2, 8):
        model_dir = save_hf_model(
            tiny_hf_model("llama", num_hidden_layers=layers), tmp_path / str(layers)
        )
        counts[layers] = step_transfers(model_dir, monkeypatch, graphs, params)
    for steps, sampler in counts.values():
        assert steps == [1, 1, 1, 1], counts
        assert sampler == [0, 0, 0, 0], counts


def test_the_transfer_count_sees_the_sampler_uploading_on_its_own(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The counter above is not blind: the sampler called without staged inputs (the
    one-off path) moves its plan's arrays in one copy, and its top-k / top-p rows' values
    in one more when they must be on the device (`sample`)."""
    moves = []
    real_move = staging.move

    def move(*args: Any, **kwargs: Any) -> torch.Tensor:
        moves.append(1)
        return real_move(*args, **kwargs)

    monkeypatch.setattr(staging, "move", move)
    params = [p for p in MIXED for _ in range(p.n)]
    logits = torch.randn(len(params), 50)
    out = sample_planned(logits, plan_samples(params, [make_generator(i) for i in range(8)], 50))
    assert len(moves) == 1 and out.host_rows is not None
    out.on_device()
    assert len(moves) == 2 and out.host_rows is None


@pytest.mark.gpu
def test_on_cuda_stages_come_from_pinned_buffers_and_keep_their_values() -> None:
    """The CUDA runtime: pinned host buffers, one device buffer a stage, and a third stage
    rewriting the first buffer only after its event while the first stage's tensors, on the
    device, keep their values; a kernel reads every view. The stream is held busy first
    (a ~0.1 s spin), so the first stage's copy has not run when the third stage writes:
    without the wait on its event, the first stage would read the third's values."""
    st = StepStaging("cuda", capacity=64)
    kept = []
    torch.cuda._sleep(200_000_000)  # GPU cycles: the copies below queue behind it
    for step in range(3):
        values = [list(range(step, step + 5)), [[step, 1], [2, 3]]]
        staged = st.stage([Array(values[0], torch.int64), Array(values[1], torch.int32, (2, 2))])
        assert all(t.is_cuda for t in staged.tensors)
        kept.append((values, staged.tensors))
    assert all(h is not None and h[0].is_pinned() for h in st.hosts)
    assert set(st.runtime.events) == {0, 1}  # type: ignore[union-attr]
    for (ids, table), (a, b) in kept:
        assert (a + 0).tolist() == ids and (b * 1).tolist() == table


@pytest.mark.gpu
def test_on_cuda_the_sampler_reads_its_inputs_from_a_staged_buffer() -> None:
    """The step's path on CUDA: a mixed batch's plan staged from a pinned buffer behind
    another array, sampled by `sample_planned` (top-k / top-p rows kept on the host), equals
    `sample` on the same device (every row sent up by `on_device`) bit for bit: the same ops
    on the same device values."""
    params = [p for p in MIXED for _ in range(p.n)]
    v = 300
    logits = torch.randn(len(params), v, generator=torch.Generator().manual_seed(0)).cuda()
    plan = plan_samples(params, [make_generator(i) for i in range(len(params))], v)
    staged = StepStaging("cuda").stage([Array([1, 2, 3], torch.int64), *plan.arrays()])
    stepped = sample_planned(logits, plan, staged.tensors[1:])
    assert stepped.host_rows is not None and stepped.tokens.is_cuda
    whole = sample(logits, params, [make_generator(i) for i in range(len(params))])
    assert whole.host_rows is None and whole.tokens.is_cuda
    a, b = stepped.to_host(), whole.to_host()
    assert (a.tokens, a.logprobs, a.top_logprobs) == (b.tokens, b.logprobs, b.top_logprobs)
    # and the independent slow twin, on the host copy of the logits, with the same draws: the
    # same tokens (a draw within float rounding of a CDF step could differ; none of these
    # rows is), logprobs to fp32 rounding across devices
    tokens, logprobs = reference_sample(
        logits.cpu(), params, [make_generator(i) for i in range(len(params))]
    )
    assert a.tokens == tokens.tolist()
    assert a.logprobs == pytest.approx(logprobs.tolist(), abs=1e-5)


VERIFY_KW: dict[str, Any] = {"max_tokens": 24, "ignore_eos": True}
VERIFY_PARAMS = {
    "greedy": [SamplingParams(temperature=0, n=2, logprobs=2, **VERIFY_KW)] * 2,
    "tempered": [
        SamplingParams(temperature=0, n=2, logprobs=2, **VERIFY_KW),
        SamplingParams(temperature=1.0, seed=1, n=2, **VERIFY_KW),
        SamplingParams(temperature=0.7, seed=5, **VERIFY_KW),
    ],
    "mixed": [
        SamplingParams(temperature=0, n=2, logprobs=2, **VERIFY_KW),
        SamplingParams(temperature=1.0, seed=1, n=2, **VERIFY_KW),
        SamplingParams(temperature=0.7, seed=5, **VERIFY_KW),
        SamplingParams(temperature=0.9, top_k=5, seed=3, **VERIFY_KW),
        SamplingParams(top_p=0.8, seed=4, logprobs=1, **VERIFY_KW),
    ],
}
"""Verify steps' batches: all greedy; greedy, plain and tempered; and with top-k and top-p
sequences, whose outcome is decided on the host."""


@pytest.mark.parametrize(
    "graphs",
    [False, True, "chunked", "lazy-layout"],
    ids=["eager", "graph-twin", "chunked", "lazy"],
)
@pytest.mark.parametrize(("params", "want"), [("greedy", 1), ("tempered", 1), ("mixed", 2)])
def test_a_verify_step_makes_one_transfer_plus_one_for_top_k_rows(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    graphs: bool | str,
    params: str,
    want: int,
) -> None:
    """A speculative verify step's host-known inputs (token ids, the attention indices, the
    padded query layout sdpa reads, and the verify plan: the draft layout, temperatures, each
    path's rows, the uniforms) go up in the forward's ONE copy: everything but the top-k /
    top-p sequences' outcome is known before the forward (the scheduler chose the drafts).
    That outcome, decided on the host after the forward, goes up in one more: 1 transfer a
    verify step without such sequences, 2 with them. With the CUDA-graph twin installed the
    verify steps still run eagerly (graphs take one query token a sequence) and the decode
    steps between them through the twin. "chunked": the CPU path verifying chunks of whole
    sequences (`sample_chunk_bytes`, 6 rows a chunk): every chunk's plan rides in the same
    copy, and each chunk with top-k / top-p sequences sends their outcome up in one of its
    own. "lazy": a backend that does not ask for the padded layout staged (sdpa answering
    no) has the layer stage it when it first reads it: one transfer more, which the count
    sees. `verify_planned` is handed every array its plan asks for, staged."""
    model_dir = save_hf_model(tiny_hf_model("llama"), tmp_path)
    config = EngineConfig(
        model=str(model_dir), block_size=4, num_kv_blocks=256, max_model_len=256,
        speculative={"enable": True, "max_num_seqs": 0}, tune_host_malloc=False,
    )  # fmt: skip
    batch_params = VERIFY_PARAMS[params]
    moves: list[int] = []
    real_move = staging.move

    def move(*args: Any, **kwargs: Any) -> torch.Tensor:
        moves.append(1)
        return real_move(*args, **kwargs)

    staged_inputs: list[tuple[int, int]] = []
    truncating: list[bool] = []  # per verify_planned call: whether it has top-k / top-p rows

    def planned(f: Callable[..., Any]) -> Callable[..., Any]:
        def run(logits: torch.Tensor, plan: Any, inputs: Any = None, *rest: Any) -> Any:
            staged_inputs.append((len(plan.arrays()), -1 if inputs is None else len(inputs)))
            truncating.append(bool(plan.truncated))
            return f(logits, plan, inputs, *rest)

        return run

    engine = Engine(config)
    if graphs is True:
        engine.runner.graphs = engine.runner._decode_graphs(capture=False)
    chunks, lazy = graphs == "chunked", graphs == "lazy-layout"
    if lazy:
        monkeypatch.setattr(engine.runner.model.backend, "wants_padded_queries", lambda h: False)
    if chunks:
        engine.runner.sample_chunk_bytes = 4 * 7 * engine.model.config.vocab_size
    batch = [[3 + i, 17, 42, 5 + i, 9, 11 + i] for i in range(len(batch_params))]
    keys = [f"p{i}" for i in range(len(batch_params))]
    monkeypatch.setattr(staging, "move", move)
    monkeypatch.setattr(model_runner, "verify_planned", planned(model_runner.verify_planned))
    forwards: list[int] = []
    if engine.runner.graphs is not None:
        forward = engine.runner.graphs.forward
        monkeypatch.setattr(
            engine.runner.graphs, "forward", lambda *a: forwards.append(1) or forward(*a)
        )
    per_verify, calls, expected, decodes = [], [], [], 0
    for _ in range(2):  # the second round also drafts from the first's responses
        for prompt, p, key in zip(batch, batch_params, keys, strict=True):
            engine.add_request(prompt, p, prompt_key=key)
        while engine.has_unfinished():
            verified, start, graphed = len(staged_inputs), len(moves), len(forwards)
            decoded = engine.counters.decode_steps
            engine.step()
            if len(staged_inputs) > verified:
                per_verify.append(len(moves) - start)
                calls.append(len(staged_inputs) - verified)
                expected.append(1 + lazy + sum(truncating[verified:]))
                assert len(forwards) == graphed  # a verify step runs eagerly
            elif engine.counters.decode_steps > decoded:
                decodes += 1
    monkeypatch.undo()
    assert engine.stats()["spec_drafted_tokens"] > 0
    assert len(per_verify) >= 3 and per_verify == expected, (per_verify, expected)
    if not chunks:
        assert set(per_verify) == {want + lazy}, per_verify
    assert decodes > 0 and len(forwards) == (decodes if graphs is True else 0)
    assert (max(calls) > 1) is chunks  # chunked: some step verified in several calls
    assert all(n == got for n, got in staged_inputs), staged_inputs


def test_a_padded_query_layout_staged_with_the_context_equals_the_lazy_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`AttentionContext.staged(padded=True)` (a verify step's) puts `padded_queries()`'s
    layout in the context's one copy: the same index, limit and block tables as a context
    that builds it when a layer first asks (in one more copy), with the extra arrays after
    it."""
    q_lens, ctx_lens = [3, 1, 5, 2], [9, 4, 13, 2]
    tables = [[7, 8, 9], [1], [2, 3, 4, 5], [6]]
    slots = list(range(sum(q_lens)))
    host = HostBatch.check(
        q_lens, ctx_lens, slot_mapping=slots, block_tables=tables, kv_cache=_Cache()
    )
    extra = [Array([5, 6, 7], torch.int64)]
    eager, (ids,) = AttentionContext.staged(host, StepStaging("cpu"), extra, padded=True)
    lazy, _ = AttentionContext.staged(host, StepStaging("cpu"), extra)
    assert ids.tolist() == [5, 6, 7]
    moves: list[int] = []
    real_move = staging.move

    def move(*args: Any, **kwargs: Any) -> torch.Tensor:
        moves.append(1)
        return real_move(*args, **kwargs)

    monkeypatch.setattr(staging, "move", move)
    have = eager.padded_queries()
    assert moves == []  # already on the device
    want = lazy.padded_queries()
    assert moves == [1]
    monkeypatch.undo()
    for got, expected in zip(have, want, strict=True):
        assert got.dtype == expected.dtype and torch.equal(got, expected)
    with pytest.raises(ValueError, match="padded query layout needs block tables"):
        AttentionContext.staged(HostBatch.check([2, 1]), padded=True)


def test_a_staged_verify_plan_verifies_as_the_one_call_form() -> None:
    """The step's path: a mixed verify plan (greedy, plain, tempered, top-k, top-p; empty and
    long drafts) staged behind another array and handed to `verify_planned` gives what
    `verify_drafts` gives on fresh generators of the same seeds, bit for bit (the same
    uniforms in the same order, the same ops on the same values), and draws exactly
    len(draft) + 1 uniforms per sampling sequence, none for a greedy one."""
    params = [
        SamplingParams(temperature=0, logprobs=2),
        SamplingParams(temperature=1.0, seed=1),
        SamplingParams(temperature=0.7, seed=2, logprobs=1),
        SamplingParams(temperature=0.9, top_k=5, seed=3),
        SamplingParams(top_p=0.8, seed=4),
        SamplingParams(temperature=0.8, seed=5),
    ]
    drafts = [[4, 9], [], [1, 2, 3], [7], [3, 3, 3, 3], [0]]
    v = 40
    rows = sum(1 + len(d) for d in drafts)
    logits = torch.randn(rows, v, generator=torch.Generator().manual_seed(0)) * 3
    gens = [make_generator(i) for i in range(len(params))]
    plan = plan_verify(drafts, params, gens, v)
    staged = StepStaging("cpu").stage([Array([1, 2, 3], torch.int64), *plan.arrays()])
    stepped = verify_planned(logits, plan, staged.tensors[1:]).to_host()
    whole = verify_drafts(logits, drafts, params, [make_generator(i) for i in range(6)]).to_host()
    assert stepped == whole
    for i, (p, d) in enumerate(zip(params, drafts, strict=True)):
        fresh = make_generator(i)
        if not p.greedy:
            torch.rand(1 + len(d), generator=fresh)
        assert torch.equal(gens[i].get_state(), fresh.get_state()), i


@pytest.mark.gpu
def test_on_cuda_a_verify_plan_is_read_from_a_staged_buffer() -> None:
    """The verify step's path on CUDA: a mixed verify plan staged from a pinned buffer behind
    another array and handed to `verify_planned` equals `verify_drafts` on the same device
    and fresh generators of the same seeds, bit for bit (the same ops on the same values)."""
    params = [
        SamplingParams(temperature=0, logprobs=2),
        SamplingParams(temperature=1.0, seed=1),
        SamplingParams(temperature=0.9, top_k=5, seed=3),
        SamplingParams(top_p=0.8, seed=4, logprobs=1),
    ]
    drafts = [[4, 9], [1, 2, 3], [7], []]
    v = 300
    rows = sum(1 + len(d) for d in drafts)
    logits = torch.randn(rows, v, generator=torch.Generator().manual_seed(0)).cuda() * 3
    plan = plan_verify(drafts, params, [make_generator(i) for i in range(4)], v)
    staged = StepStaging("cuda").stage([Array([1, 2, 3], torch.int64), *plan.arrays()])
    assert all(t.is_cuda for t in staged.tensors)
    stepped = verify_planned(logits, plan, staged.tensors[1:])
    assert stepped.tokens.is_cuda
    whole = verify_drafts(logits, drafts, params, [make_generator(i) for i in range(4)])
    assert stepped.to_host() == whole.to_host()


def test_sdpa_wants_the_padded_layout_staged_for_short_multi_token_queries() -> None:
    """sdpa reads every sequence's padded layout when each query has 2 ..
    `max_batched_query` tokens over a cache (a verify step, short prompts): then, and only
    then, the runner stages it with the context (`AttentionContext.staged(padded=True)`)."""

    def host(q_lens: list[int], cache: bool = True) -> HostBatch:
        if not cache:
            return HostBatch.check(q_lens)
        ctx = [q + 3 for q in q_lens]
        slots = list(range(sum(q_lens)))
        return HostBatch.check(
            q_lens, ctx, slot_mapping=slots, block_tables=[[0, 1]] * len(q_lens), kv_cache=_Cache()
        )

    sdpa = SdpaBackend()
    assert sdpa.wants_padded_queries(host([5, 1, 3]))
    assert not sdpa.wants_padded_queries(host([1, 1]))  # a decode step: its own path
    assert not sdpa.wants_padded_queries(host([2, 66]))  # one too long: per sequence
    assert not sdpa.wants_padded_queries(host([3, 2], cache=False))
    assert not SdpaBackend(max_batched_query=1).wants_padded_queries(host([5, 1, 3]))
