"""Forward + backward of the margin heads at face-recognition size (B=256, d=512, C=10,000).

Baseline, timed in the same run: ``nn.Linear`` (no bias) + ``cross_entropy`` on the same
features.  The heads add a normalisation of W and x, a gather and a ``torch.where`` on
the target column; the goal for ``ASoftmaxLoss`` is at most 1.3x the baseline.
"""

import torch
import torch.nn.functional as F

from sphereml.margins import ArcFaceLoss, ASoftmaxLoss, CosFaceLoss, LambdaSchedule, LSoftmaxLoss

from .harness import compare

B, D, C = 256, 512, 10_000


def run(device: torch.device) -> dict:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(B, D, generator=g).to(device).requires_grad_(True)
    y = torch.randint(C, (B,), generator=g).to(device)
    linear = torch.nn.Linear(D, C, bias=False).to(device)
    heads = {
        "A-Softmax m=4 (annealed)": ASoftmaxLoss(D, C, m=4, lambda_=LambdaSchedule.sphereface()),
        "A-Softmax m=1.5 detached": ASoftmaxLoss(D, C, m=1.5, s=30.0, detach_margin=True),
        "L-Softmax m=4": LSoftmaxLoss(D, C, m=4),
        "CosFace": CosFaceLoss(D, C),
        "ArcFace": ArcFaceLoss(D, C),
    }

    def step(loss_of):
        x.grad = None
        loss_of().backward()

    candidates = {"nn.Linear + cross_entropy": lambda: step(lambda: F.cross_entropy(linear(x), y))}
    for label, head in heads.items():
        head.to(device)
        candidates[label] = lambda h=head: step(lambda: h.loss(x, y))
    return compare("margin_heads_fwd_bwd", candidates, baseline="nn.Linear + cross_entropy", device=device,
                   repeats=25, extra={"batch": B, "in_features": D, "num_classes": C})
