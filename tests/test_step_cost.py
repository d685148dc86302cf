"""What a training step costs a GPU, proven on the CPU: operation budgets, no host reads, one compiled graph.

Each aten operation is about one kernel launch on a GPU, and each host read of a device tensor a
synchronisation (:mod:`sphereml.launches`).  The budgets are for the thesis's CNN-9 (64/128/256, Table E.1)
and the OPT chapter's CNN-6 (Table F.1); the measured counts are in the benchmark files
(``python -m benchmarks comhe opt`` prints them beside the timings).
"""

import pytest
import torch

from sphereml.heads import margins
from sphereml import models
from sphereml.regularizers import opt, orthogonalizers
from sphereml import regularizers as R
from sphereml.regularizers.comhe import VARIANTS, CoMHE
from sphereml.layers.decoupled import DecoupledConv2d
from sphereml.energy import batched, gram, output_energy
from sphereml.launches import CAPTURE_UNSAFE, HostSyncError, compiled_ops, count_ops, no_host_sync
from sphereml.layers.scs import SharpenedCosineSimilarity2d
from sphereml.layers.sphereconv import SphereConv2d


@pytest.fixture(autouse=True)
def as_on_a_gpu(monkeypatch):
    """Energies evaluated as on a GPU: one chunk per evaluation, and blocks merged into buckets as a GPU merges them
    (the CPU's cache-sized chunks and unmerged blocks add launches that a GPU never sees)."""
    monkeypatch.setattr(gram, "CPU_CHUNK", 2**62)
    monkeypatch.setattr(batched, "MERGE_MAX", 2**62)
    monkeypatch.setattr(batched, "MERGE_WASTE", batched.ACCELERATOR_MERGE_WASTE)
    monkeypatch.setattr(batched, "on_accelerator", lambda device: True)  # fan-ins share blocks, as on a GPU


def _cnn9(depth=9, widths=(64, 128, 256)):
    torch.manual_seed(0)
    return models.Classifier(models.plain_cnn(depth, widths=widths, feature_dim=256), 100)


def _step(net, reg=None, optimizer=None, batch=2, classes=100):
    g = torch.Generator().manual_seed(0)
    device = next(net.parameters()).device
    x, y = torch.randn(batch, 3, 32, 32, generator=g), torch.randint(0, classes, (batch,), generator=g)
    x, y = x.to(device), y.to(device)
    optimizer = optimizer or torch.optim.SGD(net.parameters(), 0.1, momentum=0.9, foreach=True)

    def step():
        optimizer.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(net(x), y)
        (loss + reg() if reg is not None else loss).backward()
        optimizer.step()

    step()  # the first step creates the optimiser's state and the regulariser's device constants
    return step


REGULARIZERS = {
    "HS-MHE": lambda net: R.MHE(net, half_space=True),
    "MHE": lambda net: R.MHE(net),
    "MHE angular": lambda net: R.MHE(net, metric="angular"),
    "RP-CoMHE": lambda net: CoMHE(net),
    "RP-CoMHE (max)": lambda net: CoMHE(net, variant="random_max"),
    "AP-CoMHE (unrolled)": lambda net: CoMHE(net, variant="angle", num_proj=1, resample_every=None),
    "AP-CoMHE (alt.)": lambda net: CoMHE(net, variant="angle", num_proj=1, unrolled=False, ap_every=1),
    "Adv-CoMHE": lambda net: CoMHE(net, variant="adversarial", num_proj=1),
    "G-CoMHE": lambda net: CoMHE(net, variant="group"),
    "BP-CoMHE": lambda net: CoMHE(net, variant="bilateral", num_proj=1),
}
# Launching operations of one CNN-9 step (forward, backward, SGD) with each regulariser; the plain step
# has about 100.  Measured on torch 2.13: HS-MHE 197, MHE 180, RP-CoMHE 242 (max 271), AP-CoMHE 563 (alt. 396),
# Adv-CoMHE 355, G-CoMHE 228, BP-CoMHE 281, since every weight is packed by one gather, MHE's six fan-ins share two
# blocks (energy.packing; before: 235, 218, 278, 290, 606, 437, 404, 264, 313), CoMHE's penalty is one weighted
# sum of its energies (but for the max; before: 260, 581, 414, 374, 246, 295) and a single bucket's energies are
# summed as they come (SetEnergies.joined); one per-layer op each was 28 / 141 /
# 69 / 1,950 host syncs and 1,138-66,361 operations before the batched engine.  The issue's budgets (HS-MHE 400,
# CoMHE 1,300) bound them; REGRESSION holds each to about 1.25 times its count (MHE to 1.15, below its count before
# the shared blocks), so that losing a batching step shows.
BUDGETS = {"HS-MHE": 400, "MHE": 400, "MHE angular": 400, "RP-CoMHE": 1300, "RP-CoMHE (max)": 1300,
           "AP-CoMHE (unrolled)": 1300, "AP-CoMHE (alt.)": 1300, "Adv-CoMHE": 1300, "G-CoMHE": 1300,
           "BP-CoMHE": 1300}
