"""The 8-, 4- and 2-bit element types: rounding into each format checked exhaustively against ml_dtypes (every code,
the values halfway between codes and just beside them, subnormals, overflow with and without saturation, NaN and
infinities, every float16), and the runner's handling of such inputs, initializers and outputs."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
from onnx import TensorProto as TP, helper, numpy_helper  # noqa: E402

from fusegrad import Tensor  # noqa: E402
from fusegrad.onnx import OnnxRunner, OnnxUnsupportedError  # noqa: E402
from fusegrad.onnx.narrow import NARROW, NarrowTensor, round_to, values  # noqa: E402

FLOATS = [TP.FLOAT8E4M3FN, TP.FLOAT8E4M3FNUZ, TP.FLOAT8E5M2, TP.FLOAT8E5M2FNUZ, TP.FLOAT6E2M3, TP.FLOAT6E3M2,
          TP.FLOAT4E2M1]
# the formats without NaN or infinity, which always saturate
SATURATING = [TP.FLOAT6E2M3, TP.FLOAT6E3M2, TP.FLOAT4E2M1]


def _count(t: int) -> int:
    """The number of codes of a float format."""
    return 16 if t == TP.FLOAT4E2M1 else 64 if t in (TP.FLOAT6E2M3, TP.FLOAT6E3M2) else 256
INTS = [TP.INT4, TP.UINT4, TP.INT2, TP.UINT2]


def _codes(t: int) -> np.ndarray:
    """Every value of a format, as float32 (ml_dtypes decodes the codes)."""
    n = NARROW[t]
    count = _count(t)
    return np.arange(count, dtype=np.uint8).view(n.np_type).astype(np.float32)


def _probe_values(t: int) -> np.ndarray:
    """The codes, the points halfway between neighbouring codes and the floats just beside those, values beyond the
    largest one, tiny values and the special ones, with both signs."""
    codes = _codes(t)
    pos = np.unique(np.abs(codes[np.isfinite(codes)]))
    top = pos[-1]
    step = pos[-1] - pos[-2]
    ext = np.concatenate([pos, [top + step, top + 2 * step, top * 4]]).astype(np.float32)
    mids = ((ext[:-1].astype(np.float64) + ext[1:]) / 2).astype(np.float32)
    beside = np.concatenate([np.nextafter(mids, np.float32(np.inf)), np.nextafter(mids, np.float32(0))])
    tiny = np.array([pos[1] / 4, pos[1] / 2 * 1.0001, 1e-30, 1e-45, 3e38], np.float32)
    vals = np.concatenate([ext, mids, beside, tiny, [np.inf, np.nan]]).astype(np.float32)
    return np.concatenate([vals, -vals])


def _reference(x: np.ndarray, t: int, saturate: bool) -> np.ndarray:
    """ml_dtypes' cast; with saturation, values beyond the largest one (infinities too) are clamped first, which is
    ONNX's saturating cast (the formats without NaN always saturate)."""
    n = NARROW[t]
    if saturate and t not in SATURATING:
        big = float(ml_dtypes.finfo(n.np_type).max)
        x = np.where(np.isnan(x), x, np.clip(x, -big, big)).astype(x.dtype)
    return x.astype(n.np_type)


def _assert_same(got: np.ndarray, want: np.ndarray, x: np.ndarray) -> None:
    """Equal codes, except that any NaN matches any NaN."""
    assert got.dtype == want.dtype
    gb, wb = got.view(np.uint8), want.view(np.uint8)
    gf, wf = got.astype(np.float32), want.astype(np.float32)
    bad = (gb != wb) & ~(np.isnan(gf) & np.isnan(wf))
    assert not bad.any(), f"inputs {x[bad][:8]}: got {gf[bad][:8]}, want {wf[bad][:8]}"


@pytest.mark.parametrize("saturate", [True, False])
@pytest.mark.parametrize("t", FLOATS, ids=lambda t: NARROW[t].name)
def test_float_rounding_probes(t, saturate):
    x = _probe_values(t)
    got = round_to(Tensor(x), t, saturate).numpy()
    _assert_same(got, _reference(x, t, saturate), x)


@pytest.mark.parametrize("t", FLOATS, ids=lambda t: NARROW[t].name)
def test_float_rounding_every_float16(t):
    # every float16 value, NaNs and infinities included, in one kernel
    x = np.arange(1 << 16, dtype=np.uint16).view(np.float16)
    with np.errstate(invalid="ignore", over="ignore"):
        x32 = x.astype(np.float32)
    got = round_to(Tensor(x), t, False).numpy()
    with np.errstate(invalid="ignore", over="ignore"):
        _assert_same(got, _reference(x32, t, False), x)


