"""FGSM and PGD in the L-infinity ball: exact on a linear model, projections, accuracy under attack, bad input."""

import pytest
import torch
import torch.nn.functional as F

from sphereml.attacks import adversarial_loss, attack_table, fgsm, pgd, robust_accuracy
from sphereml.train import evaluate


def _linear(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(12, 2))
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(64, 1, 3, 4, generator=g) * 0.6 + 0.2  # inside [0, 1] with room to move
    y = model(x).argmax(1).detach()  # labels the model gets right
    return model, x, y


def test_fgsm_is_the_exact_worst_case_of_a_binary_linear_model():
    """For two classes and a linear model the margin w_y.x - w_o.x falls fastest along -sign(w_y - w_o)."""
    model, x, y = _linear()
    w = model[1].weight.detach()  # (2, 12)
    direction = (w[1 - y] - w[y]).sign().view_as(x)  # raises the other class's logit
    eps = 0.05
    torch.testing.assert_close(fgsm(model, x, y, eps), (x + eps * direction).clamp(0, 1))
    one_step = pgd(model, x, y, eps, step_size=eps, steps=1, random_start=False)
    torch.testing.assert_close(one_step, fgsm(model, x, y, eps))


def test_pgd_stays_in_the_ball_and_the_pixel_range_and_raises_the_loss():
    model, x, y = _linear(1)
    for eps in (0.0, 0.01, 0.3):
        x_adv = pgd(model, x, y, eps, steps=5, generator=torch.Generator().manual_seed(0))
        assert float((x_adv - x).abs().max()) <= eps + 1e-7
        assert float(x_adv.min()) >= 0.0 and float(x_adv.max()) <= 1.0
        if eps > 0:
            with torch.no_grad():
                assert float(F.cross_entropy(model(x_adv), y)) > float(F.cross_entropy(model(x), y))
    torch.testing.assert_close(pgd(model, x, y, 0.0), x)
    assert all(p.grad is None for p in model.parameters())  # the attack leaves the parameters alone


def test_robust_accuracy_starts_at_the_clean_accuracy_and_falls():
    model, x, y = _linear(2)
    data = torch.utils.data.TensorDataset(x, y)
    model.train()
    result = robust_accuracy(model, data, [0.0, 0.02, 0.1, 0.3], attack="fgsm", batch_size=16)
    assert model.training  # mode restored
    assert result[0.0] == pytest.approx(evaluate(model, data, device="cpu")["accuracy"]) == 1.0
    values = list(result.values())
    assert all(a >= b for a, b in zip(values, values[1:])) and values[-1] < 1.0
    again = robust_accuracy(model, data, [0.1], attack="pgd", steps=3, seed=4)
    assert again == robust_accuracy(model, data, [0.1], attack="pgd", steps=3, seed=4)  # seeded random starts


@pytest.mark.parametrize("call,message", [
    (lambda m, x, y: fgsm(m, x, y, -0.1), "eps must be a finite number >= 0"),
    (lambda m, x, y: pgd(m, x, y, 0.1, steps=0), "steps must be an integer >= 1"),
    (lambda m, x, y: pgd(m, x, y, 0.1, step_size=-1.0), "step_size must be a finite number >= 0"),
    (lambda m, x, y: robust_accuracy(m, torch.utils.data.TensorDataset(x, y), [0.1], attack="cw"),
     "attack must be one of"),
])
def test_bad_arguments(call, message):
    model, x, y = _linear()
    with pytest.raises(ValueError, match=message):
        call(model, x, y)


def test_black_box_transfer_attacks_the_source_and_evaluates_the_target():
    model, x, y = _linear(3)
    data = torch.utils.data.TensorDataset(x, y)
    same = robust_accuracy(model, data, [0.0, 0.1], attack="fgsm", source=model)
    assert same == robust_accuracy(model, data, [0.0, 0.1], attack="fgsm")  # source = target: white-box
    other, _, _ = _linear(4)
    other.train()
    transferred = robust_accuracy(model, data, [0.0, 0.1], attack="fgsm", source=other)
    assert other.training and transferred[0.0] == 1.0
    x_other = fgsm(other.eval(), x, y, 0.1)  # by hand: FGSM examples of the other model, scored by this one
    with torch.no_grad():
        manual = float((model(x_other).argmax(1) == y).float().mean())
    assert transferred[0.1] == pytest.approx(manual)


def _accuracy_on(model, x_adv, y):
    with torch.no_grad():
        return float((model(x_adv).argmax(1) == y).float().mean())


def test_attack_table_gives_the_five_columns_of_tables_4_7_and_4_8():
    model, x, y = _linear(5)
    substitute, _, _ = _linear(6)
    data = torch.utils.data.TensorDataset(x, y)
    table = attack_table(model, data, 0.1, source=substitute, bim_steps=5, batch_size=16)
    assert list(table) == ["none", "FGSM", "BIM", "black FGSM", "black BIM"]
    bim = pgd(model, x, y, 0.1, step_size=0.025, steps=5, random_start=False)  # BIM: no random start, eps / 4
    black_bim = pgd(substitute, x, y, 0.1, step_size=0.025, steps=5, random_start=False)
    expected = {"none": 1.0, "FGSM": _accuracy_on(model, fgsm(model, x, y, 0.1), y), "BIM": _accuracy_on(model, bim, y),
                "black FGSM": _accuracy_on(model, fgsm(substitute, x, y, 0.1), y),
                "black BIM": _accuracy_on(model, black_bim, y)}
    assert table == pytest.approx(expected)
    # a linear model's gradient sign never changes: four steps of eps / 4 reach the corner FGSM jumps to
    assert table["BIM"] == table["FGSM"] < 1.0
    assert list(attack_table(model, data, 0.1, bim_step=0.01)) == ["none", "FGSM", "BIM"]  # no substitute: white-box


def test_adversarial_loss_mixes_clean_and_fgsm_losses():
    model, x, y = _linear(5)
    clean = F.cross_entropy(model(x), y)
    adversarial = F.cross_entropy(model(fgsm(model, x, y, 0.05)), y)
    for weight in (0.0, 0.5, 1.0):
        loss, logits = adversarial_loss(0.05, weight=weight)(model, x, y)
        torch.testing.assert_close(loss, (1 - weight) * clean + weight * adversarial)
        torch.testing.assert_close(logits, model(x))
    loss, _ = adversarial_loss(0.05, attack="pgd", steps=2)(model, x, y)
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())  # it trains the model
    for kwargs, message in [(dict(eps=-1.0), "eps must be"), (dict(eps=0.1, weight=1.5), "weight must be"),
                            (dict(eps=0.1, attack="cw"), "attack must be one of")]:
        with pytest.raises(ValueError, match=message):
            adversarial_loss(**kwargs)
