"""The suite's own fixtures: what every test may rely on before its first line runs."""

import random
import zlib

import numpy as np
import torch


def _seed_of(request) -> int:
    return zlib.crc32(request.node.nodeid.encode())


def test_each_test_starts_from_generators_seeded_by_its_node_id(request):
    """An unseeded draw gives the same numbers in every run, alone or after any other test (``restore_rng``)."""
    seed = _seed_of(request)
    torch.testing.assert_close(torch.rand(4), torch.rand(4, generator=torch.Generator().manual_seed(seed)))
    assert random.random() == random.Random(seed).random()
    assert np.random.rand() == np.random.RandomState(seed).rand()

