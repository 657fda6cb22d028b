"""OC20's S2EF files as OC20 distributes them, and the download of a named split.

A split (``s2ef_train_200K.tar``, ...) unpacks to a folder of numbered pairs: ``<k>.extxyz.xz``, the
frames (ASE's extended XYZ: positions, cell, pbc, ``tags`` 0 sub-surface / 1 surface / 2 adsorbate, a
``move_mask`` that ASE reads as ``FixAtoms``, the DFT ``energy`` and ``forces``), and ``<k>.txt.xz``,
one line per frame in the same order: ``random<system id>,frame<frame number>,<reference energy>``
(fairchem's ``preprocess_ef.py`` reads them so). Either may be uncompressed (``.extxyz``, ``.txt``:
fairchem's ``uncompress.py`` output). The S2EF target is the **referenced** energy, the frame's total
energy minus its line's reference energy (the clean slab's and the adsorbate's gas-phase references:
an adsorption energy); ``energy: total`` keeps the DFT total instead.

Each frame's trajectory (``group``) is its system id, so a split keeps every frame of a system in one of
train/val/test. OC20 scores forces on the atoms with tag > 0 (surface and adsorbate; fairchem masks
``fixed == 0``, and in OC20's files the fixed atoms are exactly the tag-0 ones): the reader takes an
atom as fixed iff its tag is 0, which is what the project's loss and metrics leave out, and says on
stderr how many atoms' ``move_mask`` disagreed with that, if any.

``SPLITS`` is OC20's published table (fairchem's ``download_data.py`` and docs/core/datasets/oc20.md:
URL, MD5 of the tar, frames); :func:`fetch_split` reads the folder when it holds the split, else downloads
the tar (MD5 checked), unpacks its ``.extxyz.xz``/``.txt.xz`` into the folder, and refuses in one line
saying what to do when neither works.
"""

from __future__ import annotations

import hashlib
import lzma
import os
import re
import shutil
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ..io import GnnPipeError

ENERGIES = ("referenced", "total")
_BASE = "https://dl.fbaipublicfiles.com/opencatalystproject/data"


@dataclass(frozen=True)
class Split:
    url: str
    md5: str  # of the tar, as OC20 publishes it
    frames: int  # S2EF frames in the split (fairchem's S2EF_COUNTS): a folder with another count is incomplete


#: OC20's S2EF train and validation splits (the test split is distributed as pickled LMDBs: not read here)
SPLITS = {
    "200k": Split(f"{_BASE}/s2ef_train_200K.tar", "f8d0909c2623a393148435dede7d3a46", 200_000),
    "2M": Split(f"{_BASE}/s2ef_train_2M.tar", "953474cb93f0b08cdc523399f03f7c36", 2_000_000),
    "20M": Split(f"{_BASE}/s2ef_train_20M.tar", "863bc983245ffc0285305a1850e19cf7", 20_000_000),
    "all": Split(f"{_BASE}/s2ef_train_all.tar", "12a7087bfd189a06ccbec9bc7add2bcd", 133_934_018),
    "val_id": Split(f"{_BASE}/s2ef_val_id.tar", "f57f7f5c1302637940f2cc858e789410", 999_866),
    "val_ood_ads": Split(f"{_BASE}/s2ef_val_ood_ads.tar", "431ab0d7557a4639605ba8b67793f053", 999_838),
    "val_ood_cat": Split(f"{_BASE}/s2ef_val_ood_cat.tar", "532d6cd1fe541a0ddb0aa0f99962b7db", 999_809),
    "val_ood_both": Split(f"{_BASE}/s2ef_val_ood_both.tar", "5731862978d80502bbf7017d68c2c729", 999_944),
    "rattled": Split(f"{_BASE}/s2ef_rattled.tar", "40431149b27b64ce1fb40cac4e2e064b", 16_677_031),
    "md": Split(f"{_BASE}/s2ef_md.tar", "9fed845aaab8fb4bf85e3a8db57796e0", 38_315_405),
}
_FRAMES = re.compile(r"^(.+)\.extxyz(\.xz)?$")
_LINE = re.compile(r"^random(\d+),frame(\d+),(\S+)$")


