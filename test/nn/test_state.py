"""nn.state against independent writers and readers: the `safetensors` package, `torch.save`, the `gguf` package; round
trips; state-dict naming against torch.nn; and every malformed-file case rejected with a clear error."""
from __future__ import annotations
import io
import json
import pickle
import struct
import tarfile
import time
import tracemalloc
import zipfile
import zlib
import numpy as np
import pytest
import torch
import safetensors.numpy
import safetensors.torch
from fusegrad import Tensor, dtypes, nn
from fusegrad.nn import state
from fusegrad.nn.state import (get_parameters, get_state_dict, gguf_load, load_state_dict, safe_load,
                               safe_load_metadata, safe_save, tar_extract, torch_load, zip_extract)

NP_DTYPES = [np.float64, np.float32, np.float16, np.int64, np.int32, np.int16, np.int8, np.uint8, np.bool_,
             np.uint16, np.uint32, np.uint64]

def _arr(dt, shape=(3, 4), seed=0):
    a = np.random.default_rng(seed).standard_normal(shape) * 50
    return (a > 0) if dt is np.bool_ else a.astype(dt)

# *** safetensors ***

def test_safetensors_package_file_reads_back_equal(tmp_path):
    arrays = {f"t{i}": _arr(dt, seed=i) for i, dt in enumerate(NP_DTYPES)}
    arrays["empty"], arrays["scalar"] = np.zeros((0, 3), np.float32), np.array(2.5, np.float32)
    safetensors.numpy.save_file(arrays, str(tmp_path / "a.safetensors"), metadata={"format": "np"})
    got = safe_load(tmp_path / "a.safetensors")
    assert got.keys() == arrays.keys()
    for k, a in arrays.items():
        assert got[k].shape == a.shape
        np.testing.assert_array_equal(got[k].numpy(), a)
    assert safe_load_metadata(tmp_path / "a.safetensors")[2]["__metadata__"] == {"format": "np"}

def test_bfloat16_from_the_torch_writer(tmp_path):
    t = torch.randn(5, 3).bfloat16()
    safetensors.torch.save_file({"w": t}, str(tmp_path / "b.safetensors"))
    got = safe_load(tmp_path / "b.safetensors")["w"]
    assert got.dtype == dtypes.bfloat16
    np.testing.assert_array_equal(got.float().numpy(), t.float().numpy())

def test_our_files_read_by_the_package(tmp_path):
    ts = {"a": Tensor(_arr(np.float32)), "b": Tensor(_arr(np.int64)).reshape(2, 6), "c": Tensor.arange(5).half(),
          "d": Tensor([True, False]), "e": Tensor.zeros(0, 2), "f": Tensor(3.0), "g": Tensor(_arr(np.float32)).T}
    safe_save(ts, str(tmp_path / "o.safetensors"), metadata={"who": "fusegrad"})
    ref = safetensors.numpy.load_file(str(tmp_path / "o.safetensors"))
    for k, t in ts.items(): np.testing.assert_array_equal(ref[k], t.numpy())
    back = safe_load(str(tmp_path / "o.safetensors"))
    for k, t in ts.items(): np.testing.assert_array_equal(back[k].numpy(), t.numpy())
    with open(tmp_path / "o.safetensors", "rb") as f:
        from safetensors import safe_open
        assert safe_open(f.name, "np").metadata() == {"who": "fusegrad"}

def _write_raw(path, header: dict | bytes, data: bytes = b"", declared_len: int | None = None):
    hdr = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(hdr) if declared_len is None else declared_len) + hdr + data)

@pytest.mark.parametrize("case", ["short", "header_past_end", "bad_json", "unknown_dtype", "offsets_out_of_range",
                                  "size_mismatch", "overlap", "bad_shape", "not_object"])
def test_malformed_safetensors(tmp_path, case):
    p = tmp_path / "bad.safetensors"
    ok = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}
    if case == "short": p.write_bytes(b"\x01\x02")
    elif case == "header_past_end": _write_raw(p, {"a": ok}, b"\0" * 8, declared_len=10**9)
    elif case == "bad_json": _write_raw(p, b"{not json", b"")
    elif case == "unknown_dtype": _write_raw(p, {"a": {**ok, "dtype": "F8_E9"}}, b"\0" * 8)
    elif case == "offsets_out_of_range": _write_raw(p, {"a": {**ok, "data_offsets": [0, 4096]}}, b"\0" * 8)
    elif case == "size_mismatch": _write_raw(p, {"a": {**ok, "shape": [3]}}, b"\0" * 8)
    elif case == "overlap": _write_raw(p, {"a": ok, "b": {**ok, "data_offsets": [4, 12]}}, b"\0" * 12)
    elif case == "bad_shape": _write_raw(p, {"a": {**ok, "shape": [-2, -1]}}, b"\0" * 8)
    elif case == "not_object": _write_raw(p, b"[1, 2]", b"")
    with pytest.raises(ValueError, match="safetensors"): safe_load(p)

