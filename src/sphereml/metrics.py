"""Metrics the chapters report: accuracy, angular hardness, ranking statistics, angle-vs-norm probes.

All functions take CPU or GPU tensors and return Python floats or tensors; none of
them needs gradients, except :func:`saliency_maps`, which takes them of the model's input.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._checks import integer, labels as check_labels
from .geometry import cosine_matrix, normalize, safe_angle

__all__ = [
    "accuracy", "true_class_confidence", "angular_visual_hardness", "roc_auc", "spearman",
    "class_directions", "angle_only_accuracy", "histogram_bayes_classifier", "histogram_bayes_accuracy",
    "norm_only_accuracy", "polar_angle", "polar_angle_accuracy",
    "angular_fisher_score", "sample_pairs", "pair_cosines", "verification_accuracy", "saliency_maps", "top_share",
    "share_inside",
]


def _check_labels(labels: Tensor, n: int, num_classes: int | None = None) -> None:
    check_labels("labels", labels, n, num_classes)


def accuracy(logits: Tensor, labels: Tensor) -> float:
    """Fraction of rows of ``logits`` (Tensor[N, C]) whose arg-max equals ``labels``."""
    _check_labels(labels, logits.shape[0], logits.shape[1])
    return float((logits.argmax(1) == labels).float().mean())


def true_class_confidence(logits: Tensor, labels: Tensor) -> Tensor:
    """Softmax probability of the true class, exp(z_y) / sum_j exp(z_j) (thesis Fig. 1.2, middle)."""
    _check_labels(labels, logits.shape[0], logits.shape[1])
    return logits.softmax(1).gather(1, labels[:, None]).squeeze(1)  # (N,)


def angular_visual_hardness(features: Tensor, weight: Tensor, labels: Tensor) -> Tensor:
    """AVH(x) = theta(x, W_y) / sum_i theta(x, W_i) (Chen et al.; thesis Sec. 1.1, Fig. 1.2).

    Args:
        features (Tensor[N, d]): deep features x.
        weight (Tensor[C, d]): classifier weights W (bias ignored).
        labels (Tensor[N]): true classes y.

    Returns:
        Tensor[N] in [0, 1]; smaller means easier. Invariant to positive scaling of
        x and of each W_i, unlike the softmax confidence.
    """
    _check_labels(labels, features.shape[0], weight.shape[0])
    theta = safe_angle(cosine_matrix(features, weight))  # (N, C)
    return theta.gather(1, labels[:, None]).squeeze(1) / theta.sum(1).clamp_min(1e-12)


def roc_auc(scores: Tensor, positive: Tensor) -> float:
    """Area under the ROC curve of ``scores`` for the boolean targets ``positive``.

    Equals the probability that a random positive scores above a random negative
    (ties count one half), computed from mid-ranks (Mann-Whitney U).
    """
    positive = positive.bool()
    n_pos, n_neg = int(positive.sum()), int((~positive).sum())
    if n_pos == 0 or n_neg == 0:
        raise ValueError("roc_auc needs at least one positive and one negative example")
    ranks = _midranks(scores.double())
    u = ranks[positive].sum() - n_pos * (n_pos + 1) / 2
    return float(u / (n_pos * n_neg))


def _midranks(x: Tensor) -> Tensor:
    """Ranks 1..n, ties sharing their average rank."""
    order = torch.argsort(x)
    sorted_x = x[order]
    ranks = torch.empty_like(x)
    _, inverse, counts = torch.unique_consecutive(sorted_x, return_inverse=True, return_counts=True)
    # average rank of each tie group, scattered back through the sort order
    ends = counts.cumsum(0).to(x.dtype)
    mean_rank = ends - (counts.to(x.dtype) - 1) / 2
    ranks[order] = mean_rank[inverse]
    return ranks


def spearman(a: Tensor, b: Tensor) -> float:
    """Spearman rank correlation of two 1-D tensors (Pearson correlation of their mid-ranks)."""
    if a.shape != b.shape or a.dim() != 1 or len(a) < 2:
        raise ValueError(f"need two 1-D tensors of equal length >= 2, got {tuple(a.shape)} and {tuple(b.shape)}")
    ra, rb = _midranks(a.double()), _midranks(b.double())
    ra, rb = ra - ra.mean(), rb - rb.mean()
    return float((ra * rb).sum() / (ra.norm() * rb.norm()).clamp_min(1e-300))


def class_directions(features: Tensor, labels: Tensor, num_classes: int) -> Tensor:
    """Unit mean direction of each class's normalised features: Tensor[C, d]."""
    _check_labels(labels, features.shape[0], num_classes)
    sums = torch.zeros(num_classes, features.shape[1], dtype=features.dtype, device=features.device)
    sums.index_add_(0, labels, normalize(features))
    return normalize(sums)


def angle_only_accuracy(train_features, train_labels, test_features, test_labels, num_classes: int) -> float:
    """Accuracy of the nearest class direction (largest cosine): uses angles, ignores norms."""
    directions = class_directions(train_features, train_labels, num_classes)  # (C, d)
    _check_labels(test_labels, test_features.shape[0], num_classes)
    return float(((normalize(test_features) @ directions.T).argmax(1) == test_labels).float().mean())


