"""The registry of kinds (gnnpipe.registry): one mechanism for every kind of model."""

from __future__ import annotations

import pytest

from gnnpipe.registry import Registry, UnknownKind


def test_names_in_order_entries_by_name_and_clear_errors():
    reg: Registry[dict] = Registry("conv")
    reg.register("gcn", {"layers": 2})

    @reg.register("sage")
    def sage():
        return "sage"

    assert reg.names() == ("gcn", "sage") and list(reg) == ["gcn", "sage"] and len(reg) == 2
    assert reg["gcn"] == {"layers": 2} and reg["sage"]() == "sage" and "sage" in reg and "gat" not in reg
    assert reg.get("gat") is None
    with pytest.raises(UnknownKind, match="unknown conv kind 'gat'; known: gcn, sage"):
        reg["gat"]
    with pytest.raises(ValueError, match="registered twice"):
        reg.register("gcn", {})
