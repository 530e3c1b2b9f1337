"""The prefix cache's compiled key -> slot map (:class:`hybridkv.blockmgr.prefix.slotmap.SlotMap`) against
a dict: random operations, scalar and bulk, with keys crafted to share home cells (long probe runs,
runs that wrap around the end of the table, removals from their middle) and growth."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridkv.blockmgr import kernels
from hybridkv.blockmgr.prefix import slotmap
from hybridkv.blockmgr.prefix.slotmap import SlotMap

np = pytest.importorskip("numpy")
pytestmark = pytest.mark.skipif(kernels.numba is None, reason="numba is not installed")

_M64 = (1 << 64) - 1
_GOLD_INV = pow(slotmap._GOLD, -1, 1 << 64)


def _key_at(home: int, r: int, shift: int) -> int:
    """A signed 64-bit key whose home cell is ``home`` in a table with this ``shift``."""
    k = (((home << shift) + r) * _GOLD_INV) & _M64
    return k - (1 << 64) if k >> 63 else k


def test_crafted_keys_have_their_home_cells():
    m = SlotMap()
    shift = int(m.meta[1])
    size = m.tab.shape[0]
    for home in (0, 1, size - 1, size // 2):
        assert slotmap._km_home(_key_at(home, 12345, shift), shift) == home


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_the_map_agrees_with_a_dict(data):
    m, d = SlotMap(), {}
    shift, size = int(m.meta[1]), m.tab.shape[0]
    # keys in a few clusters of shared home cells, some at the table's end (runs wrap around)
    homes = data.draw(st.lists(st.sampled_from([0, 1, 2, size - 3, size - 2, size - 1, 500]), min_size=1, max_size=4))
    pool = [_key_at(h, r, shift) for h in homes for r in range(12)] + [-1, 0, 1, (1 << 63) - 1, -(1 << 63)]
    keys = st.sampled_from(pool)
    for _ in range(data.draw(st.integers(1, 120))):
        op = data.draw(st.sampled_from(["set", "del", "pop", "get", "put", "remove", "lookup"]))
        if op == "set":
            k, v = data.draw(keys), data.draw(st.integers(0, 1000))
            m[k] = d[k] = v
        elif op == "del":
            k = data.draw(keys)
            if k in d:
                del m[k], d[k]
            else:
                with pytest.raises(KeyError):
                    del m[k]
        elif op == "pop":
            k = data.draw(keys)
            assert m.pop(k, None) == d.pop(k, None)
        elif op == "get":
            k = data.draw(keys)
            assert m.get(k) == d.get(k) and (k in m) == (k in d)
        elif op == "put":
            ks = data.draw(st.lists(keys, max_size=10, unique=True))
            vs = [data.draw(st.integers(0, 1000)) for _ in ks]
            m.put(np.array(ks, dtype=np.int64), np.array(vs, dtype=np.int64))
            d.update(zip(ks, vs, strict=True))
        elif op == "remove":
            ks = data.draw(st.lists(keys, max_size=10, unique=True))
            got = m.remove(np.array(ks, dtype=np.int64)).tolist()
            assert got == [d.pop(k, -1) for k in ks]
        else:
            ks = data.draw(st.lists(keys, max_size=10))
            assert m.lookup(np.array(ks, dtype=np.int64)).tolist() == [d.get(k, -1) for k in ks]
        assert len(m) == len(d)
    assert dict(m.items()) == d
    assert sorted(m.keys()) == sorted(d) and sorted(m.values()) == sorted(d.values())


def test_growth_keeps_every_key():
    rng = np.random.default_rng(0)
    keys = rng.integers(-(1 << 63), (1 << 63) - 1, size=5000, dtype=np.int64)
    keys = np.unique(keys)
    m = SlotMap(16)
    size = m.tab.shape[0]
    for i in range(0, keys.size, 700):  # bulk puts past the load bound: the arrays double
        m.put(keys[i : i + 700], np.arange(i, min(i + 700, keys.size), dtype=np.int64))
    assert m.tab.shape[0] > size and len(m) == keys.size and len(m) <= m.tab.shape[0] // 2
    assert m.lookup(keys).tolist() == list(range(keys.size))
    m.remove(keys[::2])
    assert m.lookup(keys).tolist() == [-1 if i % 2 == 0 else i for i in range(keys.size)]
