"""A whole fused margin head as one autograd node: the loss of L-, A-Softmax, CosFace, ArcFace and the normalised
softmax in 10 to 19 operations per training step (``nn.Linear`` + ``cross_entropy``: 8).

:func:`~sphereml.heads.margin_ce.label_split` fuses the B x C part of a head, but leaves the head's O(B) part (the
target logit from the label logit, the scale, the annealing) and the normalisation of the features to autograd:
a step made 42 (the normalised softmax) to 115 (L-Softmax) operations so, each a kernel launch on a GPU, where
the H200's eager steps spent about 20 us of host time per operation (``book/measurements.md``).
:func:`fused_margin_loss` writes the head's forward and backward by hand from the custom operators of
:mod:`~sphereml.heads.margin_ce` and :mod:`~sphereml.heads.margin_tail`:

* forward: the norms of W and of the features (one pass each, ``margin_ce_norms``), the features scaled to s/||x||
  where the head normalises them, the product, the log-sum-exp pass, and ``margin_tail``, which returns the loss
  with its derivatives with respect to every B-sized input (Note [tail derivatives]);
* backward: the gradient pass over the product, scaled by the loss's incoming gradient inside the kernel, the two
  products, the norm term of dL/dW (one in-place pass), and the features' gradient through their normalisation,
  dL/dx = (s / ||x||) (g - (g . x_hat) x_hat) for ||x|| >= eps, (s / eps) g below, or, for heads scaled by ||x||,
  g + dL/d||x|| x / ||x||.

Its values and gradients are those of the reference path (``backend="reference"``) to float64 rounding
(``tests/test_margin_ce.py``); every operator traces under ``torch.compile(fullgraph=True)``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .margin_ce import margin_ce_grad, margin_ce_lse, margin_ce_norms
from .margin_tail import TAIL_KINDS, anneal_weights, margin_tail_operator

__all__ = ["FEATURE_EPS", "fused_margin_loss"]

FEATURE_EPS = 1e-12  # the floor of geometry.normalize, and of the class norms


class _FusedMarginLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, labels, kind, m, s, a, b, normalize_weight, return_logits):
        w_norm, w_inv, w_dinv = margin_ce_norms(weight, FEATURE_EPS if normalize_weight else 0.0)
        if s > 0 or kind != "plain":  # the features' norms: to normalise them, or as the target's scale
            x_norm, x_inv, x_dinv = margin_ce_norms(x, FEATURE_EPS if s > 0 else 0.0)
        else:
            x_norm = x_inv = x_dinv = w_norm[:0]  # a view: no operation
        x_scale = x_inv * s if s > 0 else None
        product_input = x * x_scale[:, None].to(x.dtype) if s > 0 else x
        raw = product_input @ weight.T  # (B, C): the one product, in autocast's dtype where autocast is on
        inv = w_inv if normalize_weight else w_inv[:0]
        rest, raw_y, logits = margin_ce_lse(raw, inv, labels, normalize_weight, return_logits)
        loss, row_grad, label_grad, x_norm_grad, w_norm_grad = margin_tail_operator(
            rest, raw_y, inv, x_norm if s <= 0 else x_norm[:0], w_norm if not normalize_weight else w_norm[:0],
            labels, kind, m, s, a, b)
        ctx.save_for_backward(x, weight, labels, raw, product_input, rest, row_grad, label_grad, w_inv, w_dinv,
                              x_scale, x_inv, x_dinv, x_norm_grad, w_norm_grad)
        ctx.normalize_weight, ctx.s, ctx.norm_scaled = normalize_weight, s, s <= 0 and kind != "plain"
        ctx.set_materialize_grads(False)
        ctx.mark_non_differentiable(logits)
        return loss, logits if return_logits else None

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss, _grad_logits):
        (x, weight, labels, raw, product_input, rest, row_grad, label_grad, w_inv, w_dinv, x_scale, x_inv, x_dinv,
         x_norm_grad, w_norm_grad) = ctx.saved_tensors
        if grad_loss is None:
            return (None,) * 10
        normalized = ctx.normalize_weight
        g, colsum = margin_ce_grad(raw, w_inv if normalized else w_inv[:0], labels, rest, row_grad,
                                   label_grad, normalized, True, grad_loss)
        grad_x = grad_w = None
        if ctx.needs_input_grad[1]:
            grad_w = (g.T @ product_input.to(g.dtype)).to(weight.dtype)
            if normalized:  # d inv_j / dW_j = dinv_j inv_j^2 W_j, colsum_j = sum_b g'_bj z_bj = dL/dinv_j inv_j^2
                coeff = colsum * w_dinv
            else:  # L-Softmax: d||W_j|| / dW_j = W_j / ||W_j|| (w_inv = 1 / ||W_j||, 0 for a zero row)
                per_class = torch.zeros_like(w_inv).index_add_(0, labels, w_norm_grad * grad_loss)
                coeff = per_class * w_inv
            grad_w.addcmul_(weight, coeff[:, None].to(weight.dtype))
        if ctx.needs_input_grad[0]:
            grad_in = (g @ weight.to(g.dtype)).to(x.dtype)
            if ctx.s > 0:  # x s / max(||x||, eps): the projection off x_hat where the floor is not reached
                along = (grad_in * product_input).sum(1) * x_dinv * x_inv  # -(g . x_hat) s / ||x||^2, or 0
                grad_x = torch.addcmul(grad_in * x_scale[:, None].to(x.dtype), x, along[:, None].to(x.dtype))
            elif ctx.norm_scaled:  # a scale ||x|| (times ||W_y||): dL/d||x|| x / ||x||, 0 at x = 0
                grad_x = torch.addcmul(grad_in, x, (x_norm_grad * grad_loss * x_inv)[:, None].to(x.dtype))
            else:
                grad_x = grad_in
        return grad_x, grad_w, None, None, None, None, None, None, None, None


def fused_margin_loss(x: Tensor, weight: Tensor, labels: Tensor, kind: str, m: float = 0.0, s: float | None = None,
                      lam: float = 0.0, normalize_weight: bool = True, return_logits: bool = False):
    """The mean margin cross-entropy of a head from its features, weight and labels (module notes).

    Args:
        x (Tensor[B, d]): the features (not yet normalised or scaled).
        weight (Tensor[C, d]): the class weights.
        labels (Tensor[B], int64): the classes.
        kind (str): the target, one of :data:`~sphereml.heads.margin_tail.TAIL_KINDS`.
        m (float): the margin. Default: 0.
        s (float, optional): a constant scale, the features normalised to it; None keeps x, and the scale is
            ||x|| (||x|| ||W_y|| for ``"lsoftmax"``). Default: None.
        lam (float): the annealing lambda (0: the full margin; inf: none). Default: 0.
        normalize_weight (bool): logits (x . W_j) / max(||W_j||, eps); False for L-Softmax. Default: True.
        return_logits (bool): also the margin-free logits, detached. Default: False.

    Returns:
        (loss, logits or None).
    """
    if kind not in TAIL_KINDS:
        raise ValueError(f"kind must be one of {TAIL_KINDS}, got {kind!r}")
    if (kind == "lsoftmax") == normalize_weight or (kind == "lsoftmax" and s is not None):
        raise ValueError("the 'lsoftmax' target goes with unnormalised weights and no constant scale, every other "
                         f"with normalised weights; got kind={kind!r}, normalize_weight={normalize_weight}, s={s}")
    a, b = anneal_weights(lam)
    return _FusedMarginLoss.apply(x, weight, labels, kind, float(m), 0.0 if s is None else float(s), a, b,
                                  normalize_weight, return_logits)