# *** state dicts ***

class Net:
    def __init__(self):
        self.conv = nn.Conv2d(1, 2, 3)
        self.bn = nn.BatchNorm2d(2)
        self.layers = [nn.Linear(8, 4), nn.Linear(4, 2)]
    def __call__(self, x): return self.layers[1](self.layers[0](self.bn(self.conv(x)).relu().flatten(1)))

class TorchNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.bn = torch.nn.Conv2d(1, 2, 3), torch.nn.BatchNorm2d(2)
        self.layers = torch.nn.ModuleList([torch.nn.Linear(8, 4), torch.nn.Linear(4, 2)])

def test_state_dict_names_match_torch():
    ours, ref = get_state_dict(Net()), TorchNet().state_dict()
    assert set(ours) == set(ref)
    for k in ref: assert ours[k].shape == tuple(ref[k].shape), k
    assert len(get_parameters(Net())) == len(ref)

def test_load_torch_checkpoint_into_model_and_run(tmp_path):
    ref = TorchNet()
    torch.save(ref.state_dict(), tmp_path / "net.pth")
    net = Net()
    load_state_dict(net, torch_load(tmp_path / "net.pth"), verbose=False)
    x = np.random.default_rng(0).standard_normal((2, 1, 4, 4)).astype(np.float32)
    ref.eval()
    with torch.no_grad():
        r = ref.layers[1](ref.layers[0](torch.relu(ref.bn(ref.conv(torch.tensor(x)))).flatten(1)))
    np.testing.assert_allclose(net(Tensor(x)).numpy(), r.numpy(), atol=1e-5)

def test_load_state_dict_checks():
    net = Net()
    sd = get_state_dict(Net())
    with pytest.raises(KeyError, match="missing"): load_state_dict(net, {k: v for k, v in sd.items() if k != "bn.bias"})
    with pytest.raises(KeyError, match="unexpected"): load_state_dict(net, {**sd, "extra": Tensor([1.0])})
    with pytest.raises(ValueError, match=r"conv.weight.*\(2, 1, 3, 3\)"):
        load_state_dict(net, {**sd, "conv.weight": Tensor.zeros(2, 1, 2, 2)})
    # non-strict: a missing key is kept, the rest is loaded; float16 values are cast to the model's float32
    half = {k: v.half() if dtypes.is_float(v.dtype) else v for k, v in sd.items() if k != "bn.bias"}
    load_state_dict(net, half, strict=False, verbose=False)
    assert net.conv.weight.dtype == dtypes.float32
    np.testing.assert_allclose(net.conv.weight.numpy(), sd["conv.weight"].half().float().numpy())
    with pytest.raises(TypeError, match="dtype mismatch"):
        load_state_dict(net, {**sd, "conv.weight": Tensor.zeros(2, 1, 3, 3, dtype=dtypes.int32)})

def test_safe_save_load_model_round_trip(tmp_path):
    a, b = Net(), Net()
    safe_save(get_state_dict(a), str(tmp_path / "m.safetensors"))
    load_state_dict(b, safe_load(tmp_path / "m.safetensors"), verbose=False)
    for k, v in get_state_dict(a).items(): np.testing.assert_array_equal(get_state_dict(b)[k].numpy(), v.numpy())

# *** torch checkpoints ***

@pytest.mark.parametrize("zip_format", [True, False], ids=["zip", "legacy"])
def test_torch_load(tmp_path, zip_format):
    base = torch.arange(24, dtype=torch.float32).reshape(2, 3, 4)
    obj = {"model": {"w": base, "t": base.permute(2, 0, 1), "strided": base[:, ::2, 1:3], "shared": base[1],
                     "h": torch.randn(3).half(), "bf": torch.randn(3).bfloat16(), "i": torch.arange(5),
                     "b": torch.tensor([True, False]), "p": torch.nn.Parameter(torch.ones(2)), "s": torch.tensor(7.0)},
           "epoch": 3, "names": ["a", "b"]}
    torch.save(obj, tmp_path / "c.pth", _use_new_zipfile_serialization=zip_format)
    got = torch_load(tmp_path / "c.pth")
    assert got["epoch"] == 3 and got["names"] == ["a", "b"]
    for k, ref in obj["model"].items():
        g = got["model"][k]
        assert g.shape == tuple(ref.shape), k
        bf = ref.dtype == torch.bfloat16
        np.testing.assert_array_equal(g.float().numpy() if bf else g.numpy(),
                                      ref.detach().float().numpy() if bf else ref.detach().numpy())

class _Evil:
    def __reduce__(self): return (print, ("pwned",))

@pytest.mark.parametrize("zip_format", [True, False], ids=["zip", "legacy"])
def test_torch_load_refuses_code(tmp_path, zip_format):
    torch.save({"w": torch.ones(2), "evil": _Evil()}, tmp_path / "evil.pth", _use_new_zipfile_serialization=zip_format)
    refused = r"refusing to load global (__builtin__|builtins)\.print"
    with pytest.raises((pickle.UnpicklingError, ValueError), match=refused):
        torch_load(tmp_path / "evil.pth")

