"""The collate's cheap checks of well-formed batches still name the sample of a bad one, and
the timeout message's sample comes from the samples read so far."""

import enum
from collections import namedtuple

import pytest
import torch

import sbpflow as sf
from sbpflow.data.collate import read_samples, reading_index, stack_samples

Pair = namedtuple("Pair", "x y")


def test_structure_errors_name_the_sample():
    a, b = torch.zeros(2), torch.ones(2)
    with pytest.raises(sf.errors.DataLoaderError, match="sample 12 .* is a tuple of 3 but sample 10 "
                                                 "is a tuple of 2"):
        stack_samples([(a, 0), (b, 1), (a, 2, 3)], [10, 11, 12], "here")
    with pytest.raises(sf.errors.DataLoaderError, match="sample 11 .* is a list of 1 but sample 10 "
                                                 "is one value"):
        stack_samples([a, [b]], [10, 11], "here")


def test_namedtuple_and_list_items_stack_as_torch_does():
    samples = [Pair(torch.full((2,), float(i)), i) for i in range(3)] + [[torch.ones(2), 7]]
    form, (x, y) = stack_samples(samples, [0, 1, 2, 3], "here")
    ref = torch.utils.data.default_collate([tuple(s) for s in samples])
    assert form.kind is Pair  # the first sample's type, as default_collate
    assert torch.equal(x, ref[0]) and torch.equal(y, ref[1])


def test_reading_index_follows_the_reads():
    seen = []

    class Probe:
        def __getitem__(self, i):
            seen.append(reading_index(progress))
            if i == 9:
                raise KeyError(i)
            return i

    progress: dict = {"index": None}
    assert read_samples(Probe(), [5, 7, 8], "here", progress) == [5, 7, 8]
    assert seen == [5, 7, 8]
    with pytest.raises(sf.errors.DataLoaderError, match="reading sample 9 .here. failed: KeyError"):
        read_samples(Probe(), [4, 9, 6], "here", progress)
    assert reading_index(progress) == 9


@pytest.mark.parametrize("values", [[3, -2, 2**62], [0.5, -1e300, 3.0], [True, False, True]])
def test_numbers_stack_as_default_collate(values):
    """Python numbers of one type (stacked through numpy) give default_collate's values and
    dtypes (int64, float64, bool), one value or one element of a tuple."""
    _, (one,) = stack_samples(values, [0, 1, 2], "here")
    _, (x, n) = stack_samples([(torch.zeros(1), v) for v in values], [0, 1, 2], "here")
    ref = torch.utils.data.default_collate(values)
    for got in (one, n):
        assert got.dtype == ref.dtype and torch.equal(got, ref)


def test_an_int_beyond_int64_fails_as_in_torch():
    with pytest.raises(Exception) as ours:
        stack_samples([1, 2**64], [0, 1], "here")
    with pytest.raises(Exception) as torchs:
        torch.utils.data.default_collate([1, 2**64])
    assert type(ours.value) is type(torchs.value) and "Overflow" in str(ours.value)


def test_mixed_tuple_and_list_samples_still_checked():
    """A list sample after tuple ones of another length is named (the one-type fast path
    does not hide it)."""
    a = torch.zeros(2)
    with pytest.raises(sf.errors.DataLoaderError, match="sample 2 .* is a list of 3 but sample 0 "
                                                 "is a tuple of 2"):
        stack_samples([(a, 0), (a, 1), [a, 2, 3]], [0, 1, 2], "here")


class Color(enum.IntEnum):
    RED = 1
    BLUE = 7


def test_int_and_float_subclasses_stack_as_default_collate():
    """An IntEnum label (an int subclass) is int64, as torch's ``isinstance`` test makes it,
    alone or beside plain ints; a bool beside ints is still refused (a bool tensor is no
    int64 one)."""
    for values in ([Color.RED, Color.BLUE], [Color.BLUE, 3]):
        _, (got,) = stack_samples(values, [0, 1], "here")
        ref = torch.utils.data.default_collate(values)
        assert got.dtype == ref.dtype == torch.int64 and torch.equal(got, ref)
    with pytest.raises(sf.errors.DtypeMismatchError, match="sample 1 is torch.bool but sample 0 is "
                                                    "torch.int64"):
        stack_samples([3, True], [0, 1], "here")


def test_dicts_with_keys_in_another_order_stack_by_the_first():
    """Dict samples with the same keys in another order are collated by the first sample's
    keys, as torch does; a dict with other keys is still refused, naming it."""
    samples = [{"x": torch.zeros(2), "y": 1}, {"y": 2, "x": torch.ones(2)}]
    form, (x, y) = stack_samples(samples, [0, 1], "here")
    ref = torch.utils.data.default_collate(samples)
    assert form.keys == ("x", "y") and list(ref) == ["x", "y"]
    assert torch.equal(x, ref["x"]) and torch.equal(y, ref["y"])
    with pytest.raises(sf.errors.DataLoaderError, match=r"sample 1 .* is a dict with keys \['x', "
                                                 r"'z'\] but sample 0 is a dict"):
        stack_samples([samples[0], {"x": torch.ones(2), "z": 2}], [0, 1], "here")