REGRESSION = {"HS-MHE": 225, "MHE": 205, "MHE angular": 205, "RP-CoMHE": 305, "RP-CoMHE (max)": 340,
              "AP-CoMHE (unrolled)": 705, "AP-CoMHE (alt.)": 500, "Adv-CoMHE": 450, "G-CoMHE": 290, "BP-CoMHE": 355}


def _slow_for_groups(names):
    """G-CoMHE's CPU path counts ~42,000 operations per step: 20-45 s each, left out by make test-fast."""
    return [pytest.param(n, marks=pytest.mark.slow) if n == "G-CoMHE" else n for n in names]


@pytest.mark.parametrize("name", _slow_for_groups(REGULARIZERS))
def test_regularised_cnn9_step_within_its_operation_budget(name):
    net = _cnn9()
    ops = count_ops(_step(net, REGULARIZERS[name](net))).total
    assert ops <= min(BUDGETS[name], REGRESSION[name]), f"{name}: {ops} operations per step"


@pytest.mark.slow
def test_group_comhe_costs_no_more_launches_than_random_projections():
    counts = {}
    for name in ("RP-CoMHE", "G-CoMHE"):
        net = _cnn9()
        counts[name] = count_ops(_step(net, REGULARIZERS[name](net))).total
    assert counts["G-CoMHE"] <= counts["RP-CoMHE"]


@pytest.mark.parametrize("name", _slow_for_groups(["HS-MHE", "RP-CoMHE", "G-CoMHE"]))
def test_operations_do_not_grow_with_layers(name, monkeypatch):
    """CNN-18 has nine more weight layers than CNN-9, all of fan-ins CNN-9 already has: the regulariser's
    own operations stay the same; only the sum of two gradients into each new weight is added.  (With one block
    per fan-in: which fan-ins share a block depends on their layers' sizes, test_shared_blocks_save_operations.)"""
    monkeypatch.setattr(batched, "ACCELERATOR_COLUMN_WASTE", None)
    extra = {}
    for depth in (9, 18):
        plain, net = _cnn9(depth), _cnn9(depth)
        extra[depth] = count_ops(_step(net, REGULARIZERS[name](net))).total - count_ops(_step(plain)).total
    assert extra[18] - extra[9] <= 9, extra


@pytest.mark.parametrize("depth", [9, 18])
def test_shared_blocks_save_operations(depth, monkeypatch):
    """MHE's fan-ins sharing blocks on an accelerator (energy.packing): fewer operations than one block per fan-in,
    two blocks for CNN-9's six fan-ins and three for CNN-18's."""
    counts = {}
    for waste in (None, batched.ACCELERATOR_COLUMN_WASTE):
        monkeypatch.setattr(batched, "ACCELERATOR_COLUMN_WASTE", waste)
        net = _cnn9(depth)
        reg = REGULARIZERS["HS-MHE"](net)
        counts[waste] = count_ops(_step(net, reg)).total
        blocks = len(reg._engine.blocks(torch.device("cpu")))
    assert blocks == {9: 2, 18: 3}[depth]
    assert counts[batched.ACCELERATOR_COLUMN_WASTE] <= counts[None] - 3 * (6 - blocks), counts  # 3-4 per block


def test_operations_do_not_grow_with_projections():
    """(One projection can take fewer: its sets may fit a bucket of their own size without padding.)"""
    counts = []
    for num_proj in (1, 5, 20):
        net = _cnn9()
        counts.append(count_ops(_step(net, CoMHE(net, num_proj=num_proj))).total)
    assert counts[0] <= counts[1] == counts[2]


