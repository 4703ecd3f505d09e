"""Attention dropout: a counter-based keep bit per (sequence, query head, query, key).

Every backend that runs dropout draws the same bits: each pair's keep bit is a pure function of
`(seed, offset, b, h, q, k)` through Philox 4x32-10 (Salmon et al., "Parallel random numbers:
as easy as 1, 2, 3", SC'11; the generator of Random123, cuRAND and FlashAttention), so nothing
of size `[rows, keys]` is stored between forward and backward: the backward draws the bits
again. The exact rule, which a device kernel reproduces bit for bit, is in docs/semantics.md
("Dropout"); in short, for query position `q` and key position `k` of sequence `b` (positions
inside the sequence, never packed row numbers) at query head `h`:

    counter = (k >> 2, q, h, offset)                       # four uint32 words
    key     = (seed & 0xFFFFFFFF, (seed >> 32) ^ (b * SEQ_MIX mod 2^32))
    word    = philox4x32_10(counter, key)[k & 3]
    keep    = word >= threshold,  threshold = min(round(p * 2^32), 2^32 - 1)

A kept probability is multiplied by `1 / (1 - p)` (FlashAttention 2).
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass, replace

import numpy as np

__all__ = ["Dropout", "make_dropout", "check_dropout", "check_seed", "check_offset",
           "philox4x32_10", "keep_bits", "threshold_of", "PHILOX_M0", "PHILOX_M1", "PHILOX_W0",
           "PHILOX_W1", "SEQ_MIX", "ROUNDS", "seed_of_words"]

# Philox 4x32 constants (Random123's PHILOX_M4x32_0/1 and PHILOX_W32_0/1).
PHILOX_M0 = 0xD2511F53
PHILOX_M1 = 0xCD9E8D57
PHILOX_W0 = 0x9E3779B9      # golden ratio
PHILOX_W1 = 0xBB67AE85      # sqrt(3) - 1
ROUNDS = 10
# Odd, so b -> b * SEQ_MIX mod 2^32 is a bijection: every sequence of a batch gets its own key.
SEQ_MIX = 0x85EBCA6B
_MASK32 = 0xFFFFFFFF


def philox4x32_10(c0, c1, c2, c3, k0, k1):
    """Philox 4x32-10 on broadcastable uint32 arrays: the four output words (uint32 arrays).

    counter `(c0, c1, c2, c3)`, key `(k0, k1)`; round r (0-based) uses the key bumped r times
    by `(W0, W1)`. Checked against Random123's known-answer vectors (tests/test_dropout.py).
    """
    m0, m1 = np.uint64(PHILOX_M0), np.uint64(PHILOX_M1)
    lo_mask, shift = np.uint64(_MASK32), np.uint64(32)
    c0, c1, c2, c3 = (np.asarray(c, dtype=np.uint64) for c in (c0, c1, c2, c3))
    k0, k1 = (np.asarray(k, dtype=np.uint64) for k in (k0, k1))
    for r in range(ROUNDS):
        if r:
            k0 = (k0 + np.uint64(PHILOX_W0)) & lo_mask
            k1 = (k1 + np.uint64(PHILOX_W1)) & lo_mask
        p0 = c0 * m0                   # 32 x 32 -> 64 bits: exact in uint64
        p1 = c2 * m1
        c0, c1, c2, c3 = ((p1 >> shift) ^ c1 ^ k0, p1 & lo_mask,
                          (p0 >> shift) ^ c3 ^ k1, p0 & lo_mask)
    return tuple(c.astype(np.uint32) for c in (c0, c1, c2, c3))


def seed_of_words(words) -> int:
    """The 64-bit seed of two uint32 words `(hi, lo)`: how a framework's random key becomes a
    seed (the JAX adapter draws the two words from `dropout_rng` inside the traced program and
    hands them to the host or device call as an operand)."""
    w = np.asarray(words)
    if w.shape != (2,) or w.dtype != np.uint32:
        raise ValueError(f"dropout seed words must be uint32 of shape (2,), got "
                         f"{w.dtype}{list(w.shape)}")
    return (int(w[0]) << 32) | int(w[1])


def threshold_of(p: float) -> int:
    """The uint32 threshold of drop probability `p`: a word below it drops its pair."""
    return min(int(round(p * 2.0 ** 32)), _MASK32)


@dataclass(frozen=True)
class Dropout:
    """A call's dropout: probability `p` in (0, 1), the 64-bit `seed`, the 32-bit `offset`,
    and what kernels read: `threshold` (uint32) and `scale = 1 / (1 - p)`.

    `head_offset`: the global query head of a kernel call's local head 0 (0 for a call that
    sees every head; under Ulysses a rank's kernels see a slice of the heads, `for_heads`):
    a kernel draws the bits of local head `j` at head `head_offset + j`. Sequences and
    positions need no map: a context-parallel kernel call's plan numbers its sequences as the
    batch does and holds whole-document positions."""

    p: float
    seed: int
    offset: int
    head_offset: int = 0

    def for_heads(self, first: int) -> "Dropout":
        """This dropout for a kernel call whose local query head `j` is global head
        `first + j` (as `varlen.mods.Mods.for_heads` for the user functions)."""
        return self if first == self.head_offset else replace(self, head_offset=int(first))

    @property
    def threshold(self) -> int:
        return threshold_of(self.p)

    @property
    def scale(self) -> float:
        return 1.0 / (1.0 - self.p)

    @property
    def key0(self) -> int:
        return self.seed & _MASK32

    @property
    def key1(self) -> int:
        """The second key word before the sequence is mixed in."""
        return self.seed >> 32

    def keep(self, b, h, q, k):
        """Bool array (the broadcast shape of the int arrays `b, h, q, k`): which pairs are
        kept. Positions are inside the sequence (under context parallelism, the document);
        `h` is the kernel call's local head (global head `head_offset + h`)."""
        return keep_bits(self, b, h, q, k)


