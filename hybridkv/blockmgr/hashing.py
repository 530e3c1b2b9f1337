"""Token arrays and the prefix cache's hash chain, computed for a whole request at once.

The chain key of block ``j`` (tokens ``[j * bs, (j + 1) * bs)``) is

    K_j = C * K_{j-1} + h(block j)   (mod 2**64),   K_{-1} = 0 (``ROOT_KEY``)

where ``h`` mixes every token with its position in the block and sums the results. The recurrence
is linear, so the keys of ``n`` blocks are one cumulative sum (``K_j = C**j * (C * K_{start-1} +
sum_k h_k * C**-k)``; ``C`` is odd, hence invertible mod 2**64): numpy over the token array, no
Python object per block. Keys are int64 (the uint64 bits). Equal keys are not trusted alone: the
cache compares a block's token ids on a hit.

Token ids are held as int64 arrays (:class:`TokenArray` grows one in place for sampled tokens).
"""

from __future__ import annotations

import array
import struct
from collections.abc import Iterator, Sequence

import numpy as np

from hybridkv.blockmgr import kernels
from hybridkv.blockmgr.kernels import _jit

ROOT_KEY = 0
_MASK = (1 << 64) - 1
_C = 0x9E3779B97F4A7C15  # odd: invertible mod 2**64
_C64 = np.uint64(_C)
_C_INV = pow(_C, -1, 1 << 64)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_S29 = np.uint64(29)
_SMALL = 24  # up to this many blocks, keys_from_hashes steps the recurrence in Python (faster than numpy's setup)


def as_token_array(token_ids: Sequence[int] | np.ndarray) -> np.ndarray:
    """``token_ids`` as a 1-D int64 array (no copy when it already is one).

    Raises ``TypeError`` for anything that is not a sequence of integers (floats, strings, a bool
    array) and ``ValueError`` for a multi-dimensional array. Python bools inside a list are read as
    0 / 1: refusing them would cost a type test per token (2.5x the conversion itself, on the prefix
    path of every admission), so the scheduler checks first (``Scheduler.add_request`` refuses
    bools before any work)."""
    if isinstance(token_ids, np.ndarray):
        arr = token_ids
    else:
        # one strict pass over the ints (floats, strings and ints out of int64's range raise and
        # are classified below); a long sequence is splatted into struct, which packs it straight
        # into a new array about 2.5x faster than array.array's or numpy's conversion of a list
        if isinstance(token_ids, (str, bytes, bytearray, memoryview)):  # text, or raw bytes: not token ids
            raise TypeError(f"token ids must be a sequence of integers, got {type(token_ids).__name__}")
        if not hasattr(token_ids, "__len__"):  # an iterator
            token_ids = list(token_ids)
        n = len(token_ids)
        try:
            if n < 32:
                return np.frombuffer(array.array("q", token_ids), dtype=np.int64)
            out = np.empty(n, dtype=np.int64)
            struct.pack_into(f"{n}q", out, 0, *token_ids)
            return out
        except (struct.error, OverflowError, TypeError):
            arr = np.asarray(token_ids)
    if arr.ndim != 1:
        raise ValueError(f"token ids must be one-dimensional, got shape {arr.shape}")
    if arr.dtype.kind not in "iu":
        if arr.size == 0:
            return np.empty(0, dtype=np.int64)
        raise TypeError(f"token ids must be integers, got dtype {arr.dtype}")
    if arr.dtype != np.int64:
        if arr.dtype == np.uint64 and arr.size and int(arr.max()) > np.iinfo(np.int64).max:
            raise TypeError("token ids must fit int64")
        arr = arr.astype(np.int64)
    return arr


