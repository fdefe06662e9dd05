"""The remaining tinygrad Tensor names against independent references: hashlib for Keccak/SHA-3, NumPy for QR and
SVD, Python arithmetic for the raw ALU helpers, torch for contiguous_backward's gradient."""
from __future__ import annotations
import hashlib
import http.server
import threading
import urllib.error
import numpy as np
import pytest
import torch
from fusegrad import Tensor, dtypes
from fusegrad.uop.ops import Ops

def _bytes_tensor(msg: bytes) -> Tensor:
    return Tensor(list(msg), dtype=dtypes.uint8) if msg else Tensor.zeros(0, dtype=dtypes.uint8)

@pytest.mark.parametrize("n", [0, 3, 135, 136, 137, 300])
def test_keccak_equals_hashlib(n):
    msg = bytes((i * 7 + 3) % 256 for i in range(n))
    assert bytes(_bytes_tensor(msg).keccak().tolist()) == hashlib.sha3_256(msg).digest()
    assert bytes(_bytes_tensor(msg).keccak("sha3_512").tolist()) == hashlib.sha3_512(msg).digest()

def test_keccak_rows_and_errors():
    rows = [bytes([i] * 10) for i in range(3)]
    got = Tensor([list(r) for r in rows], dtype=dtypes.uint8).keccak("sha3_224")
    assert [bytes(r) for r in got.tolist()] == [hashlib.sha3_224(r).digest() for r in rows]
    with pytest.raises(ValueError, match="cfg"): Tensor([1], dtype=dtypes.uint8).keccak("md5")

def test_hash_is_sha3_of_the_bytes():
    a = np.arange(6, dtype=np.int32)
    assert bytes(Tensor(a).hash().tolist()) == hashlib.sha3_256(a.tobytes()).digest()
    assert Tensor(a).hash().tolist() != Tensor(a + 1).hash().tolist()

@pytest.mark.parametrize("shape", [(5, 3), (3, 5), (4, 4), (2, 4, 3)])
def test_qr(shape):
    a = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    q, r = Tensor(a).qr()
    q, r = q.numpy(), r.numpy()
    k = min(shape[-2:])
    assert q.shape == shape[:-1] + (k,) and r.shape == shape[:-2] + (k, shape[-1])
    np.testing.assert_allclose(q @ r, a, atol=1e-5)
    np.testing.assert_allclose(np.swapaxes(q, -1, -2) @ q, np.broadcast_to(np.eye(k), q.shape[:-2] + (k, k)), atol=1e-5)
    assert np.all(np.tril(r, -1) == 0)

@pytest.mark.parametrize("shape,full", [((5, 3), False), ((3, 5), True), ((4, 4), True)])
def test_svd(shape, full):
    a = np.random.default_rng(1).standard_normal(shape).astype(np.float32)
    u, s, vh = (t.numpy() for t in Tensor(a).svd(full_matrices=full))
    np.testing.assert_allclose(s, np.linalg.svd(a, compute_uv=False), rtol=1e-5, atol=1e-5)
    k = min(shape)
    np.testing.assert_allclose((u[:, :k] * s) @ vh[:k], a, atol=1e-5)
    if full: assert u.shape == (shape[0],) * 2 and vh.shape == (shape[1],) * 2
    np.testing.assert_allclose(u.T @ u, np.eye(u.shape[1]), atol=1e-5)

def test_alu_const_and_u_helpers():
    assert Tensor([1.0, 2.0]).alu(Ops.MAX, Tensor([[0.0], [3.0]])).tolist() == [[1.0, 2.0], [3.0, 3.0]]
    assert Tensor([1, 5]).alu(Ops.CMPLT, Tensor([3, 3])).tolist() == [True, False]
    with pytest.raises(ValueError, match="elementwise"): Tensor([1]).alu(Ops.REDUCE_AXIS)
    c = Tensor.const(3.5)
    assert c.shape == () and c.item() == 3.5 and Tensor.const(2, dtypes.int8).dtype == dtypes.int8
    assert Tensor([1, 2]).usum(1, Tensor([10, 20])).tolist() == [1 + 1 + 10, 2 + 1 + 20]
    assert Tensor([1, 2]).uprod(3, 2).tolist() == [6, 12]
    assert Tensor([1, 2]).ufix(0.5).dtype == dtypes.default_float and Tensor([1.0]).ufix(2).dtype == dtypes.float32