def histogram_bayes_classifier(train_values: Tensor, train_labels: Tensor, num_classes: int, bins: int = 50):
    """Fit the Bayes rule of per-class histograms of one scalar per example; return ``predict(values)``.

    ``bins`` quantile bins of the training values; each bin predicts its most frequent
    training class. Up to binning, this is the best a classifier that sees only that
    scalar can do: the probe behind :func:`norm_only_accuracy` and :func:`polar_angle_accuracy`.
    """
    _check_labels(train_labels, train_values.shape[0], num_classes)
    integer("bins", bins, at_least=1)
    train_values = train_values.double()
    edges = torch.quantile(train_values, torch.linspace(0, 1, bins + 1, dtype=torch.double)[1:-1])
    counts = torch.zeros(bins, num_classes, dtype=torch.double)
    counts.index_put_((torch.bucketize(train_values, edges), train_labels), torch.ones_like(train_values),
                      accumulate=True)
    best_class = counts.argmax(1)  # (bins,)
    return lambda values: best_class[torch.bucketize(values.double(), edges)]


def histogram_bayes_accuracy(train_values: Tensor, train_labels: Tensor, test_values: Tensor,
                             test_labels: Tensor, num_classes: int, bins: int = 50) -> float:
    """Test accuracy of :func:`histogram_bayes_classifier` fitted on the training values."""
    _check_labels(test_labels, test_values.shape[0], num_classes)
    predict = histogram_bayes_classifier(train_values, train_labels, num_classes, bins)
    return float((predict(test_values) == test_labels).float().mean())


def polar_angle(features: Tensor) -> Tensor:
    """Polar angle atan2(x_2, x_1) in (-pi, pi] of 2-D features Tensor[N, 2]."""
    if features.dim() != 2 or features.shape[1] != 2:
        raise ValueError(f"polar angles need Tensor[N, 2] features, got {tuple(features.shape)}")
    return torch.atan2(features[:, 1], features[:, 0])


def norm_only_accuracy(train_features, train_labels, test_features, test_labels, num_classes: int,
                       bins: int = 50) -> float:
    """Best accuracy from ||x|| alone: :func:`histogram_bayes_accuracy` of the feature norms."""
    return histogram_bayes_accuracy(train_features.norm(dim=1), train_labels, test_features.norm(dim=1),
                                    test_labels, num_classes, bins)


def polar_angle_accuracy(train_features, train_labels, test_features, test_labels, num_classes: int,
                         bins: int = 50) -> float:
    """Best accuracy from the polar angle of 2-D features alone (the norm's counterpart)."""
    return histogram_bayes_accuracy(polar_angle(train_features), train_labels, polar_angle(test_features),
                                    test_labels, num_classes, bins)


def angular_fisher_score(features: Tensor, labels: Tensor) -> float:
    r"""Angular Fisher score :math:`S_w / S_b` (thesis App. A.5, eq. A.1); lower is more discriminative.

    :math:`S_w = \sum_i \sum_{x \in X_i} (1 - \cos\langle x, m_i \rangle)` and
    :math:`S_b = \sum_i n_i (1 - \cos\langle m_i, m \rangle)`, where :math:`m_i` is the mean of class
    :math:`i` and :math:`m` the overall mean.  The thesis does not say
    whether the means are taken over raw or normalised features; we average the unit
    features, so the score depends on directions only (invariant to rescaling any sample).

    Args:
        features (Tensor[N, d]), labels (Tensor[N], int64): at least two classes present.
    """
    _check_labels(labels, features.shape[0])
    unit = normalize(features.double())
    classes = labels.unique()
    if len(classes) < 2:
        raise ValueError("angular_fisher_score needs at least two classes")
    overall = unit.mean(0, keepdim=True)
    s_w = s_b = 0.0
    for c in classes:
        members = unit[labels == c]
        centre = members.mean(0, keepdim=True)
        s_w += float((1 - cosine_matrix(members, centre)).sum())
        s_b += len(members) * float(1 - cosine_matrix(centre, overall))
    if s_b <= 0.0:
        raise ValueError("angular_fisher_score is undefined when every class mean points along the overall mean "
                         "(S_b = 0): the features do not separate the classes by angle")
    return s_w / s_b