@pytest.fixture
def opt_as_on_a_gpu(monkeypatch):
    """OPT's maps as a GPU computes them: Gram-Schmidt and Householder by Cholesky, Löwdin by eigh, exp without host
    branches (the CPU's LAPACK calls are single operations that a GPU splits into several), a batch of Cayley
    solves in one call; on one thread, where the CPU's batched solve is safe (Note [batched LU on the CPU])."""
    monkeypatch.setattr(orthogonalizers, "on_accelerator", lambda device: True)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _opt_step(method, depth=6):
    torch.manual_seed(0)
    net = models.Classifier(models.opt_cnn(depth, width=64), 100)
    if method == "plain":
        return _step(net)
    opt.overparameterize_model(net, method)
    optimizer = opt.ogd_optimizer(net) if method == "ogd" else None
    return _step(net, opt.OrthogonalRelaxation(net) if method == "or" else None, optimizer)


# Launching operations of one CNN-6 step (Table F.1, width 64) with each OPT method, the maps as on a GPU; the plain
# step has 78.  Measured on torch 2.13 with the rotations evaluated together (Note [rotations evaluated together])
# and the LQ backward written out (Note [the LQ backward]): gs 189, householder 175, lowdin 250, cayley 148,
# matrix_exp 1,117, or 166, ogd 230; one evaluation per layer and autograd's LQ backward took 379 / 365 / 442 / 204 /
# 2,465 / 221 / 461.  The issue's budget for gs is 2,000; OPT_REGRESSION holds each to about 1.25x its count.
OPT_REGRESSION = {"gs": 240, "householder": 225, "lowdin": 315, "cayley": 185, "matrix_exp": 1400, "or": 210,
                  "ogd": 290}


@pytest.mark.parametrize("method", list(OPT_REGRESSION))
def test_opt_cnn6_step_within_its_operation_budget(method, opt_as_on_a_gpu):
    ops = count_ops(_opt_step(method)).total
    assert ops <= min(2000, OPT_REGRESSION[method]), f"{method}: {ops} operations per step"


@pytest.mark.parametrize("method", list(OPT_REGRESSION))
def test_opt_operations_do_not_grow_with_layers(method, opt_as_on_a_gpu):
    """CNN-9 has three more OPT layers than CNN-6, all of a size CNN-6 has (d = 576): its rotations cost no more
    evaluations; each new layer adds only its own product W = V R^T (forward and backward, at most 6 operations)."""
    extra = {depth: count_ops(_opt_step(method, depth)).total - count_ops(_opt_step("plain", depth)).total
             for depth in (6, 9)}
    assert extra[9] - extra[6] <= 3 * 6, extra


# ---------------------------------------------------------------- no host reads


def _small_net(device="cpu"):
    torch.manual_seed(0)
    return models.Classifier(models.plain_cnn(9, widths=(8, 16, 16), feature_dim=16), 10).to(device)


def _regularised(make, device):
    net = _small_net(device)
    return _step(net, make(net), classes=10)


def _opt_case(method, device):
    net = _small_net()
    opt.overparameterize_model(net, method)
    net.to(device)
    optimizer = opt.ogd_optimizer(net) if method == "ogd" else None
    return _step(net, opt.OrthogonalRelaxation(net) if method == "or" else None, optimizer, classes=10)


def _layer_case(make, device):
    layer = make().to(device)
    x = torch.randn(2, 8, 8, 8, generator=torch.Generator().manual_seed(0)).to(device)
    sgd = torch.optim.SGD(layer.parameters(), 0.1)

    def step():
        sgd.zero_grad()
        layer(x).square().mean().backward()
        sgd.step()
    step()
    return step


def _head_case(head, device, output_mhe=False):
    torch.manual_seed(0)
    net = models.Classifier(models.plain_cnn(3, widths=(8, 8, 8), feature_dim=16, feature_act=False), 10,
                            head=head(16, 10)).to(device)
    x, y = torch.randn(4, 3, 32, 32, device=device), torch.randint(0, 10, (4,), device=device)
    sgd = torch.optim.SGD(net.parameters(), 0.1)

    def step():
        sgd.zero_grad()
        loss = net.loss_and_logits(x, y)[0]
        if output_mhe:  # SphereFace+ (eq. 5.8): the batch's own classes pushed from the others
            loss = loss + output_energy(net.head.weight, y)
        loss.backward()
        sgd.step()
    step()
    return step


