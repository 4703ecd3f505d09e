"""The toy data of the training examples (train_cp_torch.py, train_cp_jax.py): one packed batch
of documents per step whose tokens are mostly their predecessor plus one, a structure a tiny
model learns in a few steps."""
import numpy as np

LENGTHS = (13, 29, 1, 20, 7)          # documents of one packed batch (70 rows: not 4k)


def packed_batch(step: int, vocab: int, ignore: int):
    """cu_seqlens (int32), tokens, next-token targets (`ignore`: none) and in-document positions
    (int64) of the batch of `step`."""
    rng = np.random.default_rng(step)
    cu = np.concatenate([[0], np.cumsum(LENGTHS)]).astype(np.int32)
    tokens = rng.integers(0, vocab, cu[-1])
    for b in range(len(LENGTHS)):
        for i in range(cu[b] + 1, cu[b + 1]):
            if rng.random() < 0.8:
                tokens[i] = (tokens[i - 1] + 1) % vocab
    targets = np.full_like(tokens, ignore)
    positions = np.zeros_like(tokens)
    for b in range(len(LENGTHS)):
        targets[cu[b]:cu[b + 1] - 1] = tokens[cu[b] + 1:cu[b + 1]]
        positions[cu[b]:cu[b + 1]] = np.arange(LENGTHS[b])
    return cu, tokens, targets, positions
