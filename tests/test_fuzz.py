"""Property-based fuzzing of every public function and layer (hypothesis).

Inputs are drawn where numerics break: random shapes, rows scaled anywhere from 1e-30 to 1e30, zero rows,
duplicate and antipodal rows, cosines of exactly -1, 0 and +1, float32 and float64, and the layers under
bfloat16 autocast.  The property is the same for every case: the outputs and the gradients of their sum
are finite, or the call raises a ValueError (a clear error).  The terminal summary reports how many cases
ran.

Where the mathematics itself leaves the dtype's range (an unbounded operator fed 1e30 in float32), the
case draws from the range its output can represent; each such bound is stated beside the case.
"""


import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sphereml import angular, energy, geometry, metrics, regularizers
from sphereml.regularizers import comhe, convsim, orthogonalizers
from sphereml.layers import decoupled, scs, sphereconv
from sphereml.heads import margins, targets

pytestmark = pytest.mark.usefixtures("one_thread")

EXAMPLES = 60
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.function_scoped_fixture])  # `count` only counts
DTYPES = (torch.float32, torch.float64)


# ------------------------------------------------------------------ strategies
@st.composite
def hard_rows(draw, rows=(1, 6), cols=(1, 5), exponents=(-30, 30), dtype=None):
    """A Tensor[n, d] whose rows have random directions, norms 10**e for e in ``exponents``, and some
    rows zero, duplicated or antipodal to an earlier row."""
    n, d = draw(st.integers(*rows)), draw(st.integers(*cols))
    dtype = dtype or draw(st.sampled_from(DTYPES))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    x = torch.randn(n, d, generator=g, dtype=torch.float64)
    x = x * torch.tensor([10.0 ** draw(st.integers(*exponents)) for _ in range(n)], dtype=torch.float64)[:, None]
    for i in range(n):
        kind = draw(st.sampled_from(("random", "random", "zero", "duplicate", "antipodal")))
        if kind == "zero":
            x[i] = 0.0
        elif kind in ("duplicate", "antipodal") and i > 0:
            x[i] = x[draw(st.integers(0, i - 1))] * (1 if kind == "duplicate" else -1)
    return x.to(dtype)


@st.composite
def hard_cosines(draw):
    """Cosines in [-1, 1] with the endpoints and 0 over-represented."""
    values = draw(st.lists(st.one_of(st.sampled_from((-1.0, 0.0, 1.0, -1 + 1e-7, 1 - 1e-7)),
                                     st.floats(-1.0, 1.0)), min_size=1, max_size=8))
    return torch.tensor(values, dtype=draw(st.sampled_from(DTYPES)))


@st.composite
def hard_images(draw, channels=2, exponents=(-30, 30)):
    """A Tensor[B, C, H, W]: each sample a fuzzed row (zero, duplicated, antipodal or scaled), so whole
    receptive fields are zero or at extreme scales."""
    b, h, w = draw(st.integers(1, 3)), draw(st.integers(3, 5)), draw(st.integers(3, 5))
    x = draw(hard_rows(rows=(b, b), cols=(channels * h * w, channels * h * w), exponents=exponents))
    return x.view(b, channels, h, w)


@st.composite
def hard_squares(draw, exponents=(-30, 30)):
    m = draw(st.integers(1, 5))
    return draw(hard_rows(rows=(m, m), cols=(m, m), exponents=exponents))


# ------------------------------------------------------------------ the property
def _leaves(*tensors):
    return [t.detach().clone().requires_grad_(t.is_floating_point()) for t in tensors]


