"""Step-time shapes with known answers for lenpredict's tests: `step(tp, batch, context)` or,
padded, `step(tp, batch, context, longest)` -> seconds (synthetic: nothing here is measured).
Build a profile from one with `patrl_testkit.profiles.profile_from`."""


def flat(tp: int, batch: int, context: int) -> float:
    """Every step costs the same, whatever the layout: TP can never help."""
    return 0.01


def tp_speeds_up(tp: int, batch: int, context: int) -> float:
    """Memory-bound GPU-like: weights split over TP ranks, a small per-step collective cost."""
    return 0.008 / tp + 0.0002 * (tp > 1) + 2e-5 * batch / tp + 1e-8 * context / tp


def gloo_like(tp: int, batch: int, context: int) -> float:
    """Shaped like this CPU box (research/feasibility.md §4, bf16): TP=2 over gloo costs more
    per step than TP=1 at every batch size (B=1: ~29 ms vs ~60 ms; B=32: ~88 ms vs ~100 ms)."""
    return 0.029 + 0.0019 * batch + 1e-7 * context + (0.031 if tp > 1 else 0.0) * tp / 2


def compute_bound(tp: int, batch: int, context: int) -> float:
    """Compute-bound with a per-token collective: at large batches DP beats TP."""
    return 0.001 / tp + 0.002 * batch / tp + (0.0003 + 1e-4 * batch) * (tp > 1)


def cpu_knee(tp: int, batch: int, context: int) -> float:
    """This CPU box's shape since TP goes through shared memory (wide_2l): small batches are
    dear (single-threaded sgemm), the slope drops past 4 sequences, TP faster everywhere."""
    per_rank = 0.011 * min(batch, 4) + 0.0035 * max(0, batch - 4)
    return 0.017 / tp + per_rank / tp + 0.001 * (tp > 1) + 1e-8 * context / tp


def cpu_two_knees(tp: int, batch: int, context: int) -> float:
    """This CPU box's vocab_2l profile (2026-11-24): batch 4 costs ~2.6x batch 1, batch 16
    little more than batch 4, and the slope rises again past 16 (two knees, two ways)."""
    per_rank = 0.0147 * min(batch, 4) + 0.0037 * min(max(0, batch - 4), 12)
    per_rank += 0.0069 * max(0, batch - 16)
    return 0.012 / tp + per_rank / tp + 0.001 * (tp > 1) + 1e-8 * context / tp


def sdpa_like(tp: int, batch: int, context: int, longest: int) -> float:
    """A padded attention backend (this machine's sdpa): every sequence reads the longest
    one's blocks; a compute knee at 32 sequences. `tp_speeds_up` otherwise."""
    return tp_speeds_up(tp, batch, 0) + 4e-8 * batch * longest / tp + 1e-4 * max(0, batch - 32) / tp


def padded_no_knee(tp: int, batch: int, context: int, longest: int) -> float:
    """`sdpa_like` without its compute knee: a padded term on a fit with no knee to sum."""
    return tp_speeds_up(tp, batch, 0) + 4e-8 * batch * longest / tp


def ragged_like(tp: int, batch: int, context: int, longest: int) -> float:
    """A ragged attention backend (flash): only the total context costs."""
    return tp_speeds_up(tp, batch, 0) + 4e-8 * context / tp
