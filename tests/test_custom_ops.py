"""The library's custom operators: direct eager calls where nothing needs the dispatcher, the registered operator
everywhere else (Note [direct eager calls] in :mod:`sphereml._custom_ops`)."""

from __future__ import annotations

import ast
import importlib
import pkgutil
from pathlib import Path

import pytest
import torch
from torch.autograd import forward_ad
from torch._subclasses.fake_tensor import FakeTensorMode

import sphereml
from sphereml import _custom_ops
from sphereml._custom_ops import Operator, custom_op
from sphereml.heads.margin_ce import margin_ce_grad, margin_ce_lse, margin_ce_norms
from sphereml.heads.margin_tail import margin_tail_operator
from sphereml.heads.margins import CosFaceLoss, LSoftmaxLoss
from sphereml.launches import count_ops


@custom_op("sphereml_test::scaled_sum", mutates_args=())
def _scaled_sum(x: torch.Tensor, y: torch.Tensor, scale: float) -> torch.Tensor:
    return (x + y) * scale


@_scaled_sum.register_fake
def _(x, y, scale):
    return torch.empty_like(x)


@custom_op("sphereml_test::add_into", mutates_args=("out",))
def _add_into(out: torch.Tensor, x: torch.Tensor) -> None:
    out.data.add_(x)  # as a kernel writes through the pointer: no version bump of its own


@_add_into.register_fake
def _(out, x):
    return None


@pytest.fixture
def dispatched(monkeypatch):
    """Records the calls that reach the registered operator (the dispatcher's path)."""
    calls = []
    packet = _scaled_sum.packet

    def record(*args, **kwargs):
        calls.append(args)
        return packet(*args, **kwargs)

    monkeypatch.setattr(_scaled_sum, "packet", record)
    return calls


def test_a_plain_eager_call_runs_the_implementation_directly(dispatched):
    x, y = torch.randn(3), torch.randn(3)
    with torch.no_grad():
        out = _scaled_sum(x, y, 2.0)
        parameter_out = _scaled_sum(torch.nn.Parameter(x), y, 2.0)
    torch.testing.assert_close(out, (x + y) * 2)
    torch.testing.assert_close(parameter_out, out)
    assert dispatched == []


def test_with_gradients_on_the_call_goes_to_the_operator(dispatched):
    out = _scaled_sum(torch.randn(3), torch.randn(3), 2.0)
    assert len(dispatched) == 1 and out.shape == (3,)


def test_an_operation_counter_sees_the_operator():
    x, y = torch.randn(3), torch.randn(3)
    with torch.no_grad():
        counts = count_ops(lambda: _scaled_sum(x, y, 2.0))
    assert counts.by_op["sphereml_test::scaled_sum"] == 1 and counts.total == 1, counts.by_op


def test_fake_tensors_get_the_fake_implementation(dispatched):
    with torch.no_grad(), FakeTensorMode() as mode:
        out = _scaled_sum(mode.from_tensor(torch.randn(4)), mode.from_tensor(torch.randn(4)), 2.0)
    assert out.shape == (4,) and len(dispatched) == 1


def test_a_torch_func_transform_goes_to_the_operator(dispatched):
    x = torch.randn(2, 3)
    with torch.no_grad():
        out = torch.vmap(lambda row: _scaled_sum(row, row, 1.0))(x)
    torch.testing.assert_close(out, 2 * x)
    assert len(dispatched) == 1


def test_a_function_mode_goes_to_the_operator(dispatched):
    with torch.no_grad(), torch.device("cpu"):  # a TorchFunctionMode
        _scaled_sum(torch.randn(3), torch.randn(3), 1.0)
    assert len(dispatched) == 1


def test_a_tensor_subclass_goes_to_the_operator(dispatched):
    class Tagged(torch.Tensor):
        pass

    with torch.no_grad():
        out = _scaled_sum(torch.randn(3).as_subclass(Tagged), torch.randn(3), 1.0)
    assert len(dispatched) == 1 and type(out) is Tagged


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")  # forward AD
def test_keywords_and_forward_mode_go_to_the_operator(dispatched):
    x, tangent = torch.randn(3), torch.ones(3)
    with torch.no_grad():
        _scaled_sum(x, x, scale=1.0)
        with forward_ad.dual_level():
            _scaled_sum(forward_ad.make_dual(x, tangent), x, 1.0)
    assert len(dispatched) == 2