def _nearest_code(x: np.ndarray, t: int) -> np.ndarray:
    """Saturating round to nearest even, by search over the codes in float64 (ml_dtypes rounds a float64 through
    float32, which can round twice)."""
    n = NARROW[t]
    count = _count(t)
    codes = np.arange(count, dtype=np.uint8)
    vals = codes.view(n.np_type).astype(np.float64)
    keep = np.isfinite(vals) & (vals >= 0) & ~((vals == 0) & (np.arange(count) != 0))
    vals, codes = vals[keep], codes[keep]
    order = np.argsort(vals)
    vals, codes = vals[order], codes[order]
    a = np.minimum(np.abs(x), vals[-1])
    hi = np.clip(np.searchsorted(vals, a), 1, len(vals) - 1)
    lo = hi - 1
    dlo, dhi = a - vals[lo], vals[hi] - a
    pick = np.where(dlo < dhi, lo, np.where(dhi < dlo, hi, np.where(codes[lo] % 2 == 0, lo, hi)))
    out = vals[pick] * np.where(np.signbit(x), -1.0, 1.0)
    if t in (TP.FLOAT8E4M3FNUZ, TP.FLOAT8E5M2FNUZ): out = np.where(out == 0, 0.0, out)
    return out.astype(n.np_type)


@pytest.mark.parametrize("t", FLOATS, ids=lambda t: NARROW[t].name)
def test_float_rounding_from_float64(t):
    # rounded in float64: values just beside the halfway points, which float32 would round onto them
    x = _probe_values(t).astype(np.float64)
    x = x[np.isfinite(x)]
    x = np.concatenate([x, x * (1 + 2.0 ** -40), x * (1 - 2.0 ** -40)])
    got = round_to(Tensor(x), t, True).numpy()
    _assert_same(got, _nearest_code(x, t), x)
    # the search agrees with ml_dtypes on float32 values
    x32 = _probe_values(t)
    x32 = x32[np.isfinite(x32)]
    _assert_same(_nearest_code(x32.astype(np.float64), t), _reference(x32, t, True), x32)


@pytest.mark.parametrize("t", FLOATS + INTS, ids=lambda t: NARROW[t].name)
def test_every_code_round_trips(t):
    n = NARROW[t]
    if t in FLOATS: arr = np.arange(_count(t), dtype=np.uint8).view(n.np_type)
    else: arr = np.arange(n.fmt[0], n.fmt[1] + 1).astype(n.np_type)  # type: ignore[index]
    got = round_to(Tensor(arr.astype(np.float32)), t, False).numpy()
    _assert_same(got, arr, arr.astype(np.float32))


@pytest.mark.parametrize("t", INTS, ids=lambda t: NARROW[t].name)
def test_int_cast_truncates_and_wraps(t):
    # as ml_dtypes: floats truncate toward zero, out-of-range values keep their low bits
    x = np.concatenate([np.arange(-40, 40, 0.25), [0.5, -0.5, 7.9, -8.9, np.nan, np.inf, -np.inf]]).astype(np.float32)
    got = round_to(Tensor(x), t).numpy()
    with np.errstate(invalid="ignore"):
        want = x.astype(NARROW[t].np_type)
    np.testing.assert_array_equal(got.astype(np.int32), want.astype(np.int32))
    ints = np.arange(-300, 300, dtype=np.int32)
    np.testing.assert_array_equal(round_to(Tensor(ints), t).numpy().astype(np.int32),
                                  ints.astype(NARROW[t].np_type).astype(np.int32))


def _e8m0_probes() -> np.ndarray:
    exps = np.arange(-149, 128, dtype=np.float64)
    mant = np.array([1.0, 1.25, 1.5, 1.5 + 2.0 ** -20, 1.5 - 2.0 ** -20, 1.75, 2 - 2.0 ** -23])
    v = (2.0 ** exps[:, None] * mant[None, :]).reshape(-1)
    v = v[v < 3.4e38]
    return np.concatenate([v, [0.0, np.inf, np.nan, 3.4e38, 2.0 ** -127 * 0.75, 2.0 ** -127 * 0.5]]).astype(np.float32)


@pytest.mark.parametrize("saturate", [True, False])
@pytest.mark.parametrize("mode", ["up", "down", "nearest"])
def test_e8m0_rounding(mode, saturate):
    x = _e8m0_probes()
    got = round_to(Tensor(x), TP.FLOAT8E8M0, saturate, mode).numpy()
    want = numpy_helper.to_float8e8m0(x, saturate, mode)
    np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))