def assert_finite_or_clear_error(fn, *tensors, autocast=False, gradients=True):
    """``fn(*tensors)`` is finite and so is the gradient of its sum w.r.t. each floating input (unless
    ``gradients=False``); or it raises ValueError."""
    leaves = _leaves(*tensors)
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = fn(*leaves)
    except ValueError as err:
        assert str(err), "a ValueError must say what is wrong"
        return
    outs = tuple(torch.as_tensor(o) for o in (out if isinstance(out, tuple) else (out,)))
    for o in outs:
        assert torch.isfinite(o).all(), f"non-finite output {o}"
    differentiable = [o for o in outs if o.requires_grad]
    if not (differentiable and gradients):
        return
    total = sum(o.float().sum() for o in differentiable)
    grads = torch.autograd.grad(total, [t for t in leaves if t.requires_grad], allow_unused=True)
    for g in grads:
        assert g is None or torch.isfinite(g).all(), f"non-finite gradient {g}"


@pytest.fixture
def count(fuzz_cases, request):
    def tick():
        fuzz_cases[request.node.originalname] += 1

    return tick


# ------------------------------------------------------------------ geometry and angular functions
ROW_FUNCTIONS = {
    "normalize": geometry.normalize,
    "cosine_matrix": geometry.cosine_matrix,
    "angle_matrix": geometry.angle_matrix,
    "energy dense s=2": lambda w: energy.hyperspherical_energy(w, s=2.0, backend="dense"),
    "energy tiled s=2": lambda w: energy.hyperspherical_energy(w, s=2.0, backend="tiled"),
    "energy dense s=0 (log)": lambda w: energy.hyperspherical_energy(w, s=0.0, backend="dense"),
    "energy angular half-space": lambda w: energy.hyperspherical_energy(w, s=1.0, metric="angular",
                                                                        half_space=True),
    "energy tiled angular half-space": lambda w: energy.hyperspherical_energy(
        w, s=2.0, metric="angular", half_space=True, backend="tiled"),
    "minibatch energy": lambda w: energy.minibatch_energy(w, 2, generator=torch.Generator().manual_seed(0)),
    "output energy": lambda w: energy.output_energy(w, torch.arange(len(w)) % 2),
    "group energy": lambda w: comhe.group_energy(w, group_size=2),
    "projected energies": lambda w: comhe.projected_energies(
        w, torch.randn(3, w.shape[1], 2, dtype=w.dtype, generator=torch.Generator().manual_seed(0))),
    "bilateral energy": lambda w: comhe.bilateral_energy(
        w, torch.randn(w.shape[1], 2, dtype=w.dtype), torch.randn(len(w), 2, dtype=w.dtype)),
    "angle distortion": lambda w: comhe.angle_distortion(
        w, torch.randn(2, w.shape[1], 2, dtype=w.dtype, generator=torch.Generator().manual_seed(0))),
    "sphere_linear cosine": lambda x: sphereconv.sphere_linear(x, torch.randn(3, x.shape[1], dtype=x.dtype)),
    "sphere_linear sigmoid": lambda x: sphereconv.sphere_linear(
        x, torch.randn(3, x.shape[1], dtype=x.dtype), angular="sigmoid", k=0.3),
    "sphere_linear linear": lambda x: sphereconv.sphere_linear(
        x, torch.randn(3, x.shape[1], dtype=x.dtype), angular="linear"),
    "sphere_linear, fuzzed weight": lambda w: sphereconv.sphere_linear(
        torch.randn(2, w.shape[1], dtype=w.dtype), w, angular="linear"),
    "angular fisher score": lambda x: metrics.angular_fisher_score(x, torch.arange(len(x)) % 2),
    "pair cosines": lambda x: metrics.pair_cosines(x, torch.tensor([[0, len(x) - 1]])),
}


@pytest.mark.parametrize("name", sorted(ROW_FUNCTIONS))
@FUZZ
@given(w=hard_rows())
def test_row_functions(name, w, count):
    count()
    assert_finite_or_clear_error(ROW_FUNCTIONS[name], w)


