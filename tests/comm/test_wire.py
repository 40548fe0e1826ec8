"""The wire format of message channels (sbpflow/comm/wire.py): typed frames, tensors as raw
bytes, and a decoder that runs no code from the wire (docs/runtime.md 'What the transport
trusts')."""

import os
import pickle
import struct

import pytest
import torch

from sbpflow.comm.wire import FrameReader, encode, parse_frame
from sbpflow.errors import WireError


def _round_trip(obj):
    src, channel, back = parse_frame(b"".join(encode(3, "ch", obj)))
    assert (src, channel) == (3, "ch")
    return back


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16,
                                   torch.int64, torch.int8, torch.uint8, torch.bool,
                                   torch.complex64])
def test_a_plain_tensor_round_trips_bit_for_bit(dtype):
    g = torch.Generator().manual_seed(0)
    base = torch.randn(3, 5, generator=g, dtype=torch.float64) * 7
    t = base.to(dtype) if dtype != torch.complex64 else torch.complex(base.float(), -base.float())
    parts = encode(0, "c", t)
    assert len(parts) == 3 and bytes(parts[2]) == t.reshape(-1).view(torch.uint8).numpy().tobytes()
    back = _round_trip(t)
    assert back.dtype == t.dtype and back.shape == t.shape
    assert torch.equal(back.reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8))
    assert back.untyped_storage().data_ptr() != t.untyped_storage().data_ptr()


def test_odd_shapes_views_and_autograd_tensors_keep_their_values_and_flags():
    g = torch.Generator().manual_seed(1)
    full = torch.randn(4, 6, generator=g)
    cases = {"0-d": torch.tensor(2.5), "empty": torch.empty(0, 3),
             "transposed": full.t(), "strided slice": full[:, ::2],
             "offset view": full[1:3, 2:], "conj": torch.randn(3, generator=g,
                                                            dtype=torch.cfloat).conj()}
    msg = {"nested": [cases, ("tag", 7)]}
    back = _round_trip(msg)
    assert back["nested"][1] == ("tag", 7)
    for name, t in cases.items():
        b = back["nested"][0][name]
        assert b.shape == t.shape and b.dtype == t.dtype, name
        assert torch.equal(b.resolve_conj(), t.resolve_conj()), name
    leaf = torch.randn(3, generator=g).requires_grad_()
    b = _round_trip(leaf)
    assert b.requires_grad and torch.equal(b.detach(), leaf.detach())   
