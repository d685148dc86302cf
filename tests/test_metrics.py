import pytest
import torch
from scipy.stats import spearmanr
from sklearn.metrics import roc_auc_score

from sphereml import metrics


def test_roc_auc_matches_sklearn_with_ties():
    g = torch.Generator().manual_seed(0)
    scores = torch.randint(0, 5, (300,), generator=g).double()
    pos = torch.rand(300, generator=g) < scores / 6
    assert metrics.roc_auc(scores, pos) == pytest.approx(roc_auc_score(pos.numpy(), scores.numpy()))
    assert metrics.roc_auc(torch.tensor([1.0, 2.0]), torch.tensor([False, True])) == 1.0
    with pytest.raises(ValueError, match="at least one positive"):
        metrics.roc_auc(torch.ones(3), torch.zeros(3, dtype=torch.bool))


def test_spearman_matches_scipy():
    g = torch.Generator().manual_seed(1)
    a = torch.randn(200, generator=g)
    b = a + torch.randn(200, generator=g)
    b[:20] = 0.0  # ties
    assert metrics.spearman(a, b) == pytest.approx(spearmanr(a.numpy(), b.numpy()).statistic, abs=1e-10)
    with pytest.raises(ValueError, match="equal length"):
        metrics.spearman(a, b[:5])


def test_avh_range_and_scale_invariance_confidence_is_not():
    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(50, 4, generator=g), torch.randn(6, 4, generator=g)
    y = torch.randint(0, 6, (50,), generator=g)
    avh = metrics.angular_visual_hardness(x, w, y)
    assert ((avh >= 0) & (avh <= 1)).all()
    scaled = metrics.angular_visual_hardness(3.0 * x, w * torch.rand(6, 1, generator=g).add(0.1), y)
    assert torch.allclose(avh, scaled, atol=1e-5)
    conf = metrics.true_class_confidence(x @ w.T, y)
    assert not torch.allclose(conf, metrics.true_class_confidence(3.0 * x @ w.T, y))


def test_avh_value_on_a_hand_example():
    x = torch.tensor([[1.0, 0.0]])
    w = torch.tensor([[1.0, 1.0], [0.0, 1.0], [-1.0, 0.0]])
    # angles: pi/4, pi/2, pi -> AVH = (pi/4) / (7 pi / 4) = 1/7
    assert float(metrics.angular_visual_hardness(x, w, torch.tensor([0]))) == pytest.approx(1 / 7, abs=1e-4)


def test_angle_and_norm_probes():
    # classes differ only by angle: the angle probe is perfect, the norm probe is at chance
    g = torch.Generator().manual_seed(3)
    dirs = torch.tensor([[1.0, 0.0], [0.0, 1.0], [-1.0, -1.0]])
    y = torch.randint(0, 3, (600,), generator=g)
    r = torch.rand(600, 1, generator=g) * 5 + 0.5
    x = dirs[y] / dirs[y].norm(dim=1, keepdim=True) * r
    assert metrics.angle_only_accuracy(x[:300], y[:300], x[300:], y[300:], 3) == 1.0
    assert metrics.norm_only_accuracy(x[:300], y[:300], x[300:], y[300:], 3) < 0.5
    assert metrics.polar_angle_accuracy(x[:300], y[:300], x[300:], y[300:], 3) == 1.0
    # classes differ only by norm: the reverse
    x2 = torch.randn(600, 2, generator=g)
    x2 = x2 / x2.norm(dim=1, keepdim=True) * (1.0 + 3.0 * y[:, None])
    assert metrics.norm_only_accuracy(x2[:300], y[:300], x2[300:], y[300:], 3) > 0.95
    assert metrics.angle_only_accuracy(x2[:300], y[:300], x2[300:], y[300:], 3) < 0.6
    assert metrics.polar_angle_accuracy(x2[:300], y[:300], x2[300:], y[300:], 3) < 0.6
    with pytest.raises(ValueError, match=r"need Tensor\[N, 2\]"):
        metrics.polar_angle_accuracy(torch.randn(5, 3), y[:5], torch.randn(5, 3), y[:5], 3)
    with pytest.raises(ValueError, match="bins must be an integer >= 1"):
        metrics.histogram_bayes_accuracy(r[:, 0], y, r[:, 0], y, 3, bins=0)