def keep_bits(d: Dropout, b, h, q, k):
    """`d.keep(b, h, q, k)`: the rule of the module docstring, vectorised."""
    b, h, q, k = (np.asarray(x, dtype=np.int64) for x in (b, h, q, k))
    key1 = (np.uint64(d.key1) ^ ((b.astype(np.uint64) * np.uint64(SEQ_MIX)) &
                                 np.uint64(_MASK32)))
    words = philox4x32_10((k >> 2).astype(np.uint64), q.astype(np.uint64),
                          (h + d.head_offset).astype(np.uint64), np.uint64(d.offset),
                          np.uint64(d.key0), key1)
    lane = k & 3
    word = np.where(lane == 0, words[0], np.where(lane == 1, words[1],
                                                  np.where(lane == 2, words[2], words[3])))
    return word >= np.uint32(d.threshold)


def _check_p(dropout_p) -> float:
    if isinstance(dropout_p, (bool, np.bool_)) or not isinstance(dropout_p, numbers.Real):
        raise TypeError(f"dropout_p must be a float in [0, 1), got {dropout_p!r}")
    p = float(dropout_p)
    if not 0.0 <= p < 1.0:                  # NaN too (no math.isnan: torch.compile traces this)
        raise ValueError(f"dropout_p must be in [0, 1) (the probability of dropping a pair), "
                         f"got {dropout_p!r}")
    return p


def check_seed(seed, name: str = "seed") -> int:
    """`seed` as a Python int in [0, 2^64) (TypeError / ValueError naming `name`)."""
    if isinstance(seed, (bool, np.bool_)) or not isinstance(seed, numbers.Integral):
        raise TypeError(f"{name} must be an int in [0, 2**64), got {seed!r}")
    s = int(seed)
    if not 0 <= s < 2 ** 64:
        raise ValueError(f"{name} must be an int in [0, 2**64), got {seed!r}")
    return s


def check_offset(offset) -> int:
    if isinstance(offset, (bool, np.bool_)) or not isinstance(offset, numbers.Integral):
        raise TypeError(f"offset must be an int in [0, 2**32), got {offset!r}")
    o = int(offset)
    if not 0 <= o < 2 ** 32:
        raise ValueError(f"offset must be an int in [0, 2**32), got {offset!r}")
    return o


def check_dropout(dropout_p=0.0, seed=None, offset=0) -> tuple:
    """`(p, seed, offset)` checked (TypeError / ValueError naming the argument); a None seed
    stays None."""
    p = _check_p(dropout_p)
    offset = check_offset(offset)
    return p, (None if seed is None else check_seed(seed)), offset


def make_dropout(dropout_p=0.0, seed=None, offset=0) -> Dropout | None:
    """The checked `Dropout` of a call's `dropout_p`, `seed` and `offset`; None when
    `dropout_p == 0` (the path without dropout, bit for bit). A `dropout_p > 0` needs a seed:
    the keep set is a function of it, so forward and backward (and every backend) agree."""
    p, seed, offset = check_dropout(dropout_p, seed, offset)
    if p == 0.0:
        return None
    if seed is None:
        raise ValueError(f"seed is required with dropout_p={dropout_p!r}: an int in [0, 2**64) "
                         f"that, with offset, fixes which pairs are dropped (the backward "
                         f"draws the same ones)")
    return Dropout(p, seed, offset)