def test_e8m0_values():
    codes = np.arange(256, dtype=np.uint8)
    got = values(NarrowTensor(Tensor(codes), TP.FLOAT8E8M0)).numpy()
    np.testing.assert_array_equal(got, codes.view(ml_dtypes.float8_e8m0fnu).astype(np.float32))


def _cast_model(src: int, dst: int, shape: list[int], **attrs) -> onnx.ModelProto:
    node = helper.make_node("Cast", ["x"], ["y"], to=dst, **attrs)
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", src, shape)],
                          [helper.make_tensor_value_info("y", dst, shape)])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 23)])


@pytest.mark.parametrize("t", [TP.FLOAT8E4M3FN, TP.FLOAT8E5M2FNUZ, TP.INT4, TP.FLOAT4E2M1, TP.FLOAT6E3M2],
                         ids=lambda t: NARROW[t].name)
def test_cast_under_jit(t):
    x = _probe_values(TP.FLOAT8E4M3FN)[:64] if t in FLOATS else np.arange(-8, 8, 0.25, dtype=np.float32)
    run = OnnxRunner(_cast_model(TP.FLOAT, t, [len(x)])).jit()
    for k in range(3):  # capture, then replays with new values
        xk = (x * (k + 1)).astype(np.float32)
        got = run({"x": xk})["y"]
        with np.errstate(invalid="ignore"):
            want = _reference(xk, t, True) if t in FLOATS else xk.astype(NARROW[t].np_type)
        _assert_same(got, want, xk)


def test_narrow_input_and_output_under_jit():
    # an INT4 input, reshaped (its type carries over), cast to float and to UINT4
    nodes = [helper.make_node("Reshape", ["x", "shape"], ["r"]), helper.make_node("Cast", ["r"], ["f"], to=TP.FLOAT),
             helper.make_node("Cast", ["r"], ["u"], to=TP.UINT4)]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TP.INT4, [2, 8])],
                          [helper.make_tensor_value_info("r", TP.INT4, [4, 4]),
                           helper.make_tensor_value_info("f", TP.FLOAT, [4, 4]),
                           helper.make_tensor_value_info("u", TP.UINT4, [4, 4])],
                          [numpy_helper.from_array(np.array([4, 4], np.int64), "shape")])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 23)])
    x = np.arange(-8, 8).reshape(2, 8).astype(ml_dtypes.int4)
    plain = OnnxRunner(model)({"x": x})
    assert isinstance(plain["r"], NarrowTensor) and plain["r"].numpy().dtype == ml_dtypes.int4
    run = OnnxRunner(model).jit()
    for k in range(3):
        xk = ((np.arange(-8, 8) + k) % 16 - 8).reshape(2, 8).astype(ml_dtypes.int4)
        out = run({"x": xk})
        assert out["r"].dtype == ml_dtypes.int4 and out["u"].dtype == ml_dtypes.uint4
        np.testing.assert_array_equal(out["r"].astype(np.int32), xk.reshape(4, 4).astype(np.int32))
        np.testing.assert_array_equal(out["f"], xk.reshape(4, 4).astype(np.float32))
        np.testing.assert_array_equal(out["u"].astype(np.int32), xk.reshape(4, 4).astype(np.int32) % 16)


def test_packed_initializer():
    # an odd number of INT4 values (two per byte) and UINT2 values (four per byte) in initializers
    vals4 = np.array([-8, 7, 3, -1, 0], dtype=ml_dtypes.int4)
    vals2 = np.array([0, 1, 2, 3, 3, 1, 2], dtype=ml_dtypes.uint2)
    nodes = [helper.make_node("Cast", ["a"], ["fa"], to=TP.FLOAT), helper.make_node("Cast", ["b"], ["fb"], to=TP.FLOAT)]
    g = helper.make_graph(nodes, "g", [], [helper.make_tensor_value_info("fa", TP.FLOAT, [5]),
                                           helper.make_tensor_value_info("fb", TP.FLOAT, [7])],
                          [helper.make_tensor("a", TP.INT4, [5], vals4.astype(np.int8).tolist()),
                           helper.make_tensor("b", TP.UINT2, [7], vals2.astype(np.uint8).tolist())])
    out = OnnxRunner(helper.make_model(g, opset_imports=[helper.make_opsetid("", 23)]))({})
    np.testing.assert_array_equal(out["fa"].numpy(), vals4.astype(np.float32))
    np.testing.assert_array_equal(out["fb"].numpy(), vals2.astype(np.float32))


