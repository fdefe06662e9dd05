"""ONNX's operator test cases (the node cases of onnx.backend.test, with ONNX's reference outputs) for every op the
runner implements. A representative set of op families runs by default; all of them with -m slow."""
from __future__ import annotations

import re
import warnings

import pytest

pytest.importorskip("onnx")

from fusegrad.onnx.ops import OPS  # noqa: E402
from test.onnx.node_cases import all_modules, cases_of, run_case  # noqa: E402

# cases of implemented ops that are left out, each with the reason
EXCLUDED: dict[str, str] = {
    r"^test_training_dropout(?!_zero_ratio)": "a random mask can't equal the one of the reference's generator",
    r"^test_bernoulli": "random values can't equal those of the reference's generator (test_random_and_control.py "
                        "checks their shape, dtype and statistics)",
    r"^test_resize_downsample_scales_(linear|cubic)_align_corners$":
        "the expected outputs are onnx's reference's, which divides by the unrounded output length (scale * n_in - 1); "
        "the operator's text divides by length_resized - 1, the resized tensor's length, as onnxruntime and the "
        "runner do (test_more_ops.py checks it against onnxruntime)",
}

# op families whose cases run by default (fast, and covering the runner's paths: attributes vs inputs across opsets,
# optional inputs, several outputs, broadcasting, every integer dtype of the comparisons)
DEFAULT_MODULES = ["add", "relu", "conv", "convtranspose", "gemm", "matmul", "reshape", "slice", "gather",
                   "gatherelements", "softmax", "layernormalization", "batch_normalization", "gelu", "concat",
                   "transpose", "split", "squeeze", "unsqueeze", "expand", "where", "reducesum", "pad", "cast",
                   "cumsum", "topk", "clip", "shape", "constantofshape", "rangeop", "flatten", "argmax", "einsum",
                   "scatternd", "onehot", "trilu", "depthtospace", "div", "pow", "quantizelinear",
                   "dequantizelinear", "qlinearconv", "qlinearmatmul", "resize", "upsample", "if_",
                   "loop", "identity", "sequenceinsert", "sequence_map", "splittosequence", "optionalgetelement",
                   "optionalhaselement", "scan", "rotaryembedding", "center_crop_pad", "affinegrid", "string_split",
                   "stringnormalizer", "ai_onnx_ml.label_encoder", "regex_full_match", "image_decoder"]


def _excluded(name: str) -> str | None:
    return next((why for pat, why in EXCLUDED.items() if re.search(pat, name)), None)


def _implemented(case) -> bool:
    return all(("" if n.domain in ("", "ai.onnx") else n.domain, n.op_type) in OPS for n in case.model.graph.node)


def _params(modules: list[str]) -> list:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cases = cases_of(modules)
    return [pytest.param(c, id=c.name) for c in cases if _implemented(c) and not _excluded(c.name)]


@pytest.mark.parametrize("case", _params(DEFAULT_MODULES))
def test_node_case(case):
    run_case(case)


def pytest_generate_tests(metafunc):
    # collecting every module computes all of ONNX's reference outputs (~20 s): only when slow tests are selected
    if metafunc.function.__name__ == "test_node_case_all":
        wanted = "slow" in metafunc.config.getoption("markexpr", "") and "not slow" not in \
            metafunc.config.getoption("markexpr", "")
        metafunc.parametrize("case", _params([m for m in all_modules() if m not in DEFAULT_MODULES]) if wanted else [])


@pytest.mark.slow
def test_node_case_all(case):
    run_case(case)
