"""The fused cross-entropy of the margin heads against the reference (autograd over the B x C logits).

The fused backend's two passes run as PyTorch operations in float64 (the oracle for gradcheck), and as
Triton kernels on CUDA tensors or, on a CPU-only machine, under ``TRITON_INTERPRET=1`` (set here before
Triton is imported, as in ``test_energy_triton.py``).  Float32 tolerances: 1e-5 relative on the loss and
2e-5 relative to the largest entry on the gradients (the passes sum in a different order).
"""

import os
from collections import Counter

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from conftest import sm90_compile_rows  # noqa: E402

from sphereml import launches  # noqa: E402
from sphereml.geometry import safe_norm  # noqa: E402
from sphereml.heads import margins  # noqa: E402
from sphereml.heads.margin_ce import margin_cross_entropy  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FUSABLE = {
    "normalised": lambda d, c: margins.NormalizedSoftmaxLoss(d, c),
    "normalised s=10": lambda d, c: margins.NormalizedSoftmaxLoss(d, c, s=10.0),
    "A-Softmax m=4 annealed": lambda d, c: margins.ASoftmaxLoss(d, c, m=4, lambda_=3.0),
    "A-Softmax detached": lambda d, c: margins.ASoftmaxLoss(d, c, m=1.5, s=30.0, detach_margin=True),
    "CosFace": lambda d, c: margins.CosFaceLoss(d, c),
    "ArcFace": lambda d, c: margins.ArcFaceLoss(d, c),
    "L-Softmax m=3": lambda d, c: margins.LSoftmaxLoss(d, c, m=3, lambda_=2.0),
}


def _inputs(b, d, c, seed=0, dtype=torch.float64, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, d, generator=g, dtype=dtype)
    labels = torch.randint(c, (b,), generator=g)
    labels[0], labels[-1] = 0, c - 1  # the first and the last column
    return x.to(device), labels.to(device)


def _loss_and_grads(head, x, labels, backend):
    head.backend = backend
    head.zero_grad()
    x = x.clone().requires_grad_(True)
    loss, logits = head.loss_and_logits(x, labels)
    loss.backward()
    return loss.detach(), logits, x.grad, head.weight.grad.clone()