COSINE_FUNCTIONS = {
    "safe_angle": geometry.safe_angle,
    "stable_arccos": angular.stable_arccos,
    "inverse_sine": angular.inverse_sine,
    "chebyshev_cos m=4": lambda c: targets.chebyshev_cos(c, 4),
    "multiplicative_psi m=3": lambda c: targets.multiplicative_psi(c, 3),
    "arcface_psi": lambda c: targets.arcface_psi(c, 0.5),
    "psi(theta) m=1.5": lambda c: targets.psi(geometry.safe_angle(c), 1.5),
    **{f"angular_activation {g}": (lambda c, g=g: angular.angular_activation(c, g, k=0.3))
       for g in angular.DECOUPLED_ANGULAR},
    **{f"sharpen p={p}": (lambda c, p=p: scs.sharpen(c, p)) for p in (0.1, 1.0, 2.0, 7.0)},
}


@pytest.mark.parametrize("name", sorted(COSINE_FUNCTIONS))
@FUZZ
@given(c=hard_cosines())
def test_cosine_functions(name, c, count):
    count()
    assert_finite_or_clear_error(COSINE_FUNCTIONS[name], c)


# ------------------------------------------------------------------ margin heads (features fuzzed)
HEADS = {
    "normalized softmax": lambda d: margins.NormalizedSoftmaxLoss(d, 3, s=16.0),
    "L-Softmax": lambda d: margins.LSoftmaxLoss(d, 3, m=4),
    "A-Softmax": lambda d: margins.ASoftmaxLoss(d, 3, m=4),
    "A-Softmax detached": lambda d: margins.ASoftmaxLoss(d, 3, m=1.5, detach_margin=True),
    "CosFace": lambda d: margins.CosFaceLoss(d, 3),
    "ArcFace": lambda d: margins.ArcFaceLoss(d, 3),
    "GA-Softmax": lambda d: margins.GASoftmaxLoss(d, 3, angular="sigmoid"),
    "W-Softmax": lambda d: margins.WSoftmaxLoss(d, 3),
}


@pytest.mark.parametrize("name", sorted(HEADS))
@pytest.mark.parametrize("autocast", [False, True], ids=["fp", "bf16-autocast"])
@FUZZ
@given(x=hard_rows(), seed=st.integers(0, 1000))
def test_margin_heads(name, autocast, x, seed, count):
    """Loss and gradients finite for features of any scale (L-Softmax is unnormalised: |x| <= 1e15)."""
    count()
    torch.manual_seed(seed)
    head = HEADS[name](x.shape[1]).to(x.dtype)
    y = torch.arange(len(x)) % 3
    if name == "L-Softmax":
        x = x.clamp(-1e15, 1e15)
    assert_finite_or_clear_error(lambda f: head.loss(f, y), x,
                                 autocast=autocast)


# ------------------------------------------------------------------ convolutions (images fuzzed)
def _kernel(dtype, out=3, inp=2, k=3):
    return torch.randn(out, inp, k, k, dtype=dtype, generator=torch.Generator().manual_seed(1))


CONV_FUNCTIONS = {
    **{f"sphere_conv2d {g}": (lambda x, g=g: sphereconv.sphere_conv2d(x, _kernel(x.dtype), padding=1, angular=g))
       for g in angular.ANGULAR},
    "scs_conv2d p=2": lambda x: scs.scs_conv2d(x, _kernel(x.dtype), p=2.0, padding=1),
    "scs_conv2d p=0.5": lambda x: scs.scs_conv2d(x, _kernel(x.dtype), p=0.5, q=0.0, padding=1),
    "max_abs_pool2d": lambda x: scs.max_abs_pool2d(x, 2),
    **{f"decoupled_conv2d {h} x {g}": (lambda x, h=h, g=g: decoupled.decoupled_conv2d(
        x, _kernel(x.dtype), padding=1, magnitude=h, angular=g))
       for h in decoupled.MAGNITUDES for g in ("cosine", "sqcosine", "linear")},
    "decoupled_conv2d tanh, weighted tanh_joint": lambda x: decoupled.decoupled_conv2d(
        x, _kernel(x.dtype), magnitude="tanh", weighted="tanh_joint"),
    "decoupled_conv2d ball, radius E|x|": lambda x: decoupled.decoupled_conv2d(
        x, _kernel(x.dtype), magnitude="ball", norm_mean=1.0),
    "feature_map_similarity": lambda x: convsim.feature_map_similarity(_kernel(x.dtype), x, normalized=True),
}
# Unbounded magnitudes (h = |x| etc.) grow with the input: 1e30 patches exceed float32's range in h itself.
UNBOUNDED = ("linear", "seg", "log", "mix")


