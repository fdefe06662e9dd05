"""Programs written for tinygrad run with only their import changed: the helpers they use (function, Context as a
decorator with TRAINING, Timing, tqdm/trange, colored, profile_marker) behave as tinygrad documents them, and a
training script in tinygrad's style (examples/mnist_tinygrad_style.py) reads MNIST from the cache and trains."""
from __future__ import annotations
import gzip
import io
import os
import pathlib
import struct
import subprocess
import sys
import tarfile
import numpy as np
import pytest
from fusegrad import Context, Tensor, function, nn
from fusegrad.helpers import Timing, TRAINING, profile_marker, profile_markers, tqdm, trange

ROOT = pathlib.Path(__file__).resolve().parents[1]

# *** helpers ***

def test_context_training_is_tensor_training():
    assert Tensor.training is False and not TRAINING
    with Context(TRAINING=1):
        assert Tensor.training is True
        with Tensor.test(): assert Tensor.training is False and not TRAINING
        assert Tensor.training is True
    assert Tensor.training is False

    @Context(TRAINING=1)
    def inside() -> bool: return Tensor.training
    assert inside() is True and Tensor.training is False

def test_context_training_switches_dropout_and_batchnorm():
    x = Tensor.ones(64, 64)
    with Context(TRAINING=1): dropped = x.dropout(0.5).numpy()
    assert (dropped == 0).any() and set(np.unique(dropped)) <= {0.0, 2.0}
    np.testing.assert_array_equal(x.dropout(0.5).numpy(), np.ones((64, 64), np.float32))
    bn = nn.BatchNorm(3)
    data = np.random.default_rng(0).standard_normal((8, 3, 4, 4)).astype(np.float32) * 3 + 2
    with Context(TRAINING=1): out = bn(Tensor(data)).numpy()
    ref = (data - data.mean((0, 2, 3), keepdims=True)) / np.sqrt(data.var((0, 2, 3), keepdims=True) + 1e-5)
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-4)
    # the running statistics moved by momentum 0.1 towards the batch's (unbiased variance, as torch)
    np.testing.assert_allclose(bn.running_mean.numpy(), 0.1 * data.mean((0, 2, 3)), rtol=1e-4, atol=1e-5)

def test_timing_prints_elapsed_ms(capsys):
    with Timing("block: ", on_exit=lambda ns: f" ({ns} ns)") as t: sum(range(1000))
    out = capsys.readouterr().out
    assert out.startswith("block: ") and " ms (" in out and str(t.et) in out
    with Timing("quiet", enabled=False): pass
    assert capsys.readouterr().out == ""

def test_tqdm_and_trange():
    assert list(trange(5, disable=True)) == list(range(5))
    assert list(trange(2, 11, 3, disable=True)) == list(range(2, 11, 3))
    assert list(tqdm("abc", disable=True)) == ["a", "b", "c"]
    bar = tqdm(total=10, disable=True)
    bar.update(4); bar.update(3)
    assert bar.n == 7 and bar.total == 10
    with pytest.raises(TypeError, match="nothing to iterate"): list(tqdm(disable=True))

def test_tqdm_draws_on_stderr(capsys):
    bar = tqdm(range(3), desc="work", disable=False)
    assert list(bar) == [0, 1, 2]
    bar.set_description("loss 1.0")
    err = capsys.readouterr().err
    assert "work: " in err and "3/3" in err and "loss 1.0: " in err

def test_profile_marker_records_in_order():
    before = len(profile_markers)
    profile_marker("first"); profile_marker("second", color="red")
    assert [(n, c) for _, n, c in profile_markers[before:]] == [("first", "gray"), ("second", "red")]
    assert profile_markers[before][0] <= profile_markers[before + 1][0]

# *** function ***

class _Model:
    def __init__(self):
        self.layer = nn.Linear(3, 2)
    @function
    def __call__(self, x: Tensor) -> Tensor: return self.layer(x).relu()

