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


def test_a_lazy_entry_is_imported_when_first_asked_for():
    """Every kind's name comes without torch (the config and Snakemake list them); an entry is
    imported from its module on first use."""
    import subprocess
    import sys

    reg: Registry[object] = Registry("thing")
    reg.register_lazy("path", "os.path:join")
    reg.register("eager", 1)
    assert reg.names() == ("path", "eager") and "path" in reg
    import os.path
    assert reg["path"] is os.path.join and reg.items() == [("path", os.path.join), ("eager", 1)]
    with pytest.raises(ValueError, match="a lazy entry is 'module:attribute'"):
        reg.register_lazy("bad", "os.path.join")
    code = ("import sys; from gnnpipe.config import MODEL_KINDS; from gnnpipe.kinds import ATOMIC_MODELS, CONVS; "
            "assert 'torch' not in sys.modules, 'torch imported'; print(CONVS.names(), ATOMIC_MODELS.names()); "
            "print(ATOMIC_MODELS['gemnet_t'].name, CONVS['sage'].name, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split("\n")
    assert out[:2] == ["('gcn', 'sage', 'gat', 'gcnii', 'resgcn', 'mlp') ('dimenetpp', 'gemnet_t')", "gemnet_t sage True"]


def test_every_entry_is_the_kind_it_is_registered_as():
    """gnnpipe.kinds names each kind and where its entry is; the entry there says the same name."""
    from gnnpipe.kinds import ATOMIC_MODELS, CONVS

    for reg in (CONVS, ATOMIC_MODELS):
        assert [entry.name for _, entry in reg.items()] == list(reg.names()), reg