@pytest.mark.parametrize("name", sorted(CONV_FUNCTIONS))
@FUZZ
@given(x=hard_images())
def test_conv_functions(name, x, count):
    count()
    if any(f" {h} " in name for h in UNBOUNDED) or name == "feature_map_similarity":
        x = x.clamp(-1e15, 1e15)
    assert_finite_or_clear_error(CONV_FUNCTIONS[name], x)


@pytest.mark.parametrize("name", ["sphere_conv2d cosine", "scs_conv2d p=2", "decoupled_conv2d tanh x cosine"])
@FUZZ
@given(w=hard_rows(rows=(3, 3), cols=(18, 18)))
def test_conv_functions_with_fuzzed_kernels(name, w, count):
    """Zero, duplicated and extreme kernels (the images are ordinary)."""
    count()
    x = torch.randn(2, 2, 4, 4, dtype=w.dtype, generator=torch.Generator().manual_seed(2))
    fn = {"sphere_conv2d cosine": sphereconv.sphere_conv2d, "scs_conv2d p=2": scs.scs_conv2d,
          "decoupled_conv2d tanh x cosine": decoupled.decoupled_conv2d}[name]
    assert_finite_or_clear_error(lambda k: fn(x, k.view(3, 2, 3, 3)), w)


LAYERS = {
    "SphereConv2d sigmoid, learnable k": lambda: sphereconv.SphereConv2d(2, 3, 3, padding=1, angular="sigmoid",
                                                                         learnable_k=True),
    "SphereNorm rescaled": lambda: sphereconv.SphereNorm(2, 3, 3, padding=1, rescale=True),
    "SCS learnable": lambda: scs.SharpenedCosineSimilarity2d(2, 3, 3, padding=1, learnable=True),
    "DecoupledConv2d tanh, learnable rho": lambda: decoupled.DecoupledConv2d(2, 3, 3, magnitude="tanh",
                                                                             learnable_rho=True),
    "DecoupledConv2d seg, radius norm": lambda: decoupled.DecoupledConv2d(2, 3, 3, magnitude="seg",
                                                                          radius_norm=True),
    "DecoupledConv2d sphere x sqcosine": lambda: decoupled.DecoupledConv2d(2, 3, 3, magnitude="sphere",
                                                                           angular="sqcosine"),
}


@pytest.mark.parametrize("name", sorted(LAYERS))
@pytest.mark.parametrize("autocast", [False, True], ids=["fp", "bf16-autocast"])
@FUZZ
@given(x=hard_images())
def test_layers(name, autocast, x, count):
    """Layers in training mode, float32/float64 and under bfloat16 autocast."""
    count()
    torch.manual_seed(0)
    layer = LAYERS[name]().to(x.dtype)
    if "seg" in name:
        x = x.clamp(-1e15, 1e15)
    assert_finite_or_clear_error(layer, x, autocast=autocast)