def test_function_decorated_method_computes_the_same():
    import torch
    m = _Model()
    x = np.random.default_rng(1).standard_normal((4, 3)).astype(np.float32)
    ref = torch.relu(torch.tensor(x) @ torch.tensor(m.layer.weight.numpy()).T + torch.tensor(m.layer.bias.numpy()))
    np.testing.assert_allclose(m(Tensor(x)).numpy(), ref.numpy(), rtol=1e-5, atol=1e-6)

def test_function_rejects_implicit_inputs_and_bad_returns():
    w = Tensor.ones(3, 2).contiguous().realize()
    @function
    def uses_global(x: Tensor) -> Tensor: return x @ w
    with pytest.raises(RuntimeError, match="uses_global reads 1 tensor.*allow_implicit"): uses_global(Tensor.ones(2, 3))
    allowed = function(allow_implicit=True)(lambda x: x @ w)
    np.testing.assert_array_equal(allowed(Tensor.ones(2, 3)).numpy(), np.full((2, 2), 3.0, np.float32))
    # passed as an argument, the same tensor is explicit
    np.testing.assert_array_equal(function(lambda x, w: x @ w)(Tensor.ones(2, 3), w).numpy(), np.full((2, 2), 3.0))
    with pytest.raises(RuntimeError, match="must return a Tensor"): function(lambda x: x.numpy())(Tensor.ones(2))
    pair = function(lambda x: (x + 1, x * 2))(Tensor([1.0, 2.0]))
    assert [t.tolist() for t in pair] == [[2.0, 3.0], [2.0, 4.0]]

# *** a training script in tinygrad's style ***

def _idx(a: np.ndarray) -> bytes:
    return bytes([0, 0, 8, a.ndim]) + struct.pack(f">{a.ndim}I", *a.shape) + a.astype(np.uint8).tobytes()

def _digits_as_mnist(root: pathlib.Path) -> None:
    """scikit-learn's 8x8 digits scaled up to MNIST's 28x28 uint8 images, written as MNIST's four gzipped IDX files."""
    from sklearn.datasets import load_digits
    d = load_digits()
    order = np.random.default_rng(0).permutation(len(d.target))
    images = np.pad((d.images[order] * 255 / 16).repeat(3, 1).repeat(3, 2), ((0, 0), (2, 2), (2, 2)))
    labels, n = d.target[order], 1437
    root.mkdir(parents=True)
    for name, arr in (("train-images-idx3-ubyte", images[:n]), ("train-labels-idx1-ubyte", labels[:n]),
                      ("t10k-images-idx3-ubyte", images[n:]), ("t10k-labels-idx1-ubyte", labels[n:])):
        (root / (name + ".gz")).write_bytes(gzip.compress(_idx(arr)))

