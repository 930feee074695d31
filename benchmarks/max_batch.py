"""The largest micro-batch a configuration trains at on one GPU, and its speed there.

A try trains two steps at one micro-batch (then, when timed, --steps more). A try that runs out of memory
ends its process: what an out-of-memory error leaves behind is not all freed in the process (on an H100
held to 8 GiB, configurations searched after another's failed tries "ran out of memory" at micro-batch 1
where a fresh process trained 128). So a search is a few processes, each building the engine once and
trying micro-batches upwards until one fails: first sizes predicted from the peaks seen so far (memory
grows about linearly with the micro-batch), then, once one has failed, bisection, to within 5%.
"""
import json
import math

TOLERANCE = 20  # the search ends within 1/TOLERANCE of the largest micro-batch
LIMIT = 4096  # the default ceiling: nobody needs a larger micro-batch
UNDER_THE_LINE = 0.97  # predicted sizes are aimed this much low: the peak grows a little faster than linearly
MAX_GROWTH = 8  # and never more than this many times the largest that fitted
NEAR_THE_CAP = 0.9  # a try that reserved this share of the budget is close to the largest


def converged(low, high, limit=LIMIT):
    """Whether [low, high) (high: the smallest micro-batch that failed, None before any did) is narrow enough,
    or `limit` fits."""
    return low >= limit or (high is not None and high - low <= max(1, low // TOLERANCE))


def predicted(peaks, budget):
    """The micro-batch at which the GPU would run out of memory, by the line of peak allocated memory through the
    two largest tries (`peaks`: [micro-batch, peak allocated, peak reserved] of tries that fitted), against the
    `budget` less the share of reserved memory the largest try left unallocated (near the cap reserved memory
    saturates and says nothing); None with fewer than two tries or no growth."""
    sizes = sorted({batch: (allocated, reserved) for batch, allocated, reserved in peaks}.items())
    if len(sizes) < 2:
        return None
    (b1, (a1, _)), (b2, (a2, r2)) = sizes[-2:]
    slope = (a2 - a1) / (b2 - b1)
    return None if slope <= 0 else b2 + (budget * a2 / max(r2, a2) - a2) / slope


def next_batch(low, high, peaks, budget, limit=LIMIT):
    """The micro-batch to try next, or None once the search is done.

    `low`: the largest micro-batch that fitted (0: none yet); `high`: the smallest that failed (None: none);
    `peaks`: [micro-batch, peak allocated, peak reserved] of the tries that fitted; `budget`: the bytes the
    GPU allows; `limit`: the largest micro-batch worth trying.
    """
    if converged(low, high, limit):
        return None
    if low == 0:
        return 1
    ceiling = min(limit, high - 1 if high is not None else MAX_GROWTH * low)
    step = max(1, low // TOLERANCE)
    if high is not None:
        return max(low + 1, min((low + high) // 2, ceiling))
    guess = predicted(peaks, budget)
    if guess is None:  # no line yet, or a flat one: double, or creep up where the last try nearly filled the GPU
        near_the_cap = bool(peaks) and max(peaks)[2] > NEAR_THE_CAP * budget
        return min(low + step if near_the_cap else 2 * low, ceiling)
    return max(low + step, min(math.floor(guess * UNDER_THE_LINE), ceiling))


def search(run_child, limit=LIMIT):
    """Search with processes `run_child(state) -> (tries, finished)`, each trying micro-batches upwards from
    `state` ({"low", "high", "peaks", "limit"}) until one fails; a try is a dict with "batch" and "fits" (and
    the figures of a fitting try). Returns (largest micro-batch, the try that found it or None, every try)."""
    low, high, peaks, tries = 0, None, [], []
    while not converged(low, high, limit):
        state = {"low": low, "high": high, "peaks": peaks, "limit": limit}
        ran, finished = run_child(state)
        if not ran:
            raise RuntimeError(f"a search process tried nothing from {json.dumps(state)}")
        for attempt in ran:
            tries.append(attempt)
            if attempt["fits"]:
                low = max(low, attempt["batch"])
                peaks = [*peaks, [attempt["batch"], attempt["peak_allocated_bytes"], attempt["peak_reserved_bytes"]]]
            else:
                high = attempt["batch"] if high is None else min(high, attempt["batch"])
        if finished and not converged(low, high, limit):
            raise RuntimeError(f"a search process ended at {low} without a failed try")
    best = next((attempt for attempt in reversed(tries) if attempt["fits"] and attempt["batch"] == low), None)
    return low, best, tries
