"""Requests leaving and entering an engine: export, import and snapshot as `SequenceState`.

A state carries a sample's tokens, logprobs and generator state, and optionally its KV, so
another replica (or the same one at another layout) continues it exactly where it stopped.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from patrl.kvstore import PagedKVCache, SequenceKV
from patrl.rollout.outputs import SequenceState
from patrl.rollout.sampler import export_generator, import_generator
from patrl.rollout.scheduler import Scheduler
from patrl.rollout.sequence import Request, Seq, SequenceStatus


def export_requests(
    requests: dict[str, Request],
    scheduler: Scheduler,
    cache: PagedKVCache,
    request_ids: Iterable[str],
    with_kv: bool,
    include_finished: bool,
) -> list[SequenceState]:
    """Take `request_ids` out of `requests` (and the scheduler), their running samples with
    KV when `with_kv`; finished samples come along only with `include_finished`."""
    states: list[SequenceState] = []
    for request_id in request_ids:
        request = requests.pop(request_id, None)
        if request is None:
            raise KeyError(f"no request {request_id!r} in this engine")
        exported: set[int] = set()  # a leader exports the children waiting on its prefill
        for index in sorted(request.seqs):
            seq = request.seqs[index]
            if seq.seq_id in exported:
                continue
            if seq.is_finished:
                if include_finished:
                    states.append(state_of(seq, None))
                continue
            kv = None
            if with_kv and seq.status is SequenceStatus.RUNNING and not seq.fork_children:
                kv = cache.export(seq.seq_id)
            pending_children = seq.fork_children
            seq.fork_children = []
            scheduler.remove(seq)
            for s in (seq, *pending_children):
                states.append(state_of(s, kv if s is seq else None))
                exported.add(s.seq_id)
    return states


def snapshot_requests(
    requests: dict[str, Request], request_ids: Iterable[str]
) -> list[SequenceState]:
    """Every sample of `request_ids` as it stands, without KV, the engine left unchanged."""
    states: list[SequenceState] = []
    for request_id in request_ids:
        request = requests.get(request_id)
        if request is None:
            raise KeyError(f"no request {request_id!r} in this engine")
        states += [state_of(request.seqs[i], None) for i in sorted(request.seqs)]
    return states


def state_of(seq: Seq, kv: SequenceKV | None) -> SequenceState:
    """`seq` detached from its engine (with `kv`, when given)."""
    return SequenceState(
        request_id=seq.request_id,
        sample_index=seq.sample_index,
        prompt_token_ids=list(seq.prompt_token_ids),
        output_token_ids=list(seq.output_token_ids),
        output_logprobs=list(seq.output_logprobs),
        params=seq.params,
        generator_state=export_generator(seq.generator),
        output_top_logprobs=list(seq.output_top_logprobs),
        kv=kv,
        num_preemptions=seq.num_preemptions,
        finish_reason=seq.finish_reason if seq.is_finished else None,
        stop_reason=seq.stop_reason if seq.is_finished else None,
        keep=seq.keep,
        prompt_key=seq.prompt_key,
    )


def import_requests(
    requests: dict[str, Request],
    scheduler: Scheduler,
    cache: PagedKVCache,
    states: Iterable[SequenceState],
    new_seq_id: Callable[[], int],
) -> None:
    """Continue `states` here: with their KV when it fits, else by recompute. Samples that
    had not started wait on one leader again, so their prompt is prefilled once and forked."""
    leaders: dict[str, Seq] = {}
    for st in states:
        request = requests.get(st.request_id)
        if request is None:
            request = requests[st.request_id] = Request(st.request_id, list(st.prompt_token_ids))
        if st.sample_index in request.seqs:
            raise ValueError(
                f"sample {st.sample_index} of request {st.request_id!r} is already here"
            )
        seq = _seq_of(new_seq_id(), st)
        request.seqs[st.sample_index] = seq
        if st.finish_reason is not None:
            seq.finish(st.finish_reason)  # a finished sample of a request that goes on
            seq.stop_reason = st.stop_reason
            continue
        if not st.output_token_ids and st.kv is None:
            leader = leaders.get(st.request_id)
            if leader is not None:
                leader.fork_children.append(seq)
                continue
            leaders[st.request_id] = seq
        if st.kv is not None and _kv_matches(seq, st) and cache.can_import(st.kv):
            cache.import_(seq.seq_id, st.kv)
            if cache.blocks.num_uncomputed(seq.seq_id) == 0:
                seq.status = SequenceStatus.RUNNING
                scheduler.running.append(seq)
                continue
            scheduler.remove(seq)  # KV short of the last token: recompute instead
        scheduler.add(seq)


def _seq_of(seq_id: int, st: SequenceState) -> Seq:
    return Seq(
        seq_id,
        st.request_id,
        st.sample_index,
        list(st.prompt_token_ids),
        st.params,
        import_generator(st.generator_state),
        output_token_ids=list(st.output_token_ids),
        output_logprobs=list(st.output_logprobs),
        output_top_logprobs=list(st.output_top_logprobs),
        num_preemptions=st.num_preemptions,
        # states pickled before these fields existed (a saved partial rollout) lack them
        prompt_key=getattr(st, "prompt_key", None),
        keep=getattr(st, "keep", False),
    )


def _kv_matches(seq: Seq, st: SequenceState) -> bool:
    assert st.kv is not None
    return list(st.kv.token_ids) == seq.token_ids[:-1] and seq.output_token_ids != []