def test_tinygrad_style_mnist_script_trains(tmp_path):
    _digits_as_mnist(tmp_path / "mnist")
    env = {**os.environ, "MNIST_DIR": str(tmp_path / "mnist"), "STEPS": "60", "BS": "64", "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, str(ROOT / "examples" / "mnist_tinygrad_style.py")], env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    accuracy = float(r.stdout.split("test accuracy ")[-1].split("%")[0])
    assert accuracy > 85, r.stdout  # chance is 10%; 60 steps of 64 reach ~95% on these digits

# *** data sets by tinygrad's signatures ***

def _serve(directory: pathlib.Path):
    import http.server
    import threading
    class Handler(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *a, **k): super().__init__(*a, directory=str(directory), **k)
        def log_message(self, *a): pass
    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server

def test_fashion_mnist_downloads_into_its_own_cache(tmp_path, monkeypatch):
    import fusegrad.nn.datasets as datasets
    rng = np.random.default_rng(3)
    arrays = [rng.integers(0, 256, (3, 28, 28)), rng.integers(0, 10, 3), rng.integers(0, 256, (2, 28, 28)),
              rng.integers(0, 10, 2)]
    (tmp_path / "www").mkdir()
    for name, a in zip(datasets._MNIST_FILES, arrays):
        (tmp_path / "www" / (name + ".gz")).write_bytes(gzip.compress(_idx(a)))
    server = _serve(tmp_path / "www")
    try:
        monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
        monkeypatch.delenv("MNIST_DIR", raising=False)
        monkeypatch.setattr(datasets, "_FASHION_URL", f"http://127.0.0.1:{server.server_port}/")
        out = datasets.mnist(fashion=True)
    finally: server.shutdown()
    for t, a in zip(out, arrays): np.testing.assert_array_equal(t.numpy().reshape(a.shape), a)
    assert out[0].shape == (3, 1, 28, 28)
    assert sorted(p.name for p in (tmp_path / "cache" / "fusegrad" / "fashion-mnist").iterdir()) == \
        sorted(n + ".gz" for n in datasets._MNIST_FILES)
    # a second call reads the cache: no server needed
    np.testing.assert_array_equal(datasets.mnist(fashion=True)[3].numpy(), arrays[3])

def test_cifar_from_its_binary_archive(tmp_path, monkeypatch):
    import fusegrad.nn.datasets as datasets
    rng = np.random.default_rng(4)
    batches = [rng.integers(0, 256, (n, 3073), dtype=np.uint8) for n in (2, 3, 1, 2, 2, 4)]
    names = [f"data_batch_{i}.bin" for i in range(1, 6)] + ["test_batch.bin"]
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        for name, rows in zip(names, batches):
            info = tarfile.TarInfo(f"cifar-10-batches-bin/{name}")
            info.size = rows.nbytes
            tf.addfile(info, io.BytesIO(rows.tobytes()))
    (tmp_path / "www").mkdir()
    (tmp_path / "www" / "cifar.tar.gz").write_bytes(gzip.compress(buf.getvalue()))
    server = _serve(tmp_path / "www")
    try:
        monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
        monkeypatch.delenv("CIFAR_DIR", raising=False)
        monkeypatch.setattr(datasets, "_CIFAR_URL", f"http://127.0.0.1:{server.server_port}/cifar.tar.gz")
        xtr, ytr, xte, yte = datasets.cifar()
    finally: server.shutdown()
    train = np.concatenate(batches[:5])
    np.testing.assert_array_equal(xtr.numpy(), train[:, 1:].reshape(-1, 3, 32, 32))
    np.testing.assert_array_equal(ytr.numpy(), train[:, 0])
    np.testing.assert_array_equal(xte.numpy(), batches[5][:, 1:].reshape(-1, 3, 32, 32))
    np.testing.assert_array_equal(yte.numpy(), batches[5][:, 0])
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "cifar-10-binary.tar").write_bytes(buf.getvalue()[:2000])
    with pytest.raises(ValueError): datasets.cifar(path=tmp_path / "bad")
    with pytest.raises(FileNotFoundError, match="download=True"): datasets.cifar(path=tmp_path / "none", download=False)

# *** Tensor.uop as tinygrad programs inspect it ***

def test_uop_realized_state_and_buffer():
    a = Tensor([1.0, 2.0, 3.0]).realize()
    lazy, view = a + 1, a.reshape(3, 1)
    assert a.uop.is_realized and a.uop.base is a.uop and a.uop.shape == (3,)
    np.testing.assert_array_equal(a.uop.realized.numpy(), [1.0, 2.0, 3.0])
    assert not lazy.uop.is_realized and lazy.uop.realized is None and lazy.uop.shape == (3,)
    with pytest.raises(ValueError, match="realize it first"): lazy.uop.buffer
    # a view: realized through its base, but not itself a buffer
    assert view.uop.is_realized and view.uop.realized is None and view.uop.base is a.uop and view.uop.shape == (3, 1)
    assert view.uop.buffer is a.uop.buffer
    lazy.realize()
    assert lazy.uop.is_realized
    np.testing.assert_array_equal(lazy.uop.buffer.numpy(), [2.0, 3.0, 4.0])
