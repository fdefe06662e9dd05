"""The loss ops: NegativeLogLikelihoodLoss and SoftmaxCrossEntropyLoss (the latter is the former of a log-softmax)."""
from __future__ import annotations

from fusegrad import Tensor, dtypes
from fusegrad.onnx.errors import Unsupported
from fusegrad.onnx.ops import op

REDUCTIONS = ("none", "sum", "mean")


def nll(logp: Tensor, target: Tensor, weight: Tensor | None, ignore_index: int | None, reduction: str) -> Tensor:
    """-logp[n, target[n, ...], ...] weighted by weight[target]; targets equal to ignore_index weigh 0. `mean` divides
    by the sum of the weights taken (without weights: by the number of targets not ignored)."""
    if reduction not in REDUCTIONS: raise Unsupported(f"reduction {reduction!r} (supported: {', '.join(REDUCTIONS)})")
    if logp.ndim < 2: raise ValueError(f"the input must be (N, C, ...), got shape {tuple(logp.shape)}")
    want = (logp.shape[0],) + tuple(logp.shape[2:])
    if tuple(target.shape) != want:
        raise ValueError(f"the target must have shape {want} for an input of shape {tuple(logp.shape)}, got "
                         f"{tuple(target.shape)}")
    c = logp.shape[1]
    if weight is not None and tuple(weight.shape) != (c,):
        raise ValueError(f"the weights must have shape ({c},), got {tuple(weight.shape)}")
    t = target.cast(dtypes.int32)
    keep = t != ignore_index if ignore_index is not None else None
    # an ignored target may be any value (often -1 or C): read class 0 there and weigh it 0
    safe = keep.where(t, 0) if keep is not None else t
    picked = -logp.gather(1, safe.unsqueeze(1)).squeeze(1)
    w = weight.gather(0, safe.reshape(-1)).reshape(safe.shape).cast(logp.dtype) if weight is not None else None
    if keep is not None: w = keep.where(w, 0) if w is not None else keep.cast(logp.dtype)
    loss = picked * w if w is not None else picked
    if reduction == "none": return loss
    if reduction == "sum": return loss.sum()
    return loss.sum() / w.sum() if w is not None else loss.mean()


@op("NegativeLogLikelihoodLoss")
def negative_log_likelihood_loss(x: Tensor, target: Tensor, weight: Tensor | None = None, *,
                                 ignore_index: int | None = None, reduction: str = "mean") -> Tensor:
    return nll(x, target, weight, ignore_index, reduction)


@op("SoftmaxCrossEntropyLoss")
def softmax_cross_entropy_loss(scores: Tensor, labels: Tensor, weights: Tensor | None = None, *,
                               ignore_index: int | None = None, reduction: str = "mean") -> tuple[Tensor, Tensor]:
    """The loss of log_softmax(scores) over the classes (axis 1), and those log-probabilities."""
    logp = scores.log_softmax(1) if scores.ndim >= 2 else scores
    return nll(logp, labels, weights, ignore_index, reduction), logp