def test_torch_load_malformed(tmp_path):
    (tmp_path / "junk.pth").write_bytes(b"this is not a checkpoint at all")
    with pytest.raises(ValueError, match="torch_load"): torch_load(tmp_path / "junk.pth")
    torch.save({"w": torch.ones(1000)}, tmp_path / "ok.pth", _use_new_zipfile_serialization=False)
    raw = (tmp_path / "ok.pth").read_bytes()
    (tmp_path / "cut.pth").write_bytes(raw[:len(raw) - 100])
    with pytest.raises(ValueError, match="outside|truncated"): torch_load(tmp_path / "cut.pth")

# *** archives ***

def test_zip_and_tar_extract(tmp_path):
    with zipfile.ZipFile(tmp_path / "a.zip", "w") as z:
        z.writestr("stored.bin", b"\x01\x02\x03", compress_type=zipfile.ZIP_STORED)
        z.writestr("deflated.bin", b"abc" * 100, compress_type=zipfile.ZIP_DEFLATED)
    got = zip_extract(str(tmp_path / "a.zip"))
    assert bytes(got["stored.bin"].numpy()) == b"\x01\x02\x03" and bytes(got["deflated.bin"].numpy()) == b"abc" * 100
    with tarfile.open(tmp_path / "a.tar", "w") as t:
        info = tarfile.TarInfo("x/y.bin")
        info.size = 4
        t.addfile(info, io.BytesIO(b"wxyz"))
    assert bytes(tar_extract(str(tmp_path / "a.tar"))["x/y.bin"].numpy()) == b"wxyz"
    (tmp_path / "bad.zip").write_bytes(b"PK\x03\x04garbage")
    with pytest.raises(ValueError, match="zip"): zip_extract(str(tmp_path / "bad.zip"))

# *** GGUF ***

def _q6k_blocks(n_blocks: int, seed: int = 0) -> np.ndarray:
    """Q6_K blocks built by hand from their layout: ql[128] qh[64] int8 scales[16] float16 d."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(n_blocks, 210), dtype=np.uint8)
    blocks[:, 208:210] = np.frombuffer(rng.uniform(0.01, 0.1, n_blocks).astype(np.float16).tobytes(),
                                       np.uint8).reshape(n_blocks, 2)
    return blocks

def test_gguf_against_the_package(tmp_path):
    gguf = pytest.importorskip("gguf")  # in the test extra
    from gguf.quants import dequantize, quantize
    Q = gguf.GGMLQuantizationType
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "llama")
    w.add_uint32("test.n", 7)
    w.add_string("test.s", "hi")
    w.add_array("test.a", [1, 2, 3])
    expected = {}
    for qt in (Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1):
        a = rng.standard_normal((3, 256)).astype(np.float32)
        q = quantize(a, qt)
        w.add_tensor(f"t_{qt.name}", q, raw_dtype=qt)
        expected[f"t_{qt.name}"] = dequantize(q, qt).reshape(3, 256)
    q6 = _q6k_blocks(4).reshape(2, 420)  # two rows of two blocks
    w.add_tensor("t_Q6_K", q6, raw_dtype=Q.Q6_K)
    expected["t_Q6_K"] = dequantize(q6, Q.Q6_K).reshape(2, 512)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    kv, ts = gguf_load(str(tmp_path / "m.gguf"))
    assert kv["test.n"] == 7 and kv["test.s"] == "hi" and kv["test.a"] == [1, 2, 3]
    for k, ref in expected.items():
        assert ts[k].shape == ref.shape, k
        np.testing.assert_allclose(ts[k].float().numpy(), ref, rtol=1e-6, atol=1e-6, err_msg=k)

@pytest.mark.parametrize("case", ["magic", "version", "huge_count", "truncated", "bad_type", "offset_past_end"])
def test_gguf_malformed(tmp_path, case):
    def s(x: str) -> bytes: return struct.pack("<Q", len(x)) + x.encode()
    head = b"GGUF" + struct.pack("<IQQ", 3, 1, 0)
    info = s("w") + struct.pack("<IQ", 1, 4) + struct.pack("<IQ", 0, 0)
    body = head + info
    body += b"\0" * (-len(body) % 32) + b"\0" * 16
    if case == "magic": body = b"GGML" + body[4:]
    elif case == "version": body = b"GGUF" + struct.pack("<I", 99) + body[8:]
    elif case == "huge_count": body = b"GGUF" + struct.pack("<IQQ", 3, 2**60, 0) + info
    elif case == "truncated": body = body[:30]
    elif case == "bad_type": body = head + s("w") + struct.pack("<IQ", 1, 4) + struct.pack("<IQ", 77, 0) + b"\0" * 64
    elif case == "offset_past_end": body = head + s("w") + struct.pack("<IQ", 1, 4) + struct.pack("<IQ", 0, 4096)
    (tmp_path / "bad.gguf").write_bytes(body)
    with pytest.raises(ValueError, match="gguf"): gguf_load(str(tmp_path / "bad.gguf"))

# *** hostile files: bounded expansion ***

GiB = 1 << 30

class _FakeStorage:
    def __init__(self, key: str, numel: int, kind=torch.FloatStorage):
        self.key, self.numel, self.kind = key, numel, kind

class _View:
    """Pickles as torch's record of a tensor: a storage and a geometry (any geometry, also ones torch never writes)."""
    def __init__(self, storage, offset, size, stride): self.args = (storage, offset, size, stride)
    def __reduce__(self):
        import collections
        return torch._utils._rebuild_tensor_v2, (*self.args, False, collections.OrderedDict())

