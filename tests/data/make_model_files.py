"""Writes the committed model files that tests/test_modelfile.py loads (run once; commit the output).

* ``atomic-model-v1.pt``: a bare model file of format version 1 (a tiny DimeNet++, float64, a
  normaliser fitted on 8 EMT slabs), and ``atomic-model-v1.json``: its energy and forces on the
  structure of ``reference_structure()``. Future gnnpipe versions must keep loading it (or
  refuse it in one line) and reproduce these numbers.
* ``legacy-model.pt``: a ``model.pt`` as the trainer wrote it before model files described
  themselves (weights, epochs, the run config, the fingerprint, a digest; no normaliser,
  cutoff or elements).

    .venv/bin/python tests/data/make_model_files.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
TINY = dict(hidden_channels=8, num_blocks=1, int_emb_size=4, basis_emb_size=2, out_emb_channels=8,
            num_spherical=2, num_radial=2)


def reference_structure():
    """A Cu(111) slab with an O atom: deterministic, no random numbers."""
    from ase.build import add_adsorbate, fcc111
    from ase.constraints import FixAtoms
    slab = fcc111("Cu", size=(2, 2, 2), vacuum=5.0)
    add_adsorbate(slab, "O", 1.8, "fcc")
    slab.set_constraint(FixAtoms(indices=[a.index for a in slab if a.tag == 2]))
    return slab


def main() -> None:
    sys.path.insert(0, str(HERE.parent))
    from helpers import tiny_atomic_model

    from gnnpipe.ase import GNNPipeCalculator
    from gnnpipe.atomic import data
    from gnnpipe.atomic.modelfile import save_model_file
    from gnnpipe.checkpoint import digest
    from gnnpipe.config import load_workflow_config, resolve_runs, to_dict

    systems = data.generate(8, metals=("Cu",), adsorbates=("O", "CO"), seed=5, progress=False)
    mf = tiny_atomic_model(systems, "dimenetpp", seed=3, cutoff=4.0, max_neighbors=12, **TINY)
    save_model_file(HERE / "atomic-model-v1.pt", mf.payload())
    atoms = reference_structure()
    atoms.calc = GNNPipeCalculator(HERE / "atomic-model-v1.pt")
    (HERE / "atomic-model-v1.json").write_text(json.dumps(
        {"energy": atoms.get_potential_energy(), "forces": atoms.get_forces(apply_constraint=False).tolist()},
        indent=1) + "\n")

    wf = load_workflow_config({"datasets": {"slabs": {"kind": "atoms"}},
                               "models": {"dpp": {"kind": "dimenetpp", "dimenetpp": {"preset": "small"}}},
                               "training": {"epochs": 1}, "runs": [{"mode": "single", "dataset": "slabs",
                                                                     "model": "dpp"}]})
    cfg, = resolve_runs(wf).values()
    legacy = {"model": mf.state_dict, "epoch": 0, "epochs_done": 1, "run_id": cfg.run_id, "config": to_dict(cfg),
              "config_hash": "0" * 64, "graph_hash": "1" * 64, "store_hash": None}
    legacy["digest"] = digest(legacy)
    torch.save(legacy, HERE / "legacy-model.pt")
    print("wrote", *(p.name for p in sorted(HERE.glob("*.pt"))), np.round(atoms.get_potential_energy(), 6))


if __name__ == "__main__":
    main()
