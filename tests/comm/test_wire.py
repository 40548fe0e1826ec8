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
    assert len(parts) == 2 and bytes(parts[1]) == t.reshape(-1).view(torch.uint8).numpy().tobytes()
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


def test_frames_cut_at_any_byte_arrive_whole_and_in_order():
    g = torch.Generator().manual_seed(2)
    msgs = [("req", 1, "fwd", 0, 1, 2, None), {"t": torch.randn(5, 3, generator=g), "k": [1, 2.5]},
            ("ack", "x" * 300), torch.arange(4), (torch.Size([2, 3]), torch.float16,
                                                  torch.device("cpu"), 1 + 2j, {1, 2})]
    stream = b"".join(b"".join(bytes(p) for p in encode(r, f"ch{r}", m))
                      for r, m in enumerate(msgs))
    for step in (1, 7, 64, len(stream)):
        reader, got = FrameReader(), []
        for i in range(0, len(stream), step):
            got += reader.feed(stream[i:i + step])
        assert reader.error is None and len(got) == len(msgs)
        for r, ((src, channel, back), want) in enumerate(zip(got, msgs)):
            assert (src, channel) == (r, f"ch{r}")
            if isinstance(want, dict):
                assert torch.equal(back["t"], want["t"]) and back["k"] == want["k"]
            elif isinstance(want, torch.Tensor):
                assert torch.equal(back, want)
            else:
                assert back == want


@pytest.mark.parametrize("planted", ["os.system", "builtins.eval", "torch.load",
                                     "sbpflow.comm.wire.encode", "collections.OrderedDict"])
def test_a_body_naming_any_other_global_is_refused_and_nothing_after_it_is_read(planted):
    module, name = planted.rsplit(".", 1)
    body = b"\x80\x05" + b"c" + module.encode() + b"\n" + name.encode() + b"\n" + b")R."
    head = struct.pack("!QIiHH", 1 + len(body), len(body), 0, 1, 0) + b"c"
    good = b"".join(encode(0, "c", "before"))
    reader = FrameReader()
    got = reader.feed(good + head + body + good)
    assert got == [(0, "c", "before")]
    assert isinstance(reader.error, WireError) and planted in str(reader.error)
    assert reader.feed(good) == []  # the connection is out of step: it is dropped


@pytest.mark.parametrize("frame", [b"\x00" * 20, struct.pack("!QIiHH", 4, 9, 0, 0, 0) + b"abcd",
                                   struct.pack("!QIiHH", 3, 1, 0, 2, 0) + b"\xff\xfe."])
def test_frames_whose_sizes_or_names_are_wrong_are_refused(frame):
    with pytest.raises(WireError):
        from sbpflow.comm.wire import parse_frame as parse
        parse(frame)


def test_a_tensor_record_whose_bytes_do_not_fill_its_shape_is_refused():
    first, data = encode(0, "c", torch.ones(4))
    assert bytes(data) == torch.ones(4).numpy().tobytes()
    after, body_n, src, chan_n, n_buf = struct.unpack_from("!QIiHH", first)
    body = first[struct.calcsize("!QIiHH") + 8 + chan_n:]
    assert (n_buf, len(body)) == (1, body_n)
    short = bytes(data)[:12]  # 3 floats for a shape of 4
    frame = struct.pack("!QIiHH", 8 + chan_n + body_n + 12, body_n, 0, chan_n, 1) + \
        struct.pack("!Q", 12) + b"c" + body + short
    with pytest.raises(WireError, match=r"shape \(4,\) and torch.float32 with 12 bytes"):
        parse_frame(frame)


@pytest.mark.parametrize("obj", [numpy_array := __import__("numpy").zeros(3), object(),
                                 print, Exception("x"), torch.ones(2).to_sparse()])
def test_the_encoder_refuses_what_a_message_never_holds(obj):
    with pytest.raises(WireError, match="message channel carries"):
        encode(0, "c", ("req", obj))
