"""The fused heads' O(B) part (sphereml.heads.margin_tail) and the whole fused head (sphereml.heads.fused_head).

Oracles: the closed-form derivatives against autograd over the heads' own target formulas (``_target_cosine`` and
``_target`` of each head, float64, 1e-10); the Triton tail (compiled on CUDA, interpreted here) against the
PyTorch form in float64 (float32 tolerance 2e-6 relative to the largest entry; arccos by Abramowitz and Stegun
4.4.46 in the kernel).  The fused heads' values against the reference path are in ``test_margin_ce.py``.
"""

import math
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from sphereml import launches  # noqa: E402
from sphereml.heads import margins  # noqa: E402
from sphereml.heads.fused_head import fused_margin_loss  # noqa: E402
from sphereml.heads.margin_tail import TAIL_KINDS, anneal_weights, margin_tail, tail_terms  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HEADS = {  # (head, kind, m, s, lambda): every fused target, with and without a constant scale and annealing
    "plain": (lambda: margins.NormalizedSoftmaxLoss(4, 5), "plain", 0.0, None, 0.0),
    "plain s=10": (lambda: margins.NormalizedSoftmaxLoss(4, 5, s=10.0), "plain", 0.0, 10.0, 0.0),
    "CosFace": (lambda: margins.CosFaceLoss(4, 5, s=30.0, m=0.35), "cosface", 0.35, 30.0, 0.0),
    "ArcFace": (lambda: margins.ArcFaceLoss(4, 5, s=64.0, m=0.5), "arcface", 0.5, 64.0, 0.0),
    "A-Softmax m=4 lambda=3": (lambda: margins.ASoftmaxLoss(4, 5, m=4, lambda_=3.0), "multiplicative", 4.0, None, 3.0),
    "A-Softmax m=3 s=20": (lambda: margins.ASoftmaxLoss(4, 5, m=3, s=20.0), "multiplicative", 3.0, 20.0, 0.0),
    "A-Softmax detached": (lambda: margins.ASoftmaxLoss(4, 5, m=1.5, s=30.0, detach_margin=True, lambda_=1.0),
                           "detached", 1.5, 30.0, 1.0),
    "A-Softmax detached s=None": (lambda: margins.ASoftmaxLoss(4, 5, m=2.5, detach_margin=True), "detached", 2.5,
                                  None, 0.0),
    "L-Softmax m=4 lambda=2": (lambda: margins.LSoftmaxLoss(4, 5, m=4, lambda_=2.0), "lsoftmax", 4.0, None, 2.0),
    "L-Softmax m=2 lambda=inf": (lambda: margins.LSoftmaxLoss(4, 5, m=2, lambda_=math.inf), "lsoftmax", 2.0, None,
                                 math.inf),
}


def _cosines(m: float) -> torch.Tensor:
    """Cosines over [-1, 1] with the ends, the branch points cos(j pi / m) and their neighbours, and outside it."""
    branches = [math.cos(j * math.pi / m) for j in range(1, math.ceil(m))]
    near = [c + e for c in branches for e in (-1e-9, 1e-9)]
    return torch.tensor([-1.0, 1.0, 0.0, -1 + 1e-9, 1 - 1e-9, 1.2, -1.2, *branches, *near,
                         *torch.linspace(-0.999, 0.999, 41).tolist()], dtype=torch.float64)


