"""Three seeds of a chapter's network trained together (``sphereml.multiseed.fit_seeds``, one batched step) against
the same three trained one after another with ``fit``: one epoch each way, on Fashion-MNIST-sized batches.

On a GPU these networks are bound by launching kernels (book/reproducing.md, "Sizing the gpu profiles"), so the
stacked step should take little more than one seed's; on a CPU the arithmetic is the same either way.
"""

import torch
from torch.utils.data import TensorDataset

from sphereml import models
from sphereml.layers.decoupled import decoupled_factory
from sphereml.layers.decoupled_training import WeightProjection
from sphereml.multiseed import fit_seeds
from sphereml.regularizers import MHE
from sphereml.regularizers.comhe import CoMHE
from sphereml.train import fit

from .harness import compare, smoke_or

SEEDS = [0, 1, 2]
NETWORKS = {  # chapter 1-2's ConvNet, chapter 5's SCS network (cpu widths) and chapter 3's CNN-9, on 1 x 28 x 28
    "convnet_16x32": lambda: models.Classifier(models.ConvNet(1, 64, widths=(16, 32), act_layer="prelu"), 10),
    "scs_16x32x64": lambda: models.Classifier(models.scs_net((16, 32, 64), in_channels=1, image_size=28), 10),
    "cnn9_64x96x128": lambda: models.Classifier(
        models.plain_cnn(9, widths=(64, 96, 128), in_channels=1, image_size=28, feature_dim=256), 10),
    # chapter 6's BatchNorm ConvNet with half-space MHE and with RP-CoMHE (one per seed, as in chapter 7), chapter
    # 4's TanhConv CNN-9 with weight projection
    "convnet_16x32_hs_mhe": lambda: models.Classifier(
        models.ConvNet(1, 64, widths=(16, 32), norm_layer="batchnorm"), 10),
    "convnet_16x32_rp_comhe_each": lambda: models.Classifier(
        models.ConvNet(1, 64, widths=(16, 32), norm_layer="batchnorm"), 10),
    "tanhconv_cnn9_32x64x128_projection": lambda: models.Classifier(models.plain_cnn(
        9, widths=(32, 64, 128), in_channels=1, image_size=28, feature_dim=128,
        conv_layer=decoupled_factory(magnitude="tanh", radius_norm=True, learnable_rho=True)), 10),
}


def _extras(name: str, net, seed: int) -> dict:
    """What the network trains with besides the data: its regulariser (bound to ``net``) or its callbacks."""
    if name.endswith("hs_mhe"):
        return {"regularizer": MHE(net, half_space=True)}
    if name.endswith("comhe_each"):  # its projections drawn from its run's seed
        return {"regularizer": CoMHE(net, seed=seed)}
    if name.endswith("projection"):
        return {"callbacks": [WeightProjection()]}
    return {}


def run(device: torch.device) -> dict:
    n, batch = smoke_or(2048, 16), smoke_or(128, 8)
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.rand(n, 1, 28, 28, generator=generator), torch.randint(0, 10, (n,), generator=generator))
    results = {}
    for name, make in smoke_or(NETWORKS, dict(list(NETWORKS.items())[-3:])).items():
        nets = [make().to(device) for _ in SEEDS]
        settings = dict(epochs=1, batch_size=batch, lr=1e-3, optimizer="adam", device=device)

        def together(name=name, nets=nets, settings=settings):
            extras = _extras(name, nets[0], SEEDS[0])  # HS-MHE: one regulariser serves every seed
            per_model = ("callbacks", "regularizer") if name.endswith("comhe_each") else ("callbacks",)
            for key in set(per_model) & set(extras):
                extras[key] = [_extras(name, net, seed)[key] for net, seed in zip(nets, SEEDS)]
            fit_seeds(nets, data, seeds=SEEDS, **extras, **settings)

        def one_after_another(name=name, nets=nets, settings=settings):
            for net, seed in zip(nets, SEEDS):
                fit(net, data, seed=seed, progress=False, **_extras(name, net, seed), **settings)

        candidates = {"3 seeds together": together, "3 seeds one after another": one_after_another}
        results[name] = compare(
            f"multiseed_{name}_b{batch}", candidates, baseline="3 seeds one after another", device=device,
            repeats=3, count=True,
            extra={"images": n, "batch": batch, "seeds": len(SEEDS),
                   "note": "one epoch of each seed; ops_per_call counts the whole epoch"})
    return results
