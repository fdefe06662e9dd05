"""Mutated model files (truncations, byte flips, huge lengths, inserted and deleted bytes) made from valid files that
the `safetensors`, `torch` and `gguf` packages wrote: every load either raises ValueError or returns the tensors the
package's own reader gets from the same bytes, quickly."""
from __future__ import annotations
import io
import random
import signal
import time
import zipfile
from collections.abc import Callable
from typing import Any
import numpy as np
import pytest
import torch
import safetensors.torch
import gguf
from gguf.quants import dequantize, quantize
from fusegrad import Tensor, dtypes
from fusegrad.nn.state import gguf_load, safe_load, torch_load

SECONDS_PER_LOAD = 5.0  # a load that takes longer counts as a hang

# *** the valid files ***

def _safetensors_file() -> bytes:
    g = torch.Generator().manual_seed(0)
    return safetensors.torch.save({"w": torch.randn(2, 3, generator=g), "i": torch.arange(4),
                                   "h": torch.randn(3, generator=g).bfloat16(), "e": torch.zeros(0, 2)},
                                  metadata={"k": "v"})

def _torch_file(zip_format: bool) -> bytes:
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    obj = {"w": base, "t": base.T, "x": torch.ones(2).expand(3, 2), "i": torch.tensor([5, -6]),
           "h": torch.tensor([1.5, -2.0]).half(), "b": torch.tensor([True, False]), "n": [1, "a"]}
    f = io.BytesIO()
    torch.save(obj, f, _use_new_zipfile_serialization=zip_format)
    return f.getvalue()

