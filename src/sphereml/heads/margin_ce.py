"""The B x C part of every margin head: class logits and the cross-entropy with a margin target.

A margin head (:mod:`~sphereml.heads.margins`) computes logits z_bj = (x_b . W_j) inv_j, with
inv_j = 1 / max(||W_j||, eps) when the class weights are normalised (A-Softmax, CosFace, ArcFace,
the normalised softmax) and inv_j = 1 otherwise (L-Softmax), replaces the label column by a target
logit t_b that carries the margin, and takes the mean cross-entropy (Part I introduction, the
generalised softmax):

    L = mean_b [ log( exp(t_b) + sum_{j != y_b} exp(z_bj) ) - t_b ].

Only B values change, so the head computes t_b itself in O(B d) from the label rows of W, and
:func:`margin_cross_entropy` does the rest.  Two backends:

* ``"reference"``: autograd over readable steps (the product with :class:`WeightNormalizedLinear`,
  ``scatter`` of the targets, ``F.cross_entropy``); the oracle of the tests.
* ``"fused"``: one product x W^T and two passes over it.  The forward streams the B x C product once
  for the row log-sum-exp (label column left out, t_b added in O(B)); the backward reads it once and
  writes the gradient of the product, p_bj inv_j / B (softmax p, zero on the label column), with the
  column sums of that gradient times the product in the same pass (the norm term of dL/dW).  Then
  dL/dx = g' W and dL/dW = g'^T x - W_j inv_j^2 sum_b g'_bj (x_b . W_j), and dL/dt_b = (p_b,y - 1) / B.
  The passes are Triton kernels (:mod:`sphereml.heads._margin_kernels`) on CUDA tensors, and on CPU tensors
  under ``TRITON_INTERPRET=1``; elsewhere the same two passes run as PyTorch operations.  Both are
  custom operators (``torch.ops.sphereml.margin_ce_lse`` / ``margin_ce_grad``), so the fused loss
  traces under ``torch.compile(fullgraph=True)``.  The loss scale stays a device tensor (no host copy).

``"auto"`` takes ``"reference"``, or ``"fused"`` on CUDA tensors with Triton installed where
``SPHEREML_FUSED=1`` (:func:`~sphereml.energy.triton_backend.choose_backend` gives the measurements).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ..energy.triton_backend import choose_backend, usable_on
from ..geometry import safe_norm

__all__ = ["WeightNormalizedLinear", "weight_normalized_linear", "margin_cross_entropy"]


class WeightNormalizedLinear(torch.autograd.Function):
    """x W_hat^T with W_hat_j = W_j / max(||W_j||, eps), with a hand-written backward.  ``apply`` returns the product
    and two tensors the backward keeps; :func:`weight_normalized_linear` returns the product only.

    Forward scales the columns of x W^T (B x C values) instead of normalising the C x d
    weight.  Backward, with g'_bj = g_bj / ||W_j||:  dx = g' W and
    dW_j = (g'^T x)_j - W_j (sum_b g_bj out_bj) / ||W_j||^2, one matmul each plus one fused
    pass over W (autograd through the norm takes four passes; 1.15x instead of 1.5x of
    ``nn.Linear`` at B = 256, d = 512, C = 10,000 on our CPU).
    """

    generate_vmap_rule = True  # several seeds' heads at once (sphereml.multiseed)

    @staticmethod
    def forward(x: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor, Tensor]:
        """(x W_hat^T, 1 / max(||W_j||, eps), ||W_j|| >= eps): the two extras are for the backward only."""
        norm = safe_norm(weight, dim=1)
        inv = norm.clamp_min(eps).reciprocal()  # (C,)
        return (x @ weight.T) * inv, inv, norm >= eps  # (B, C), (C,), (C,)

    @staticmethod
    def setup_context(ctx, inputs, output):
        (x, weight, _), (out, inv, active) = inputs, output
        ctx.mark_non_differentiable(inv, active)
        ctx.set_materialize_grads(False)  # no zero gradients made for those extras
        ctx.save_for_backward(x, weight, inv, out, active)

    @staticmethod
    def backward(ctx, grad: Tensor | None, _grad_inv=None, _grad_active=None):
        if grad is None:  # the product unused (only an extra asked for): nothing flows back
            return None, None, None
        x, weight, inv, out, active = ctx.saved_tensors
        g = grad * inv  # (B, C)
        grad_x = g @ weight if ctx.needs_input_grad[0] else None
        grad_w = None
        if ctx.needs_input_grad[1]:
            coeff = (grad * out).sum(0) * inv * inv * active  # (C,); zero where the norm was floored
            grad_w = torch.addcmul(g.T @ x, weight, coeff[:, None], value=-1.0)
        return grad_x, grad_w, None


def weight_normalized_linear(x: Tensor, weight: Tensor, eps: float = 1e-12) -> Tensor:
    """x W_hat^T, W_hat_j = W_j / max(||W_j||, eps): :class:`WeightNormalizedLinear`'s product."""
    return WeightNormalizedLinear.apply(x, weight, eps)[0]


# --- the two passes as custom operators: Triton kernels where usable, PyTorch operations otherwise ---

def _accumulation_dtype(raw: Tensor) -> torch.dtype:
    """float64 for float64 products (gradcheck), float32 for every other dtype (the kernels' arithmetic)."""
    return torch.float64 if raw.dtype == torch.float64 else torch.float32


def _on_kernels(raw: Tensor) -> bool:
    return usable_on(raw) and raw.dtype != torch.float64


def _masked_logits(raw: Tensor, inv: Tensor, has_inv: bool) -> Tensor:
    z = raw.to(_accumulation_dtype(raw))
    return z * inv if has_inv else z


@torch.library.custom_op("sphereml::margin_ce_lse", mutates_args=())
def _lse(raw: Tensor, inv: Tensor, labels: Tensor, target: Tensor, has_inv: bool) -> Tensor:
    """log(exp(t_b) + sum_{j != y_b} exp(z_bj)) for every row b: Tensor[B], float32 (float64 for float64)."""
    if _on_kernels(raw):
        return _triton_lse(raw, inv, labels, target, has_inv)
    z = _masked_logits(raw, inv, has_inv)
    z = z.scatter(1, labels[:, None], target.to(z.dtype)[:, None])
    return torch.logsumexp(z, dim=1)


@_lse.register_fake
def _(raw, inv, labels, target, has_inv):
    return raw.new_empty(raw.shape[0], dtype=_accumulation_dtype(raw))


@torch.library.custom_op("sphereml::margin_ce_grad", mutates_args=())
def _grad(raw: Tensor, inv: Tensor, labels: Tensor, lse: Tensor, scale: Tensor,
          has_inv: bool) -> tuple[Tensor, Tensor]:
    """(g' = scale * softmax * inv with the label column 0: Tensor[B, C] in raw's dtype,
    column sums of g' * raw: Tensor[C] as lse; empty without ``has_inv``)."""
    if _on_kernels(raw):
        return _triton_grad(raw, inv, labels, lse, scale, has_inv)
    p = torch.exp(_masked_logits(raw, inv, has_inv) - lse[:, None]).scatter_(1, labels[:, None], 0.0) * scale
    if not has_inv:
        return p.to(raw.dtype), p.new_empty(0)
    g = p * inv
    return g.to(raw.dtype), (g * raw.to(g.dtype)).sum(0)


@_grad.register_fake
def _(raw, inv, labels, lse, scale, has_inv):
    return raw.new_empty(raw.shape), raw.new_empty(raw.shape[1] if has_inv else 0, dtype=_accumulation_dtype(raw))


def _kernels():
    import triton

    from . import _margin_kernels

    return triton, _margin_kernels


def _placeholder(inv: Tensor) -> Tensor:
    """``inv``, or one float when it is empty: an empty CUDA tensor has a null pointer, which Triton's
    launcher refuses even for an argument the kernel never reads."""
    return inv if inv.numel() else inv.new_empty(1)


def _triton_lse(raw, inv, labels, target, has_inv):
    triton, kernels = _kernels()
    (b, c), (bm, bn, warps) = raw.shape, kernels.LSE_BLOCKS
    raw, inv, labels = raw.contiguous(), _placeholder(inv), labels.contiguous()  # the kernels assume stride 1
    row_blocks = triton.cdiv(b, bm)
    n_chunks = max(1, min(triton.cdiv(c, bn), triton.cdiv(4 * 132, max(row_blocks, 1))))  # ~4 programs per H100 SM
    chunk = triton.cdiv(triton.cdiv(c, n_chunks), bn) * bn  # a multiple of BN: tiles never straddle chunks
    n_chunks = triton.cdiv(c, chunk)
    maxes = torch.empty(b, n_chunks, dtype=torch.float32, device=raw.device)
    sums = torch.empty_like(maxes)
    kernels.lse_kernel[(row_blocks, n_chunks)](raw, inv, labels, maxes, sums, b, c, raw.stride(0), chunk, n_chunks,
                                                HAS_INV=has_inv, BM=bm, BN=bn, num_warps=warps)
    t = target.float()
    top = torch.maximum(maxes.amax(1), t)
    total = (sums * torch.exp(maxes - top[:, None])).sum(1) + torch.exp(t - top)
    return top + torch.log(total)


def _triton_grad(raw, inv, labels, lse, scale, has_inv):
    triton, kernels = _kernels()
    (b, c), (bm, bn, warps) = raw.shape, kernels.GRAD_BLOCKS
    raw, inv, labels = raw.contiguous(), _placeholder(inv), labels.contiguous()
    grid = (triton.cdiv(b, bm), triton.cdiv(c, bn))
    grad = torch.empty_like(raw)
    partial = torch.empty(grid[0] if has_inv else 1, c, dtype=torch.float32, device=raw.device)
    kernels.grad_kernel[grid](raw, inv, labels, lse, scale, grad, partial, b, c, raw.stride(0),
                              HAS_INV=has_inv, BM=bm, BN=bn, num_warps=warps)
    return grad, partial.sum(0) if has_inv else partial.new_empty(0)


class _FusedMarginCE(torch.autograd.Function):
    """mean_b [lse_b - t_b] from one product x W^T and the two passes above (module notes)."""

    @staticmethod
    def forward(ctx, x, weight, labels, target, normalize_weight, eps, return_logits):
        if normalize_weight:
            norm = safe_norm(weight, dim=1)
            inv, active = norm.clamp_min(eps).reciprocal(), norm >= eps
        else:
            inv = active = weight.new_empty(0)
        raw = x @ weight.T  # (B, C): the one product, in autocast's dtype where autocast is on
        inv = inv.to(_accumulation_dtype(raw))
        lse = torch.ops.sphereml.margin_ce_lse(raw, inv, labels, target, normalize_weight)
        loss = (lse - target.to(lse.dtype)).mean()
        ctx.save_for_backward(x, weight, raw, inv, active, lse, labels, target)
        ctx.normalize_weight = normalize_weight
        ctx.set_materialize_grads(False)  # no B x C zeros for the gradient of the logits output
        if not return_logits:
            return loss, None
        logits = raw * inv if normalize_weight else raw.clone()
        ctx.mark_non_differentiable(logits)
        return loss, logits

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss, _grad_logits):
        if grad_loss is None:  # grads are not materialised: the loss was not used
            return (None,) * 7
        x, weight, raw, inv, active, lse, labels, target = ctx.saved_tensors
        scale = (grad_loss.to(lse.dtype) / raw.shape[0]).reshape(1)  # stays on the device
        g, colsum = torch.ops.sphereml.margin_ce_grad(raw, inv, labels, lse, scale, ctx.normalize_weight)
        grad_x = (g @ weight.to(g.dtype)).to(x.dtype) if ctx.needs_input_grad[0] else None
        grad_w = None
        if ctx.needs_input_grad[1]:
            grad_w = (g.T @ x.to(g.dtype)).to(weight.dtype)
            if ctx.normalize_weight:
                grad_w.addcmul_(weight, (colsum * inv * inv * active)[:, None].to(weight.dtype), value=-1.0)
        grad_t = None
        if ctx.needs_input_grad[3]:
            grad_t = (scale * (torch.exp(target.to(lse.dtype) - lse) - 1.0)).to(target.dtype)
        return grad_x, grad_w, None, grad_t, None, None, None


