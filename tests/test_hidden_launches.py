"""What the library's custom operators launch inside themselves, where the operation counts do not look.

``sphereml.launches.count_ops`` is a dispatch mode: it sees each ``sphereml::`` operator as one operation, but not
the aten operations that the operator's Python implementation runs around its Triton kernels, each of which is a
launch of its own on a GPU (a ``torch.zeros`` is a fill kernel).  Here every operator runs its implementation
under a count of its own, with its Triton kernels replaced by recorders, so that a step's launches inside the
operators are listed by name: the kernels, and the reductions of their partial sums.  Allocations launch nothing
and are left out.  The GPU's forms run on either device (the kernels are never executed).
"""

import importlib
import os
from collections import Counter

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

triton = pytest.importorskip("triton")

from sphereml import _custom_ops  # noqa: E402
from sphereml.energy import batched, gram  # noqa: E402
from sphereml.heads import margins  # noqa: E402
from sphereml.launches import count_ops  # noqa: E402
from sphereml.layers import patch_norms  # noqa: E402
from sphereml.layers.decoupled import decoupled_conv2d  # noqa: E402
from sphereml.layers.patches import patch_cosine2d  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
KERNEL_MODULES = ("sphereml.layers._patch_kernels", "sphereml.layers._window_kernels", "sphereml.layers._unit_kernels",
                  "sphereml.heads._margin_kernels", "sphereml.energy._pair_kernels")
ALLOCATIONS = {"aten::empty.memory_format", "aten::new_empty", "aten::empty_like", "aten::empty_strided"}
PATCH_KERNELS = Counter({"sphereml.layers._unit_kernels.forward_kernel": 1,
                         "sphereml.layers._unit_kernels.backward_kernel": 1,
                         "sphereml.layers._window_kernels.window_sums_kernel": 1,
                         "sphereml.layers._window_kernels.window_gradient_kernel": 1,
                         "sphereml.layers._patch_kernels.forward_kernel": 1,
                         "sphereml.layers._patch_kernels.backward_kernel": 1})


class _Recorder:
    """A Triton kernel's stand-in: ``kernel[grid](...)`` counts a launch and runs nothing."""

    def __init__(self, name: str, launches: Counter):
        self.name, self.launches = name, launches

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.update([self.name])


def _inside_operators(monkeypatch, step) -> tuple[dict, Counter]:
    """Run ``step()`` once: ({operator: Counter of the aten operations its implementation launched}, Counter of the
    Triton kernels launched)."""
    hidden, kernels = {}, Counter()
    for module_name in KERNEL_MODULES:
        module = importlib.import_module(module_name)
        for name, value in vars(module).items():  # the launched kernels, not the helpers they call
            if name.endswith("_kernel") and isinstance(value, triton.runtime.jit.KernelInterface):
                monkeypatch.setattr(module, name, _Recorder(f"{module_name}.{name}", kernels))

    def counted(self, *args):
        out = []
        count = count_ops(lambda: out.append(self.implementation(*args)))
        launched = Counter({op: n for op, n in count.by_op.items() if op not in ALLOCATIONS})
        hidden[self.name] = hidden.get(self.name, Counter()) + launched
        return out[0]

    monkeypatch.setattr(_custom_ops.Operator, "__call__", counted)
    step()
    return {name: ops for name, ops in hidden.items() if ops}, kernels


PATCH_CASES = {
    "SphereConv, cosine": (lambda x, w: patch_cosine2d(x, w, padding=1, backend="fused"), {}),
    "SCS, fixed p and q": (lambda x, w: patch_cosine2d(x, w, padding=1, q=1e-3, power=2.0, backend="fused"), {}),
    "SphereConv, sigmoid, channels-last": (
        lambda x, w: patch_cosine2d(x.to(memory_format=torch.channels_last), w, padding=1, angular="sigmoid", k=0.3,
                                    backend="fused"), {}),
    "decoupled, learned rho": (
        lambda x, w: decoupled_conv2d(x, w, padding=1, rho=torch.tensor(1.0, device=DEVICE, requires_grad=True),
                                      backend="fused"),
        {"sphereml::patch_epilogue_backward": {"aten::sum": 1}}),  # dL/dr from the programs' shares
}