_MHE = {"full": {}, "half": {"half_space": True}, "angular": {"metric": "angular"}}
SYNC_FREE = {  # name -> device -> one training step (warmed up once)
    **{f"CoMHE {v}": (lambda d, v=v: _regularised(lambda n: CoMHE(n, variant=v, proj_dim=8, num_proj=2, group_size=4,
                                                                    ap_every=1), d)) for v in VARIANTS},
    **{f"MHE {k}": (lambda d, kw=kw: _regularised(lambda n: R.MHE(n, **kw), d)) for k, kw in _MHE.items()},
    "Orthonormality": lambda d: _regularised(lambda n: R.Orthonormality(n, include_linear=True), d),
    "Orthogonality": lambda d: _regularised(R.Orthogonality, d),
    "ConvSimilarity": lambda d: _regularised(R.ConvSimilarity, d),
    **{f"OPT {m}": (lambda d, m=m: _opt_case(m, d)) for m in opt.METHODS},
    "SphereConv2d": lambda d: _layer_case(lambda: SphereConv2d(8, 8, 3, padding=1, angular="sigmoid"), d),
    "SharpenedCosineSimilarity2d": lambda d: _layer_case(lambda: SharpenedCosineSimilarity2d(8, 8, 3, padding=1), d),
    "DecoupledConv2d": lambda d: _layer_case(lambda: DecoupledConv2d(8, 8, 3, padding=1), d),
    **{name: (lambda d, h=getattr(margins, name): _head_case(h, d))
       for name in ("NormalizedSoftmaxLoss", "LSoftmaxLoss", "ASoftmaxLoss", "CosFaceLoss", "ArcFaceLoss",
                    "GASoftmaxLoss", "WSoftmaxLoss")},
    "SphereFace+": lambda d: _head_case(margins.ASoftmaxLoss, d, output_mhe=True),
}


@pytest.mark.parametrize("name", list(SYNC_FREE))
def test_training_step_reads_nothing_on_the_host(name):
    step = SYNC_FREE[name]("cpu")
    with no_host_sync():
        step()
        step()


# torch.linalg.eigh (Löwdin's map on a GPU, Note [Löwdin on a GPU]) checks its convergence on the host, so that
# step synchronises once per OPT layer; Newton-Schulz iterations would not, but on an H200 the sixty that d = 1024
# needs took 2-4.6 times as long as the eigendecomposition (benchmarks/results/logs/gpu-check-4-h200.txt).
SYNCS_ON_CUDA = {"OPT lowdin"}
_EIGH_SYNC = pytest.mark.xfail(strict=True, reason="the eigendecomposition checks its convergence on the host")


@pytest.mark.needs_cuda
@pytest.mark.parametrize("name", [pytest.param(n, marks=_EIGH_SYNC)
                                  if n in SYNCS_ON_CUDA else n for n in SYNC_FREE])
def test_cuda_training_step_never_synchronises(name):
    """The same steps on a GPU under CUDA's own check, which also sees device-to-host copies."""
    step = SYNC_FREE[name]("cuda")
    step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_the_guard_catches_each_kind_of_host_read():
    t = torch.randn(5)
    reads = [lambda: t.sum().item(), lambda: bool(t.sum() > 0), lambda: float(t[0]), lambda: t.nonzero(),
             lambda: t[t > 0], lambda: t.tolist(), lambda: t.cpu(), lambda: t.masked_select(t > 0),
             lambda: t.unique(), lambda: torch.equal(t, t)]
    for read in reads:
        with pytest.raises(HostSyncError), no_host_sync():
            read()
    with no_host_sync():
        torch.where(t > 0, t, 0.0).sum()  # masks kept on the device are fine
    assert t.tolist()  # restored afterwards


def test_count_ops_counts_launches_and_views_apart():
    t = torch.randn(4, 4)
    count = count_ops(lambda: (t.T @ t).relu().sum())
    assert count.total == 3 and count.views == 1
    assert dict(count.most_common()) == {"aten::mm": 1, "aten::relu": 1, "aten::sum": 1}


# ---------------------------------------------------------------- one compiled graph


COMPILED = {
    **{name: REGULARIZERS[name] for name in ("HS-MHE", "MHE angular", "RP-CoMHE", "RP-CoMHE (max)",
                                             "AP-CoMHE (unrolled)", "Adv-CoMHE", "G-CoMHE", "BP-CoMHE")},
    "AP-CoMHE (alt.)": lambda net: CoMHE(net, variant="angle", num_proj=1, unrolled=False, ap_every=1),
    "Orthonormality": lambda net: R.Orthonormality(net, include_linear=True),
    "Orthogonality": R.Orthogonality,
    "ConvSimilarity": lambda net: R.ConvSimilarity(net, method="direct"),
}