@pytest.mark.parametrize("name", HEADS)
def test_closed_form_matches_autograd_over_the_heads_formulas(name):
    make, kind, m, s, lam = HEADS[name]
    head = make().double()
    c = _cosines(m)
    n = torch.full_like(c, s) if s is not None else torch.linspace(0.5, 40.0, c.numel(), dtype=torch.float64)
    n[0] = n[0] if s is not None else 1e-13  # a scale under the floor
    z = (c * n).requires_grad_(True)
    n = n.requires_grad_(s is None)
    t_ref = head._target(head._target_cosine(None, None, z[:, None], n[:, None]), z[:, None], n[:, None])[:, 0]
    grads = torch.autograd.grad(t_ref.sum(), [z] + ([n] if s is None else []), allow_unused=True)
    t, dt_dz, dt_dn = tail_terms(z.detach(), n.detach(), kind, m, anneal_weights(lam))
    torch.testing.assert_close(t, t_ref.detach(), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(dt_dz, grads[0], rtol=1e-9, atol=1e-9)
    if s is None:
        expected = grads[1] if grads[1] is not None else torch.zeros_like(dt_dn)
        torch.testing.assert_close(dt_dn, expected, rtol=1e-9, atol=1e-9)


def _tail_inputs(kind, b=37, c=11, seed=0):
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(c, (b,), generator=g)
    inv = torch.rand(c, generator=g, dtype=torch.float64) + 0.5
    w_norm = 1 / inv
    x_norm = torch.rand(b, generator=g, dtype=torch.float64) * 10 + 0.1
    x_norm[3] = 0.0  # a zero feature
    scale = x_norm * (w_norm[labels] if kind == "lsoftmax" else 1.0)
    raw_y = (torch.rand(b, generator=g, dtype=torch.float64) * 2 - 1) * scale
    if kind != "lsoftmax":
        raw_y = raw_y / inv[labels]
    rest = torch.randn(b, generator=g, dtype=torch.float64) * 5
    rest[5] = -math.inf  # a row with no other class
    return rest, raw_y, inv, x_norm, w_norm, labels


@pytest.mark.parametrize("name", HEADS)
def test_tail_kernel_matches_the_float64_form(name):
    """Ragged blocks (37 rows), a zero feature, a row whose log-sum-exp of the other classes is -inf."""
    _, kind, m, s, lam = HEADS[name]
    rest, raw_y, inv, x_norm, w_norm, labels = _tail_inputs(kind)
    inv, w_norm = (inv[:0], w_norm) if kind == "lsoftmax" else (inv, w_norm[:0])
    x_norm = x_norm if s is None else x_norm[:0]
    args = (rest, raw_y, inv, x_norm, w_norm, labels)
    expected = margin_tail(*args, kind, m, s, lam)
    got = margin_tail(*(t.float().to(DEVICE) if t.is_floating_point() else t.to(DEVICE) for t in args), kind, m, s,
                      lam)
    assert len(got) == len(expected) == 5
    for a, b in zip(got, expected):
        assert a.dtype == torch.float32 and a.shape == b.shape
        assert torch.isfinite(a).all()
        largest = float(b.abs().max()) if b.numel() else 0.0
        torch.testing.assert_close(a.double().cpu(), b, rtol=0, atol=2e-6 * max(1.0, largest))
    assert expected[1][5] == 0 and expected[2][5] == 0  # nothing to push against: no gradient


def test_tail_operator_passes_opcheck():
    for name in ("ArcFace", "A-Softmax m=4 lambda=3", "L-Softmax m=4 lambda=2"):
        _, kind, m, s, lam = HEADS[name]
        rest, raw_y, inv, x_norm, w_norm, labels = (t.float().to(DEVICE) if t.is_floating_point() else t.to(DEVICE)
                                                    for t in _tail_inputs(kind, b=9))
        rest[5] = 0.0
        inv, w_norm = (inv[:0], w_norm) if kind == "lsoftmax" else (inv, w_norm[:0])
        a, b = anneal_weights(lam)
        torch.library.opcheck(torch.ops.sphereml.margin_tail, (rest, raw_y, inv, x_norm if s is None else x_norm[:0],
                                                               w_norm, labels, kind, m, s or 0.0, a, b))


FUSED = {  # every head with a fused form, at a size where nothing is padded away
    "normalised": lambda d, c: margins.NormalizedSoftmaxLoss(d, c),
    "normalised s=10": lambda d, c: margins.NormalizedSoftmaxLoss(d, c, s=10.0),
    "A-Softmax m=4 annealed": lambda d, c: margins.ASoftmaxLoss(d, c, m=4, lambda_=margins.LambdaSchedule.sphereface()),
    "A-Softmax detached": lambda d, c: margins.ASoftmaxLoss(d, c, m=1.5, s=30.0, detach_margin=True),
    "CosFace": lambda d, c: margins.CosFaceLoss(d, c),
    "ArcFace": lambda d, c: margins.ArcFaceLoss(d, c),
    "L-Softmax m=4": lambda d, c: margins.LSoftmaxLoss(d, c, m=4),
}


def _step_ops(head, b, d, c):
    g = torch.Generator().manual_seed(0)
    x, labels = torch.randn(b, d, generator=g).requires_grad_(True), torch.randint(c, (b,), generator=g)

    def step():
        x.grad = None
        head.zero_grad(set_to_none=True)
        head.loss(x, labels).backward()

    step()
    return launches.count_ops(step)


@pytest.mark.parametrize("name", FUSED)
def test_fused_head_step_within_its_operation_budget(name):
    """A fused head's forward + backward: at most 12 operations more than nn.Linear + cross_entropy's 8 (on a GPU;
    here 4 more read the labels' range), whatever B, d and C (the reference path: 41 to 112)."""
    head = FUSED[name](16, 50)
    head.backend = "fused"
    counts = [_step_ops(head, b, 16, 50).total for b in (8, 64)]
    assert counts[0] == counts[1]
    assert counts[0] - 4 <= 8 + 12, _step_ops(head, 8, 16, 50).by_op
    head.backend = "reference"
    assert _step_ops(head, 8, 16, 50).total >= counts[0] + 20


@pytest.mark.parametrize("name", ["A-Softmax m=4 annealed", "L-Softmax m=4", "CosFace"])
def test_fused_heads_compile_without_graph_breaks(name):
    torch.compiler.reset()
    head = FUSED[name](8, 13).double()
    g = torch.Generator().manual_seed(2)
    x, labels = torch.randn(6, 8, generator=g, dtype=torch.float64), torch.randint(13, (6,), generator=g)
    head.backend = "fused"
    head.eval()  # no schedule step between the two calls
    a = x.clone().requires_grad_(True)
    torch.compile(head.loss, fullgraph=True, backend="aot_eager")(a, labels).backward()
    b = x.clone().requires_grad_(True)
    head.backend = "reference"
    head.loss(b, labels).backward()
    torch.testing.assert_close(a.grad, b.grad, rtol=1e-12, atol=1e-12)


def test_fused_head_under_vmap_takes_the_reference_path():
    """Several seeds' features through one head under torch.func.vmap (sphereml.multiseed): no batching rule is
    needed, the result is the reference's."""
    head = margins.ArcFaceLoss(8, 13).double()
    g = torch.Generator().manual_seed(4)
    x, labels = torch.randn(3, 6, 8, generator=g, dtype=torch.float64), torch.randint(13, (6,), generator=g)
    head.backend = "fused"
    batched = torch.func.vmap(lambda f: head.loss(f, labels))(x)
    head.backend = "reference"
    torch.testing.assert_close(batched, torch.stack([head.loss(f, labels) for f in x]), rtol=1e-12, atol=1e-12)


def test_bad_tail_arguments_are_named():
    x, w, labels = torch.randn(3, 4), torch.randn(5, 4), torch.tensor([0, 1, 2])
    with pytest.raises(ValueError, match="kind must be one of"):
        fused_margin_loss(x, w, labels, "sphereface")
    with pytest.raises(ValueError, match="'lsoftmax' target goes with unnormalised weights"):
        fused_margin_loss(x, w, labels, "lsoftmax", m=2, normalize_weight=True)
    with pytest.raises(ValueError, match="'lsoftmax' target goes with unnormalised weights"):
        fused_margin_loss(x, w, labels, "cosface", m=0.35, s=30.0, normalize_weight=False)
    with pytest.raises(ValueError, match="kind must be one of"):
        margin_tail(*(torch.zeros(3),) * 5, labels, "bogus", 1.0, None, 0.0)
    rest, none = torch.zeros(3), torch.zeros(0)
    with pytest.raises(ValueError, match="w_norm .* goes with kind 'lsoftmax'"):
        margin_tail(rest, rest, none, rest, torch.ones(5), labels, "plain", 0.0, None, 0.0)
    with pytest.raises(ValueError, match="x_norm must be Tensor"):
        margin_tail(rest, rest, torch.ones(5), none, none, labels, "multiplicative", 4.0, None, 0.0)
    assert set(TAIL_KINDS) == {"plain", "cosface", "arcface", "multiplicative", "detached", "lsoftmax"}
