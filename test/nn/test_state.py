"""nn.state against independent writers and readers: the `safetensors` package, `torch.save`, the `gguf` package; round
trips; state-dict naming against torch.nn; and every malformed-file case rejected with a clear error."""
from __future__ import annotations
import io
import json
import pickle
import struct
import tarfile
import zipfile
import numpy as np
import pytest
import torch
import safetensors.numpy
import safetensors.torch
from fusegrad import Tensor, dtypes, nn
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