@pytest.mark.parametrize("case", PATCH_CASES)
def test_a_patch_layer_launches_its_kernels_and_nothing_else_inside_its_operators(monkeypatch, case):
    """Six kernels a step (the unit kernels', the box sums', the epilogue's, each way), and inside the operators no
    fill, copy or cast; a learned scalar's gradient is one sum of the programs' shares."""
    monkeypatch.setattr(patch_norms, "on_accelerator", lambda device: True)
    layer, expected = PATCH_CASES[case]
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 4, 5, 5, generator=g).to(DEVICE).requires_grad_(True)
    w = torch.randn(6, 4, 3, 3, generator=g).to(DEVICE).requires_grad_(True)
    hidden, kernels = _inside_operators(monkeypatch, lambda: layer(x, w).sum().backward())
    assert hidden == expected
    assert kernels == PATCH_KERNELS


def test_learned_p_and_q_cost_one_sum_each(monkeypatch):
    """SCS as its layer learns it (p per channel, q one value): dL/dp from the partial sums over positions, reduced
    once; dL/dq from the programs' shares of dL/dm, summed once.  Outside the operators the step has no operation
    of the chain that formed dL/dsq from dL/dm for a learned q."""
    monkeypatch.setattr(patch_norms, "on_accelerator", lambda device: True)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(2, 4, 5, 5, generator=g).to(DEVICE).requires_grad_(True)
    w = torch.randn(6, 4, 3, 3, generator=g).to(DEVICE).requires_grad_(True)
    p = torch.full((6, 1, 1), 2.0, device=DEVICE, requires_grad=True)
    q = torch.tensor(1e-3, device=DEVICE, requires_grad=True)

    def step():
        patch_cosine2d(x, w, padding=1, q=q, power=p, backend="fused").sum().backward()
    outside = count_ops(step).by_op
    assert not {"aten::sqrt_", "aten::clamp_min", "aten::div_.Tensor", "aten::ge.Scalar"} & set(outside), outside
    hidden, kernels = _inside_operators(monkeypatch, step)
    assert hidden == {"sphereml::patch_epilogue_backward": {"aten::sum.dim_IntList": 1, "aten::sum": 1}}
    assert kernels == PATCH_KERNELS


@pytest.mark.parametrize("name", ["CosFace", "L-Softmax"])
def test_a_fused_margin_heads_operators_launch_their_kernels_and_one_column_sum(monkeypatch, name):
    """The norms (of the features and of W), the log-sum-exp in chunks and their combination, the target's tail and
    the gradient's kernel; inside, only the sum of the gradient kernel's partial column sums, which a normalised
    head's dL/dW needs and L-Softmax's (no norm of W in its logits' gradient) does not."""
    b, d, c = 8, 16, 50
    head = (margins.CosFaceLoss(d, c) if name == "CosFace" else margins.LSoftmaxLoss(d, c, m=3, lambda_=2.0)).to(DEVICE)
    head.backend = "fused"
    g = torch.Generator().manual_seed(5)
    x = torch.randn(b, d, generator=g).to(DEVICE).requires_grad_(True)
    labels = torch.randint(c, (b,), generator=g).to(DEVICE)
    hidden, kernels = _inside_operators(monkeypatch, lambda: head.loss(x, labels).backward())
    column_sums = {"sphereml::margin_ce_grad": {"aten::sum.dim_IntList": 1}}
    assert hidden == (column_sums if name == "CosFace" else {})
    module = "sphereml.heads._margin_kernels"
    assert kernels == Counter({f"{module}.norm_kernel": 2, f"{module}.lse_kernel": 1, f"{module}.combine_kernel": 1,
                               f"{module}.tail_kernel": 1, f"{module}.grad_kernel": 1})


def test_the_pair_kernels_launch_one_sum_of_partial_sums_per_bucket(monkeypatch):
    """HS-MHE with the pair kernels on a narrow CNN-9, one block per fan-in (several buckets): per bucket the energy
    kernel with the sum of its partial sums, and the gradient kernel."""
    from test_step_cost import REGULARIZERS, _cnn9

    monkeypatch.setattr(gram, "PAIRS_BACKEND", "fused")
    monkeypatch.setattr(batched, "ACCELERATOR_COLUMN_WASTE", None)
    reg = REGULARIZERS["HS-MHE"](_cnn9(widths=(8, 16, 32)).to(DEVICE))
    hidden, kernels = _inside_operators(monkeypatch, lambda: reg.weighted_penalty().backward())
    buckets = kernels["sphereml.energy._pair_kernels.energy_kernel"]
    assert buckets >= 2
    assert hidden == {"sphereml::gram_pair_energies": {"aten::sum.dim_IntList": buckets}}
    assert kernels == Counter({"sphereml.energy._pair_kernels.energy_kernel": buckets,
                               "sphereml.energy._pair_kernels.gradient_kernel": buckets})
