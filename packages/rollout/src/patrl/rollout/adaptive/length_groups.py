"""The length groups (GRPO groups) of a rollout's requests, as the length model learns them:
the one writer of a run's length model."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from patrl.rollout.adaptive.protocols import Lengths


class LengthGroups:
    """Tells `lengths` which requests form a group and how its samples end. The requests of
    one prompt key in one rollout form one group, so n requests of one sample each (TRL's way
    of asking for a group, or a per-sample replay) are siblings as n samples of one request
    are. Every rank feeds it the same reports in the same order, so all learn alike.

    It is the only writer of the length model. An adaptive engine's controller feeds it
    during a rollout (`learn`: the planner predicts from siblings that have finished); the
    schedule reports every finished response after the rollout (`learn_groups`), and what was
    not learnt during it is learnt then: each finished response updates the model once,
    whichever engine ran it."""

    def __init__(self, lengths: Lengths) -> None:
        self.lengths = lengths
        self.open: dict[str, list[int]] = {}  # group id -> [size, unreported, observed]
        self.of_request: dict[str, tuple[str, list[int]]] = {}  # id -> (group, [unreported])
        self._by_key: dict[str, str] = {}  # prompt key -> its group in this rollout
        self._count = 0
        self.learnt: set[str] = set()  # requests `learn` observed in this rollout

    def new_rollout(self) -> None:
        """Requests of a key seen in an earlier rollout start a new group."""
        self._by_key = {}
        self.learnt = set()

    def group_of(self, request_id: str) -> str:
        return self.of_request[request_id][0]

    def learn(
        self, started: list[tuple[str, str, int]], finished: list[tuple[str, int, int, str]]
    ) -> None:
        """`started`: (request id, prompt key, n); `finished`: (request id, sample index,
        length, finish reason). Lengths of aborted or rejected samples are not observed."""
        for rid, key, n in started:
            self._start(rid, key, n)
        for rid, index, length, reason in finished:
            self._finish(rid, index, length, reason)

    def learn_groups(self, groups: Iterable[tuple[str, Sequence[tuple[str, int]]]]) -> None:
        """Finished groups after a rollout, each (prompt key, [(request id, length) of each
        finished sample]): the samples of requests `learn` did not observe in this rollout
        form one group of the key, learnt whole (and closed) now."""
        for key, samples in groups:
            lengths = [length for rid, length in samples if rid not in self.learnt]
            if not lengths:
                continue
            self._count += 1
            gid = f"{key}@{self._count}"
            self.lengths.start_group(gid, key, len(lengths))
            for i, length in enumerate(lengths):
                self.lengths.observe_finished(f"{gid}:{i}", gid, length)

    def _start(self, rid: str, key: str, n: int) -> None:
        gid = self._by_key.get(key)
        if gid is not None and gid in self.open:
            self.lengths.extend_group(gid, n)
            self.open[gid][0] += n
            self.open[gid][1] += n
        else:
            self._count += 1
            gid = f"{key}@{self._count}"
            self.lengths.start_group(gid, key, n)
            self.open[gid] = [n, n, 0]
            self._by_key[key] = gid
        self.of_request[rid] = (gid, [n])

    def _finish(self, rid: str, index: int, length: int, reason: str) -> None:
        request = self.of_request.get(rid)
        if request is None:
            return
        gid, unreported = request
        self.learnt.add(rid)
        entry = self.open[gid]
        if reason in ("stop", "length"):
            self.lengths.observe_finished(f"{rid}#{index}", gid, length)
            entry[2] += 1
        entry[1] -= 1
        unreported[0] -= 1
        if unreported[0] == 0:
            del self.of_request[rid]
        if entry[1] == 0:
            del self.open[gid]
            if entry[2] < entry[0]:
                # aborted or rejected samples: close the group here (a fully observed one
                # closed itself at its last sample)
                self.lengths.end_group(gid)