class _Pickler(pickle.Pickler):
    def persistent_id(self, obj):
        if isinstance(obj, _FakeStorage): return ("storage", obj.kind, obj.key, "cpu", obj.numel)
        return None

def _zeros_deflated(n_mib: int) -> bytes:
    """A raw deflate stream of n_mib MiB of zeros, made from one compressed MiB repeated (each ends in a full flush,
    which resets the compressor, so every repeat compresses the same)."""
    c = zlib.compressobj(9, zlib.DEFLATED, -zlib.MAX_WBITS)
    one = c.compress(b"\0" * (1 << 20)) + c.flush(zlib.Z_FULL_FLUSH)
    assert c.compress(b"\0" * (1 << 20)) + c.flush(zlib.Z_FULL_FLUSH) == one
    return one * n_mib + zlib.compressobj(9, zlib.DEFLATED, -zlib.MAX_WBITS).flush()

def _zip(members: dict[str, bytes | tuple[bytes, int, int]]) -> bytes:
    """A zip archive written by hand: a member is its stored bytes, or (a raw deflate stream, the size and CRC the
    directory declares for it), which may be lies."""
    out, central = io.BytesIO(), b""
    for name, m in members.items():
        data, size, crc, method = (m, len(m), zlib.crc32(m), 0) if isinstance(m, bytes) else (*m, 8)
        offset = out.tell()
        out.write(struct.pack("<IHHHHHIIIHH", 0x04034b50, 20, 0, method, 0, 0, crc, len(data), size, len(name), 0))
        out.write(name.encode() + data)
        central += struct.pack("<IHHHHHHIIIHHHHHII", 0x02014b50, 20, 20, 0, method, 0, 0, crc, len(data), size,
                               len(name), 0, 0, 0, 0, 0, offset) + name.encode()
    start = out.tell()
    out.write(central + struct.pack("<IHHHHIIH", 0x06054b50, 0, 0, len(members), len(members), len(central), start, 0))
    return out.getvalue()

def _checkpoint(obj, storages: dict[str, bytes | tuple[bytes, int, int]]) -> bytes:
    """A zip-format PyTorch checkpoint of `obj` (with _View and _FakeStorage in it) and the given storage members."""
    f = io.BytesIO()
    _Pickler(f, protocol=2).dump(obj)
    return _zip({"archive/data.pkl": f.getvalue(), "archive/byteorder": b"little", "archive/version": b"3\n",
                 **{f"archive/data/{k}": v for k, v in storages.items()}})

def test_hand_made_checkpoint_loads_as_torch_does():
    data = np.arange(6, dtype=np.float32).tobytes()
    st = _FakeStorage("0", 6)
    c = zlib.compressobj(9, zlib.DEFLATED, -zlib.MAX_WBITS)
    deflated = c.compress(data) + c.flush()
    for member in (data, (deflated, len(data), zlib.crc32(data))):
        raw = _checkpoint({"a": _View(st, 1, (2, 2), (2, 1)), "b": _View(st, 0, (3, 2), (1, 1))}, {"0": member})
        ref, got = torch.load(io.BytesIO(raw), weights_only=True), torch_load(raw)
        for k in "ab": np.testing.assert_array_equal(got[k].numpy(), ref[k].numpy())

def _bounded(fn, max_seconds: float = 5.0, max_mib: int = 48):
    """fn() run under tracemalloc: its exception, after checking it ran fast and allocated little on the way."""
    tracemalloc.start()
    start = time.perf_counter()
    try:
        fn()
        err = None
    except Exception as e:  # noqa: BLE001 (returned to the caller, which checks its type)
        err = e
    seconds, peak = time.perf_counter() - start, tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert seconds < max_seconds and peak < max_mib << 20, (seconds, peak)
    return err

def test_torch_zip_bomb_refused_before_inflating():
    # a 1 MB checkpoint whose 16-byte storage is a deflated member of 1 GiB: its size disagrees with the tensor's
    bomb = _zeros_deflated(1024)
    assert len(bomb) < 2 << 20
    raw = _checkpoint({"w": _View(_FakeStorage("0", 4), 0, (4,), (1,))}, {"0": (bomb, GiB, 0)})
    err = _bounded(lambda: torch_load(raw))
    assert isinstance(err, ValueError) and "holds 1073741824 bytes, not the 4" in str(err)

