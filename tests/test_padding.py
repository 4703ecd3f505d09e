"""Padding helpers of `varlen.torch`: `unpad_input` / `pad_input` (FlashAttention's
`bert_padding` contract) and `cu_seqlens_from_position_ids` (batches packed by transformers'
`DataCollatorWithFlattening`)."""
import pytest

torch = pytest.importorskip("torch")

import varlen.torch as vt  # noqa: E402


def masks(S=9, seed=0):
    """Right padding, left padding, an empty row, a full row and two rows with holes."""
    g = torch.Generator().manual_seed(seed)
    pos = torch.arange(S)
    return torch.stack([pos < 5, pos >= 3, pos < 0, pos >= 0,
                        *(torch.rand(2, S, generator=g) < 0.6)])


def bert_padding_unpad(x, mask):
    """FlashAttention's `unpad_input`, spelled with boolean indexing."""
    flat = mask.reshape(-1)
    lengths = mask.sum(-1, dtype=torch.int32)
    cu = torch.nn.functional.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0))
    return x.reshape(-1, *x.shape[2:])[flat], flat.nonzero().flatten(), cu, int(lengths.max())


@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.int64, torch.int32])
def test_unpad_input_matches_bert_padding(mask_dtype):
    mask = masks()
    x = torch.randn(*mask.shape, 3, 2)
    got = vt.unpad_input(x, mask.to(mask_dtype))
    want = bert_padding_unpad(x, mask)
    assert len(got) == 5
    assert torch.equal(got[0], want[0]), "unpadded rows"
    assert torch.equal(got[1], want[1]) and got[1].dtype == torch.int64, "indices"
    assert torch.equal(got[2], want[2]) and got[2].dtype == torch.int32, "cu_seqlens"
    assert got[3] == want[3] and isinstance(got[3], int), "max_seqlen"
    assert torch.equal(got[4], mask.sum(-1, dtype=torch.int32)), "seqused"


def test_unused_mask_is_packed_but_not_used():
    mask = masks()
    unused = torch.zeros_like(mask)
    unused[0, 5:7] = True                      # allocated right after sequence 0's tokens
    x = torch.randn(*mask.shape, 4)
    rows, indices, cu, max_seqlen, seqused = vt.unpad_input(x, mask, unused)
    want = bert_padding_unpad(x, mask | unused)
    assert torch.equal(rows, want[0]) and torch.equal(indices, want[1])
    assert torch.equal(cu, want[2]) and max_seqlen == want[3]
    assert torch.equal(seqused, mask.sum(-1, dtype=torch.int32))


def test_pad_input_inverts_unpad_input_with_gradients():
    mask = masks(S=7, seed=1)
    x = torch.randn(*mask.shape, 5, requires_grad=True)
    rows, indices, *_ = vt.unpad_input(x, mask)
    back = vt.pad_input(rows * 2, indices, *mask.shape)
    assert back.shape == x.shape
    assert torch.equal(back, torch.where(mask[..., None], x * 2, 0)), "pad rows must be 0"
    back.sum().backward()
    assert torch.equal(x.grad, mask[..., None].expand_as(x) * 2.0)


def test_empty_batch_and_empty_rows():
    x = torch.randn(0, 4, 3)
    rows, indices, cu, max_seqlen, seqused = vt.unpad_input(x, torch.ones(0, 4, dtype=torch.bool))
    assert rows.shape == (0, 3) and indices.shape == (0,) and cu.tolist() == [0]
    assert max_seqlen == 0 and seqused.shape == (0,)
    rows, indices, cu, max_seqlen, _ = vt.unpad_input(torch.randn(2, 4, 3),
                                                      torch.zeros(2, 4, dtype=torch.bool))
    assert rows.shape == (0, 3) and cu.tolist() == [0, 0, 0] and max_seqlen == 0
    assert torch.equal(vt.pad_input(rows, indices, 2, 4), torch.zeros(2, 4, 3))