def _reference(x, weight, labels, target, normalize_weight, eps):
    logits = weight_normalized_linear(x, weight, eps) if normalize_weight else x @ weight.T
    with_target = logits.scatter(1, labels[:, None], target[:, None].to(logits.dtype))
    return F.cross_entropy(with_target, labels), logits


def margin_cross_entropy(x: Tensor, weight: Tensor, labels: Tensor, target: Tensor, normalize_weight: bool = True,
                         eps: float = 1e-12, backend: str = "auto",
                         return_logits: bool = False) -> Tensor | tuple[Tensor, Tensor]:
    """Mean cross-entropy of the logits (x_b . W_j) inv_j with the label column replaced by ``target``.

    Args:
        x (Tensor[B, d]): the features as they enter the product (already scaled or normalised).
        weight (Tensor[C, d]): the class weights.
        labels (Tensor[B], int64): the classes, in [0, C).
        target (Tensor[B]): the target logit of each row (the margin, computed by the head).
        normalize_weight (bool): inv_j = 1 / max(||W_j||, eps) if True, 1 otherwise. Default: True.
        eps (float): floor on ||W_j||. Default: 1e-12.
        backend (str): ``"auto"``, ``"reference"`` or ``"fused"`` (module notes). Default: ``"auto"``.
        return_logits (bool): also return the margin-free logits, detached (Tensor[B, C]). Default: False.

    Returns:
        The mean loss (a 0-d tensor), or (loss, logits) with ``return_logits``.
    """
    if choose_backend(backend, x) == "reference":
        loss, logits = _reference(x, weight, labels, target, normalize_weight, eps)
        logits = logits.detach()
    else:
        loss, logits = _FusedMarginCE.apply(x, weight, labels, target, normalize_weight, eps, return_logits)
    return (loss, logits) if return_logits else loss
