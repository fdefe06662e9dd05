"""Data sets: MNIST from its IDX files and the handwritten digits that scikit-learn ships; a progress-bar helper."""
from __future__ import annotations
import gzip
import os
import pathlib
import struct
from typing import Iterable, Iterator, TypeVar
from fusegrad.device import Device
from fusegrad.dtype import dtypes
from fusegrad.helpers import fetch, prod
from fusegrad.tensor import Tensor

__all__ = ["mnist", "digits", "parse_idx", "progress"]

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

def mnist(path: str | os.PathLike | None = None, download: bool = False) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(X_train (60000,1,28,28) uint8, Y_train, X_test (10000,1,28,28), Y_test) from the four standard IDX files
    (optionally .gz) in `path` (default: $MNIST_DIR or ~/.cache/fusegrad/mnist); download=True fetches missing
    files first."""
    root = pathlib.Path(path or os.getenv("MNIST_DIR") or pathlib.Path.home() / ".cache" / "fusegrad" / "mnist")
    out = []
    for name in _MNIST_FILES:
        found = next((root / f for f in (name, name + ".gz") if (root / f).is_file()), None)
        if found is None and download:
            found = fetch(_MNIST_URL + name + ".gz", name=(root / (name + ".gz")).resolve())
        if found is None:
            raise FileNotFoundError(f"MNIST file {name}[.gz] not found in {root}: put the four IDX files there, set "
                                    "MNIST_DIR, or call mnist(download=True)")
        out.append(parse_idx(found.read_bytes(), str(found)))
    xtr, ytr, xte, yte = out
    for x, y, split in ((xtr, ytr, "train"), (xte, yte, "test")):
        if x.ndim != 3 or y.ndim != 1 or x.shape[0] != y.shape[0]:
            raise ValueError(f"MNIST {split}: images {x.shape} and labels {y.shape} don't match")
    return xtr.reshape(-1, 1, *xtr.shape[1:]), ytr, xte.reshape(-1, 1, *xte.shape[1:]), yte

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
