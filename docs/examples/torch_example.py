"""varlen in PyTorch: a packed batch, a different mask per sequence, autograd, torch.compile,
a plan reused across layers.

    python docs/examples/torch_example.py            # CPU (NumPy backend), or CUDA if present

Three sequences of lengths 5, 1 and 7 are packed into one `[13, H, D]` tensor; the first and the
last are causal (decoder), the middle one bidirectional (encoder), all in one call.
"""
import torch

import varlen
import varlen.torch


def attention_block(q, k, v, cu_seqlens, is_causal):
    """One attention call over the packed batch, with a per-sequence causal flag."""
    mask = varlen.Mask.causal_where(is_causal)         # window_right = 0 where causal, else -1
    return varlen.torch.varlen_attention(q, k, v, cu_seqlens, cu_seqlens, mask=mask)


def main(compile_backend="inductor"):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    torch.manual_seed(0)
    lengths = [5, 1, 7]
    T, Hq, Hk, D = sum(lengths), 4, 2, 16                # GQA: 2 query heads per key head
    cu_seqlens = torch.tensor([0, 5, 6, 13], dtype=torch.int32, device=device)
    is_causal = torch.tensor([True, False, True], device=device)
    q = torch.randn(T, Hq, D, device=device, dtype=dtype, requires_grad=True)
    k = torch.randn(T, Hk, D, device=device, dtype=dtype, requires_grad=True)
    v = torch.randn(T, Hk, D, device=device, dtype=dtype, requires_grad=True)

    # Eager: forward, backward through the custom op's registered autograd.
    out = attention_block(q, k, v, cu_seqlens, is_causal)
    out.float().square().sum().backward()
    grads = [x.grad.clone() for x in (q, k, v)]

    # The op has a fake implementation, so the whole function compiles as one graph.
    compiled = torch.compile(attention_block, fullgraph=True, backend=compile_backend)
    for x in (q, k, v):
        x.grad = None
    out_c = compiled(q, k, v, cu_seqlens, is_causal)
    out_c.float().square().sum().backward()

    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(out_c, out, atol=tol, rtol=tol)
    for g, x in zip(grads, (q, k, v)):
        torch.testing.assert_close(x.grad, g, atol=tol, rtol=tol)

    # A plan built once per batch and reused by every layer (on the data's device; no host
    # read when num_rows_* are given). Under torch.compile, pass the same Plan object each step.
    plan = varlen.plan(cu_seqlens, cu_seqlens, mask=varlen.Mask.causal_where(is_causal),
                       num_rows_q=T, num_rows_k=T)
    for _layer in range(2):
        out_p = varlen.torch.varlen_attention(q, k, v, cu_seqlens, cu_seqlens, plan=plan,
                                              mask=varlen.Mask.causal_where(is_causal))
        torch.testing.assert_close(out_p, out, atol=0, rtol=0)

    # The log-sum-exp, e.g. to merge partial results; it carries no gradient.
    _, lse = varlen.torch.varlen_attention(q, k, v, cu_seqlens, cu_seqlens, mask="causal",
                                           return_lse=True)
    print(f"device={device} out {tuple(out.shape)} {out.dtype}, lse {tuple(lse.shape)} "
          f"{lse.dtype}; eager and torch.compile({compile_backend}) agree")


if __name__ == "__main__":
    main()
