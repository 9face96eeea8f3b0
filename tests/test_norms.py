"""colibri.engine.norms against transformers' RMSNorm, and the compiled row norm of the decode
step against it bit for bit."""
import numpy as np
import pytest
from numeric import assert_close as _close

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from colibri.kernels import rms_norm_rows_into
from colibri.engine.norms import rms_norm


def test_rms_norm_matches_transformers():
    from transformers.models.olmoe.modeling_olmoe import OlmoeRMSNorm
    rng = np.random.default_rng(0)
    x = rng.normal(size=(3, 5, 48)).astype(np.float32) * 3
    w = rng.normal(size=48).astype(np.float32)
    ref = OlmoeRMSNorm(48, eps=1e-5)
    ref.weight.data = torch.from_numpy(w)
    _close(rms_norm(x, w, 1e-5), ref(torch.from_numpy(x)).detach().numpy(), 1e-6)


def _rms_norm_as_before(x, weight, eps):
    """rms_norm as it was written first (np.mean); the rewrite must give the same bits."""
    x = np.asarray(x, dtype=np.float32)
    var = np.mean(np.square(x), axis=-1, keepdims=True, dtype=np.float32)
    return weight * (x * (np.float32(1.0) / np.sqrt(var + np.float32(eps))))


@pytest.mark.parametrize("n", [7, 24, 64, 100, 1024, 1536, 2880])
def test_rms_norm_in_place_and_compiled_rows_are_bit_identical(n):
    rng = np.random.default_rng(n)
    for i in range(20):
        x = (rng.normal(size=(3, n)) * 10.0 ** rng.uniform(-4, 4)).astype(np.float32)
        w = rng.normal(size=n).astype(np.float32)
        eps = (1e-5, 1e-6, 1e-8)[i % 3]
        want = _rms_norm_as_before(x, w, eps)
        np.testing.assert_array_equal(rms_norm(x, w, eps), want)
        y = x.copy()
        assert rms_norm(y, w, eps, out=y) is y
        np.testing.assert_array_equal(y, want)
        out = np.empty((1, n), np.float32)
        for r in range(3):                           # the decode step's compiled row norm
            rms_norm_rows_into(x[r:r + 1], w, np.float32(eps), out)
            np.testing.assert_array_equal(out[0], want[r])


@pytest.mark.parametrize("bias", [False, True])
def test_layer_norm_matches_torch(bias):
    """norms.layer_norm against torch.nn.LayerNorm (DBRX: no bias; PhiMoE: with bias), in
    place and into a row buffer as the decode step calls it."""
    from colibri.engine.norms import layer_norm
    rng = np.random.default_rng(7)
    x = (rng.normal(size=(3, 5, 96)) * 4 + 2).astype(np.float32)
    w = rng.normal(size=96).astype(np.float32)
    b = rng.normal(size=96).astype(np.float32) if bias else None
    ref = torch.nn.LayerNorm(96, eps=1e-5, bias=bias)
    with torch.no_grad():
        ref.weight.copy_(torch.from_numpy(w))
        if bias:
            ref.bias.copy_(torch.from_numpy(b))
        want = ref(torch.from_numpy(x)).numpy()
    got = layer_norm(x, w, b, 1e-5)
    assert got.dtype == np.float32
    _close(got, want, 1e-6)
    y = x.copy()
    assert layer_norm(y, w, b, 1e-5, out=y) is y
    np.testing.assert_array_equal(y, got)
    row = np.empty((1, 96), np.float32)
    layer_norm(x[1, 2:3], w, b, np.float32(1e-5), out=row)
    np.testing.assert_array_equal(row[0], got[1, 2])