def test_narrow_input_errors():
    run = OnnxRunner(_cast_model(TP.FLOAT8E4M3FN, TP.FLOAT, [3]))
    with pytest.raises(Exception, match="float8_e4m3fn"):
        run({"x": np.zeros(3, np.float32)})
    node = helper.make_node("Add", ["x", "x"], ["y"])
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TP.FLOAT8E5M2, [3])],
                          [helper.make_tensor_value_info("y", TP.FLOAT8E5M2, [3])])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 23)])
    with pytest.raises(OnnxUnsupportedError, match="Add.*FLOAT8E5M2"):
        OnnxRunner(model)({"x": np.zeros(3, ml_dtypes.float8_e5m2)})


@pytest.mark.parametrize("t", [TP.INT4, TP.UINT4, TP.INT2, TP.UINT2, TP.FLOAT8E4M3FN, TP.FLOAT4E2M1,
                               TP.FLOAT6E2M3],
                         ids=lambda t: NARROW[t].name)
def test_quantize_dequantize(t):
    x = np.linspace(-20, 20, 81).astype(np.float32)
    scale = np.float32(1.5)
    zp = np.zeros((), NARROW[t].np_type)
    nodes = [helper.make_node("QuantizeLinear", ["x", "s", "zp"], ["q"]),
             helper.make_node("DequantizeLinear", ["q", "s", "zp"], ["d"])]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TP.FLOAT, [81])],
                          [helper.make_tensor_value_info("q", t, [81]),
                           helper.make_tensor_value_info("d", TP.FLOAT, [81])],
                          [numpy_helper.from_array(np.array(scale), "s"), numpy_helper.from_array(zp, "zp")])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)])
    from onnx.reference import ReferenceEvaluator
    want_q, want_d = ReferenceEvaluator(model).run(None, {"x": x})
    out = OnnxRunner(model).jit()({"x": x})
    _assert_same(out["q"], want_q, x)
    np.testing.assert_array_equal(out["d"], want_d)


@pytest.mark.parametrize("t", FLOATS + INTS + [TP.FLOAT8E8M0], ids=lambda t: NARROW[t].name)
def test_numpy_conversions_match_ml_dtypes(t):
    # every code to the holder's values and back (the conversions look values up instead of calling ml_dtypes)
    from fusegrad.onnx.narrow import _bits, from_narrow_numpy, to_narrow_numpy
    n = NARROW[t]
    codes = np.arange(1 << _bits(n), dtype=np.uint8)
    arr = codes.view(n.np_type) if t in FLOATS or t == TP.FLOAT8E8M0 else \
        np.arange(n.fmt[0], n.fmt[1] + 1).astype(n.np_type)  # type: ignore[index]
    held = from_narrow_numpy(arr, t)
    if t in FLOATS: np.testing.assert_array_equal(held, arr.astype(np.float32))
    elif t != TP.FLOAT8E8M0: np.testing.assert_array_equal(held, arr.astype(np.int32))
    back = to_narrow_numpy(held, t)
    assert back.dtype == arr.dtype
    same = back.view(np.uint8) == arr.view(np.uint8)
    if t in FLOATS: same |= np.isnan(back.astype(np.float32)) & np.isnan(arr.astype(np.float32))
    assert same.all()


@pytest.mark.parametrize("t", FLOATS + INTS, ids=lambda t: NARROW[t].name)
def test_inexact_holder_values(t):
    # a holder value is accepted exactly when ml_dtypes' type has it, bit for bit (any NaN matches any NaN)
    from fusegrad.onnx.narrow import inexact
    n = NARROW[t]
    if t in FLOATS:
        x = _probe_values(t)
        with np.errstate(invalid="ignore", over="ignore"):
            back = x.astype(n.np_type).astype(np.float32)
        want = ~((back.view(np.uint32) == x.view(np.uint32)) | (np.isnan(back) & np.isnan(x)))
    else:
        x = np.arange(-128, 128).astype(np.int8) if n.fmt[0] < 0 else np.arange(256).astype(np.uint8)  # type: ignore
        want = (x.astype(np.int32) < n.fmt[0]) | (x.astype(np.int32) > n.fmt[1])  # type: ignore[index]
    np.testing.assert_array_equal(inexact(x, t), want)
    assert want.any() and not want.all()


