"""Byte-level primitives: digests and whole-storage swaps."""

import pytest
import torch

from lightning_replay.state import _word_digest, digest, storage_bytes, swap_


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.uint8])
def test_digest_sees_every_single_bit_flip_and_word_swap(dtype):
    torch.manual_seed(0)
    t = (torch.randn(37) * 100).to(dtype)
    base = digest(t)
    assert digest(t.clone()) == base
    raw = t.clone().view(torch.uint8)
    for byte in (0, 7, raw.numel() // 2, raw.numel() - 1):
        for bit in (0, 3, 7):
            u = raw.clone()
            u[byte] ^= 1 << bit
            assert digest(u.view(dtype)) != base, (byte, bit)
    swapped = t.clone()
    swapped[[0, 1]] = swapped[[1, 0]]
    if not torch.equal(swapped, t):
        assert digest(swapped) != base
    # non-contiguous input: the digest of its values, as if contiguous
    assert digest(t[::2]) == digest(t[::2].contiguous())
    assert digest(torch.zeros(0, dtype=dtype)) == 0


@pytest.mark.parametrize("chunk", [1, 3, 1 << 22])
def test_device_digest_is_chunking_invariant_and_bit_sensitive(chunk):
    # The accelerator path, run on CPU tensors: chunks must not change the value.
    torch.manual_seed(1)
    b = torch.randint(0, 256, (101,), dtype=torch.uint8)  # not a multiple of 8: padded
    ref = _word_digest(b, chunk=1 << 22)
    assert _word_digest(b, chunk=chunk) == ref
    for i in (0, 50, 100):
        u = b.clone()
        u[i] ^= 0x10
        assert _word_digest(u, chunk=chunk) != ref
    # the padding is not confused with real zero bytes
    assert _word_digest(torch.cat([b, b.new_zeros(3)]), chunk) != ref


def test_swap_exchanges_storage_bytes_in_place():
    a = torch.arange(10.0)
    b = -torch.arange(10.0)
    a0, b0 = a.clone(), b.clone()
    swap_(storage_bytes(a), storage_bytes(b))
    assert torch.equal(a, b0) and torch.equal(b, a0)


def test_device_digests_read_back_once_for_many_tensors(monkeypatch):
    """On an accelerator a checked step's digests cost one host sync per device, not one per
    tensor (CPU stands in for the device here: its word-sum path is the device code)."""
    from lightning_replay import state as st

    tensors = [torch.randn(n) for n in (3, 17, 1024)] + [torch.arange(5, dtype=torch.int8)]
    monkeypatch.setattr(st, "_on_host", lambda b: False)
    reads = []
    real_tolist = torch.Tensor.tolist

    def counting_tolist(self):
        reads.append(tuple(self.shape))
        return real_tolist(self)

    monkeypatch.setattr(torch.Tensor, "tolist", counting_tolist)
    batched = st.digests(tensors)
    assert reads == [(4, 3)]
    one_by_one = [st._word_digest(t.contiguous().view(-1).view(torch.uint8)) for t in tensors]
    assert batched == one_by_one
    flipped = tensors[1].clone()
    flipped.view(torch.int32)[5] ^= 1
    assert st.digests([flipped])[0] != batched[1]


def test_a_digested_tensor_can_still_be_resized():
    """A checked step digests the state; a queue grown with ``resize_`` afterwards must still
    grow (``Tensor.numpy()`` would have marked its storage non-resizable)."""
    from lightning_replay.state import digest, digests

    q = torch.randn(4, 8)
    before = digest(q)
    digests([q])
    q.resize_(6, 8)
    assert q.shape == (6, 8) and digest(q[:4].contiguous()) == before