class TokenArray:
    """A request's token ids: an int64 buffer grown by doubling (sampled tokens arrive one step at
    a time). ``view()`` is the filled part (a view: valid until the next ``extend``)."""

    __slots__ = ("_buf", "_n", "_hashes", "_hash_bs")

    def __init__(self, token_ids: Sequence[int] | np.ndarray) -> None:
        arr = as_token_array(token_ids)
        # a list was converted into a new array already (ours); the caller's array is copied (it may change)
        ours = arr is not token_ids and (arr.base is None or isinstance(arr.base, memoryview))
        self._buf = arr if ours and arr.flags.writeable else np.array(arr, dtype=np.int64, copy=True)
        self._n = arr.size
        self._hashes = np.empty(0, dtype=np.uint64)  # block hashes of the first full blocks (memo)
        self._hash_bs = 0

    def block_hashes(self, end: int, block_size: int) -> np.ndarray:
        """:func:`block_hashes` of full blocks ``[0, end)`` (``end * block_size <= len(self)``), each
        computed once: the blocks already hashed are kept (a request registers its blocks a few at a
        time; tokens never change once written)."""
        h = self._hashes
        if self._hash_bs != block_size:
            h, self._hash_bs = np.empty(0, dtype=np.uint64), block_size
        if h.size < end:
            full = self._n // block_size  # hash every full block present now, not only up to end
            more = block_hashes(self._buf[h.size * block_size : full * block_size].reshape(-1, block_size))
            h = np.concatenate((h, more))
        self._hashes = h
        return h[:end]

    def __len__(self) -> int:
        return self._n

    def view(self) -> np.ndarray:
        return self._buf[: self._n]

    def __getitem__(self, index: int | slice) -> np.ndarray | np.int64:
        return self.view()[index]

    def __iter__(self) -> Iterator[int]:
        return iter(self.view().tolist())

    def tolist(self) -> list[int]:
        return self.view().tolist()

    def extend(self, token_ids: Sequence[int] | np.ndarray) -> None:
        arr = as_token_array(token_ids)
        end = self._n + arr.size
        if end > self._buf.size:
            grown = np.empty(max(end, 2 * self._buf.size, 16), dtype=np.int64)
            grown[: self._n] = self._buf[: self._n]
            self._buf = grown
        self._buf[self._n : end] = arr
        self._n = end

    def same_as(self, other: TokenArray | np.ndarray) -> bool:
        """Whether ``other`` holds exactly these tokens (compared, not assumed)."""
        view = other.view() if isinstance(other, TokenArray) else other
        return view.size == self._n and np.array_equal(view, self.view())

    def adopt_hashes(self, other: TokenArray) -> None:
        """Keep ``other``'s block hashes when it holds the same tokens and has hashed more blocks
        (a scheduler asks about a request's tokens, then admits it: hashed once)."""
        if other._hashes.size > self._hashes.size and (self._hash_bs in (0, other._hash_bs)) and self.same_as(other):
            self._hashes, self._hash_bs = other._hashes, other._hash_bs

    def copy(self) -> TokenArray:
        out = TokenArray(self.view())
        out._hashes, out._hash_bs = self._hashes, self._hash_bs  # same tokens, same hashes
        return out