def test_label_checks():
    with pytest.raises(ValueError, match="int64"):
        metrics.accuracy(torch.randn(3, 2), torch.tensor([0, 1, 1], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"labels must lie in \[0, 2\)"):
        metrics.accuracy(torch.randn(3, 2), torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError, match=r"Tensor\[3\]"):
        metrics.accuracy(torch.randn(3, 2), torch.tensor([0, 1]))
    assert metrics.accuracy(torch.tensor([[2.0, 1.0], [0.0, 1.0]]), torch.tensor([0, 0])) == 0.5
    directions = metrics.class_directions(torch.randn(4, 3), torch.tensor([0, 0, 1, 1]), 2)
    assert torch.allclose(directions.norm(dim=1), torch.ones(2))


def test_angular_fisher_score_zero_for_identical_directions_and_scale_invariant():
    labels = torch.tensor([0, 0, 1, 1, 2, 2])
    centres = torch.eye(3, dtype=torch.float64)
    features = centres[labels] * torch.tensor([1.0, 3.0, 0.5, 2.0, 1.0, 9.0], dtype=torch.float64)[:, None]
    assert metrics.angular_fisher_score(features, labels) == pytest.approx(0.0, abs=1e-12)
    g = torch.Generator().manual_seed(0)
    noisy = features + 0.3 * torch.randn(6, 3, generator=g, dtype=torch.float64)
    score = metrics.angular_fisher_score(noisy, labels)
    scale = torch.rand(6, 1, generator=g, dtype=torch.float64) + 0.1
    assert metrics.angular_fisher_score(noisy * scale, labels) == pytest.approx(score)
    tighter = metrics.angular_fisher_score(features + 0.1 * torch.randn(6, 3, generator=g, dtype=torch.float64), labels)
    assert tighter < score
    with pytest.raises(ValueError, match="at least two classes"):
        metrics.angular_fisher_score(features, torch.zeros(6, dtype=torch.long))


def test_sample_pairs_balanced_and_correct():
    labels = torch.arange(40) % 5
    pairs, same = metrics.sample_pairs(labels, 200, generator=torch.Generator().manual_seed(0))
    assert pairs.shape == (200, 2) and int(same.sum()) == 100
    assert torch.equal(labels[pairs[:, 0]] == labels[pairs[:, 1]], same)
    assert bool((pairs[same, 0] != pairs[same, 1]).all())
    with pytest.raises(ValueError, match="n_pairs must be an even integer >= 2"):
        metrics.sample_pairs(labels, 3)
    with pytest.raises(ValueError, match="n_pairs must be an integer >= 2"):
        metrics.sample_pairs(labels, True)


def test_verification_accuracy_perfect_random_and_bad_args():
    same = torch.arange(100) % 2 == 0
    perfect = same.double() + 0.01 * torch.arange(100)
    assert metrics.verification_accuracy(same.double(), same)[0] == 1.0
    assert metrics.verification_accuracy(perfect, same)[0] > 0.9
    g = torch.Generator().manual_seed(0)
    scores = torch.rand(2000, generator=g, dtype=torch.float64)
    chance = metrics.verification_accuracy(scores, torch.rand(2000, generator=g) < 0.5)[0]
    assert 0.4 < chance < 0.6
    with pytest.raises(ValueError, match=r"folds must be an integer in \[2, 5\]"):
        metrics.verification_accuracy(scores[:5], same[:5], folds=10)
    with pytest.raises(ValueError, match="same a bool"):
        metrics.verification_accuracy(scores[:100], same.long())


def test_pair_cosines():
    feats = torch.tensor([[1.0, 0.0], [0.0, 2.0], [3.0, 3.0]])
    cos = metrics.pair_cosines(feats, torch.tensor([[0, 1], [0, 2], [1, 1]]))
    torch.testing.assert_close(cos, torch.tensor([0.0, 2 ** -0.5, 1.0]))


def test_saliency_of_a_linear_model_is_the_absolute_weight_row_of_the_label():
    torch.manual_seed(0)  # dropout of one half: in training mode the maps would lose about half their entries
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Dropout(0.5), torch.nn.Linear(6, 3)).train()
    images, labels = torch.rand(4, 1, 2, 3), torch.tensor([0, 2, 1, 2])
    maps = metrics.saliency_maps(model, images, labels)
    assert maps.shape == images.shape and model.training  # the model's mode is restored
    torch.testing.assert_close(maps.flatten(1), model[2].weight.detach()[labels].abs())  # eval mode: no dropout
    assert all(p.grad is None for p in model.parameters()) and not images.requires_grad


def test_top_share_and_share_inside_measure_where_a_map_holds_its_mass():
    spread, peaked = torch.ones(1, 1, 4, 5), torch.zeros(1, 1, 4, 5)
    peaked[0, 0, 1, 2] = 3.0
    torch.testing.assert_close(metrics.top_share(torch.cat([spread, peaked]), 0.1), torch.tensor([0.1, 1.0]))
    mask = torch.zeros(2, 1, 4, 5, dtype=torch.bool)
    mask[:, :, 1] = True  # the second row of every map
    torch.testing.assert_close(metrics.share_inside(torch.cat([spread, peaked]), mask), torch.tensor([0.25, 1.0]))
    assert float(metrics.top_share(torch.zeros(1, 4))) == 0.0  # an empty map: finite
    with pytest.raises(ValueError, match="fraction"):
        metrics.top_share(spread, 0.0)
    with pytest.raises(ValueError, match="shape"):
        metrics.share_inside(spread, mask)