@pytest.mark.parametrize("name", FUSABLE)
def test_fused_head_equals_reference_in_float64(name):
    head = FUSABLE[name](8, 13).double()
    x, labels = _inputs(6, 8, 13)
    for ref, fused in zip(_loss_and_grads(head, x, labels, "reference"), _loss_and_grads(head, x, labels, "fused")):
        torch.testing.assert_close(fused, ref, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("normalize_weight", [True, False])
def test_gradcheck_float64(normalize_weight):
    x, labels = _inputs(5, 4, 7)
    w = torch.randn(7, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    t = torch.randn(5, dtype=torch.float64)

    def loss(a, b, c):
        return margin_cross_entropy(a, b, labels, c, normalize_weight, backend="fused")

    assert torch.autograd.gradcheck(loss, tuple(v.clone().requires_grad_(True) for v in (x, w, t)))


def test_degenerate_rows_give_finite_gradients_and_match_the_reference():
    """A zero class weight and one of norm 1e-13 (under eps: no gradient through the norm) and a zero feature."""
    head = margins.ArcFaceLoss(4, 6).double()
    with torch.no_grad():
        head.weight[2] = 0.0
        head.weight[4] *= 1e-13 / head.weight[4].norm()
    x, labels = _inputs(5, 4, 6)
    x[1] = 0.0
    ref, fused = _loss_and_grads(head, x, labels, "reference"), _loss_and_grads(head, x, labels, "fused")
    for a, b in zip(ref, fused):
        assert torch.isfinite(b).all()
        torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-12)


def test_ga_softmax_keeps_the_reference_path():
    head = margins.GASoftmaxLoss(4, 6, m=2, angular="linear").double()
    x, labels = _inputs(5, 4, 6)
    assert head.weight_normalized is None
    for a, b in zip(_loss_and_grads(head, x, labels, "reference"), _loss_and_grads(head, x, labels, "fused")):
        torch.testing.assert_close(b, a, rtol=0, atol=0)


@pytest.mark.parametrize("has_inv", [True, False])
@pytest.mark.parametrize("b,c,dtype", [(37, 300, torch.float32), (64, 1000, torch.float32), (5, 70, torch.bfloat16)])
def test_kernel_passes_match_float64(b, c, dtype, has_inv):
    """The passes on float32 / bf16 tensors (Triton here) against the same passes in float64 (PyTorch).

    Ragged row and column tiles, several column chunks, labels in the first and last columns, logits up
    to +-40 (a scaled head), a loss scale per row and a gradient for the label column, both device tensors."""
    g = torch.Generator().manual_seed(b)
    raw = (torch.randn(b, c, generator=g) * 10).to(dtype)
    inv = (torch.rand(c, generator=g) + 0.5) if has_inv else torch.empty(0)
    _, labels = _inputs(b, 1, c, seed=b)
    labels = torch.stack([labels, labels], 1)[:, 0]  # stride 2: the launchers make it contiguous
    row_scale, label_grad = torch.rand(b, generator=g), torch.randn(b, generator=g)
    ops = torch.ops.sphereml
    scale = torch.tensor(-0.7)  # the loss's incoming gradient, a device tensor
    rest64, raw_y64, logits64 = ops.margin_ce_lse(raw.double(), inv.double(), labels, has_inv, True)
    g64, col64 = ops.margin_ce_grad(raw.double(), inv.double(), labels, rest64, row_scale.double(),
                                    label_grad.double(), has_inv, True, scale.double())
    on = {"device": DEVICE}
    rest, raw_y, logits = ops.margin_ce_lse(raw.to(**on), inv.to(**on), labels.to(**on), has_inv, True)
    grad, col = ops.margin_ce_grad(raw.to(**on), inv.to(**on), labels.to(**on), rest64.float().to(**on),
                                   row_scale.to(**on), label_grad.to(**on), has_inv, True, scale.to(**on))
    assert rest.dtype == raw_y.dtype == torch.float32 and grad.dtype == dtype
    assert logits.dtype == (torch.float32 if has_inv else dtype)
    torch.testing.assert_close(rest.double().cpu(), rest64, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(raw_y.double().cpu(), raw_y64, rtol=0, atol=0)  # a copy of one entry per row
    torch.testing.assert_close(logits.double().cpu(), logits64, rtol=2e-7 if has_inv else 0, atol=0)
    tol = 2 ** -7 if dtype == torch.bfloat16 else 2e-5  # bf16: one unit in the last place (the interpreter truncates)
    torch.testing.assert_close(grad.double().cpu(), g64, rtol=0, atol=tol * float(g64.abs().max()))
    assert col.shape == col64.shape
    if has_inv:
        torch.testing.assert_close(col.double().cpu(), col64, rtol=0, atol=2e-5 * float(col64.abs().max()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_pass_neither_overflows_nor_underflows(dtype):
    """||W_j|| in one pass (float64 squares): rows of 1e30 and 1e-30 (float32 squares give inf and 0), a zero
    row, a row of float32 subnormals, ragged numbers of rows and columns, against safe_norm in float64."""
    weight = torch.randn(11, 70, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    weight[1] *= 1e30
    weight[2] *= 1e-30
    weight[3] = 0.0
    weight[4] = 3e-39 if dtype == torch.float32 else 1e-37  # subnormal float32 entries (the interpreter's bfloat16
    # loses its subnormals), a normal norm
    weight = weight.to(dtype)
    expected = safe_norm(weight.double(), dim=1)
    for eps in (1e-12, 0.0):
        norms, inv, dinv = (t.double().cpu() for t in torch.ops.sphereml.margin_ce_norms(weight.to(DEVICE), eps))
        torch.testing.assert_close(norms, expected, rtol=2e-7, atol=0)
        floor = expected.clamp_min(eps)
        want_inv = torch.where(floor > 0, 1 / floor, 0.0).clamp_max(3e38)  # 1e-30 rows: 1e30, finite in float32
        torch.testing.assert_close(inv, want_inv, rtol=2e-7, atol=0)
        torch.testing.assert_close(dinv, -want_inv * (expected >= max(eps, 1e-300)), rtol=2e-7, atol=0)
    assert inv[3] == 0 and dinv[3] == 0  # a zero row with eps = 0: no inverse, no gradient


def test_norm_pass_floors_the_inverse():
    """eps = 1e-12: a row of norm 1e-13 gets inv = 1e12 and no gradient through its norm (dinv = 0)."""
    weight = torch.randn(3, 5, dtype=torch.float64)
    weight[1] *= 1e-13 / weight[1].norm()
    weight[2] = 0.0
    norms, inv, dinv = torch.ops.sphereml.margin_ce_norms(weight.float().to(DEVICE), 1e-12)
    torch.testing.assert_close(inv.cpu()[1:].double(), torch.tensor([1e12, 1e12], dtype=torch.float64), rtol=1e-6,
                               atol=0)
    assert dinv.cpu()[1:].eq(0).all() and dinv.cpu()[0] == -inv.cpu()[0]


def test_single_class_gives_zero_loss_and_matches_the_reference():
    """C = 1: no column besides the label, so the rest's log-sum-exp is -inf and the loss 0, as on the reference."""
    head = margins.ArcFaceLoss(4, 1).double()
    x, labels = _inputs(5, 4, 1)
    for a, b in zip(_loss_and_grads(head, x, labels, "reference"), _loss_and_grads(head, x, labels, "fused")):
        assert torch.isfinite(b).all()
        torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("bad", [-1, 70, 10**6])
def test_label_out_of_range_makes_the_fused_loss_nan(bad):
    """On a GPU the labels' range is not read on the host; the kernels turn the loss NaN instead of reading a
    neighbouring row's logit (here on float32 tensors, where the range check is skipped as on a GPU)."""
    raw = torch.randn(5, 70, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    labels = torch.tensor([0, bad, 3, 69, 2], device=DEVICE)
    ops = torch.ops.sphereml
    rest, raw_y, _ = ops.margin_ce_lse(raw, raw.new_empty(0), labels, False, False)
    raw_y = raw_y.cpu()
    assert raw_y[1].isnan() and torch.equal(raw_y[[0, 2, 3, 4]], raw.cpu()[[0, 2, 3, 4], [0, 3, 69, 2]])
    assert torch.isfinite(rest).all()
    head = margins.ArcFaceLoss(8, 70).to(DEVICE)
    head.backend = "fused"
    x, _ = _inputs(5, 8, 70, dtype=torch.float32, device=DEVICE)
    x.requires_grad_(True)
    with launches.no_host_sync():  # as on a GPU: no value check of the labels
        loss = head.loss(x, labels)
        loss.backward()
    assert loss.isnan() and head.weight.grad.isnan().all()
    assert x.grad.isnan().any(1).tolist() == [False, True, False, False, False]  # only its own row's features


@pytest.mark.parametrize("name", FUSABLE)
def test_fused_head_passes_over_w_as_often_as_nn_linear_plus_two(name):
    """Operations that touch a C x d tensor (C x d above B x C here): the three products and the gradient's
    accumulation, as for nn.Linear + cross_entropy, plus the norm pass and the norm term of dL/dW.  No row of W
    is gathered, so no C x d zeros and no second C x d gradient to add.  The reference path makes five more than
    nn.Linear's for a normalised head (the norms in four passes, the norm term subtracted in place) and four for
    L-Softmax (its label rows gathered, their gradient's C x d zeros and scatter, and its sum with the product's)."""
    b, d, c = 4, 64, 300
    head = FUSABLE[name](d, c).double()
    x, labels = _inputs(b, d, c)
    linear = torch.nn.Linear(d, c, bias=False).double()

    def step(loss):
        return lambda: loss(x.clone().requires_grad_(True), labels).backward()

    counts = {}
    for backend in ("reference", "fused"):
        head.backend = backend
        step(lambda a, y: head.loss_and_logits(a, y)[0])()  # the weight's gradient exists, as in training
        counts[backend] = launches.count_ops(step(lambda a, y: head.loss_and_logits(a, y)[0]), touching=c * d)
    step(lambda a, y: torch.nn.functional.cross_entropy(linear(a), y))()
    baseline = launches.count_ops(step(lambda a, y: torch.nn.functional.cross_entropy(linear(a), y)), touching=c * d)
    assert counts["fused"].by_op == baseline.by_op + Counter({"sphereml::margin_ce_norms": 1, "aten::addcmul_": 1})
    gathered = {"aten::index.Tensor": 1, "aten::new_zeros": 1, "aten::index_put": 1, "aten::add.Tensor": 1}
    normalised = {"aten::abs": 1, "aten::amax": 1, "aten::div.Tensor": 1, "aten::linalg_vector_norm": 1,
                  "aten::addcmul_": 1}
    extra = gathered if name.startswith("L-Softmax") else normalised
    assert counts["reference"].by_op == baseline.by_op + Counter(extra)


def test_custom_operators_pass_opcheck():
    """Schemas, fake tensors and dispatch of the three operators (torch.library.opcheck), on float32 tensors."""
    g = torch.Generator().manual_seed(5)
    raw, inv = torch.randn(9, 40, generator=g).to(DEVICE), (torch.rand(40, generator=g) + 0.5).to(DEVICE)
    labels = torch.randint(40, (9,), generator=g).to(DEVICE)
    ops = torch.ops.sphereml
    for eps in (1e-12, 0.0):
        torch.library.opcheck(ops.margin_ce_norms, (torch.randn(40, 7, generator=g).to(DEVICE), eps))
    for has_inv, write_logits in ((True, True), (False, False)):
        args = (raw, inv if has_inv else inv[:0], labels, has_inv, write_logits)
        torch.library.opcheck(ops.margin_ce_lse, args)
        rest = ops.margin_ce_lse(*args)[0]
        scales = torch.rand(9, generator=g).to(DEVICE), torch.randn(9, generator=g).to(DEVICE)
        torch.library.opcheck(ops.margin_ce_grad, (*args[:3], rest, *scales, has_inv, True))
        torch.library.opcheck(ops.margin_ce_grad, (*args[:3], rest, *scales, has_inv, True, scales[1][0]))


@pytest.mark.parametrize("name", ["ArcFace", "L-Softmax m=3", "A-Softmax m=4 annealed"])
def test_fused_head_in_float32_matches_float64_reference(name):
    head = FUSABLE[name](16, 150)
    x, labels = _inputs(21, 16, 150)
    ref = _loss_and_grads(head.double(), x, labels, "reference")
    fused = _loss_and_grads(head.float().to(DEVICE), x.float().to(DEVICE), labels.to(DEVICE), "fused")
    for a, b in zip(ref, fused):
        torch.testing.assert_close(b.double().cpu(), a, rtol=0, atol=2e-5 * max(1.0, float(a.abs().max())))


@pytest.mark.parametrize("name", ["ArcFace", "L-Softmax m=3"])
def test_fused_loss_touches_the_logits_five_times(name):
    """One product, one forward pass, one backward pass, two products: against 18 (ArcFace) and 14
    (L-Softmax) B x C operations on the reference path, and 7 for nn.Linear + cross_entropy."""
    b, d, c = 16, 8, 200  # C x d below B x C: only the logit-sized tensors count
    head = FUSABLE[name](d, c).double()
    x, labels = _inputs(b, d, c)
    counts = {}
    for backend in ("reference", "fused"):
        head.backend = backend
        counts[backend] = launches.count_ops(lambda: head.loss(x.clone().requires_grad_(True), labels).backward(),
                                             touching=b * c)
    assert counts["fused"].by_op == {"aten::mm": 3, "sphereml::margin_ce_lse": 1, "sphereml::margin_ce_grad": 1}
    assert counts["reference"].total >= 14


def test_fused_loss_never_reads_the_device_on_the_host():
    head = margins.CosFaceLoss(8, 40)
    head.backend = "fused"
    x, labels = _inputs(6, 8, 40, dtype=torch.float32)
    with launches.no_host_sync():
        head.loss(x.requires_grad_(True), labels).backward()


def test_fused_loss_compiles_without_graph_breaks():
    torch.compiler.reset()
    head = margins.ArcFaceLoss(8, 13).double()
    head.backend = "fused"
    x, labels = _inputs(6, 8, 13)
    compiled = torch.compile(head.loss, fullgraph=True, backend="aot_eager")
    a = x.clone().requires_grad_(True)
    compiled(a, labels).backward()
    b = x.clone().requires_grad_(True)
    head.backend = "reference"
    head.loss(b, labels).backward()
    torch.testing.assert_close(a.grad, b.grad, rtol=1e-12, atol=1e-12)


def test_autocast_bf16_product_matches_reference():
    head = margins.ArcFaceLoss(16, 50)
    x, labels = _inputs(12, 16, 50, dtype=torch.float32)
    out = {}
    for backend in ("reference", "fused"):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out[backend] = _loss_and_grads(head, x, labels, backend)
    for a, b in zip(out["reference"], out["fused"]):
        assert b.dtype == a.dtype
        torch.testing.assert_close(b.float(), a.float(), rtol=0, atol=2e-2 * max(1.0, float(a.float().abs().max())))


HEAD_CLASSES = ("NormalizedSoftmaxLoss", "LSoftmaxLoss", "ASoftmaxLoss", "CosFaceLoss", "ArcFaceLoss",
                "GASoftmaxLoss", "WSoftmaxLoss")


@pytest.mark.parametrize("backend", ["reference", "fused"])
@pytest.mark.parametrize("name", HEAD_CLASSES)
def test_bf16_features_under_autocast_train_as_float32_ones(name, backend):
    """Features made under autocast are bf16 while the class weights stay float32: the backward multiplies in the
    logits' dtype and returns each gradient in its input's (it failed with a dtype mismatch before), and the
    gradients are the float32 run's to bf16 rounding."""
    grads = {}
    for autocast in (False, True):
        torch.manual_seed(0)
        head, layer = getattr(margins, name)(8, 5), torch.nn.Linear(4, 8)
        head.backend = backend
        x, labels = torch.randn(6, 4), torch.randint(5, (6,))
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            features = layer(x)
            assert features.dtype == (torch.bfloat16 if autocast else torch.float32)
            loss = head.loss(features, labels)
        loss.backward()  # outside autocast, as PyTorch's AMP recipe has it
        grads[autocast] = (head.weight.grad, layer.weight.grad)
    for exact, rounded in zip(grads[False], grads[True]):
        assert rounded.dtype == torch.float32
        torch.testing.assert_close(rounded, exact, rtol=0, atol=3e-2 * max(1.0, float(exact.abs().max())))


def test_bad_backend_is_named():
    head = margins.CosFaceLoss(4, 5)
    with pytest.raises(ValueError, match="backend must be one of"):
        head.backend = "cuda"
    x, labels = _inputs(3, 4, 5)
    with pytest.raises(ValueError, match="backend must be one of"):
        margin_cross_entropy(x, head.weight.double(), labels, x[:, 0], backend="triton")


def test_auto_is_the_reference_on_the_cpu():
    """The PyTorch form of the two passes is not faster than autograd on a CPU: ArcFace, CosFace, A- and
    L-Softmax took 1.30, 1.40, 1.27 and 1.61x of nn.Linear + cross_entropy fused against 1.14, 1.30, 1.20
    and 1.64x on the reference path (B = 256, d = 512, C = 10,000, our 2 cores, one run)."""
    from sphereml.energy.triton_backend import choose_backend

    assert choose_backend("auto", torch.zeros(1)) == "reference"
    assert choose_backend("fused", torch.zeros(1)) == "fused"


def test_kernels_compile_for_sm90_without_spills():
    """The five kernels (float32 and bf16 products, with and without weight norms; the tail of each target kind),
    compiled for an H100 here (``benchmarks/sm90.py``; in a subprocess, as the kernels of this process are
    interpreted)."""
    rows = sm90_compile_rows("bench_margins")
    assert len(rows) == 18
    for row in rows:
        assert row["spill_store_bytes"] in (0, None), row
        assert row["registers"] is None or row["registers"] <= 255, row