@pytest.mark.parametrize("name", list(COMPILED))
def test_penalty_compiles_as_one_graph_without_recompiling(name):
    torch._dynamo.reset()
    net = models.Classifier(models.plain_cnn(9, widths=(8, 16, 16), feature_dim=16), 10)
    reg = COMPILED[name](net)
    compiled = torch.compile(reg.weighted_penalty, fullgraph=True, backend="aot_eager")
    values = []
    for step in range(3):
        reg.before_step()  # new projections, fitted or ascended P: eager, outside the graph
        with torch._dynamo.config.patch(error_on_recompile=step > 0):
            value = compiled()
        value.backward()
        torch.testing.assert_close(value, reg.weighted_penalty(), rtol=1e-5, atol=0)
        values.append(value.detach())
    assert all(v.isfinite() for v in values)


@pytest.mark.parametrize("method", ["gs", "householder", "cayley", "matrix_exp", "or"])
def test_opt_layer_compiles_as_one_graph(method):
    torch._dynamo.reset()
    layer = torch.nn.Conv2d(4, 6, 3)
    opt.orthogonal_overparameterize(layer, method)
    x = torch.randn(2, 4, 8, 8)
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    out = compiled(x)
    out.square().sum().backward()
    torch.testing.assert_close(out, layer(x), rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- captured into a CUDA graph (Note [what a CUDA graph
# cannot capture]): fit(compile="reduce-overhead") records the compiled step, so no operation of it may be unsafe


def test_the_capture_check_finds_the_lu_solve():
    """The check fails where it should: Cayley's LU form, which an H100 could not capture, is refused."""
    a = torch.randn(2, 5, 5)
    a = (a - a.mT).requires_grad_()
    eye = torch.eye(5)
    unsafe = compiled_ops(lambda: orthogonalizers.solve_invertible(eye - a, eye + a)) & CAPTURE_UNSAFE
    assert "aten::_linalg_solve_ex" in unsafe


# Löwdin's eigh checks its convergence on the host: its compiled step trains with compile=True, not "reduce-overhead"
CAPTURE_EXPECTED = {"lowdin": {"aten::_linalg_eigh"}}


@pytest.mark.parametrize("method", ["gs", "householder", "cayley", "matrix_exp", "or", "lowdin"])
def test_compiled_opt_layer_on_a_gpu_can_be_captured(method, opt_as_on_a_gpu):
    """The GPU forms of OPT's maps (Cholesky for Gram-Schmidt and Householder, and for Cayley under compile), as a
    compiled step takes them, forward and backward."""
    torch.manual_seed(0)
    layer = torch.nn.Conv2d(4, 6, 3)
    opt.orthogonal_overparameterize(layer, method)
    x = torch.randn(2, 4, 8, 8)
    unsafe = compiled_ops(lambda: layer(x).square().sum()) & CAPTURE_UNSAFE
    assert unsafe == CAPTURE_EXPECTED.get(method, set())


@pytest.mark.parametrize("method, subset", [("gs", None), ("cayley", None), ("or", None), ("gs", 4)])
def test_compiled_opt_network_step_on_a_gpu_can_be_captured(method, subset, opt_as_on_a_gpu):
    """A whole OPT network's loss as ``fit(compile=...)`` compiles it: the rotations of its layers evaluated
    together (group_rotations), S-OPT's rotation of a subset, and OR's penalty beside the loss."""
    torch.manual_seed(0)
    net = models.Classifier(models.opt_cnn(6, width=8), 10)
    opt.overparameterize_model(net, method, **({"subset": subset} if subset else {}))
    penalty = opt.OrthogonalRelaxation(net) if method == "or" else None
    x, y = torch.randn(2, 3, 32, 32), torch.tensor([1, 2])

    def loss():
        value = torch.nn.functional.cross_entropy(net(x), y)
        return value + penalty() if penalty is not None else value

    assert not compiled_ops(loss) & CAPTURE_UNSAFE


@pytest.mark.parametrize("name", list(COMPILED))
def test_compiled_penalty_on_a_gpu_can_be_captured(name):
    """Every regulariser's compiled penalty, with the energies packed as on a GPU (the autouse fixture)."""
    net = models.Classifier(models.plain_cnn(9, widths=(8, 16, 16), feature_dim=16), 10)
    reg = COMPILED[name](net)
    reg.before_step()
    assert not compiled_ops(reg.weighted_penalty) & CAPTURE_UNSAFE