def test_contiguous_backward_is_identity_with_the_same_gradient():
    a = np.random.default_rng(2).standard_normal((3, 4)).astype(np.float32)
    x = Tensor(a, requires_grad=True)
    y = (x.contiguous_backward().exp() * 2).sum()
    y.backward()
    t = torch.tensor(a, requires_grad=True)
    (t.exp() * 2).sum().backward()
    np.testing.assert_allclose(x.grad.numpy(), t.grad.numpy(), rtol=1e-5)

def test_params_shapes_invalids_and_schedules():
    t = Tensor([1.0])
    assert not t.is_param and t.is_param_().is_param and not t.is_param_(False).is_param
    assert t.max_shape == (1,) and Tensor.zeros(2, 3).max_numel() == 6
    assert Tensor.invalids(2, 3).shape == (2, 3)
    x = Tensor([1.0, 2.0]) + 1
    sink, _ = x.linear_with_vars()
    assert sink.op is Ops.SINK and len(sink.src) >= 1 and x.schedule_linear().op is Ops.SINK
    assert x.callify().tolist() == [2.0, 3.0]
    outs = Tensor([1.0, 2.0]).custom_kernel(Tensor([3.0, 4.0]), fxn=lambda a, b: [a + b, a * b])
    assert [o.tolist() for o in outs] == [[4.0, 6.0], [3.0, 8.0]]
    assert Tensor([2.0]).call(fxn=lambda a: a * 5).tolist() == [10.0]

def test_custom_kernel_with_its_own_gradient():
    a = Tensor([1.0, 2.0, 3.0], requires_grad=True)
    b = Tensor([4.0, 5.0, 6.0], requires_grad=True)
    # forward a*b; a deliberately different "gradient": 10*g for a, none for b
    (out,) = a.custom_kernel(b, fxn=lambda x, y: x * y, grad_fxn=lambda g, x, y: (g * 10, None))
    (out * 2).sum().backward()
    assert out.tolist() == [4.0, 10.0, 18.0]
    assert a.grad.tolist() == [20.0, 20.0, 20.0] and b.grad.tolist() == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="2 inputs"):
        (bad,) = a.custom_kernel(b, fxn=lambda x, y: x + y, grad_fxn=lambda g, x, y: g)
        bad.sum().gradient(a)

def _serve(folder, hits):
    """A local HTTP server of `folder` on a free port (its requests logged in `hits`)."""
    class Handler(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *a, **k): super().__init__(*a, directory=str(folder), **k)
        def log_message(self, *a): hits.append(a)
    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server

def test_fetch_caches_names_and_gunzips(tmp_path, monkeypatch):
    import gzip
    from fusegrad import fetch
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    payload = bytes(range(256)) * 50
    (tmp_path / "www").mkdir()
    (tmp_path / "www" / "blob.bin").write_bytes(payload)
    (tmp_path / "www" / "blob.gz").write_bytes(gzip.compress(payload))
    hits: list = []
    server = _serve(tmp_path / "www", hits)
    try:
        base = f"http://127.0.0.1:{server.server_port}"
        p = fetch(f"{base}/blob.bin")
        assert p.read_bytes() == payload and str(p).startswith(str(tmp_path / "cache"))
        assert fetch(f"{base}/blob.bin") == p and len(hits) == 1, "the second call finds the cached file"
        assert fetch(f"{base}/blob.bin", allow_caching=False).read_bytes() == payload and len(hits) == 2
        named = fetch(f"{base}/blob.bin", name="x.bin", subdir="sub")
        assert named.name == "x.bin" and named.parent.name == "sub" and named.read_bytes() == payload
        assert fetch(f"{base}/blob.gz", gunzip=True).read_bytes() == payload
        absolute = tmp_path / "elsewhere" / "y.bin"
        assert fetch(f"{base}/blob.bin", name=absolute) == absolute and absolute.read_bytes() == payload
        # a missing file raises the HTTP error and leaves nothing behind that a later call would take as the file
        with pytest.raises(urllib.error.HTTPError):
            fetch(f"{base}/missing.bin", name="missing.bin")
        leftovers = [q.name for q in (tmp_path / "cache").rglob("*") if "missing" in q.name]
        assert leftovers == []
    finally: server.shutdown()

def test_from_url_downloads_once(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    (tmp_path / "data.bin").write_bytes(b"\x01\x02\x03")
    hits: list = []
    server = _serve(tmp_path, hits)
    try:
        url = f"http://127.0.0.1:{server.server_port}/data.bin"
        from fusegrad.helpers import cache_dir
        getattr(cache_dir, "cache_clear", lambda: None)()
        assert Tensor.from_url(url).tolist() == [1, 2, 3]
        assert Tensor.from_url(url).tolist() == [1, 2, 3]
        assert len(hits) == 1, "the second call reads the cached file"
    finally: server.shutdown()