def test_a_mutating_operator_bumps_the_version_counter_either_way(monkeypatch):
    x = torch.ones(3)
    for direct in (True, False):
        monkeypatch.setattr(_custom_ops, "plain_eager", lambda args, direct=direct: direct)
        out = torch.zeros(3)
        with torch.no_grad():
            _add_into(out, x)
        assert out._version == 1 and torch.equal(out, x)


def test_an_operator_must_name_what_it_mutates():
    with pytest.raises(ValueError, match="mutates_args"):
        custom_op("sphereml_test::unknown_mutation", mutates_args="unknown")(lambda x: None)


@pytest.mark.filterwarnings("ignore:`torch.jit.trace` is deprecated:DeprecationWarning")
def test_jit_and_fx_traces_hold_the_operator():
    x, y = torch.randn(3), torch.randn(3)
    with torch.no_grad():
        traced = torch.jit.trace(lambda a, b: _scaled_sum(a, b, 2.0), (x, y))
    assert "sphereml_test::scaled_sum" in str(traced.graph)
    graph = torch.fx.symbolic_trace(lambda a, b: _scaled_sum(a, b, 2.0)).graph
    assert any("scaled_sum" in str(node.target) for node in graph.nodes), graph


def test_compiled_graphs_hold_the_operator():
    graphs = []

    def backend(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    @torch.compile(backend=backend, fullgraph=True)
    def twice(x, y):
        with torch.no_grad():
            return _scaled_sum(x, y, 2.0) * 2

    x, y = torch.randn(3), torch.randn(3)
    torch.testing.assert_close(twice(x, y), (x + y) * 4)
    assert any("scaled_sum" in str(node.target) for node in graphs[0].graph.nodes), graphs[0].graph


def _library_modules():
    for info in pkgutil.walk_packages(sphereml.__path__, "sphereml."):
        if info.name.endswith("__main__"):  # a command line, run on import
            continue
        try:
            yield importlib.import_module(info.name)
        except ImportError:  # a module that needs Triton, or the book's extras, where they are absent
            continue


def test_every_library_operator_is_called_directly_in_eager_mode():
    """Each sphereml:: operator is defined through :func:`custom_op`, and the library calls the Operator, never
    ``torch.ops.sphereml`` (which would pay the dispatcher on every call)."""
    defined = {value.name for module in _library_modules() for value in vars(module).values()
               if isinstance(value, Operator)}
    registered = {name for name in torch._C._dispatch_get_all_op_names() if name.startswith("sphereml::")}
    assert len(registered) >= 10 and registered <= defined, registered - defined
    dispatched_calls = [f"{path.name}:{node.lineno}" for path in Path(sphereml.__file__).parent.rglob("*.py")
                        for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.Attribute)
                        and ast.unparse(node).startswith("torch.ops.sphereml")]
    assert dispatched_calls == []


@pytest.mark.parametrize("autocast", [False, True])
@pytest.mark.parametrize("head_class", [CosFaceLoss, LSoftmaxLoss])
def test_a_fused_head_gives_the_same_loss_and_gradients_either_way(monkeypatch, head_class, autocast):
    """The fused head's eager calls skip the dispatcher, and give what the dispatched operators give, bf16 autocast
    included (its operators have no autocast kernel, so autocast reaches the operations inside them either way)."""
    torch.manual_seed(0)
    head = head_class(8, 5)
    head.backend = "fused"
    features, labels = torch.randn(6, 8, requires_grad=True), torch.randint(0, 5, (6,))

    def loss_and_grads():
        head.zero_grad()
        features.grad = None
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss, logits = head.loss_and_logits(features, labels)
        loss.backward()
        return loss.detach(), logits, features.grad.clone(), head.weight.grad.clone()

    def unreachable(*args):
        raise AssertionError("an eager call of the fused head reached the dispatcher")

    with monkeypatch.context() as patch:
        for operator in (margin_ce_norms, margin_ce_lse, margin_ce_grad, margin_tail_operator):
            patch.setattr(operator, "packet", unreachable)
        direct = loss_and_grads()
    monkeypatch.setattr(_custom_ops, "plain_eager", lambda args: False)
    for ours, dispatched in zip(direct, loss_and_grads()):
        torch.testing.assert_close(ours, dispatched, rtol=0, atol=0)