def test_plain_tensor_for_narrow_input():
    # a plain Tensor (or a held array) for a narrow input must hold values of the type: onnxruntime refuses a tensor
    # of another element type, and an inexact value would be read as it is
    from fusegrad.onnx import OnnxInputError
    run = OnnxRunner(_cast_model(TP.FLOAT8E4M3FN, TP.FLOAT, [3]))
    np.testing.assert_array_equal(run({"x": Tensor(np.array([0.3125, -448, 0], np.float32))})["y"].numpy(),
                                  [0.3125, -448, 0])
    for bad in (Tensor(np.array([0.3, 1, 2], np.float32)), Tensor(np.array([1, 2, 250], np.float32)) * 2):
        with pytest.raises(OnnxInputError, match="input 'x' has element type FLOAT8E4M3FN, but 1 of the values"):
            run({"x": bad})
    with pytest.raises(OnnxInputError, match="not values of FLOAT8E4M3FN"):
        run.bind_inputs({"x": np.array([0.3, 1, 2], np.float32)}, held=True)
    run4 = OnnxRunner(_cast_model(TP.INT4, TP.INT8, [3]))
    with pytest.raises(OnnxInputError, match=r"not values of INT4, e.g. \[9\]"):
        run4({"x": Tensor(np.array([1, 9, -8], np.int8))})


def test_plain_tensor_for_narrow_input_under_tinyjit():
    # a capture can't read its input: the values are rounded into the type on the device, as a saturating Cast
    from fusegrad import TinyJit
    run = OnnxRunner(_cast_model(TP.FLOAT8E4M3FN, TP.FLOAT, [4]))

    @TinyJit
    def step(x: Tensor) -> Tensor: return run({"x": x})["y"].realize()
    for k in range(4):
        x = np.array([0.3 * k, 1, -1000.0 * k, 2.5 * k], np.float32)
        want = _reference(x, TP.FLOAT8E4M3FN, True).astype(np.float32)
        if k < 2: x = want   # (the first, plain call checks the values)
        np.testing.assert_array_equal(step(Tensor(x)).numpy(), want)


def _quant_model(op: str, x_type: int, scale_type: int, out_type: int, **attrs) -> onnx.ModelProto:
    node = helper.make_node(op, ["x", "s"], ["y"], **attrs)
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", x_type, [6]),
                                        helper.make_tensor_value_info("s", scale_type, [])],
                          [helper.make_tensor_value_info("y", out_type, [6])])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 25)])


def test_e8m0_scales_against_reference():
    # FLOAT8E8M0 is a type of scales: DequantizeLinear with output_dtype, QuantizeLinear to int8
    from onnx.reference import ReferenceEvaluator
    scale = np.array(0.25, np.float32).astype(ml_dtypes.float8_e8m0fnu)
    xq = np.array([1, 2, 3, -4, 127, -128], np.int8)
    dq = _quant_model("DequantizeLinear", TP.INT8, TP.FLOAT8E8M0, TP.FLOAT, output_dtype=TP.FLOAT)
    onnx.checker.check_model(dq, full_check=True)
    np.testing.assert_array_equal(OnnxRunner(dq)({"x": xq, "s": scale})["y"].numpy(),
                                  ReferenceEvaluator(dq).run(None, {"x": xq, "s": scale})[0])
    xf = np.array([0.1, 0.125, 0.2, -1.0, 40.0, -0.3], np.float32)
    q = _quant_model("QuantizeLinear", TP.FLOAT, TP.FLOAT8E8M0, TP.INT8, output_dtype=TP.INT8)
    np.testing.assert_array_equal(OnnxRunner(q)({"x": xf, "s": scale})["y"].numpy(),
                                  ReferenceEvaluator(q).run(None, {"x": xf, "s": scale})[0])


def test_narrow_outputs_the_spec_refuses():
    # onnx's checker refuses these types as outputs (and its reference can't quantize to FLOAT8E8M0)
    from fusegrad.onnx import OnnxNodeError
    cases = [(_quant_model("QuantizeLinear", TP.FLOAT, TP.FLOAT, TP.FLOAT8E8M0, output_dtype=TP.FLOAT8E8M0),
              {"x": np.ones(6, np.float32), "s": np.array(1, np.float32)}, "can't quantize to FLOAT8E8M0"),
             (_quant_model("DequantizeLinear", TP.INT8, TP.FLOAT, TP.FLOAT8E4M3FN, output_dtype=TP.FLOAT8E4M3FN),
              {"x": np.ones(6, np.int8), "s": np.array(1, np.float32)}, "output is float, float16 or bfloat16"),
             (_quant_model("DequantizeLinear", TP.INT8, TP.FLOAT8E8M0, TP.FLOAT8E8M0),
              {"x": np.ones(6, np.int8), "s": np.array(1, ml_dtypes.float8_e8m0fnu)}, "needs output_dtype")]
    for model, feed, msg in cases:
        with pytest.raises(onnx.shape_inference.InferenceError):
            onnx.checker.check_model(model, full_check=True)
        with pytest.raises(OnnxNodeError, match=msg):
            OnnxRunner(model)(feed)
