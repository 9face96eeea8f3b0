"""colibri.engine.kv_cache.KVCache: bookkeeping, overflow, reset/truncate/copy."""
import numpy as np
import pytest

from colibri.errors import ColibriError
from colibri.engine.kv_cache import CacheOverflowError, KVCache


def _kv(rng, B, Hkv, T, Dh):
    return (rng.normal(size=(B, Hkv, T, Dh)).astype(np.float32),
            rng.normal(size=(B, Hkv, T, Dh)).astype(np.float32))


def _fill(cache, rng, T, valid=None):
    kvs = []
    for layer in range(cache.n_layers):
        k, v = _kv(rng, cache.batch, cache.n_kv_heads, T, cache.head_dim)
        ks, vs = cache.write(layer, k, v)
        assert ks.shape == (cache.batch, cache.n_kv_heads, cache.length + T, cache.head_dim)
        np.testing.assert_array_equal(ks[:, :, -T:], k)
        kvs.append((k, v))
    if valid is None:
        valid = np.ones((cache.batch, T), bool)
    start = cache.next_positions()[:, None]
    cache.commit(valid, start + np.cumsum(valid, axis=1) - 1)
    return kvs


def test_layout_and_append():
    rng = np.random.default_rng(0)
    c = KVCache(2, 3, 2, 10, 4)
    assert c.k[0].shape == (3, 2, 10, 4) and c.k[0].dtype == np.float32
    assert c.nbytes == 2 * 2 * 3 * 2 * 10 * 4 * 4
    first = _fill(c, rng, 4)
    second = _fill(c, rng, 1)
    assert len(c) == 5 and c.remaining == 5
    np.testing.assert_array_equal(c.k[1][:, :, :4], first[1][0])
    np.testing.assert_array_equal(c.v[0][:, :, 4:5], second[0][1])
    np.testing.assert_array_equal(c.next_positions(), [5, 5, 5])


def test_padding_positions():
    c = KVCache(1, 2, 1, 8, 2)
    rng = np.random.default_rng(1)
    valid = np.array([[True, True, True], [False, False, True]])
    _fill(c, rng, 3, valid)
    np.testing.assert_array_equal(c.next_positions(), [3, 1])
    np.testing.assert_array_equal(c.valid[:, :3], valid)


def test_overflow_error_names_numbers():
    c = KVCache(1, 1, 1, 6, 2)
    _fill(c, np.random.default_rng(2), 4)
    with pytest.raises(CacheOverflowError) as e:
        c.check_room(3)
    msg = str(e.value)
    assert "ctx 6" in msg and "length 4" in msg and "3 new" in msg
    assert isinstance(e.value, ColibriError) and isinstance(e.value, ValueError)
    c.check_room(2)                                           # exactly full is fine


def test_reset_truncate_copy():
    rng = np.random.default_rng(3)
    c = KVCache(2, 1, 2, 12, 4)
    _fill(c, rng, 6)
    snap = c.copy()
    c.truncate(4)
    assert len(c) == 4 and list(c.next_positions()) == [4]
    assert not c.valid[0, 4:].any()
    later = _fill(c, rng, 2)                                   # overwrite slots 4, 5
    np.testing.assert_array_equal(c.k[0][:, :, 4:6], later[0][0])
    # the copy kept the old contents and is independent
    assert len(snap) == 6
    assert not np.array_equal(snap.k[0][:, :, 4:6], c.k[0][:, :, 4:6])
    np.testing.assert_array_equal(snap.k[1][:, :, :4], c.k[1][:, :, :4])
    with pytest.raises(ValueError, match=r"\[0, 6\]"):
        c.truncate(7)
    c.reset()
    assert len(c) == 0 and list(c.next_positions()) == [0] and not c.valid.any()


@pytest.mark.parametrize("bad", [dict(ctx=0), dict(batch=0), dict(head_dim=2.5)])
def test_rejects_bad_sizes(bad):
    kw = dict(n_layers=1, batch=1, n_kv_heads=1, ctx=4, head_dim=2) | bad
    with pytest.raises(ValueError):
        KVCache(**kw)


def test_write_one_is_write_for_one_token():
    rng = np.random.default_rng(4)
    a, b = KVCache(2, 1, 3, 8, 4), KVCache(2, 1, 3, 8, 4)
    for step in range(5):
        k, v = _kv(rng, 1, 3, 1, 4)
        ka, va = a.write(1, k, v)
        kb, vb = b.write_one(1, k[0, :, 0], v[0, :, 0])
        np.testing.assert_array_equal(kb, ka[0])
        np.testing.assert_array_equal(vb, va[0])
        assert np.shares_memory(kb, b.k[1]) and np.shares_memory(vb, b.v[1])   # views
        kw, vw = b.write_one(1, k[0, :, 0], v[0, :, 0], start=max(0, step - 1))
        assert kw.shape == (3, step + 1 - max(0, step - 1), 4)
        np.testing.assert_array_equal(kw, ka[0, :, max(0, step - 1):])
        for c in (a, b):
            c.commit(np.ones((1, 1), bool), np.array([[step]]))
    np.testing.assert_array_equal(a.k[1], b.k[1])
    assert not b.k[0].any()


def test_run_state_is_per_cache():
    from colibri.engine.run_state import RunState
    c = KVCache(1, 1, 1, 4, 2)
    assert c.run_state is None and c.decode_binding is None
    c.run_state = RunState(4, 1, 1, 2, 1e-5)
    twin = c.copy()
    assert twin.run_state is None and twin.decode_binding is None and c.run_state is not None
    assert not hasattr(c, "scratch")


def test_value_planes_of_another_width():
    """value_dim: the value planes' width (an MLA cache: the latent in the key planes, the
    rotary key in the value planes); sizes, writes and copies follow it."""
    c = KVCache(n_layers=2, batch=1, n_kv_heads=1, ctx=6, head_dim=32, value_dim=8)
    assert c.k[0].shape == (1, 1, 6, 32) and c.v[1].shape == (1, 1, 6, 8)
    assert c.nbytes == 2 * 6 * (32 + 8) * 4 and c.bytes_per_token == 2 * (32 + 8) * 4
    k, v = np.ones((1, 1, 3, 32), np.float32), np.full((1, 1, 3, 8), 2.0, np.float32)
    kk, vv = c.write(1, k, v)
    assert kk.shape == (1, 1, 3, 32) and vv.shape == (1, 1, 3, 8)
    c.commit(np.ones((1, 3), bool), np.arange(3)[None])
    d = c.copy()
    assert d.value_dim == 8 and np.array_equal(d.v[1][:, :, :3], v)
    assert "value_dim=8" in repr(c) and "value_dim" not in repr(KVCache(1, 1, 1, 2, 4))
    with pytest.raises(ValueError, match="value_dim must be a positive integer"):
        KVCache(1, 1, 1, 2, 4, value_dim=0)