def _gguf_file(tmp_path) -> bytes:
    Q = gguf.GGMLQuantizationType
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(tmp_path / "valid.gguf"), "llama")
    w.add_uint32("n", 7)
    w.add_string("s", "hi")
    w.add_array("a", [1, 2])
    for qt in (Q.F32, Q.F16, Q.Q8_0):
        w.add_tensor(f"t_{qt.name}", quantize(rng.standard_normal((2, 32)).astype(np.float32), qt), raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return (tmp_path / "valid.gguf").read_bytes()

# *** the reference readers, as name -> float64 array (None where the reference rejects the bytes) ***

def _np(t: Any) -> np.ndarray:
    if isinstance(t, Tensor): return (t.float() if t.dtype == dtypes.bfloat16 else t).numpy().astype(np.float64)
    return t.float().numpy().astype(np.float64) if t.dtype == torch.bfloat16 else t.numpy().astype(np.float64)

def _ref_safetensors(data: bytes, path) -> Any:
    return {k: _np(v) for k, v in safetensors.torch.load(data).items()}

def _ref_torch(data: bytes, path) -> Any:
    return torch.load(io.BytesIO(data), weights_only=True)

def _ref_gguf(data: bytes, path) -> Any:
    path.write_bytes(data)
    r = gguf.GGUFReader(str(path))
    return {t.name: dequantize(t.data, t.tensor_type).astype(np.float64).reshape(tuple(reversed(t.shape.tolist())))
            for t in r.tensors}

def _same(ours: Any, ref: Any) -> bool:
    if isinstance(ours, Tensor) or isinstance(ref, torch.Tensor | np.ndarray):
        if not (isinstance(ours, Tensor) and isinstance(ref, torch.Tensor | np.ndarray)): return False
        a, b = _np(ours), (ref if isinstance(ref, np.ndarray) else _np(ref))
        return a.shape == b.shape and bool(np.array_equal(a, b, equal_nan=True))
    if isinstance(ours, dict):
        return isinstance(ref, dict) and ours.keys() == ref.keys() and all(_same(ours[k], ref[k]) for k in ours)
    if isinstance(ours, list | tuple):
        return type(ours) is type(ref) and len(ours) == len(ref) and all(map(_same, ours, ref))
    return type(ours) is type(ref) and ours == ref

# *** mutations ***

HUGE = [2**64 - 1, 2**63, 2**63 - 1, 2**62, 2**40, 2**32 + 1, 2**32 - 1, 2**31, 2**31 - 1, 2**16, 0]

def _mutate(data: bytes, rng: random.Random) -> bytes:
    b = bytearray(data)
    kind = rng.randrange(5) if len(b) >= 8 else rng.choice((0, 1, 3))
    if kind == 0: return bytes(b[:rng.randrange(len(b))])  # truncated
    if kind == 1:  # a few bytes flipped
        for _ in range(rng.randint(1, 4)): b[rng.randrange(len(b))] ^= rng.randint(1, 255)
    elif kind == 2:  # a 4- or 8-byte little-endian field (a length, count or offset) overwritten with an extreme value
        w = rng.choice((4, 8))
        i = rng.randrange(len(b) - w + 1)
        b[i:i + w] = (rng.choice(HUGE) % 2**(8 * w)).to_bytes(w, "little")
    elif kind == 3:  # bytes inserted
        i = rng.randrange(len(b) + 1)
        b[i:i] = rng.randbytes(rng.randint(1, 16))
    else:  # bytes deleted
        i = rng.randrange(len(b))
        del b[i:i + rng.randint(1, 16)]
    return bytes(b)

def _mutate_members(data: bytes, rng: random.Random) -> bytes:
    """A zip whose members are mutated and whose checksums are made right again, so the mutation reaches the
    parser of the member (a pickle) instead of the zip reader's checksum check."""
    src = zipfile.ZipFile(io.BytesIO(data))
    infos = src.infolist()
    target = rng.choice([i for i in infos if i.filename.endswith(".pkl")] * 3 + infos)
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as dst:
        for info in infos:
            body = src.read(info)
            dst.writestr(info.filename, _mutate(body, rng) if info is target and body else body)
    return out.getvalue()

class _Hang(Exception): pass

def _alarm(signum, frame): raise _Hang()

def _fuzz(ours: Callable[[bytes], Any], ref: Callable[[bytes, Any], Any], valid: bytes, n: int, seed: int, tmp_path,
          mutate: Callable[[bytes, random.Random], bytes] = _mutate) -> dict[str, int]:
    assert _same(ours(valid), ref(valid, tmp_path / "ref.bin")), "the valid file must load equal to the reference"
    rng, outcomes = random.Random(seed), {"rejected": 0, "loaded": 0}
    old = signal.signal(signal.SIGALRM, _alarm)
    try:
        for case in range(n):
            data = mutate(valid, rng)
            start = time.perf_counter()
            signal.setitimer(signal.ITIMER_REAL, SECONDS_PER_LOAD)
            try: got = ours(data)
            except ValueError: got = None
            except _Hang: pytest.fail(f"mutation {case} (seed {seed}) ran past {SECONDS_PER_LOAD} s")
            finally: signal.setitimer(signal.ITIMER_REAL, 0)
            assert time.perf_counter() - start < SECONDS_PER_LOAD
            if got is None:
                outcomes["rejected"] += 1
                continue
            try: expected = ref(data, tmp_path / "ref.bin")
            except Exception as e:  # noqa: BLE001 (any refusal of the reference reader)
                pytest.fail(f"mutation {case} (seed {seed}) loaded, but the reference reader refuses it: {e!r:.300}")
            assert _same(got, expected), f"mutation {case} (seed {seed}) loaded different tensors than the reference"
            outcomes["loaded"] += 1
    finally: signal.signal(signal.SIGALRM, old)
    return outcomes

FORMATS = ["safetensors", "pth_zip", "pth_zip_members", "pth_legacy", "gguf"]

def _setup(fmt: str, tmp_path) -> tuple[Callable, Callable, bytes, Callable]:
    if fmt == "safetensors": return safe_load, _ref_safetensors, _safetensors_file(), _mutate
    if fmt == "gguf": return (lambda d: gguf_load(d)[1]), _ref_gguf, _gguf_file(tmp_path), _mutate
    valid = _torch_file(zip_format=fmt != "pth_legacy")
    return torch_load, _ref_torch, valid, _mutate_members if fmt == "pth_zip_members" else _mutate

@pytest.mark.parametrize("fmt", FORMATS)
def test_fuzz_files(tmp_path, fmt):
    ours, ref, valid, mutate = _setup(fmt, tmp_path)
    out = _fuzz(ours, ref, valid, 120, seed=FORMATS.index(fmt), tmp_path=tmp_path, mutate=mutate)
    assert out["rejected"] > 0

@pytest.mark.slow
@pytest.mark.parametrize("fmt", FORMATS)
def test_fuzz_files_many(tmp_path, fmt):
    ours, ref, valid, mutate = _setup(fmt, tmp_path)
    _fuzz(ours, ref, valid, 3000, seed=1000 + FORMATS.index(fmt), tmp_path=tmp_path, mutate=mutate)
