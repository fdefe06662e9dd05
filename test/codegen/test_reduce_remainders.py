"""A reduction whose loads take its reduce loops divided and modulo small constants (a batch norm's gradient summed
over a strided convolution's input gradient, gathered from the phases) has those loops unrolled by the constant: each
lane's loads are affine. Values are checked against NumPy."""
import numpy as np
from fusegrad import Device, Tensor
from fusegrad.codegen import get_program
from fusegrad.codegen.opt import OptOps

def _phases(a: np.ndarray) -> Tensor:
    # (C, N, 4, 4, 2, 2) laid out by phase, read as (C, N, 8, 8) images: the load divides and takes rows and columns
    # modulo 2
    c, n = a.shape[:2]
    return Tensor(a).permute(0, 1, 2, 4, 3, 5).reshape(c, n, 8, 8)

def test_phase_gathered_channel_sum_unrolls_its_remainders():
    rng = np.random.default_rng(0)
    a = rng.standard_normal((32, 4, 4, 4, 2, 2)).astype(np.float32)
    w = rng.standard_normal((32, 4, 8, 8)).astype(np.float32)
    make = lambda: (_phases(a) * Tensor(w)).relu().sum(axis=(1, 2, 3))  # noqa: E731
    # (scheduling replaces a graph by buffers it doesn't compute: the values come from a fresh one)
    sis = [si for si in make().schedule() if si.ast.op.name == "SINK"]
    assert len(sis) == 1
    opts = get_program(sis[0].ast, Device["CPU"].renderer).applied_opts
    assert any(o.op is OptOps.UNROLL for o in opts), opts
    ref = np.maximum(a.transpose(0, 1, 2, 4, 3, 5).reshape(32, 4, 8, 8) * w, 0).sum(axis=(1, 2, 3))
    np.testing.assert_allclose(make().numpy(), ref, rtol=1e-5, atol=1e-4)

def test_contiguous_channel_sum_is_left_alone():
    # nothing to unroll: the loads are affine in every reduce loop already
    a = np.random.default_rng(1).standard_normal((32, 4, 8, 8)).astype(np.float32)
    make = lambda: Tensor(a).relu().sum(axis=(1, 2, 3))  # noqa: E731
    for si in [si for si in make().schedule() if si.ast.op.name == "SINK"]:
        opts = get_program(si.ast, Device["CPU"].renderer).applied_opts
        assert not any(o.op is OptOps.UNROLL and o.arg in (2, 4) for o in opts), opts
    np.testing.assert_allclose(make().numpy(), np.maximum(a, 0).sum(axis=(1, 2, 3)), rtol=1e-5, atol=1e-4)