class _Powers:
    """``C**j`` and ``C**-j`` mod 2**64 for ``j < n``, grown on demand."""

    def __init__(self) -> None:
        self.pow = np.ones(1, dtype=np.uint64)
        self.ipow = np.ones(1, dtype=np.uint64)

    def get(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        if n > self.pow.size:
            size = max(n, 2 * self.pow.size, 256)
            with np.errstate(over="ignore"):
                self.pow = np.cumprod(np.full(size, _C, dtype=np.uint64))
                self.ipow = np.cumprod(np.full(size, _C_INV, dtype=np.uint64))
            self.pow = np.concatenate((np.ones(1, dtype=np.uint64), self.pow[:-1]))
            self.ipow = np.concatenate((np.ones(1, dtype=np.uint64), self.ipow[:-1]))
        return self.pow[:n], self.ipow[:n]


_POWERS = _Powers()
_SALTS: dict[int, np.ndarray] = {}


def _salt(block_size: int) -> np.ndarray:
    salt = _SALTS.get(block_size)
    if salt is None:
        with np.errstate(over="ignore"):
            salt = (np.arange(1, block_size + 1, dtype=np.uint64) * _C64).astype(np.uint64)
        _SALTS[block_size] = salt
    return salt


def block_hashes(blocks: np.ndarray) -> np.ndarray:
    """``h`` of each row of ``blocks`` (``[n, block_size]`` int64): uint64 ``[n]``. With the kernels,
    one compiled pass (the same arithmetic, mod 2**64); else four numpy passes."""
    if kernels.ENABLED:
        out = np.empty(blocks.shape[0], dtype=np.uint64)
        _hash_blocks_compiled(blocks, _salt(blocks.shape[1]), _M1, out)
        return out
    x = blocks.view(np.uint64) + _salt(blocks.shape[1])
    x *= _M1
    x ^= x >> _S29
    return x.sum(axis=1, dtype=np.uint64)


def chain_keys_array(tokens: np.ndarray, block_size: int, start: int = 0, end: int | None = None,
                     parent: int = ROOT_KEY) -> np.ndarray:
    """Chain keys (int64 ``[end - start]``) of the full blocks ``[start, end)`` of ``tokens``
    (int64); ``parent`` is the key of block ``start - 1`` (``ROOT_KEY`` for ``start == 0``)."""
    end = tokens.size // block_size if end is None else end
    n = end - start
    if n <= 0:
        return np.empty(0, dtype=np.int64)
    return keys_from_hashes(block_hashes(tokens[start * block_size : end * block_size].reshape(n, block_size)), parent)


def keys_from_hashes(h: np.ndarray, parent: int = ROOT_KEY) -> np.ndarray:
    """Chain keys (int64) of consecutive blocks with block hashes ``h`` (uint64), after ``parent``."""
    n = h.size
    if kernels.ENABLED:  # the recurrence, compiled
        out = np.empty(n, dtype=np.int64)
        _chain_keys_compiled(h, parent, _C64, out)
        return out
    if n <= _SMALL:  # a few blocks (a prefill chunk, a decode block): the recurrence on Python ints
        keys, key = [], parent & _MASK
        for x in h.tolist():
            key = (_C * key + x) & _MASK
            keys.append(key)
        return np.array(keys, dtype=np.uint64).view(np.int64)
    pw, ipw = _POWERS.get(n)
    s = np.cumsum(h * ipw, dtype=np.uint64)  # uint64 array arithmetic wraps mod 2**64 (no warning)
    s += np.uint64((_C * (parent & _MASK)) & _MASK)
    return (pw * s).view(np.int64)


def key_from_hash(h: int, parent: int) -> int:
    """One step of the chain: the key after ``parent`` of a block whose hash is ``h`` (both ints)."""
    key = (_C * (parent & _MASK) + h) & _MASK
    return key - (1 << 64) if key >> 63 else key


def chain_key(block: np.ndarray, parent: int) -> int:
    """The chain key of one block (int64 ``[block_size]``) whose parent key is ``parent``: the
    same value :func:`chain_keys_array` gives, without its per-array setup (the one-block path)."""
    return key_from_hash(int(block_hashes(block.reshape(1, -1))[0]), parent)


def chain_keys(token_ids: Sequence[int] | np.ndarray, block_size: int) -> list[int]:
    """Hash-chain keys of all full blocks of ``token_ids`` (Python ints)."""
    return chain_keys_array(as_token_array(token_ids), block_size).tolist()


# ---- compiled loops (hybridkv.blockmgr.kernels.ENABLED) ---------------------------------------------
@_jit
def _hash_blocks_compiled(blocks, salt, m1, out):  # type: ignore[no-untyped-def]
    """``hashing.block_hashes`` in one pass: ``out[r] = sum_c mix((blocks[r, c] + salt[c]) * m1)``
    with ``mix(x) = x ^ (x >> 29)``, all mod 2**64 (uint64; the int64 tokens' bits)."""
    n, bs = blocks.shape
    sh = np.uint64(29)
    for r in range(n):
        acc = np.uint64(0)
        for c in range(bs):
            x = (np.uint64(blocks[r, c]) + salt[c]) * m1
            x ^= x >> sh
            acc += x
        out[r] = acc


@_jit
def _chain_keys_compiled(h, parent, c, out):  # type: ignore[no-untyped-def]
    """``out[j]``: the chain key ``c * key + h[j]`` (mod 2**64, as int64) of block ``j``, after the
    key ``parent`` (``hashing.keys_from_hashes``)."""
    key = np.uint64(parent)
    for j in range(h.size):
        key = c * key + h[j]
        out[j] = np.int64(key)
