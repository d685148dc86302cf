"""The bad-input table: for each public argument that can be wrong, the exception type and a message that
names the argument and says what it may be (a range, a set of choices or a shape).  Module tests check the
same errors where they are defined; this table keeps the contract in one place."""

import re

import pytest
import torch

from sphereml import angular, attacks, data, energy, geometry, models, recalibration, regularizers, train
from sphereml.layers import decoupled, scs, sphereconv
from sphereml.heads import margins, targets
from sphereml.regularizers import orthogonalizers

_DATA = torch.utils.data.TensorDataset(torch.zeros(4, 2), torch.zeros(4, dtype=torch.long))
_X, _Y = torch.zeros(1, 2), torch.zeros(1, dtype=torch.long)

TABLE = [  # (what, call, argument named in the message, what the message must also say)
    ("normalize", lambda: geometry.normalize(torch.ones(3), eps=0.0), "eps", "> 0"),
    ("sample_sphere", lambda: geometry.sample_sphere(-1, 3), "n", ">= 0"),
    ("sample_sphere", lambda: geometry.sample_sphere(4, 0), "d", ">= 1"),
    ("integer margin", lambda: targets.integer_margin(1.5), "m", "integer >= 1"),
    ("A-Softmax", lambda: margins.ASoftmaxLoss(4, 3, m=0), "m", ">= 1"),
    ("CosFace", lambda: margins.CosFaceLoss(4, 3, m=-1.0), "m", ">= 0"),
    ("ArcFace", lambda: margins.ArcFaceLoss(4, 3, m=4.0), "m", "< 3.14159"),
    ("angular function", lambda: angular.angular_function(torch.zeros(2), "sigmoid", k=-1.0), "k", "> 0"),
    ("angular function", lambda: angular.angular_function(torch.zeros(2), "relu"), "angular", "one of"),
    ("SphereConv2d", lambda: sphereconv.SphereConv2d(3, 4, 3, angular="sigmoid", k=0.0), "k", "> 0"),
    ("SphereConv2d", lambda: sphereconv.SphereConv2d(3, 4, 3, groups=2), "groups", "divisible"),
    ("SphereConv2d", lambda: sphereconv.SphereConv2d(3, 4, 0), "kernel_size", ">= 1"),
    ("DecoupledConv2d", lambda: decoupled.DecoupledConv2d(3, 4, 3, rho=0.0), "rho", "> 0"),
    ("DecoupledConv2d", lambda: decoupled.DecoupledConv2d(3, 4, 3, magnitude="cube"), "magnitude", "one of"),
    ("DecoupledConv2d", lambda: decoupled.DecoupledConv2d(3, 4, 3, magnitude="log", radius_norm=True),
     "radius_norm", "radius"),
    ("SCS", lambda: scs.SharpenedCosineSimilarity2d(3, 4, 3, p=-1.0), "p", "> 0"),
    ("SCS", lambda: scs.SharpenedCosineSimilarity2d(3, 4, 3, q=-1.0), "q", ">= 0"),
    ("fgsm", lambda: attacks.fgsm(torch.nn.Linear(2, 2), _X, _Y, -1.0), "eps", ">= 0"),
    ("pgd", lambda: attacks.pgd(torch.nn.Linear(2, 2), _X, _Y, 0.1, steps=0), "steps", ">= 1"),
    ("adversarial loss", lambda: attacks.adversarial_loss(0.1, weight=2.0), "weight", "<= 1"),
    ("fit", lambda: train.fit(torch.nn.Linear(2, 2), _DATA, epochs=-1), "epochs", ">= 0"),
    ("fit", lambda: train.fit(torch.nn.Linear(2, 2), _DATA, epochs=1, lr=0.0), "lr", "> 0"),
    ("fit", lambda: train.fit(torch.nn.Linear(2, 2), _DATA, epochs=1, batch_size=0), "batch_size", ">= 1"),
    ("recalibrate", lambda: recalibration.recalibrate(torch.nn.Linear(2, 2), _DATA, max_batches=0), "max_batches",
     ">= 1"),
    ("energy", lambda: energy.hyperspherical_energy(torch.randn(4, 3), s=-1.0), "s", ">= 0"),
    ("energy", lambda: energy.hyperspherical_energy(torch.randn(4, 3), metric="manhattan"), "metric", "one of"),
    ("MHE", lambda: regularizers.MHE(torch.nn.Linear(3, 4), s=-2.0), "s", ">= 0"),
    ("Orthonormality", lambda: regularizers.Orthonormality(torch.nn.Conv2d(1, 2, 3), beta=-1.0), "beta", ">= 0"),
    ("Orthogonality", lambda: regularizers.Orthogonality(torch.nn.Conv2d(1, 2, 3), beta=-1.0), "beta", ">= 0"),
    ("plain_cnn", lambda: models.plain_cnn(depth=4), "depth", "multiple of 3"),
    ("resnet", lambda: models.resnet(depth=10), "depth", "6n + 2"),
    ("take_subset", lambda: data.take_subset(_DATA, -1), "n", ">= 1"),
    ("gram_schmidt", lambda: orthogonalizers.gram_schmidt(torch.randn(3, 4)), "u", "Tensor[..., m, m]"),
    ("cayley", lambda: orthogonalizers.cayley(torch.randn(3, 4)), "a", "Tensor[..., m, m]"),
]


@pytest.mark.parametrize("what,call,argument,says", TABLE, ids=[f"{row[0]}-{row[2]}" for row in TABLE])
def test_bad_argument_gets_a_value_error_naming_it(what, call, argument, says):
    with pytest.raises(ValueError) as info:
        call()
    message = str(info.value)
    assert re.search(rf"(?<![\w.]){re.escape(argument)}(?![\w(])", message), \
        f"{what}: the message does not name {argument!r}: {message}"
    assert says in message, f"{what}: the message does not say {says!r}: {message}"


def test_the_table_is_large():
    assert len(TABLE) >= 30