def pairs(folder) -> list[tuple[Path, Path]]:
    """The (frames, metadata) file pairs of an S2EF folder, in natural order of their stem (0, 1, ..., 10)."""
    folder = Path(folder)
    out = []
    for f in folder.iterdir():
        m = _FRAMES.match(f.name)
        if m:
            txt = next((folder / f"{m.group(1)}{s}" for s in (".txt", ".txt.xz") if (folder / f"{m.group(1)}{s}").exists()),
                       None)
            if txt is None:
                raise GnnPipeError(f"{f}: no {m.group(1)}.txt(.xz) beside it; an S2EF folder holds each frames file "
                                   f"with its metadata lines (system id, frame, reference energy)")
            out.append((f, txt))
    key = lambda p: [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", p[0].name)]  # noqa: E731
    return sorted(out, key=key)


def is_s2ef_folder(folder) -> bool:
    folder = Path(folder)
    return folder.is_dir() and any(_FRAMES.match(f.name) for f in folder.iterdir())


def _open(path: Path):
    return lzma.open(path, "rt") if path.suffix == ".xz" else open(path)


def read_rows(folder, energy: str = "referenced") -> list[tuple[str, object, str]]:
    """``(where, atoms, system id)`` of every frame of an S2EF folder: ``atoms`` with its tags, fixed =
    tag 0 (``FixAtoms``), a single-point calculator holding the referenced (``energy: referenced``) or total
    energy and the forces, and ``info`` ``sid``, ``fid``, ``ref_energy``. One line refuses: a folder
    without frames, a metadata file whose line count differs from its frames, a line not of the form
    ``random<sid>,frame<fid>,<reference energy>``, a frame without energy or forces or without an atom of
    tag > 0 (no tags)."""
    import ase.io
    import numpy as np
    from ase.calculators.singlepoint import SinglePointCalculator
    from ase.constraints import FixAtoms

    if energy not in ENERGIES:
        raise GnnPipeError(f"atoms.s2ef_energy: {energy!r}: use referenced (OC20's S2EF target) or total")
    folder = Path(folder)
    found = pairs(folder) if folder.is_dir() else []
    if not found:
        raise GnnPipeError(f"{folder}: no OC20 S2EF files (*.extxyz.xz or *.extxyz, each with its *.txt(.xz)); "
                           f"put a split's files there, or name the split (atoms.s2ef_split) to download it")
    out, disagree = [], 0
    for frames_file, txt in found:
        with _open(txt) as fh:
            lines = [ln.strip() for ln in fh.read().splitlines() if ln.strip()]
        try:
            with _open(frames_file) as fh:
                frames = ase.io.read(fh, index=":", format="extxyz")
        except Exception as e:  # noqa: BLE001 - ASE raises many kinds; the user needs the file named
            raise GnnPipeError(f"{frames_file}: cannot be read as extxyz ({type(e).__name__}: {e})") from None
        if len(lines) != len(frames):
            raise GnnPipeError(f"{txt}: {len(lines)} metadata lines for the {len(frames)} frames of {frames_file.name}; "
                               f"each frame needs its line (random<sid>,frame<fid>,<reference energy>): restore the "
                               f"split's files")
        for i, (atoms, line) in enumerate(zip(frames, lines)):
            where = f"{frames_file.name} frame {i}"
            m = _LINE.match(line.replace(" ", ""))
            try:
                ref = float(m.group(3)) if m else None
            except ValueError:
                ref = None
            if ref is None:
                raise GnnPipeError(f"{txt}: line {i + 1} {line!r} is not random<system id>,frame<number>,<reference "
                                   f"energy>")
            calc = atoms.calc
            e_total = calc.results.get("energy") if calc is not None else None
            forces = calc.results.get("forces") if calc is not None else None
            if e_total is None or forces is None:
                raise GnnPipeError(f"{folder}: {where} has no {'energy' if e_total is None else 'forces'}; S2EF "
                                   f"frames carry both")
            tags = atoms.get_tags()
            fixed = tags == 0
            if fixed.all():
                raise GnnPipeError(f"{folder}: {where} has no atom with tag > 0 (OC20's tags: 0 sub-surface, 1 surface, "
                                   f"2 adsorbate; the forces of tags > 0 are trained and scored); an S2EF frame needs its "
                                   f"tags column")
            moved = np.ones(len(atoms), dtype=bool)
            for c in atoms.constraints:
                if isinstance(c, FixAtoms):
                    moved[c.get_indices()] = False
            disagree += int((moved == fixed).sum())  # fixed by tag but movable, or the reverse
            atoms.set_constraint(FixAtoms(indices=np.flatnonzero(fixed)) if fixed.any() else None)
            e = float(e_total) - (ref if energy == "referenced" else 0.0)
            atoms.calc = SinglePointCalculator(atoms, energy=e, forces=np.asarray(forces))
            atoms.info.update(sid=int(m.group(1)), fid=int(m.group(2)), ref_energy=ref)
            out.append((where, atoms, f"random{m.group(1)}"))
    if disagree:
        print(f"{folder}: {disagree} atoms' move_mask differs from OC20's rule (fixed iff tag 0); the tags decide",
              file=sys.stderr)
    return out


# --------------------------------------------------------------------------- download
def fetch_split(name: str, folder, table: dict | None = None, timeout: float = 60.0) -> Path:
    """The folder of S2EF split ``name``: ``folder`` when it already holds S2EF files (read offline, the
    frame count checked by ``check_count``), else the split downloaded from ``table`` (default
    ``SPLITS``), its MD5 checked, its ``*.extxyz.xz``/``*.txt.xz`` unpacked into ``folder`` (atomically:
    a temporary folder renamed). Neither possible: one line saying what to do."""
    import urllib.request

    table = SPLITS if table is None else table
    if name not in table:
        raise GnnPipeError(f"atoms.s2ef_split: {name!r} is not an OC20 S2EF split; one of {', '.join(table)}")
    folder = Path(folder)
    if is_s2ef_folder(folder):
        return folder
    split = table[name]
    if folder.exists() and any(folder.iterdir()):
        raise GnnPipeError(f"atoms.s2ef_split {name}: {folder} holds files but no *.extxyz(.xz) S2EF frames; give the "
                           f"split its own folder (atoms.file), or empty this one to download {split.url} into it")
    what = (f"on a machine with internet download {split.url} (MD5 {split.md5}), untar it and put its *.extxyz.xz "
            f"and *.txt.xz files in {folder}")
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.download-", dir=folder.parent))
    try:
        digest = hashlib.md5(usedforsecurity=False)
        tar_path = tmp / "split.tar"
        try:
            with urllib.request.urlopen(split.url, timeout=timeout) as r, open(tar_path, "wb") as out:
                for chunk in iter(lambda: r.read(1 << 20), b""):
                    digest.update(chunk)
                    out.write(chunk)
        except OSError as e:  # URLError, timeouts, refused connections: no network
            raise GnnPipeError(f"atoms.s2ef_split {name}: {folder} holds no S2EF files and {split.url} could not be "
                               f"fetched ({type(e).__name__}: {e}); {what}") from None
        if digest.hexdigest() != split.md5:
            raise GnnPipeError(f"atoms.s2ef_split {name}: {split.url} has MD5 {digest.hexdigest()}, not the published "
                               f"{split.md5} (a truncated or changed download); download it again, or {what}")
        unpacked = tmp / "files"
        unpacked.mkdir()
        with tarfile.open(tar_path) as tar:
            for member in tar:
                base = os.path.basename(member.name)
                if member.isfile() and (_FRAMES.match(base) or base.endswith((".txt", ".txt.xz"))):
                    with tar.extractfile(member) as src, open(unpacked / base, "wb") as dst:
                        shutil.copyfileobj(src, dst)
        if not is_s2ef_folder(unpacked):
            raise GnnPipeError(f"atoms.s2ef_split {name}: {split.url} holds no *.extxyz.xz files; {what}")
        if folder.exists():
            folder.rmdir()  # empty (checked above)
        os.replace(unpacked, folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def check_count(name: str, frames: int, folder, table: dict | None = None) -> None:
    """A named split's folder must hold the split's published number of frames (an interrupted copy does not)."""
    split = (SPLITS if table is None else table)[name]
    if frames != split.frames:
        raise GnnPipeError(f"{folder}: {frames} S2EF frames, but OC20's split {name} has {split.frames}; the folder is "
                           f"incomplete or holds another split: complete it, or empty it to download {split.url} again")
