"""TinyJit misuse that a replay could not honour raises JitError naming what was wrong (tinygrad 0.14 detects the
duplicate input, the constant input, the empty capture and the nested TinyJit; fusegrad also detects changed
non-Tensor arguments and outputs aliasing inputs, which tinygrad replays silently with the capture's values)."""
from __future__ import annotations
import numpy as np
import pytest
from fusegrad import Tensor, TinyJit
from fusegrad.engine.jit import JitError

def _t(*vals: float) -> Tensor: return Tensor(np.array(vals, np.float32)).realize()

def test_same_tensor_as_two_arguments():
    f = TinyJit(lambda a, b: a + b)
    x = _t(1, 2)
    with pytest.raises(JitError, match="argument 0 and argument 1 are the same tensor"): f(x, x)
    # two views of one buffer are one buffer too
    y = _t(1, 2, 3, 4)
    with pytest.raises(JitError, match="argument 0 and argument 1 are the same tensor"): f(y[0:2], y[2:4])

def test_same_tensor_inside_a_list_and_as_an_argument():
    f = TinyJit(lambda a, lst: a + lst[0])
    x = _t(1, 2)
    with pytest.raises(JitError, match=r"argument 0 and argument 1\[0\] are the same tensor"): f(x, [x])

def test_int_argument_that_changes():
    f = TinyJit(lambda a, k: a * k)
    x = _t(1, 2)
    assert f(x, 2).tolist() == [2.0, 4.0]
    with pytest.raises(JitError, match="argument 1 changed from 2 to 3 since the first call"): f(x, 3)
    for _ in range(3): assert f(x, 2).tolist() == [2.0, 4.0]  # the same value replays
    with pytest.raises(JitError, match="argument 1 changed from 2 to 5"): f(x, 5)

def test_keyword_and_list_values_that_change():
    f = TinyJit(lambda a, scale, shape: (a * scale[0]).reshape(shape))
    x = _t(1, 2, 3, 4)
    for _ in range(3): np.testing.assert_array_equal(f(x, scale=[2.0], shape=(2, 2)).numpy(), [[2, 4], [6, 8]])
    with pytest.raises(JitError, match=r"argument 'scale'\[0\] changed from 2\.0 to 0\.5"):
        f(x, scale=[0.5], shape=(2, 2))
    with pytest.raises(JitError, match=r"argument 'shape'\[0\] changed from 2 to 4"): f(x, scale=[2.0], shape=(4, 1))
    with pytest.raises(JitError, match="nested differently"): f(x, scale=[2.0, 1.0], shape=(2, 2))

def test_other_object_argument_that_changes():
    class Model:
        def __init__(self, w: float): self.w = w
        def __call__(self, x: Tensor) -> Tensor: return x * self.w
    f = TinyJit(lambda m, x: m(x))
    m1, x = Model(2.0), _t(1, 2)
    for _ in range(3): assert f(m1, x).tolist() == [2.0, 4.0]
    with pytest.raises(JitError, match="argument 0 changed from a .*Model object .* to a .*Model object"):
        f(Model(3.0), x)

def test_method_called_on_another_instance():
    class Net:
        def __init__(self, w: float): self.w = Tensor([w, w]).realize()
        @TinyJit
        def forward(self, x: Tensor) -> Tensor: return x * self.w
    a, b, x = Net(2.0), Net(5.0), _t(1, 2)
    for _ in range(3): assert a.forward(x).tolist() == [2.0, 4.0]
    with pytest.raises(JitError, match="argument 0 changed from a .*Net object"): b.forward(x)

def test_tensors_inside_containers_are_inputs():
    @TinyJit
    def f(pair, d):
        return pair[0] * pair[1] + d["bias"]
    for i in range(5):
        a, b, c = np.float32([i, 1]), np.float32([2, i]), np.float32([i * 10, 0])
        out = f((Tensor(a), Tensor(b)), {"bias": Tensor(c)})
        np.testing.assert_array_equal(out.numpy(), a * b + c)

def test_no_kernels_captured():
    f = TinyJit(lambda a: a.reshape(2, 1))
    x = _t(1, 2)
    f(x)
    with pytest.raises(JitError, match="ran no kernels while it was captured"): f(x)

def test_constant_input():
    f = TinyJit(lambda a: a * 2)
    with pytest.raises(JitError, match="argument 0 is a constant"): f(Tensor.ones(3))
    with pytest.raises(JitError, match=r"argument 'x' is a constant"): TinyJit(lambda x: x + 1)(x=Tensor(2.0))

def test_nested_tinyjit():
    inner = TinyJit(lambda a: a + 1)
    outer = TinyJit(lambda a: inner(a) * 2)
    with pytest.raises(JitError, match="having TinyJit inside another TinyJit is not supported"): outer(_t(1, 2))
    # the inner one on its own is unaffected
    for i in range(3): assert inner(_t(i, 0)).tolist() == [i + 1.0, 1.0]

def test_output_aliasing_an_input():
    f = TinyJit(lambda a, b: (a, b * 2))
    f(_t(1), _t(2))
    with pytest.raises(JitError, match="returns its input argument 0"): f(_t(1), _t(2))
    # a view of an input is memory of the input too (realizing a view runs nothing, as in tinygrad); a copy is fresh
    g = TinyJit(lambda a: (a * 2, a[1:]))
    g(_t(1))
    with pytest.raises(JitError, match="returns its input argument 0"): g(_t(1))
    h = TinyJit(lambda a: (a * 2, a[1:].contiguous()))
    for i in range(4):
        x = np.float32([i, i + 1, i + 2])
        doubled, tail = h(Tensor(x))
        np.testing.assert_array_equal(doubled.numpy(), x * 2)
        np.testing.assert_array_equal(tail.numpy(), x[1:])

    @TinyJit
    def scale_in_place(a):
        a.assign(a * 2)
        return a
    scale_in_place(_t(1))
    with pytest.raises(JitError, match="returns its input argument 0"): scale_in_place(_t(1))

def test_reading_data_while_captured():
    f = TinyJit(lambda a: a * a.sum().item())
    f(_t(1, 2))
    with pytest.raises(JitError, match="reading tensor data"): f(_t(1, 2))

def test_view_input_that_changes():
    f = TinyJit(lambda a: a * 2)
    base = _t(1, 2, 3, 4)
    for _ in range(3): assert f(base[1:3]).tolist() == [4.0, 6.0]
    with pytest.raises(JitError, match="another view of its buffer"): f(base[2:4])
    with pytest.raises(JitError, match=r"shape \(2,\).*shape \(3,\)"): f(base[0:3])
