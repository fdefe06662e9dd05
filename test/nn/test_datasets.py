"""Data sets: IDX parsing against NumPy on files written here (plain, gzipped, malformed), MNIST from a directory, and
scikit-learn's digits against sklearn's own arrays; the digits example trains (a smoke run here, the full accuracy
target in the slow run)."""
from __future__ import annotations
import gzip
import struct
import sys
import pathlib
import numpy as np
import pytest
from fusegrad import dtypes
from fusegrad.nn.datasets import digits, mnist, parse_idx, progress

def _idx(arr: np.ndarray, code: int) -> bytes:
    header = bytes([0, 0, code, arr.ndim]) + struct.pack(f">{arr.ndim}I", *arr.shape)
    return header + arr.astype(arr.dtype.newbyteorder(">")).tobytes()

@pytest.mark.parametrize("dtype,code", [(np.uint8, 0x08), (np.int16, 0x0B), (np.int32, 0x0C), (np.float32, 0x0D)])
def test_parse_idx(dtype, code):
    a = (np.random.default_rng(0).standard_normal((3, 4, 5)) * 100).astype(dtype)
    for raw in (_idx(a, code), gzip.compress(_idx(a, code))):
        t = parse_idx(raw)
        assert t.shape == a.shape
        np.testing.assert_array_equal(t.numpy(), a)

@pytest.mark.parametrize("raw,msg", [(b"\x01\x00\x08\x01", "magic"), (b"\x00\x00\x07\x01" + b"\0" * 4, "element type"),
                                     (b"\x00\x00\x08\x03\x00", "truncated"),
                                     (b"\x00\x00\x08\x01\x00\x00\x00\x05abc", "5"), (b"\x1f\x8bxx", "gzip")])
def test_parse_idx_malformed(raw, msg):
    with pytest.raises(ValueError, match=msg): parse_idx(raw)

def test_mnist_from_directory(tmp_path):
    rng = np.random.default_rng(1)
    xtr, ytr = rng.integers(0, 256, (6, 28, 28), dtype=np.uint8), rng.integers(0, 10, 6, dtype=np.uint8)
    xte, yte = rng.integers(0, 256, (2, 28, 28), dtype=np.uint8), rng.integers(0, 10, 2, dtype=np.uint8)
    (tmp_path / "train-images-idx3-ubyte.gz").write_bytes(gzip.compress(_idx(xtr, 0x08)))
    (tmp_path / "train-labels-idx1-ubyte").write_bytes(_idx(ytr, 0x08))
    (tmp_path / "t10k-images-idx3-ubyte").write_bytes(_idx(xte, 0x08))
    (tmp_path / "t10k-labels-idx1-ubyte").write_bytes(_idx(yte, 0x08))
    a, b, c, d = mnist(path=tmp_path)
    assert a.shape == (6, 1, 28, 28) and c.shape == (2, 1, 28, 28) and a.dtype == dtypes.uint8
    np.testing.assert_array_equal(a.numpy()[:, 0], xtr)
    np.testing.assert_array_equal(d.numpy(), yte)
    (tmp_path / "t10k-labels-idx1-ubyte").write_bytes(_idx(yte[:1], 0x08))
    with pytest.raises(ValueError, match="don't match"): mnist(path=tmp_path)
    with pytest.raises(FileNotFoundError, match="download=True"): mnist(path=tmp_path / "nowhere", download=False)

def test_mnist_download(tmp_path, monkeypatch):
    import http.server
    import threading
    import fusegrad.nn.datasets as datasets
    rng = np.random.default_rng(2)
    arrays = {"train-images-idx3-ubyte": rng.integers(0, 256, (3, 28, 28), dtype=np.uint8),
              "train-labels-idx1-ubyte": rng.integers(0, 10, 3, dtype=np.uint8),
              "t10k-images-idx3-ubyte": rng.integers(0, 256, (2, 28, 28), dtype=np.uint8),
              "t10k-labels-idx1-ubyte": rng.integers(0, 10, 2, dtype=np.uint8)}
    (tmp_path / "www").mkdir()
    for name, arr in arrays.items(): (tmp_path / "www" / (name + ".gz")).write_bytes(gzip.compress(_idx(arr, 0x08)))
    class Handler(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *a, **k): super().__init__(*a, directory=str(tmp_path / "www"), **k)
        def log_message(self, *a): pass
    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        monkeypatch.setattr(datasets, "_MNIST_URL", f"http://127.0.0.1:{server.server_port}/")
        out = mnist(path=tmp_path / "data")
        for t, arr in zip(out, arrays.values()): np.testing.assert_array_equal(t.numpy().reshape(arr.shape), arr)
        assert sorted(p.name for p in (tmp_path / "data").iterdir()) == sorted(n + ".gz" for n in arrays)
    finally: server.shutdown()

def test_digits_match_sklearn():
    from sklearn.datasets import load_digits
    ref = load_digits()
    xtr, ytr, xte, yte = digits()
    assert xtr.shape == (1437, 1, 8, 8) and xte.shape == (360, 1, 8, 8) and ytr.dtype == dtypes.int32
    x = np.concatenate([xtr.numpy(), xte.numpy()]).reshape(-1, 64) * 16
    y = np.concatenate([ytr.numpy(), yte.numpy()])
    # the same images and labels as sklearn's, in a shuffled order
    ours = sorted(zip(map(tuple, np.rint(x).astype(int)), y))
    theirs = sorted(zip(map(tuple, ref.data.astype(int)), ref.target))
    assert ours == theirs

def test_progress_passes_items_through():
    assert list(progress(range(5), total=5, desc="x")) == [0, 1, 2, 3, 4]

def _train_digits():
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "examples"))
    try:
        import train_digits
        return train_digits
    finally: sys.path.pop(0)

def test_train_digits_smoke():
    """Two short epochs already classify most test digits (chance is 10%)."""
    assert _train_digits().train(epochs=2, batch=64, quiet=True) > 0.8

@pytest.mark.slow
def test_train_digits_reaches_97_percent():
    assert _train_digits().train(quiet=True) >= 0.97