def sample_pairs(labels: Tensor, n_pairs: int, generator: torch.Generator | None = None) -> tuple[Tensor, Tensor]:
    """Half same-class, half different-class index pairs, shuffled (an LFW-style verification set).

    Args:
        labels (Tensor[N], int64): class of each sample; at least two classes with two samples.
        n_pairs (int): even number of pairs.
        generator (torch.Generator, optional): source of randomness.

    Returns:
        (pairs Tensor[n_pairs, 2] of indices, same Tensor[n_pairs] bool).
    """
    _check_labels(labels, labels.shape[0])
    if integer("n_pairs", n_pairs, at_least=2) % 2:
        raise ValueError(f"n_pairs must be an even integer >= 2, got {n_pairs!r}")
    classes, counts = labels.unique(return_counts=True)
    if len(classes) < 2 or int(counts.max()) < 2:
        raise ValueError("need at least two classes and one class with two samples")
    half = n_pairs // 2
    eligible = classes[counts >= 2]
    firsts, seconds = [], []
    for c in eligible[torch.randint(len(eligible), (half,), generator=generator)]:
        members = (labels == c).nonzero().squeeze(1)
        i, j = members[torch.randperm(len(members), generator=generator)[:2]]
        firsts.append(i)
        seconds.append(j)
    a = torch.randint(len(labels), (4 * half,), generator=generator)
    b = torch.randint(len(labels), (4 * half,), generator=generator)
    differ = (labels[a] != labels[b]).nonzero().squeeze(1)[:half]
    pairs = torch.cat([torch.stack([torch.stack(firsts), torch.stack(seconds)], 1), torch.stack([a, b], 1)[differ]])
    same = torch.cat([torch.ones(half, dtype=torch.bool), torch.zeros(len(differ), dtype=torch.bool)])
    order = torch.randperm(len(pairs), generator=generator)
    return pairs[order], same[order]


def pair_cosines(features: Tensor, pairs: Tensor) -> Tensor:
    """cos between the features of each pair (Tensor[P, 2] of indices): the verification score. Tensor[P]."""
    unit = normalize(features)
    return (unit[pairs[:, 0]] * unit[pairs[:, 1]]).sum(1)


def _best_threshold(scores: Tensor, same: Tensor) -> float:
    """The threshold t maximising the accuracy of "same iff score >= t" on these pairs."""
    values, order = scores.sort()
    hit = same[order].double()
    # predicting "same" for positions >= i: correct = negatives before i + positives from i on
    neg_before = torch.cat([torch.zeros(1, dtype=hit.dtype), (1 - hit).cumsum(0)])
    pos_from = hit.sum() - torch.cat([torch.zeros(1, dtype=hit.dtype), hit.cumsum(0)])
    i = int((neg_before + pos_from).argmax())
    if i == 0:
        return float(values[0]) - 1.0
    if i == len(values):
        return float(values[-1]) + 1.0
    return float(values[i - 1] + values[i]) / 2


def verification_accuracy(scores: Tensor, same: Tensor, folds: int = 10) -> tuple[float, float]:
    """LFW-protocol verification accuracy: the threshold is chosen on folds - 1 folds and tested on the last.

    Args:
        scores (Tensor[P]): similarity of each pair (e.g. cosine); higher means "same".
        same (Tensor[P], bool): ground truth.
        folds (int): number of folds >= 2. Default: 10.

    Returns:
        (mean, standard deviation) of the per-fold accuracies.
    """
    if scores.dim() != 1 or same.shape != scores.shape or same.dtype != torch.bool:
        raise ValueError("scores must be Tensor[P] and same a bool Tensor[P]")
    integer("folds", folds, at_least=2, at_most=len(scores))
    fold_of = torch.arange(len(scores)) % folds
    accs = []
    for k in range(folds):
        test = fold_of == k
        t = _best_threshold(scores[~test], same[~test])
        accs.append(float(((scores[test] >= t) == same[test]).double().mean()))
    accs_t = torch.tensor(accs)
    return float(accs_t.mean()), float(accs_t.std())


def saliency_maps(model, images: Tensor, labels: Tensor) -> Tensor:
    """Vanilla-gradient saliency ``|dz_y / dx|`` of each image for its label's logit z_y, in eval mode (the model's
    mode is restored; ``images`` are not changed); on the model's device, returned on the CPU with the images'
    shape."""
    was_training = model.training
    device = next(model.parameters()).device
    x = images.detach().to(device).requires_grad_(True)
    try:
        model.eval()
        (grad,) = torch.autograd.grad(model(x).gather(1, labels.to(device)[:, None]).sum(), x)
    finally:
        model.train(was_training)
    return grad.abs().cpu()


def top_share(maps: Tensor, fraction: float = 0.1) -> Tensor:
    """Per map, the share of its total held by its largest ``fraction`` of entries: 1 when concentrated on them,
    ``fraction`` when spread evenly (the sparsity of a saliency map).  Tensor[B]."""
    if not 0 < fraction <= 1:
        raise ValueError(f"fraction must lie in (0, 1], got {fraction}")
    flat = maps.flatten(1)
    k = max(1, int(fraction * flat.shape[1]))
    return flat.topk(k, dim=1).values.sum(1) / flat.sum(1).clamp_min(1e-12)


def share_inside(maps: Tensor, mask: Tensor) -> Tensor:
    """Per map, the share of its total that lies where ``mask`` is True (e.g. on the object of an image).  Tensor[B]."""
    if mask.shape != maps.shape:
        raise ValueError(f"mask must have the maps' shape {tuple(maps.shape)}, got {tuple(mask.shape)}")
    return (maps * mask).flatten(1).sum(1) / maps.flatten(1).sum(1).clamp_min(1e-12)
