"""The atomic writers every output goes through."""

import json

import pytest
import torch

from sphereml import _io


def test_write_json_is_atomic(tmp_path):
    path = tmp_path / "m.json"
    _io.write_json({"a": 1}, path)
    with pytest.raises(TypeError, match="cannot write object"):
        _io.write_json({"a": object()}, path)
    assert json.loads(path.read_text()) == {"a": 1}  # the failed write left the old file intact
    assert [p.name for p in tmp_path.iterdir()] == ["m.json"]


def test_save_torch_round_trips(tmp_path):
    path = _io.save_torch({"w": torch.ones(2)}, tmp_path / "sub" / "c.pt")
    assert torch.equal(torch.load(path)["w"], torch.ones(2))
    assert [p.name for p in path.parent.iterdir()] == ["c.pt"]  # no temporary file left behind

