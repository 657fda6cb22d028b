"""Shared I/O helpers: JSON that every tool can read."""

import json
import math

import numpy as np
import pytest

from gnnpipe.io import write_json


def test_write_json_turns_nan_and_infinities_into_null(tmp_path):
    path = tmp_path / "metrics.json"
    write_json(path, {"loss": float("nan"), "acc": np.float32("nan"), "t": [1.5, float("inf")],
                      "arr": np.array([np.nan, 2.0]), "nested": {"x": -math.inf, "ok": 3}})
    text = path.read_text()
    assert "NaN" not in text and "Infinity" not in text
    # strict parsing: Python's json accepts NaN unless told not to
    def refuse(c):
        raise ValueError(f"non-standard constant {c}")
    back = json.loads(text, parse_constant=refuse)
    assert back == {"loss": None, "acc": None, "t": [1.5, None], "arr": [None, 2.0],
                    "nested": {"x": None, "ok": 3}}


def test_write_json_leaves_the_old_file_on_an_unserialisable_object(tmp_path):
    path = tmp_path / "eval.json"
    write_json(path, {"a": 1})
    with pytest.raises(TypeError):
        write_json(path, {"a": object()})
    assert json.loads(path.read_text()) == {"a": 1}
