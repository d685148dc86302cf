"""One training step of the book's ConvNet on Fashion-MNIST-sized batches, against nn.Linear on the same batch.

This is the unit every chapter's run time is made of; book/reproducing.md quotes it.
"""

import torch
import torch.nn.functional as F

from sphereml.models import Classifier, ConvNet

from .harness import compare, smoke_or


def run(device: torch.device) -> dict:
    batch = smoke_or(128, 4)
    x = torch.rand(batch, 1, 28, 28, device=device)
    y = torch.randint(0, 10, (batch,), device=device)
    results = {}
    for widths in smoke_or([(16, 32), (32, 64)], [(2, 4)]):
        model = Classifier(ConvNet(1, 64, widths=widths, act_layer="prelu"), 10).to(device)
        linear = torch.nn.Linear(28 * 28, 10).to(device)
        opt = torch.optim.Adam(list(model.parameters()) + list(linear.parameters()), 1e-3)

        def step(net, opt=opt):
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(net(x), y).backward()
            opt.step()

        results[widths] = compare(
            f"train_step_convnet_{widths[0]}x{widths[1]}",
            {"ConvNet step": lambda m=model: step(m),
             "linear softmax step": lambda lin=linear: step(lambda z: lin(z.flatten(1)))},
            baseline="linear softmax step", device=device, extra={"batch": batch, "widths": list(widths)},
        )
    return results