def test_torch_zip_bomb_lying_directory():
    # the directory says 16 bytes (with their CRC) but the stream goes on to 1 GiB: inflation stops at byte 17
    raw = _checkpoint({"w": _View(_FakeStorage("0", 4), 0, (4,), (1,))},
                      {"0": (_zeros_deflated(1024), 16, zlib.crc32(b"\0" * 16))})
    err = _bounded(lambda: torch_load(raw))
    assert isinstance(err, ValueError) and "inflates past its declared 16 bytes" in str(err)

def test_torch_zip_bomb_honest_sizes_needs_a_raised_limit(monkeypatch):
    # sizes that agree (a 1 GiB storage, deflated) still may not inflate past the limit unless the caller raises it
    raw = _checkpoint({"w": _View(_FakeStorage("0", GiB // 4), 0, (GiB // 4,), (1,))},
                      {"0": (_zeros_deflated(1024), GiB, 0)})
    err = _bounded(lambda: torch_load(raw))
    assert isinstance(err, ValueError) and "MAX_INFLATED_BYTES" in str(err)
    small = _checkpoint({"w": _View(_FakeStorage("0", 1 << 18), 0, (1 << 18,), (1,))},
                        {"0": (_zeros_deflated(1), 1 << 20, zlib.crc32(b"\0" * (1 << 20)))})
    assert torch_load(small)["w"].shape == (1 << 18,)
    with pytest.raises(ValueError, match="1048576 bytes, past the limit of 1000"): torch_load(small, max_inflated=1000)
    monkeypatch.setattr(state, "MAX_INFLATED_BYTES", 1000)
    with pytest.raises(ValueError, match="past the limit of 1000"): torch_load(small)
    np.testing.assert_array_equal(torch_load(small, max_inflated=1 << 20)["w"].numpy(), np.zeros(1 << 18, np.float32))

def test_zip_extract_bombs():
    bomb = _zeros_deflated(1024)
    for member, match in [((bomb, GiB, 0), "past the limit"), ((bomb, 16, zlib.crc32(b"\0" * 16)), "inflates past")]:
        raw = _zip({"a.bin": member})
        err = _bounded(lambda: zip_extract(raw))
        assert isinstance(err, ValueError) and match in str(err)
    ok = _zip({"a.bin": (_zeros_deflated(1), 1 << 20, zlib.crc32(b"\0" * (1 << 20))), "b.bin": b"xyz"})
    got = zip_extract(ok)
    assert got["a.bin"].shape == (1 << 20,) and bytes(got["b.bin"].numpy()) == b"xyz"
    with pytest.raises(ValueError, match="past the limit"): zip_extract(ok, max_inflated=1 << 19)

def test_tar_gz_bomb(tmp_path):
    with tarfile.open(tmp_path / "a.tar.gz", "w:gz") as t:
        info = tarfile.TarInfo("zeros.bin")
        info.size = 8 << 20
        t.addfile(info, io.BytesIO(b"\0" * info.size))
    assert (tmp_path / "a.tar.gz").stat().st_size < 100_000
    assert tar_extract(str(tmp_path / "a.tar.gz"))["zeros.bin"].shape == (8 << 20,)
    err = _bounded(lambda: tar_extract(str(tmp_path / "a.tar.gz"), max_inflated=1 << 20))
    assert isinstance(err, ValueError) and "past the decompressed archive" in str(err)

# *** hostile files: every malformed input is a ValueError naming what is wrong ***

def _legacy(obj_pickle: bytes) -> bytes:
    """A legacy-format checkpoint around a hand-written pickle of the object (no storages)."""
    head = b"".join(pickle.dumps(x, protocol=2) for x in (0x1950a86a20f9469cfc6c, 1001, {"little_endian": True}))
    return head + obj_pickle + pickle.dumps([], protocol=2)

def _nested_lists(depth: int) -> bytes:
    return b"\x80\x02" + b"]" * depth + b"a" * (depth - 1) + b"."

@pytest.mark.parametrize("case", ["eof", "unicode", "type", "recursion", "cycle", "bad_zip", "bytearray8",
                                  "unknown_opcode", "missing_storage_key", "truncated_zip"])
def test_torch_load_malformed_pickles_are_value_errors(case):
    ok = io.BytesIO()
    torch.save({"w": torch.ones(3)}, ok)
    raw = {"eof": lambda: _legacy(b"\x80\x02]q\x00"),
           "unicode": lambda: _legacy(b"\x80\x02X\x02\x00\x00\x00\xff\xfe."),
           "type": lambda: _legacy(b"\x80\x02ccollections\nOrderedDict\nK\x01K\x02K\x03\x87R."),
           "recursion": lambda: _legacy(_nested_lists(20_000)),
           "cycle": lambda: _legacy(b"\x80\x02]q\x00h\x00a."),  # a list holding itself
           "bad_zip": lambda: b"PK\x03\x04" + b"\0" * 200,
           "bytearray8": lambda: _legacy(b"\x80\x05\x96" + struct.pack("<Q", 1 << 40) + b"."),
           "unknown_opcode": lambda: _legacy(b"\x80\x02\xff."),
           "missing_storage_key": lambda: _checkpoint({"w": _View(_FakeStorage("7", 4), 0, (4,), (1,))}, {}),
           "truncated_zip": lambda: ok.getvalue()[:len(ok.getvalue()) // 2]}[case]()
    err = _bounded(lambda: torch_load(raw))
    assert type(err) is ValueError and str(err).startswith("torch_load"), repr(err)

def test_torch_load_huge_memo_index_is_cheap():
    # LONG_BINPUT 2**31-1 is a valid pickle: the memo stays a dict of one entry instead of an array of 2**31
    raw = _legacy(b"\x80\x02K\x01r\xff\xff\xff\x7f.")
    out = []
    assert _bounded(lambda: out.append(torch_load(raw))) is None and out == [1]

@pytest.mark.parametrize("geometry,match", [
    (((2,) * 62, (0,) * 62, 0), "expands to"),  # 2**62 elements from one: past the expansion limit, refused at once
    (((2,) * 64, (0,) * 64, 0), "under 2**63 elements"),
    (((1,) * 65, (1,) * 65, 0), "at most 64 dims"),
    (((True, 2), (2, 1), 0), "bad tensor geometry"),
    (((2, 2), (1, 1), -1), "bad tensor geometry"),
    (((2, 2), (1, 1), 1.5), "bad tensor geometry"),
    (((4,), (1,), 1), "reads past its storage"),
    (((2, 3), (1,), 0), "bad tensor geometry")])
def test_torch_load_bad_geometry_refused_upfront(geometry, match):
    raw = _checkpoint({"w": _View(_FakeStorage("0", 4), geometry[2], *geometry[:2])}, {"0": b"\0" * 16})
    err = _bounded(lambda: torch_load(raw))
    assert isinstance(err, ValueError) and match in str(err), repr(err)

@pytest.mark.parametrize("size,stride,offset", [((1,) * 64, (0,) * 64, 2), ((2,) * 16, (0,) * 16, 3),
                                                 ((3, 1, 2), (0, 5, 1), 1), ((2, 2, 2), (1, 1, 1), 0),
                                                 ((2, 3, 2), (1, 0, 2), 1), ((3, 2), (2, 0), 0)])
def test_torch_load_odd_views_as_torch(size, stride, offset):
    data = np.arange(6, dtype=np.float32)
    raw = _checkpoint({"w": _View(_FakeStorage("0", 6), offset, size, stride)}, {"0": data.tobytes()})
    ref = torch.load(io.BytesIO(raw), weights_only=True)["w"]
    start = time.perf_counter()
    got = torch_load(raw)["w"]
    assert time.perf_counter() - start < 10
    assert got.shape == tuple(ref.shape)
    np.testing.assert_array_equal(got.numpy(), ref.numpy())

@pytest.mark.parametrize("case", ["deep_json", "bool_shape", "bool_offset", "list_dtype", "gap", "trailing",
                                  "metadata_not_strings", "too_many_dims"])
def test_malformed_safetensors_fields(tmp_path, case):
    p = tmp_path / "bad.safetensors"
    ok = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}
    if case == "deep_json": _write_raw(p, b"[" * 100_000 + b"]" * 100_000)
    elif case == "bool_shape": _write_raw(p, {"a": {**ok, "shape": [True, 2]}}, b"\0" * 8)
    elif case == "bool_offset": _write_raw(p, {"a": {**ok, "shape": [1], "data_offsets": [False, True]}}, b"\0")
    elif case == "list_dtype": _write_raw(p, {"a": {**ok, "dtype": ["F32"]}}, b"\0" * 8)
    elif case == "gap": _write_raw(p, {"a": {**ok, "data_offsets": [4, 12]}}, b"\0" * 12)
    elif case == "trailing": _write_raw(p, {"a": ok}, b"\0" * 12)
    elif case == "metadata_not_strings": _write_raw(p, {"__metadata__": {"n": 1}, "a": ok}, b"\0" * 8)
    elif case == "too_many_dims": _write_raw(p, {"a": {**ok, "shape": [1] * 65 + [2]}}, b"\0" * 8)
    with pytest.raises(ValueError, match="safetensors") as e: safe_load(p)
    assert type(e.value) is ValueError  # not a JSON or Unicode error passed through
    with pytest.raises(Exception): safetensors.numpy.load_file(str(p))  # the reference refuses each too

def _gguf_bytes(kv: bytes = b"", n_kv: int = 0, tensors=(), data: bytes = b"") -> bytes:
    """A GGUF file of the given metadata bytes and (name, dims, type) tensors at offset 0, then `data`."""
    body = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), n_kv) + kv
    for name, dims, typ in tensors:
        body += struct.pack("<Q", len(name)) + name + struct.pack(f"<I{len(dims)}QIQ", len(dims), *dims, typ, 0)
    return body + b"\0" * (-len(body) % 32) + data

@pytest.mark.parametrize("case", ["duplicate_tensor", "duplicate_key", "bad_utf8_name", "alignment_bool",
                                  "alignment_int32", "rows_not_blocks", "scalar_quantized"])
def test_gguf_malformed_fields(tmp_path, case):
    def kv(key: bytes, typ: int, val: bytes) -> bytes:
        return struct.pack("<Q", len(key)) + key + struct.pack("<I", typ) + val
    f32 = (b"w", (4,), 0)
    raw = {"duplicate_tensor": lambda: _gguf_bytes(tensors=[f32, f32], data=b"\0" * 16),
           "duplicate_key": lambda: _gguf_bytes(kv(b"k", 4, b"\1\0\0\0") * 2, 2),
           "bad_utf8_name": lambda: _gguf_bytes(tensors=[(b"w\xff", (4,), 0)], data=b"\0" * 16),
           "alignment_bool": lambda: _gguf_bytes(kv(b"general.alignment", 7, b"\1"), 1, [f32], b"\0" * 16),
           "alignment_int32": lambda: _gguf_bytes(kv(b"general.alignment", 5, b"\x20\0\0\0"), 1, [f32], b"\0" * 16),
           "rows_not_blocks": lambda: _gguf_bytes(tensors=[(b"q", (16, 2), 8)], data=b"\0" * 34),  # Q8_0 rows of 16
           "scalar_quantized": lambda: _gguf_bytes(tensors=[(b"q", (), 8)], data=b"\0" * 34)}[case]()
    (tmp_path / "bad.gguf").write_bytes(raw)
    with pytest.raises(ValueError, match="gguf"): gguf_load(str(tmp_path / "bad.gguf"))
    if case != "duplicate_key":  # the reference reader refuses the rest too (it skips the key check when parsing)
        import gguf
        with pytest.raises(Exception):
            r = gguf.GGUFReader(str(tmp_path / "bad.gguf"))
            from gguf.quants import dequantize
            for t in r.tensors: dequantize(t.data, t.tensor_type).reshape(tuple(reversed(t.shape.tolist())))

def test_archives_malformed(tmp_path):
    # zip: a member named twice, a bzip2 member, a multi-disk end record
    with zipfile.ZipFile(tmp_path / "dup.zip", "w") as z:
        z.writestr("a", b"1")
        with pytest.warns(UserWarning): z.writestr("a", b"2")
    with pytest.raises(ValueError, match="twice"): zip_extract(str(tmp_path / "dup.zip"))
    with zipfile.ZipFile(tmp_path / "bz.zip", "w", zipfile.ZIP_BZIP2) as z: z.writestr("a", b"1" * 100)
    with pytest.raises(ValueError, match="compression method 12"): zip_extract(str(tmp_path / "bz.zip"))
    multi = bytearray(_zip({"a": b"1"}))
    multi[-18:-16] = b"\1\0"  # this disk's number
    with pytest.raises(ValueError, match="several disks"): zip_extract(bytes(multi))
    # tar: a damaged second header (python's tarfile would stop there), a sparse member, a truncated member
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as t:
        for name in ("a", "b"):
            info = tarfile.TarInfo(name)
            info.size = 3
            t.addfile(info, io.BytesIO(b"xyz"))
    raw = bytearray(buf.getvalue())
    assert set(tar_extract(bytes(raw))) == {"a", "b"}
    damaged = raw.copy()
    damaged[1024 + 148] ^= 1  # the second header's checksum
    with pytest.raises(ValueError, match="damaged header"): tar_extract(bytes(damaged))
    with pytest.raises(ValueError, match="tar"): tar_extract(bytes(raw[:1024 + 512 + 1]))
    sparse = raw.copy()
    sparse[156:157] = b"S"
    sparse[148:156] = b"%06o\0 " % (sum(sparse[:148]) + 8 * 32 + sum(sparse[156:512]))
    with pytest.raises(ValueError, match="sparse|tar"): tar_extract(bytes(sparse))

# *** load_state_dict as tinygrad programs use it ***

def test_load_state_dict_of_torch_batchnorm_with_and_without_num_batches_tracked():
    import torch
    from fusegrad import nn
    tb = torch.nn.BatchNorm2d(4)
    tb.train()
    for _ in range(3): tb(torch.randn(2, 4, 3, 3))
    sd = {k: Tensor(v.numpy()) for k, v in tb.state_dict().items()}
    ours = nn.BatchNorm(4)
    load_state_dict(ours, sd)
    assert ours.num_batches_tracked.item() == tb.num_batches_tracked.item() == 3
    np.testing.assert_array_equal(ours.running_var.numpy(), tb.running_var.numpy())
    # tinygrad keeps the counter with shape (1,): () and (1,) load into each other
    sd["num_batches_tracked"] = Tensor([7], dtype=dtypes.int64)
    load_state_dict(ours, sd)
    assert ours.num_batches_tracked.shape == () and ours.num_batches_tracked.item() == 7
    # a model that doesn't keep the counter ignores it, even when strict; other unexpected keys still raise
    class NoCounter:
        def __init__(self):
            self.weight, self.bias = Tensor.zeros(4).contiguous(), Tensor.zeros(4).contiguous()
            self.running_mean, self.running_var = Tensor.zeros(4).contiguous(), Tensor.ones(4).contiguous()
    plain = NoCounter()
    load_state_dict(plain, {k: Tensor(v.numpy()) for k, v in tb.state_dict().items()})
    np.testing.assert_array_equal(plain.running_mean.numpy(), tb.running_mean.numpy())
    with pytest.raises(KeyError, match="unexpected keys.*'extra'"):
        load_state_dict(plain, {**{k: Tensor(v.numpy()) for k, v in tb.state_dict().items()}, "extra": Tensor([1.0])})

def test_load_state_dict_into_a_sharded_model():
    from fusegrad import nn
    devices = ("CPU", "CPU:1")
    model = nn.Linear(6, 4)
    model.weight.shard_(devices, axis=0).realize()
    model.bias.shard_(devices, axis=None).realize()
    rng = np.random.default_rng(0)
    w, b = rng.standard_normal((4, 6)).astype(np.float32), rng.standard_normal(4).astype(np.float32)
    load_state_dict(model, {"weight": Tensor(w), "bias": Tensor(b)})
    assert model.weight.device == devices and model.weight.uop.arg == 0 and model.bias.device == devices
    np.testing.assert_array_equal(model.weight.numpy(), w)
    np.testing.assert_array_equal(model.bias.numpy(), b)
    x = rng.standard_normal((3, 6)).astype(np.float32)
    np.testing.assert_allclose(model(Tensor(x).shard(devices)).numpy(), x @ w.T + b, rtol=1e-5, atol=1e-5)

@pytest.mark.parametrize("model_axis,value_axis", [(0, 1), (1, 0), (None, 0), (0, None), (None, 1), (1, None),
                                                   ("one", 0), (1, "one")])
def test_load_state_dict_lays_out_the_value_as_the_model(model_axis, value_axis):
    # ("one": on a single device) the value is split or replicated as the model's tensor is, keeping its shard bounds
    from fusegrad.schedule.multi import multi_bounds
    devices = ("CPU", "CPU:1", "CPU:2")
    rng = np.random.default_rng(1)
    w = rng.standard_normal((5, 7)).astype(np.float32)   # (uneven shards of 5 and of 7 over three devices)
    model = nn.Linear(7, 5, bias=False)
    if model_axis != "one": model.weight.shard_(devices, axis=model_axis).realize()
    before = (model.weight.device, model.weight.uop.arg, multi_bounds(model.weight.uop)) if model_axis != "one" \
        else (model.weight.device,)
    value = Tensor(w) if value_axis == "one" else Tensor(w).shard(devices, axis=value_axis)
    load_state_dict(model, {"weight": value})
    after = (model.weight.device, model.weight.uop.arg, multi_bounds(model.weight.uop)) if model_axis != "one" \
        else (model.weight.device,)
    assert after == before
    np.testing.assert_array_equal(model.weight.numpy(), w)
    if model_axis != "one":   # each shard holds its own part of the value
        shards = [Tensor(s).numpy() for s in model.weight.uop.src]
        bounds = multi_bounds(model.weight.uop)
        for s, (lo, hi) in zip(shards, bounds if bounds is not None else [(0, 5)] * 3):
            want = w if bounds is None else (w[lo:hi] if model_axis == 0 else w[:, lo:hi])
            np.testing.assert_array_equal(s, want)

def test_load_state_dict_num_batches_tracked_into_a_sharded_batchnorm():
    devices = ("CPU", "CPU:1")
    tb = torch.nn.BatchNorm2d(4)
    tb.running_mean.uniform_(); tb.num_batches_tracked.fill_(11)
    ours = nn.BatchNorm2d(4)
    for t in get_state_dict(ours).values(): t.shard_(devices).realize()
    load_state_dict(ours, {k: Tensor(v.numpy()).shard(devices, 0 if v.ndim else None)
                           for k, v in tb.state_dict().items()})
    assert ours.num_batches_tracked.device == devices and ours.num_batches_tracked.item() == 11
    assert ours.running_mean.device == devices and ours.running_mean.uop.arg is None
    np.testing.assert_array_equal(ours.running_mean.numpy(), tb.running_mean.numpy())