# ------------------------------------------------------------------ orthogonalizers and regularizers
SQUARE_FUNCTIONS = {
    "gram_schmidt": orthogonalizers.gram_schmidt,
    "gram_schmidt modified": lambda u: orthogonalizers.gram_schmidt(u, modified=True),
    "householder": orthogonalizers.householder,
    "qr_orthogonalize": orthogonalizers.qr_orthogonalize,
    "cholesky_qr": orthogonalizers.cholesky_qr,
    "lowdin": orthogonalizers.lowdin,
    "cayley": lambda a: orthogonalizers.cayley(orthogonalizers.skew(a)),
    "exp_map": lambda a: orthogonalizers.exp_map(orthogonalizers.skew(a)),
    "orthogonality_error": orthogonalizers.orthogonality_error,
    "orthonormality_penalty": regularizers.orthonormality_penalty,
    "orthogonality_penalty": regularizers.orthogonality_penalty,
    "conv_similarity": lambda w: convsim.conv_similarity(w[:, None, :]),
    "conv_similarity normalized fft": lambda w: convsim.conv_similarity(w[:, None, :], method="fft",
                                                                        normalized=True),
    "pair_similarity same": lambda w: convsim.pair_similarity(w[:, None, :], mode="same"),
    "kernel_correlation": lambda w: convsim.kernel_correlation(w[0], w[-1]),
}
# Float32 holds 1e30 but not its square: the penalties are quartic in u (squared Gram entries) and draw
# |u| <= 1e8, the kernel correlation is quadratic and draws |u| <= 1e15.
QUADRATIC = ("orthogonality_error", "orthonormality_penalty", "orthogonality_penalty", "conv_similarity",
             "pair_similarity same", "kernel_correlation")
# A skew matrix with entries near 1e30 is a rotation by 1e30 radians: its angle is lost in rounding, and
# the exponential's scaling-and-squaring needs log2(1e30) = 100 squarings; |a| <= 1e6 keeps it meaningful.
ROTATION = ("cayley", "exp_map")


@pytest.mark.parametrize("name", sorted(SQUARE_FUNCTIONS))
@FUZZ
@given(u=hard_squares())
def test_square_functions(name, u, count):
    count()
    if name.startswith(QUADRATIC):
        u = u.clamp(-1e15, 1e15) if name == "kernel_correlation" else u.clamp(-1e8, 1e8)
    if name in ROTATION:
        u = u.clamp(-1e6, 1e6)
    # Orthogonalising a singular matrix has no unique answer, and Q jumps as U crosses it: the gradient is
    # checked where U is well conditioned, the output everywhere.
    conditioned = bool(torch.linalg.cond(u.double()) < 1e4) or name in ROTATION or name.startswith(QUADRATIC)
    assert_finite_or_clear_error(SQUARE_FUNCTIONS[name], u, gradients=conditioned)


REGULARIZERS = {
    "MHE": lambda m: regularizers.MHE(m, s=2.0),
    "MHE half-space angular s=0": lambda m: regularizers.MHE(m, s=0.0, half_space=True, metric="angular"),
    "CoMHE random": lambda m: comhe.CoMHE(m, proj_dim=2, num_proj=2),
    "CoMHE group": lambda m: comhe.CoMHE(m, variant="group", group_size=2),
    "Orthonormality": lambda m: regularizers.Orthonormality(m, include_linear=True),
    "ConvSimilarity": lambda m: regularizers.ConvSimilarity(m, normalized=True),
}


@pytest.mark.parametrize("name", sorted(REGULARIZERS))
@FUZZ
@given(w=hard_rows(rows=(2, 6), cols=(9, 9), exponents=(-30, 9)))
def test_regularizers_on_fuzzed_weights(name, w, count):
    """Each regulariser on a conv layer whose kernels are the fuzzed rows (|w| <= 1e9: the orthonormality
    and similarity penalties are quartic in w)."""
    count()
    conv = torch.nn.Conv2d(1, len(w), 3, bias=False).to(w.dtype)
    head = torch.nn.Linear(len(w), 2).to(w.dtype)
    model = torch.nn.Sequential(conv, torch.nn.Flatten(), head)
    with torch.no_grad():
        conv.weight.copy_(w.view(len(w), 1, 3, 3))
    reg = REGULARIZERS[name](model)
    assert_finite_or_clear_error(lambda weight: reg(), conv.weight)
    out = reg()
    assert torch.isfinite(out)
    grad, = torch.autograd.grad(out, conv.weight)
    assert torch.isfinite(grad).all()
