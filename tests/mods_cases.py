"""The gallery of user functions every backend's tests run: masks (`mask_cases`) and score
modifiers (`score_cases`), built for a batch's sequence lengths and head count.

Each case is `(id, MaskMod or Mask & MaskMod)` / `(id, ScoreMod)`, aux arrays as NumPy arrays
(an adapter test converts them to its framework). docs/mods.md shows the same functions.
"""
from __future__ import annotations

import numpy as np

import varlen
from varlen import MaskMod, ScoreMod

__all__ = ["mask_cases", "score_cases", "t5_bucket_table", "tree_ancestors", "MASK_IDS",
           "SCORE_IDS"]


def causal(b, q_idx, k_idx):
    return k_idx <= q_idx


def prefix_lm(b, q_idx, k_idx, prefix):
    return (k_idx <= q_idx) | (k_idx < prefix[b])


def chunked_causal(b, q_idx, k_idx, chunk):
    return (k_idx <= q_idx) & (q_idx // chunk[0] == k_idx // chunk[0])


def sliding_global(b, q_idx, k_idx, width, n_global):
    near = (k_idx <= q_idx) & (q_idx - k_idx < width[0])
    return near | (k_idx < n_global[0]) | (q_idx < n_global[0])


def document_segments(b, q_idx, k_idx, doc, start):
    """Segments inside a sequence (several documents packed in one row of the batch)."""
    return (doc[start[b] + q_idx] == doc[start[b] + k_idx]) & (k_idx <= q_idx)


def tree(b, q_idx, k_idx, ancestor):
    """Speculative decoding: a query sees its ancestors in a token tree (and itself)."""
    last = ancestor.shape[0] - 1          # positions past the tree see as its last token does
    return ancestor[varlen.minimum(q_idx, last), varlen.minimum(k_idx, last)] & (k_idx <= q_idx)


def alibi(score, b, h, q_idx, k_idx, slopes):
    return score - slopes[h] * abs(q_idx - k_idx)


def relative_bias(score, b, h, q_idx, k_idx, table):
    R = (table.shape[1] - 1) // 2
    return score + table[h, varlen.minimum(varlen.maximum(q_idx - k_idx, -R), R) + R]


def t5_buckets(score, b, h, q_idx, k_idx, bucket_of, bias):
    rel = varlen.minimum(abs(q_idx - k_idx), bucket_of.shape[0] - 1)
    side = varlen.where(k_idx > q_idx, bias.shape[1] // 2, 0)
    return score + bias[h, bucket_of[rel] + side]


def soft_clip(score, b, h, q_idx, k_idx):
    return 4.0 * varlen.tanh(score / 4.0) - 0.01 * varlen.log(1.0 + abs(q_idx - k_idx))


def hide_first_key(score, b, h, q_idx, k_idx):
    """A score_mod that hides pairs (-inf): the first key of every sequence but the row's own."""
    return varlen.where((k_idx == 0) & (q_idx > 0), -np.inf, score)


_TREE = 8


def tree_ancestors(n: int = _TREE, seed: int = 0) -> np.ndarray:
    """Bool `[n, n]`: `a[i, j]` when token j is i or an ancestor of i in a random tree."""
    rng = np.random.default_rng(seed)
    parent = np.array([-1] + [int(rng.integers(0, i)) for i in range(1, n)])
    a = np.eye(n, dtype=bool)
    for i in range(n):
        j = parent[i]
        while j >= 0:
            a[i, j] = True
            j = parent[j]
    return a


def t5_bucket_table(num_buckets: int = 16, max_distance: int = 64) -> np.ndarray:
    """T5's relative-position bucket of each distance `0..max_distance` (one direction: half the
    buckets exact, the rest logarithmic), tabulated as an int32 array."""
    exact = num_buckets // 2
    d = np.arange(max_distance + 1)
    log_b = exact + (np.log(np.maximum(d, 1) / exact) / np.log(max_distance / exact) *
                     (num_buckets - exact)).astype(np.int64)
    return np.where(d < exact, d, np.minimum(log_b, num_buckets - 1)).astype(np.int32)


def mask_cases(lengths, seed: int = 0):
    """`[(id, mask)]` for a batch whose sequences have `lengths` (queries == keys)."""
    rng = np.random.default_rng(seed)
    lengths = np.asarray(lengths, np.int64)
    B = len(lengths)
    start = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int32)
    total = max(int(lengths.sum()), 1)
    doc = np.zeros(total, np.int32)
    for b in range(B):
        cuts = np.sort(rng.integers(0, max(int(lengths[b]), 1), size=2))
        doc[start[b]:start[b] + lengths[b]] = np.searchsorted(cuts, np.arange(lengths[b]),
                                                              side="right")
    prefix = rng.integers(0, np.maximum(lengths, 1) + 1).astype(np.int32)
    return [
        ("causal", MaskMod(causal)),
        ("prefix-lm", MaskMod(prefix_lm, prefix)),
        ("chunked", MaskMod(chunked_causal, np.array([5], np.int32))),
        ("sliding-global", MaskMod(sliding_global, np.array([4], np.int32),
                                   np.array([2], np.int32))),
        ("segments", MaskMod(document_segments, doc, start)),
        ("tree", MaskMod(tree, tree_ancestors())),
        ("window&prefix", varlen.Mask(window_left=6) & MaskMod(prefix_lm, prefix)),
    ]


MASK_IDS = ("causal", "prefix-lm", "chunked", "sliding-global", "segments", "tree",
            "window&prefix")


def score_cases(heads: int, seed: int = 0):
    """`[(id, score_mod)]` for `heads` query heads."""
    rng = np.random.default_rng(seed)
    slopes = (2.0 ** -np.arange(1, heads + 1)).astype(np.float32)
    table = (0.3 * rng.standard_normal((heads, 2 * 6 + 1))).astype(np.float32)
    buckets = t5_bucket_table()
    t5 = (0.3 * rng.standard_normal((heads, 2 * 16))).astype(np.float32)
    return [
        ("alibi", ScoreMod(alibi, slopes)),
        ("relative-bias", ScoreMod(relative_bias, table)),
        ("t5", ScoreMod(t5_buckets, buckets, t5)),
        ("soft-clip", ScoreMod(soft_clip)),
        ("hide-first", ScoreMod(hide_first_key)),
    ]


SCORE_IDS = ("alibi", "relative-bias", "t5", "soft-clip", "hide-first")
