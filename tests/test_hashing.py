"""The prefix cache's hash chain and token arrays (hybridkv.blockmgr.hashing)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridkv.blockmgr import kernels
from hybridkv.blockmgr.hashing import (
    ROOT_KEY,
    TokenArray,
    as_token_array,
    block_hashes,
    chain_key,
    chain_keys,
    chain_keys_array,
    keys_from_hashes,
)

MASK = (1 << 64) - 1
C = 0x9E3779B97F4A7C15


def sequential_keys(tokens: list[int], bs: int) -> list[int]:
    """The documented rule, one block at a time in Python ints: K_j = C * K_{j-1} + h_j mod 2**64."""
    arr = np.array(tokens, dtype=np.int64)
    n = len(tokens) // bs
    h = block_hashes(arr[: n * bs].reshape(n, bs)).tolist() if n else []
    out, k = [], ROOT_KEY
    for x in h:
        k = (C * k + x) & MASK
        out.append(k - (1 << 64) if k >> 63 else k)
    return out


@settings(max_examples=200, deadline=None)
@given(
    tokens=st.lists(st.integers(-(2**63), 2**63 - 1), max_size=200),
    bs=st.sampled_from([1, 2, 3, 4, 16]),
    cut=st.integers(0, 60),
)
def test_chain_keys_follow_the_rule_in_one_piece_or_several(tokens, bs, cut):
    arr = as_token_array(tokens)
    want = sequential_keys(tokens, bs)
    assert chain_keys_array(arr, bs).tolist() == want == chain_keys(tokens, bs)
    n = len(tokens) // bs
    cut = min(cut, n)
    first = chain_keys_array(arr, bs, 0, cut).tolist()
    rest = chain_keys_array(arr, bs, cut, n, first[-1] if first else ROOT_KEY).tolist()
    assert first + rest == want  # registering a request in chunks gives the keys of the whole
    key = ROOT_KEY
    for j in range(n):  # the one-block path
        key = chain_key(arr[j * bs : (j + 1) * bs], key)
        assert key == want[j]


def test_keys_depend_on_every_token_and_its_position():
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 32000, 64 * 20)
    keys = chain_keys_array(tokens, 64)
    assert np.unique(keys).size == keys.size
    for i in (0, 63, 640, 64 * 20 - 1):
        changed = tokens.copy()
        changed[i] += 1
        other = chain_keys_array(changed, 64)
        j = i // 64
        assert (other[:j] == keys[:j]).all() and (other[j:] != keys[j:]).all()
    swapped = tokens.copy()
    swapped[[0, 1]] = swapped[[1, 0]]
    assert chain_keys_array(swapped, 64)[0] != keys[0] or tokens[0] == tokens[1]


def test_token_arrays_reject_what_is_not_an_integer_sequence():
    assert as_token_array([]).dtype == np.int64 and as_token_array([]).size == 0
    assert as_token_array(np.array([1, 2], dtype=np.int32)).dtype == np.int64
    assert as_token_array([np.int64(3), 4]).tolist() == [3, 4]
    a = np.array([5, 6], dtype=np.int64)
    assert as_token_array(a) is a  # no copy
    for bad in ([1.5, 2], ["a"], np.array([1.0]), [2**64]):
        with pytest.raises(TypeError):
            as_token_array(bad)
    with pytest.raises(ValueError):
        as_token_array(np.zeros((2, 2), dtype=np.int64))


def test_token_array_grows_in_place_and_copies_are_independent():
    t = TokenArray([1, 2, 3])
    for i in range(100):
        t.extend([i])
    assert len(t) == 103 and t.tolist()[:4] == [1, 2, 3, 0] and t[-1] == 99
    c = t.copy()
    c.extend([7])
    assert len(t) == 103 and len(c) == 104
    src = np.array([4, 5], dtype=np.int64)
    t2 = TokenArray(src)
    src[0] = 9
    assert t2.tolist() == [4, 5]  # the record owns its copy


def test_a_records_block_hashes_are_computed_once_and_equal_the_plain_ones():
    rng = np.random.default_rng(1)
    t = TokenArray(rng.integers(0, 1000, 37))
    assert t.block_hashes(2, 8).tolist() == block_hashes(t.view()[:16].reshape(2, 8)).tolist()
    for _ in range(5):
        t.extend(rng.integers(0, 1000, 7).tolist())
        n = len(t) // 8
        assert t.block_hashes(n, 8).tolist() == block_hashes(t.view()[: n * 8].reshape(n, 8)).tolist()
    assert t.block_hashes(3, 4).tolist() == block_hashes(t.view()[:12].reshape(3, 4)).tolist()  # another size
    c = t.copy()
    c.extend([1] * 8)
    n = len(c) // 8
    assert c.block_hashes(n, 8).tolist() == block_hashes(c.view()[: n * 8].reshape(n, 8)).tolist()


@pytest.mark.parametrize("n", [0, 1, 31, 32, 33, 5000])
def test_token_arrays_of_every_length_convert_exactly_and_reject_bad_ids(n):
    """Short sequences (array.array) and long ones (struct, splatted) give the same int64 arrays
    and the same errors, wherever the bad id sits."""
    ids = [(i * 7919) % 150_000 - (i % 3) for i in range(n)]
    want = np.array(ids, dtype=np.int64)
    for seq in (ids, tuple(ids), iter(ids), range(n), [np.int64(x) for x in ids], [bool(x % 2) for x in ids]):
        got = as_token_array(seq)
        assert got.dtype == np.int64 and got.ndim == 1
        if isinstance(seq, range):
            assert got.tolist() == list(range(n))
        elif n and isinstance(seq, list) and isinstance(seq[0], bool):
            assert got.tolist() == [int(x) for x in seq]
        else:
            assert np.array_equal(got, want)
    for bad in (1.5, "a", 2**63, -(2**63) - 1, None):
        for at in {0, n // 2, max(n - 1, 0)}:
            seq = ids[:at] + [bad] + ids[at:]
            with pytest.raises(TypeError):
                as_token_array(seq)
    assert as_token_array(ids + [2**63 - 1, -(2**63)])[-2:].tolist() == [2**63 - 1, -(2**63)]
    for text in ("a" * n, b"a" * n, bytearray(n)):
        with pytest.raises(TypeError):
            as_token_array(text)


def test_token_arrays_adopt_hashes_only_from_the_same_tokens():
    rng = np.random.default_rng(2)
    a = TokenArray(rng.integers(0, 1000, 40))
    a.block_hashes(5, 8)
    same, other = TokenArray(a.view().copy()), TokenArray(a.view().copy())
    other.extend([])  # (no change)
    other._buf[3] += 1  # one token differs
    assert same.same_as(a) and same.same_as(a.view()) and not other.same_as(a)
    same.adopt_hashes(a)
    other.adopt_hashes(a)
    assert same._hashes is a._hashes and other._hashes.size == 0
    assert other.block_hashes(5, 8).tolist() == block_hashes(other.view().reshape(5, 8)).tolist()
    shorter = TokenArray(a.view()[:32].copy())
    shorter.adopt_hashes(a)  # another length: not the same tokens
    assert shorter._hashes.size == 0


@pytest.mark.skipif(kernels.numba is None, reason="numba is not installed")
@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 9), bs=st.sampled_from([1, 4, 16, 64]), data=st.data())
def test_compiled_block_hashes_equal_numpys(rows, bs, data):
    """The compiled hash and the numpy one, bit for bit, on any int64 tokens (negative and huge
    ones too: both hash the uint64 bits)."""
    vals = data.draw(st.lists(st.integers(-(1 << 63), (1 << 63) - 1), min_size=rows * bs, max_size=rows * bs))
    blocks = np.array(vals, dtype=np.int64).reshape(rows, bs)
    got, was = {}, kernels.ENABLED
    for enabled in (False, True):
        kernels.ENABLED = enabled
        try:
            got[enabled] = block_hashes(blocks).tolist()
        finally:
            kernels.ENABLED = was
    assert got[True] == got[False]


@pytest.mark.skipif(kernels.numba is None, reason="numba is not installed")
@settings(max_examples=60, deadline=None)
@given(n=st.integers(0, 60), parent=st.integers(-(1 << 63), (1 << 63) - 1), seed=st.integers(0, 2**32 - 1))
def test_compiled_chain_keys_equal_the_python_and_numpy_ones(n, parent, seed):
    """Chain keys of n block hashes after a parent: the compiled recurrence, the Python one (up to
    24 blocks) and numpy's cumulative sum (more) give the same int64 keys."""
    h = np.random.default_rng(seed).integers(0, 2**64 - 1, n, dtype=np.uint64, endpoint=True)
    got, was = {}, kernels.ENABLED
    for enabled in (False, True):
        kernels.ENABLED = enabled
        try:
            got[enabled] = keys_from_hashes(h, parent).tolist()
        finally:
            kernels.ENABLED = was
    assert got[True] == got[False]
    key, want = parent & MASK, []
    for x in h.tolist():
        key = (0x9E3779B97F4A7C15 * key + x) & MASK
        want.append(key - (1 << 64) if key >> 63 else key)
    assert got[True] == want
