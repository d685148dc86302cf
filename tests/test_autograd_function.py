"""``sphereml._autograd.Function``: the library's autograd nodes without a signature binding per call (Note [a lean
apply]), with the standard path's results everywhere, under ``torch.func`` transforms and ``torch.compile`` too."""

import importlib
import inspect
import pkgutil

import pytest
import torch

import sphereml
from sphereml._autograd import Function


class _Scale(Function):
    """y = a x + b, with b defaulted: the lean path when every argument is given, the standard one otherwise."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x, a, b=0.0):
        return x * a + b

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.a = inputs[1]
        ctx.seen = len(inputs)  # the standard path binds the default: setup_context sees all three

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.a, None, None


class _StandardScale(torch.autograd.Function):
    generate_vmap_rule = True
    forward, setup_context, backward = _Scale.forward, _Scale.setup_context, _Scale.backward


def _library_nodes() -> list[type]:
    for info in pkgutil.walk_packages(sphereml.__path__, "sphereml."):
        if not info.name.endswith("__main__"):  # a command line, which would run
            importlib.import_module(info.name)
    found, todo = [], [torch.autograd.Function]
    while todo:
        for sub in todo.pop().__subclasses__():
            todo.append(sub)
            if sub.__module__.startswith("sphereml.") and sub is not Function:
                found.append(sub)
    return found


def test_every_library_node_with_setup_context_takes_the_lean_apply():
    nodes = _library_nodes()
    assert len(nodes) >= 19  # the energies, the heads, the patch layers, the angular functions, the orthogonalisers
    modern = [cls for cls in nodes if cls.setup_context is not torch.autograd.Function.setup_context]
    assert len(modern) >= 12
    assert [cls.__name__ for cls in modern if not issubclass(cls, Function)] == []


@pytest.mark.parametrize("arguments", [(2.0, 0.5), (2.0,)], ids=["every argument", "a default omitted"])
def test_the_lean_apply_matches_the_standard_one(arguments):
    x = torch.randn(5, dtype=torch.float64, requires_grad=True)
    outputs = []
    for node in (_Scale, _StandardScale):
        y = node.apply(x, *arguments)
        (grad,) = torch.autograd.grad(y.sum(), x)
        outputs.append((y.detach(), grad, y.grad_fn.seen if hasattr(y.grad_fn, "seen") else None))
    assert torch.equal(outputs[0][0], outputs[1][0]) and torch.equal(outputs[0][1], outputs[1][1])
    assert outputs[0][2] == outputs[1][2] == 3  # the default reaches setup_context either way
    with pytest.raises(TypeError):
        _Scale.apply(x)  # a missing argument is refused as by the standard path


def test_the_lean_apply_binds_no_signature_per_call(monkeypatch):
    """The point of the class: no ``inspect.signature`` per call (the standard path makes one per call, so this
    test would fail with it)."""
    x = torch.randn(3, requires_grad=True)
    _Scale.apply(x, 2.0, 1.0)  # its arity is taken once
    calls = []
    real = inspect.signature
    monkeypatch.setattr(inspect, "signature", lambda *a, **k: calls.append(a) or real(*a, **k))
    for _ in range(3):
        _Scale.apply(x, 2.0, 1.0)
    assert calls == []
    _StandardScale.apply(x, 2.0, 1.0)
    assert len(calls) == 1, ("PyTorch's own apply no longer binds a signature per call (pytorch/pytorch#190694 "
                             "moved it to C++?): the lean apply may have become unnecessary")


def test_the_library_calls_its_nodes_the_lean_way(monkeypatch):
    """Every argument passed positionally at the library's call sites, so none falls back to the binding path: a
    step of a SphereConv layer (three nodes with a linear g), a CosFace head and HS-MHE and RP-CoMHE penalties."""
    from sphereml import models
    from sphereml.heads.margins import CosFaceLoss
    from sphereml.layers.sphereconv import SphereConv2d
    from sphereml.regularizers import MHE
    from sphereml.regularizers.comhe import CoMHE

    torch.manual_seed(0)
    layer, head = SphereConv2d(2, 3, 3, padding=1, angular="linear"), CosFaceLoss(4, 5)
    net = models.Classifier(models.plain_cnn(9, widths=(2, 2, 2), feature_dim=4), 5)
    penalties = [MHE(net, half_space=True), CoMHE(net)]
    x, features, labels = torch.randn(1, 2, 5, 5), torch.randn(3, 4), torch.tensor([0, 1, 4])

    def step():
        layer(x).sum().backward()
        head.loss(features, labels).backward()
        for penalty in penalties:
            penalty.before_step()
            penalty.weighted_penalty().backward()

    step()  # plans, constants and each class's arity, once
    calls = []
    real = inspect.signature
    monkeypatch.setattr(inspect, "signature", lambda *a, **k: calls.append(a) or real(*a, **k))
    step()
    assert calls == []


def test_the_lean_apply_under_transforms_keywords_and_compile():
    x = torch.randn(4, 3, dtype=torch.float64)
    assert torch.equal(torch.vmap(lambda v: _Scale.apply(v, 3.0, 1.0))(x), 3 * x + 1)
    assert torch.equal(torch.func.grad(lambda v: _Scale.apply(v, 3.0, 1.0).sum())(x[0]), torch.full((3,), 3.0,
                                                                                                   dtype=x.dtype))
    assert torch.equal(_Scale.apply(x, a=3.0), 3 * x)
    leaf = x.clone().requires_grad_(True)  # TorchDynamo traces the node itself, not the override
    compiled = torch.compile(lambda v: _Scale.apply(v, 3.0, 1.0).sin().sum(), fullgraph=True, backend="aot_eager")
    compiled(leaf).backward()
    assert torch.allclose(leaf.grad, 3 * torch.cos(3 * x + 1))
