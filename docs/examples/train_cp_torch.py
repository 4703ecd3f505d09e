"""A tiny transformer trained on packed documents with context parallelism (PyTorch).

    torchrun --nproc-per-node 2 docs/examples/train_cp_torch.py        # CP=2, gloo on a CPU
    torchrun --nproc-per-node 1 docs/examples/train_cp_torch.py        # CP=1

Every rank holds its zigzag shard of the packed rows (tokens, targets, positions); everything
but attention is per token, so only `varlen.torch.context_parallel_attention` talks to the other
ranks. The loss is the mean over all ranks' tokens: each rank backpropagates its share, and
the parameter gradients are summed over the group (all ranks hold the same parameters).

Rank 0 then trains the same model without context parallelism (`varlen.torch.varlen_attention`
on the whole batch) and checks that the per-step losses agree to float32 rounding; the
script exits with status 1 if they do not. The toy data: packed_documents.py, beside it.
"""
from __future__ import annotations

import os
import sys

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

import packed_documents
import varlen
import varlen.comm as vc
import varlen.torch as vt
from packed_documents import LENGTHS

VOCAB, DIM, HEADS, KV_HEADS, LAYERS, STEPS = 32, 32, 4, 2, 2, 5
MASK = varlen.Mask(window_left=np.array([-1, 8, -1, -1, 4], np.int32), window_right=0)


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm1, self.norm2 = torch.nn.LayerNorm(DIM), torch.nn.LayerNorm(DIM)
        self.q = torch.nn.Linear(DIM, DIM, bias=False)
        self.kv = torch.nn.Linear(DIM, 2 * KV_HEADS * DIM // HEADS, bias=False)
        self.o = torch.nn.Linear(DIM, DIM, bias=False)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(DIM, 4 * DIM), torch.nn.GELU(),
                                       torch.nn.Linear(4 * DIM, DIM))

    def forward(self, x, attend):
        T, d = x.shape[0], DIM // HEADS
        h = self.norm1(x)
        q = self.q(h).view(T, HEADS, d)
        k, v = self.kv(h).view(T, 2, KV_HEADS, d).unbind(1)
        x = x + self.o(attend(q, k, v).reshape(T, DIM))
        return x + self.mlp(self.norm2(x))


class TinyLM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.tok = torch.nn.Embedding(VOCAB, DIM)
        self.pos = torch.nn.Embedding(max(LENGTHS), DIM)
        self.blocks = torch.nn.ModuleList(Block() for _ in range(LAYERS))
        self.head = torch.nn.Linear(DIM, VOCAB)

    def forward(self, tokens, positions, attend):
        x = self.tok(tokens) + self.pos(positions)
        for block in self.blocks:
            x = block(x, attend)
        return self.head(x)


def packed_batch(step: int):
    """cu_seqlens, tokens, next-token targets (-100: none) and in-document positions."""
    cu, *rows = packed_documents.packed_batch(step, VOCAB, ignore=-100)
    return (cu, *map(torch.from_numpy, rows))


def make_model():
    torch.manual_seed(0)
    model = TinyLM()
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def train_cp(rank: int, cp: int) -> list:
    """STEPS steps with context parallelism over the default torch.distributed group."""
    model, opt = make_model()
    losses = []
    for step in range(STEPS):
        cu, tokens, targets, positions = packed_batch(step)
        part = vc.partition(cu, cp)                      # once per batch: plans cached on it
        tok_r, pos_r = part.shard(tokens, rank), part.shard(positions, rank)
        tgt_r = part.shard(targets, rank, fill=-100)     # pad rows of the shard: no target
        n_targets = int((targets != -100).sum())

        def attend(q, k, v):
            return vt.context_parallel_attention(q, k, v, part, mask=MASK, method="ring")
        logits = model(tok_r, pos_r, attend)
        loss = F.cross_entropy(logits, tgt_r, ignore_index=-100, reduction="sum") / n_targets
        opt.zero_grad()
        loss.backward()
        for p in model.parameters():                     # the same parameters on every rank
            dist.all_reduce(p.grad)
        opt.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item())
    return losses


def train_single() -> list:
    """The same training without context parallelism."""
    model, opt = make_model()
    losses = []
    for step in range(STEPS):
        cu, tokens, targets, positions = packed_batch(step)
        cu_t = torch.from_numpy(cu)

        def attend(q, k, v):
            return vt.varlen_attention(q, k, v, cu_t, cu_t, mask=MASK)
        logits = model(tokens, positions, attend)
        loss = F.cross_entropy(logits, targets, ignore_index=-100)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def main() -> int:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, cp = dist.get_rank(), dist.get_world_size()
    try:
        losses = train_cp(rank, cp)
    finally:
        dist.destroy_process_group()
    if rank != 0:
        return 0
    single = train_single()
    for step, (a, b) in enumerate(zip(losses, single)):
        print(f"step {step}: loss CP={cp} {a:.6f}  CP=1 {b:.6f}")
    worst = max(abs(a - b) / abs(b) for a, b in zip(losses, single))
    print(f"max relative difference {worst:.2e}")
    return 0 if worst < 1e-4 else 1


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
