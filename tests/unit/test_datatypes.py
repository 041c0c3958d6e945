import numpy as np
import pytest

from aiworks.core.datatypes import (
    Tensor,
    bytes_offsets,
    datatype_of,
    decode,
    deserialize_bytes,
    encode,
    serialize_bytes,
    split_rows,
)
from aiworks.core.errors import InvalidArgument


@pytest.mark.parametrize(
    "dtype,datatype",
    [(np.float32, "FP32"), (np.float64, "FP64"), (np.int64, "INT64"), (np.int8, "INT8"), (np.uint16, "UINT16"),
     (np.float16, "FP16"), (np.bool_, "BOOL")],
)
def test_fixed_size_round_trip_is_a_view(dtype, datatype):
    array = (np.arange(12) % 2 == 0) if dtype is np.bool_ else np.arange(12).astype(dtype)
    array = array.reshape(3, 4)
    assert datatype_of(array) == datatype
    raw = encode(array, datatype)
    back = decode(raw, datatype, (3, 4))
    np.testing.assert_array_equal(back, array)
    assert not back.flags.owndata  # np.frombuffer: no copy


def test_bytes_round_trip_and_layout():
    array = np.array([b"a", "bé", b""], dtype=object)
    raw = serialize_bytes(array)
    assert raw[:4] == (1).to_bytes(4, "little")
    assert bytes_offsets(raw) == [0, 5, 12, 16]
    assert list(deserialize_bytes(raw, 3)) == [b"a", "bé".encode(), b""]


def test_size_mismatch_names_the_input():
    with pytest.raises(InvalidArgument, match="input 'x': 12 bytes of data, but shape \\[2, 2\\] of FP32 needs 16"):
        decode(b"\0" * 12, "FP32", (2, 2), name="x")


def test_truncated_bytes_element_is_rejected():
    raw = serialize_bytes(np.array([b"hello"], dtype=object))[:-1]
    with pytest.raises(InvalidArgument, match="runs past the end"):
        deserialize_bytes(raw, 1)


def test_split_rows_fixed_and_bytes():
    array = np.arange(10, dtype=np.float32).reshape(5, 2)
    pieces = split_rows(encode(array, "FP32"), "FP32", (5, 2), [2, 3])
    np.testing.assert_array_equal(np.frombuffer(pieces[0], np.float32), [0, 1, 2, 3])
    np.testing.assert_array_equal(np.frombuffer(pieces[1], np.float32), [4, 5, 6, 7, 8, 9])

    words = np.array([b"a", b"bb", b"ccc", b"dddd"], dtype=object).reshape(4, 1)
    pieces = split_rows(serialize_bytes(words), "BYTES", (4, 1), [1, 3])
    assert list(deserialize_bytes(pieces[0], 1)) == [b"a"]
    assert list(deserialize_bytes(pieces[1], 3)) == [b"bb", b"ccc", b"dddd"]


def test_split_rows_rejects_wrong_total():
    with pytest.raises(InvalidArgument):
        split_rows(b"\0" * 8, "FP32", (2,), [1, 2])


def test_tensor_from_numpy():
    t = Tensor.from_numpy("x", np.ones((2, 3), np.float32))
    assert (t.datatype, t.shape, len(t.raw)) == ("FP32", (2, 3), 24)
    np.testing.assert_array_equal(t.to_numpy(), np.ones((2, 3)))