def test_unpad_input_names_bad_shapes():
    with pytest.raises(ValueError, match="attention_mask must be a 2-D"):
        vt.unpad_input(torch.randn(2, 4, 3), torch.ones(2, 4, 1))
    with pytest.raises(ValueError, match=r"hidden_states.shape=.*\(2, 5\)"):
        vt.unpad_input(torch.randn(2, 4, 3), torch.ones(2, 5))


# --------------------------------------------------------------------------------------------
# cu_seqlens from position ids
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("position_ids,boundaries", [
    ([[0, 1, 2, 0, 1, 0, 1, 2, 3]], [0, 3, 5, 9]),
    ([0, 0, 0, 1], [0, 1, 2, 4]),                                      # 1-D, length-1 documents
    ([[0, 1, 2, 3], [0, 1, 0, 1]], [0, 4, 6, 8]),                      # documents never cross rows
    ([[7, 8, 0, 1], [4, 5, 6, 7]], [0, 2, 4, 8]),                      # a row starts a document
])
def test_cu_seqlens_from_position_ids(position_ids, boundaries):
    pos = torch.tensor(position_ids)
    cu = vt.cu_seqlens_from_position_ids(pos)
    T = pos.numel()
    assert cu.dtype == torch.int32 and cu.shape == (T + 1,), "size follows the shape only"
    assert cu.tolist() == boundaries + [T] * (T + 1 - len(boundaries))


def test_data_collator_with_flattening():
    transformers = pytest.importorskip("transformers")
    collator = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=True)
    features = [{"input_ids": list(range(n))} for n in (5, 1, 3, 8, 2)]
    batch = collator(features)
    cu = vt.cu_seqlens_from_position_ids(batch["position_ids"])
    n = len(features)
    assert cu[:n + 1].tolist() == batch["cu_seq_lens_q"].tolist()
    assert (cu[n + 1:] == batch["position_ids"].numel()).all()


def test_trailing_empty_sequences_change_nothing():
    """The fixed-size cu_seqlens gives what the compact one gives."""
    g = torch.Generator().manual_seed(3)
    pos = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 0, 1, 2, 3]])
    q, k, v = (torch.randn(11, 2, 8, generator=g, dtype=torch.float64) for _ in range(3))
    cu = vt.cu_seqlens_from_position_ids(pos)
    full = vt.flash_attn_varlen_func(q, k, v, cu, cu, 11, 11, causal=True)
    compact = torch.tensor([0, 5, 7, 11], dtype=torch.int32)
    torch.testing.assert_close(full, vt.flash_attn_varlen_func(q, k, v, compact, compact, 5, 5,
                                                               causal=True), rtol=0, atol=0)


def test_cu_seqlens_from_position_ids_names_bad_input():
    with pytest.raises(ValueError, match="position_ids must be"):
        vt.cu_seqlens_from_position_ids(torch.zeros(1, 2, 3, dtype=torch.long))
    with pytest.raises(TypeError, match="must hold integers"):
        vt.cu_seqlens_from_position_ids(torch.zeros(2, 3))


# --------------------------------------------------------------------------------------------
# No host reads: on the meta device a function that reads a value fails
# --------------------------------------------------------------------------------------------

def test_only_unpad_input_reads_values():
    meta = dict(device="meta")
    cu = vt.cu_seqlens_from_position_ids(torch.empty(3, 16, dtype=torch.long, **meta))
    assert cu.shape == (49,)
    out = vt.pad_input(torch.empty(20, 4, **meta), torch.empty(20, dtype=torch.long, **meta),
                       3, 16)
    assert out.shape == (3, 16, 4)
    with pytest.raises(NotImplementedError):      # the row count is the output's shape
        vt.unpad_input(torch.empty(3, 16, 4, **meta), torch.empty(3, 16, dtype=torch.bool,
                                                                   **meta))
