"""Fixed-size binary records (sbpflow/comm/records.py): the runtime's req / ack messages travel
as one struct inside the authenticated frame, come back as exactly the tuple sent, and a
record frame that is malformed, truncated or out of range is refused like any bad frame."""

import struct
from types import SimpleNamespace

import pytest
import torch

from sbpflow.comm import records
from sbpflow.comm.wire import PREFIX, RECORD, FrameReader, encode, parse_frame
from sbpflow.errors import PlanError, WireError
from sbpflow.runtime import ActorSpec, Input, Plan
from sbpflow.runtime.messaging import RunMessages


def _frame(msg, channel="c"):
    return b"".join(bytes(p) for p in encode(5, channel, msg))


def _flags_and_body(frame):
    after, body_n, src, chan_n, n_buf = PREFIX.unpack_from(frame)
    return n_buf, body_n


@pytest.mark.parametrize("msg", [("req", 3, 2 ** 62, 0, 1, 17, 17), ("req", 3, 7, 0, 1, 2, None),
                                 ("ack", 3, 99, 0, 1, 1, 77, 0), ("ack", -(2 ** 63)),
                                 ("req",) + (1,) * 8])
def test_a_req_or_ack_of_ints_is_one_fixed_size_record(msg):
    frame = _frame(msg)
    assert _flags_and_body(frame) == (RECORD, records.HEAD.size)
    assert parse_frame(frame) == (5, "c", msg)


@pytest.mark.parametrize("value", [True, 2.5, "x", (1, 2)])
def test_a_trailing_value_that_is_no_int64_is_pickled_after_the_record(value):
    msg = ("req", 1, 2, 0, 1, 5, value)
    n_buf, body_n = _flags_and_body(_frame(msg))
    assert n_buf == RECORD and body_n > records.HEAD.size
    back = parse_frame(_frame(msg))[2]
    assert back == msg and type(back[-1]) is type(value)


def test_a_req_value_of_tensors_follows_the_record_and_round_trips():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 4, generator=g)
    msg = ("req", 1, 2, 0, 1, 5, {"x": x, "k": (1, 2.5)})
    parts = encode(5, "c", msg)
    n_buf, body_n = _flags_and_body(parts[0])
    assert n_buf == RECORD | 1 and body_n > records.HEAD.size
    _, _, back = parse_frame(b"".join(bytes(p) for p in parts))
    assert back[:6] == msg[:6] and back[6]["k"] == (1, 2.5) and torch.equal(back[6]["x"], x)


@pytest.mark.parametrize("msg", [("req", 1, "fwd", 0, 1, 2, None), ("req", 1.0, 2),
                                 ("req", True, 2), ("req", 2 ** 63, 1), ("ack",),
                                 ("start", 1, None), ("req",) + (1,) * 10,
                                 ("req", 1, 2, None, None), ["req", 1]])
def test_what_is_no_record_goes_as_a_restricted_body_and_comes_back_the_same(msg):
    frame = _frame(msg)
    assert _flags_and_body(frame)[0] == 0
    back = parse_frame(frame)[2]
    assert back == msg and [type(v) for v in back] == [type(v) for v in msg]


def _record_frame(body, flags=RECORD, channel=b"c"):
    return PREFIX.pack(len(channel) + len(body), len(body), 0, len(channel), flags) + channel + body


_GOOD = records.HEAD.pack(1, 2, records.ABSENT, 7, 8, *([0] * 6))


