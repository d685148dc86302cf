"""The B x C part of every margin head: class logits and the cross-entropy with a margin target.

A margin head (:mod:`~sphereml.heads.margins`) computes logits z_bj = (x_b . W_j) inv_j, with
inv_j = 1 / max(||W_j||, eps) when the class weights are normalised (A-Softmax, CosFace, ArcFace,
the normalised softmax) and inv_j = 1 otherwise (L-Softmax), replaces the label column by a target
logit t_b that carries the margin, and takes the mean cross-entropy (Part I introduction, the
generalised softmax):

    L = mean_b [ log( exp(t_b) + sum_{j != y_b} exp(z_bj) ) - t_b ].

Only B values change, so the head computes t_b itself (O(B) work), and :func:`margin_cross_entropy`
(or, for the fused heads, :func:`label_split`) does the rest.  Two backends:

* ``"reference"``: autograd over readable steps (the product with :class:`WeightNormalizedLinear`,
  ``scatter`` of the targets, ``F.cross_entropy``); the oracle of the tests.
* ``"fused"``: one product x W^T, one pass over W and one over the product each way.  With
  rest_b = log sum_{j != y_b} exp(z_bj), the loss is mean_b [logaddexp(t_b, rest_b) - t_b], so the B x C work
  splits from the head's O(B) work: :func:`label_split` returns rest_b, the label logit z_b,y_b and (for
  L-Softmax) ||W_y_b||, each differentiable, and a caller computes t_b from them with autograd over B values (the
  heads go one step further, :mod:`~sphereml.heads.fused_head`: their B values are one operator too).
  Its forward takes ||W_j|| in one pass (squares in float64) and streams the product once for rest_b, the
  label logit and, when asked, the logits; its backward reads the product once and writes the gradient of
  the product, g'_bj = dL/drest_b p_bj inv_j (p the softmax over the columns j != y_b) and
  g'_b,y_b = dL/dz_b,y_b inv_y_b, with the column sums of g' times the logits in the same pass.  Then
  dL/dx = g' W and dL/dW = g'^T x - W_j (inv_j sum_b g'_bj z_bj - n_j / ||W_j||), n_j the gradients of
  the label norms of class j: one in-place pass over dL/dW.  No row of W is gathered, so dL/dW takes no C x d
  zeros and no second C x d gradient: the step passes over C x d tensors as often as ``nn.Linear`` +
  ``cross_entropy`` but for the norm pass and that in-place update.
  The passes are Triton kernels (:mod:`sphereml.heads._margin_kernels`) on CUDA tensors, and on CPU tensors
  under ``TRITON_INTERPRET=1``; elsewhere the same passes run as PyTorch operations.  All are custom
  operators (``torch.ops.sphereml.margin_ce_norms`` / ``margin_ce_lse`` / ``margin_ce_grad``), so the fused
  loss traces under ``torch.compile(fullgraph=True)``; eager calls skip the dispatcher (Note [direct eager calls] in
  :mod:`sphereml._custom_ops`).  Loss scales stay device tensors (no host copy).

``"auto"`` takes ``"reference"``, or ``"fused"`` on CUDA tensors with Triton installed where
``SPHEREML_FUSED=1`` (:func:`~sphereml.energy.triton_backend.choose_backend` gives the measurements).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .._autograd import Function, transformed
from .._custom_ops import custom_op
from ..energy.triton_backend import cdiv, choose_backend, launchable, lazy_module, usable_on
from ..geometry import safe_norm

__all__ = ["WeightNormalizedLinear", "weight_normalized_linear", "margin_cross_entropy", "label_split",
           "loss_from_rest"]


def under_vmap(t: Tensor) -> bool:
    """Whether ``t`` is wrapped by a torch.func transform (several seeds' heads, :mod:`sphereml.multiseed`): the
    fused operators and some in-place operations have no batching rules, so such heads take other forms."""
    return transformed(t)


class WeightNormalizedLinear(Function):
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
        raw = x @ weight.T  # (B, C), in autocast's dtype where autocast is on
        out = raw.mul_(inv) if raw.dtype == inv.dtype else raw * inv  # in place unless inv promotes the dtype
        return out, inv, norm >= eps  # (B, C), (C,), (C,)

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
        g = grad * inv  # (B, C), in the logits' dtype: float32 under autocast, whatever x's dtype (bf16 features)
        grad_x = (g @ weight.to(g.dtype)).to(x.dtype) if ctx.needs_input_grad[0] else None
        grad_w = None
        if ctx.needs_input_grad[1]:
            coeff = (grad * out).sum(0) * inv * inv * active  # (C,); zero where the norm was floored
            grad_w = (g.T @ x.to(g.dtype)).to(weight.dtype)
            if under_vmap(grad_w):  # vmap has no batching rule for addcmul_
                grad_w = grad_w.addcmul(weight, coeff[:, None].to(weight.dtype), value=-1.0)
            else:  # in place: no second C x d tensor
                grad_w.addcmul_(weight, coeff[:, None].to(weight.dtype), value=-1.0)
        return grad_x, grad_w, None


def weight_normalized_linear(x: Tensor, weight: Tensor, eps: float = 1e-12) -> Tensor:
    """x W_hat^T, W_hat_j = W_j / max(||W_j||, eps): :class:`WeightNormalizedLinear`'s product."""
    return WeightNormalizedLinear.apply(x, weight, eps)[0]


# --- the passes as custom operators: Triton kernels where usable, PyTorch operations otherwise ---

def _accumulation_dtype(raw: Tensor) -> torch.dtype:
    """float64 for float64 products (gradcheck), float32 for every other dtype (the kernels' arithmetic)."""
    return torch.float64 if raw.dtype == torch.float64 else torch.float32


def _on_kernels(raw: Tensor) -> bool:
    return usable_on(raw) and raw.dtype != torch.float64


def _masked_logits(raw: Tensor, inv: Tensor, has_inv: bool) -> Tensor:
    z = raw.to(_accumulation_dtype(raw))
    return z * inv if has_inv else z


def _logits_dtype(raw: Tensor, has_inv: bool) -> torch.dtype:
    """The margin-free logits' dtype, as on the reference path: scaled by inv (float32) or the product's own."""
    return _accumulation_dtype(raw) if has_inv else raw.dtype


@custom_op("sphereml::margin_ce_norms", mutates_args=())
def margin_ce_norms(weight: Tensor, eps: float) -> tuple[Tensor, Tensor, Tensor]:
    """For every row: (||W_j||, inv_j = 1 / max(||W_j||, eps) (0 for a zero row when eps = 0), dinv_j = -inv_j where
    ||W_j|| >= eps and 0 elsewhere), each Tensor[C], float32 (float64 for float64); one pass over W on the kernels.
    d inv_j / dW_j = dinv_j inv_j^2 W_j, so dinv carries the gradient through the norm's floor."""
    if _on_kernels(weight):
        return _triton_norms(weight, eps)
    norm = safe_norm(weight.to(_accumulation_dtype(weight)), dim=1)
    floor = norm.clamp_min(eps)
    inv = (torch.where(floor > 0, floor, 1.0).reciprocal() * (floor > 0)).clamp_max(torch.finfo(norm.dtype).max)
    return norm, inv, -inv * ((norm >= eps) & (norm > 0))


@margin_ce_norms.register_fake
def _(weight, eps):
    norm = weight.new_empty(weight.shape[0], dtype=_accumulation_dtype(weight))
    return norm, torch.empty_like(norm), torch.empty_like(norm)


@custom_op("sphereml::margin_ce_lse", mutates_args=())
def margin_ce_lse(raw: Tensor, inv: Tensor, labels: Tensor, has_inv: bool,
                  write_logits: bool) -> tuple[Tensor, Tensor, Tensor]:
    """(log sum_{j != y_b} exp(z_bj) for every row b: Tensor[B], float32 (float64 for float64); the label
    column of the product, raw_b,y_b: Tensor[B], as lse; the logits z with ``write_logits``, else empty)."""
    if _on_kernels(raw):
        return _triton_lse(raw, inv, labels, has_inv, write_logits)
    z = _masked_logits(raw, inv, has_inv)
    rest = torch.logsumexp(z.scatter(1, labels[:, None], float("-inf")), dim=1)
    raw_y = raw.gather(1, labels[:, None])[:, 0].to(z.dtype)
    logits = z.to(_logits_dtype(raw, has_inv), copy=True) if write_logits else raw.new_empty(0)
    return rest, raw_y, logits


@margin_ce_lse.register_fake
def _(raw, inv, labels, has_inv, write_logits):
    rows = raw.new_empty(raw.shape[0], dtype=_accumulation_dtype(raw))
    logits = raw.new_empty(raw.shape if write_logits else (0,), dtype=_logits_dtype(raw, has_inv))
    return rows, torch.empty_like(rows), logits


@custom_op("sphereml::margin_ce_grad", mutates_args=())
def margin_ce_grad(raw: Tensor, inv: Tensor, labels: Tensor, lse: Tensor, row_scale: Tensor, label_grad: Tensor,
                   has_inv: bool, has_label_grad: bool, scale: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """(g' = (row_scale * softmax over the columns j != y_b, label_grad on the label column) * inv, all times the
    0-d ``scale`` when given: Tensor[B, C] in raw's dtype; column sums of g' * z: Tensor[C] as lse, empty without
    ``has_inv``)."""
    if _on_kernels(raw):
        return _triton_grad(raw, inv, labels, lse, row_scale, label_grad, has_inv, has_label_grad, scale)
    z = _masked_logits(raw, inv, has_inv)
    p = torch.exp(z - lse[:, None]).scatter_(1, labels[:, None], 0.0)
    p = p * row_scale[:, None]
    if has_label_grad:
        p = p.scatter(1, labels[:, None], label_grad[:, None].to(p.dtype))
    if scale is not None:
        p = p * scale.to(p.dtype)
    if not has_inv:
        return p.to(raw.dtype), p.new_empty(0)
    g = p * inv
    return g.to(raw.dtype), (g * z).sum(0)


@margin_ce_grad.register_fake
def _(raw, inv, labels, lse, row_scale, label_grad, has_inv, has_label_grad, scale=None):
    return raw.new_empty(raw.shape), raw.new_empty(raw.shape[1] if has_inv else 0, dtype=_accumulation_dtype(raw))


_kernels = lazy_module("sphereml.heads._margin_kernels")


def _triton_norms(weight, eps):
    kernels = _kernels()
    (c, d), (br, bd, warps) = weight.shape, kernels.NORM_BLOCKS
    weight = weight.contiguous()
    norm, inv, dinv = (torch.empty(c, dtype=torch.float32, device=weight.device) for _ in range(3))
    kernels.norm_kernel[(cdiv(c, br),)](weight, norm, inv, dinv, c, d, weight.stride(0), eps, BR=br, BD=bd,
                                        num_warps=warps)
    return norm, inv, dinv


def _triton_lse(raw, inv, labels, has_inv, write_logits):
    kernels = _kernels()
    (b, c), (bm, bn, warps) = raw.shape, kernels.LSE_BLOCKS
    raw, inv, labels = raw.contiguous(), launchable(inv), labels.contiguous()  # the kernels assume stride 1
    row_blocks = cdiv(b, bm)
    n_chunks = max(1, min(cdiv(c, bn), cdiv(4 * 132, max(row_blocks, 1))))  # ~4 programs per H100 SM
    chunk = cdiv(cdiv(c, n_chunks), bn) * bn  # a multiple of BN: tiles never straddle chunks
    n_chunks = cdiv(c, chunk)
    maxes = torch.empty(b, n_chunks, dtype=torch.float32, device=raw.device)
    sums, rest, raw_y = torch.empty_like(maxes), maxes.new_empty(b), maxes.new_empty(b)
    logits = raw.new_empty(raw.shape if write_logits else (1,), dtype=_logits_dtype(raw, has_inv))
    kernels.lse_kernel[(row_blocks, n_chunks)](raw, inv, labels, maxes, sums, raw_y, logits, b, c, raw.stride(0),
                                                chunk, n_chunks, HAS_INV=has_inv, WRITE_LOGITS=write_logits,
                                                BM=bm, BN=bn, num_warps=warps)
    bm, bk, warps = kernels.COMBINE_BLOCKS
    kernels.combine_kernel[(cdiv(b, bm),)](maxes, sums, rest, b, n_chunks, BM=bm, BK=bk, num_warps=warps)
    return rest, raw_y, logits if write_logits else logits.new_empty(0)


def _triton_grad(raw, inv, labels, lse, row_scale, label_grad, has_inv, has_label_grad, scale):
    kernels = _kernels()
    (b, c), (bm, bn, warps) = raw.shape, kernels.GRAD_BLOCKS
    raw, inv, labels, label_grad = raw.contiguous(), launchable(inv), labels.contiguous(), launchable(label_grad)
    grid = (cdiv(b, bm), cdiv(c, bn))
    grad = torch.empty_like(raw)
    partial = torch.empty(grid[0] if has_inv else 1, c, dtype=torch.float32, device=raw.device)
    kernels.grad_kernel[grid](raw, inv, labels, lse, row_scale.contiguous(), label_grad,
                              lse if scale is None else scale.to(torch.float32), grad, partial, b, c, raw.stride(0),
                              HAS_INV=has_inv, HAS_LABEL_GRAD=has_label_grad, HAS_SCALE=scale is not None, BM=bm,
                              BN=bn, num_warps=warps)
    return grad, partial.sum(0) if has_inv else partial.new_empty(0)


class _FusedLabelSplit(torch.autograd.Function):
    """From one product x W^T: the log-sum-exp of every row without its label column, the label logit z_b,y_b
    and, with ``want_label_norms``, ||W_y_b||; each differentiable (module notes)."""

    @staticmethod
    def forward(ctx, x, weight, labels, normalize_weight, eps, want_label_norms, return_logits):
        raw = x @ weight.T  # (B, C): the one product, in autocast's dtype where autocast is on
        norm = inv = dinv = torch.empty(0, dtype=_accumulation_dtype(raw), device=raw.device)
        if normalize_weight or want_label_norms:
            norm, inv, dinv = margin_ce_norms(weight, eps if normalize_weight else 0.0)
        rest, raw_y, logits = margin_ce_lse(raw, inv if normalize_weight else inv[:0], labels,
                                            normalize_weight, return_logits)
        logit_y = raw_y * inv[labels] if normalize_weight else raw_y
        label_norms = norm[labels] if want_label_norms else rest.new_empty(0)
        ctx.save_for_backward(x, weight, raw, inv, dinv, rest, labels, norm if want_label_norms else None)
        ctx.normalize_weight, ctx.want_label_norms = normalize_weight, want_label_norms
        ctx.set_materialize_grads(False)  # no B x C zeros for the gradient of the logits output
        ctx.mark_non_differentiable(logits)
        return rest, logit_y, label_norms, logits if return_logits else None

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_rest, grad_logit_y, grad_label_norms, _grad_logits):
        x, weight, raw, inv, dinv, rest, labels, norm = ctx.saved_tensors
        row_scale = grad_rest if grad_rest is not None else torch.zeros_like(rest)
        label_grad = grad_logit_y if grad_logit_y is not None else rest.new_empty(0)
        g, colsum = margin_ce_grad(raw, inv if ctx.normalize_weight else inv[:0], labels, rest,
                                   row_scale.to(rest.dtype), label_grad.to(rest.dtype),
                                   ctx.normalize_weight, grad_logit_y is not None)
        grad_x = (g @ weight.to(g.dtype)).to(x.dtype) if ctx.needs_input_grad[0] else None
        grad_w = None
        if ctx.needs_input_grad[1]:
            grad_w = (g.T @ x.to(g.dtype)).to(weight.dtype)
            coeff = colsum * dinv if ctx.normalize_weight else None  # d inv_j = dinv_j inv_j^2 W_j: margin_ce_norms
            if ctx.want_label_norms and grad_label_norms is not None:  # d||W_j|| / dW_j = W_j / ||W_j||, 0 at 0
                per_class = torch.zeros_like(norm).index_add_(0, labels, grad_label_norms.to(norm.dtype))
                unit = inv if not ctx.normalize_weight else torch.where(norm > 0, norm, 1.0).reciprocal() * (norm > 0)
                coeff = per_class * unit if coeff is None else coeff + per_class * unit
            if coeff is not None:
                grad_w.addcmul_(weight, coeff[:, None].to(weight.dtype))
        return grad_x, grad_w, None, None, None, None, None


def label_split(x: Tensor, weight: Tensor, labels: Tensor, normalize_weight: bool = True, eps: float = 1e-12,
                label_norms: bool = False, return_logits: bool = False):
    """The fused backend's parts of the margin cross-entropy, from one product x W^T (module notes).

    Returns:
        (rest, logit_y, norms_y, logits): rest_b = log sum_{j != y_b} exp(z_bj) (Tensor[B]); the label logit
        z_b,y_b (Tensor[B]); ||W_y_b|| with ``label_norms`` (Tensor[B], else empty); the margin-free logits
        with ``return_logits`` (Tensor[B, C], detached, else None).  The first three are differentiable, so a
        head computes its target logit t_b from them and the loss is mean_b [logaddexp(t_b, rest_b) - t_b].
    """
    return _FusedLabelSplit.apply(x, weight, labels, normalize_weight, eps, label_norms, return_logits)


def loss_from_rest(target: Tensor, rest: Tensor) -> Tensor:
    """mean_b [log(exp(t_b) + exp(rest_b)) - t_b]: the cross-entropy with target logit t_b (Tensor[B])."""
    target = target.to(rest.dtype)
    return (torch.logaddexp(target, rest) - target).mean()


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
        rest, _, _, logits = label_split(x, weight, labels, normalize_weight, eps, return_logits=return_logits)
        loss = loss_from_rest(target, rest)
    return (loss, logits) if return_logits else loss