@pytest.mark.parametrize("body, why", [
    (records.HEAD.pack(3, 2, 0, 7, 8, *([0] * 6)), "tag code 3"),
    (records.HEAD.pack(0, 2, 0, 7, 8, *([0] * 6)), "tag code 0"),
    (records.HEAD.pack(1, 0, 0, *([0] * 8)), "0 ints"),
    (records.HEAD.pack(1, 9, 0, *([0] * 8)), "9 ints"),
    (records.HEAD.pack(1, 2, 0, 7, 8, 1, *([0] * 5)), "past them zero"),
    (records.HEAD.pack(1, 2, 5, 7, 8, *([0] * 6)), "value kind 5"),
    (_GOOD + b"x", "value kind 0"),  # a fixed-size record with a byte more
    (records.HEAD.pack(1, 2, records.NONE, 7, 8, *([0] * 6)) + b"\x80", "value kind 1"),
    (records.HEAD.pack(1, 2, records.PICKLED, 7, 8, *([0] * 6)), "value kind 2"),  # no value
    (_GOOD[:-1], "shorter than"),  # truncated inside the frame's own sizes
    (b"", "shorter than"),
])
def test_a_malformed_record_is_refused_and_nothing_after_it_is_read(body, why):
    good = _frame(("ack", 1, 2))
    reader = FrameReader()
    got = reader.feed(good + _record_frame(body) + good)
    assert got == [(5, "c", ("ack", 1, 2))]
    assert isinstance(reader.error, WireError) and why in str(reader.error)
    assert reader.feed(good) == []  # out of step: the connection is dropped


def test_a_record_whose_value_names_a_global_runs_nothing():
    evil = b"\x80\x05cos\nsystem\n(S'true'\ntR."
    body = records.HEAD.pack(1, 2, records.PICKLED, 7, 8, *([0] * 6)) + evil
    with pytest.raises(WireError, match="os.system"):
        parse_frame(_record_frame(body))


def test_a_truncated_or_oversized_record_frame_is_refused():
    frame = _frame(("req", 1, 2, 0, 1, 2, 3))
    for cut in (1, len(PREFIX.pack(0, 0, 0, 0, 0)) + 3, len(frame) - 1):
        with pytest.raises(WireError, match="not one whole frame"):
            parse_frame(frame[:cut])
    after, body_n, src, chan_n, _ = PREFIX.unpack_from(frame)
    lying = PREFIX.pack(after, body_n + 8, src, chan_n, RECORD) + frame[PREFIX.size:]
    with pytest.raises(WireError, match="sizes do not add up"):
        parse_frame(lying)
    inflated = PREFIX.pack(after, body_n, src, chan_n, RECORD | 2) + frame[PREFIX.size:]
    with pytest.raises(WireError):
        parse_frame(inflated)


def _plan(order):
    specs = {0: [ActorSpec("p", "load", lambda mb: mb), ActorSpec("q", "load", lambda mb: mb)],
             1: [ActorSpec("c", "compute", lambda mb, x: x, inputs=[Input("p", rank=0)])]}
    return Plan({r: specs[r][::order] for r in specs}, name="ids")


def test_actor_ids_are_the_names_digests_whatever_the_specs_order():
    ids, names = _plan(1).actor_ids()
    assert ids == _plan(-1).actor_ids()[0] and len(set(ids.values())) == 3
    assert all(0 <= n < 2 ** 63 and names[n] == a for a, n in ids.items())


def test_a_message_naming_an_actor_the_plan_lacks_is_a_plan_error():
    plan = _plan(1)
    ids, names = plan.actor_ids()
    run = SimpleNamespace(names=names, ids=ids, rank=1, rt=SimpleNamespace(plan=plan))
    req = ("req", 4, "c", 0, 1, 2, None)
    ack = ("ack", 4, "p", 0, 1, (1, "c", 0))
    for msg in (req, ack):
        small = RunMessages._compact(run, msg)
        assert all(type(v) is int for v in small[1:6])
        assert parse_frame(_frame(small))[2] == small
        assert RunMessages._expand(run, small) == msg
    with pytest.raises(PlanError, match="plan 'ids' does not have"):
        RunMessages._expand(run, ("req", 4, 12345, 0, 1, 2, None))
    with pytest.raises(PlanError, match="plan 'ids' does not have"):
        RunMessages._expand(run, ("ack", 4, ids["p"], 0, 1, 1, 999, 0))
