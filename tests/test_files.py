"""A user's own graph from files (gnnpipe.data.files): good loads and every validation error."""

from __future__ import annotations

import gzip

import numpy as np
import pytest

from gnnpipe.config import DatasetConfig, FilesConfig
from gnnpipe.data import dataset_summary, load_dataset
from gnnpipe.io import GnnPipeError

N = 6
EDGES = np.array([[0, 1], [1, 2], [2, 3], [3, 4], [4, 5], [5, 0], [1, 1], [0, 1]])


def edge_set(graph) -> set[tuple[int, int]]:
    dst = np.repeat(np.arange(graph.num_nodes), np.diff(graph.indptr))
    return set(zip(graph.indices.tolist(), dst.tolist()))


@pytest.fixture
def arrays(tmp_path):
    """features.npy, labels.npy in tmp_path; returns a function making a DatasetConfig."""
    rng = np.random.default_rng(0)
    features = rng.standard_normal((N, 3))
    labels = np.array([0, 1, 2, 0, 1, 2])
    np.save(tmp_path / "features.npy", features)
    np.save(tmp_path / "labels.npy", labels)

    def cfg(edges, symmetrize=True, self_loops="remove", **files):
        files.setdefault("features", str(tmp_path / "features.npy"))
        files.setdefault("labels", str(tmp_path / "labels.npy"))
        return DatasetConfig(kind="files", symmetrize=symmetrize, self_loops=self_loops,
                             files=FilesConfig(edges=str(edges), **files))

    cfg.features, cfg.labels, cfg.dir = features, labels, tmp_path
    return cfg


def load(cfg):
    return load_dataset(cfg, "mine")


# --------------------------------------------------------------------------- good loads
@pytest.mark.parametrize("fmt", ["csv_header", "whitespace", "csv_gz", "npy_rows", "npy_cols", "npz"])
def test_good_edge_formats_give_the_same_graph(arrays, fmt):
    d = arrays.dir
    if fmt == "csv_header":
        path = d / "e.csv"
        path.write_text("src,dst\n" + "".join(f"{s}, {t}\n" for s, t in EDGES) + "\n")
    elif fmt == "whitespace":
        path = d / "e.txt"
        path.write_text("\n".join(f"{s}\t {t}" for s, t in EDGES[:4]) + "\n\n"
                        + "\n".join(f"{s} {t}" for s, t in EDGES[4:]) + "\n")
    elif fmt == "csv_gz":
        path = d / "e.csv.gz"
        path.write_bytes(gzip.compress("".join(f"{s},{t}\n" for s, t in EDGES).encode()))
    elif fmt == "npy_rows":
        path = d / "e.npy"
        np.save(path, EDGES.astype(np.int32))
    elif fmt == "npy_cols":
        path = d / "e.npy"
        np.save(path, EDGES.T.astype(np.float64))  # integral floats are accepted
    else:
        path = d / "e.npz"
        np.savez(path, edge_index=EDGES.T)
    g = load(arrays(path, symmetrize=False, self_loops="keep"))
    assert edge_set(g) == {(int(s), int(t)) for s, t in EDGES}  # duplicate (0,1) merged
    assert g.num_nodes == N and g.num_classes == 3 and g.self_loops and not g.symmetric
    np.testing.assert_array_equal(g.features, arrays.features.astype(np.float32))
    np.testing.assert_array_equal(g.labels, arrays.labels)
    assert g.source == f"files:{path}"


def test_symmetrised_graph_and_random_split(arrays):
    path = arrays.dir / "e.npy"
    np.save(path, EDGES)
    cfg = arrays(path, train_fraction=0.5, val_fraction=1 / 6, seed=3)
    g = load(cfg)
    pairs = {(int(s), int(t)) for s, t in EDGES if s != t}
    assert edge_set(g) == pairs | {(t, s) for s, t in pairs} and g.symmetric and not g.self_loops
    assert (g.train_mask.sum(), g.val_mask.sum(), g.test_mask.sum()) == (3, 1, 2)
    assert not np.any(g.train_mask & g.val_mask) and not np.any(g.train_mask & g.test_mask)
    assert np.all(g.train_mask | g.val_mask | g.test_mask)
    again = load(cfg)
    np.testing.assert_array_equal(g.train_mask, again.train_mask)  # the seed fixes the split
    s = dataset_summary(g)
    assert s["num_edges"] == g.num_edges and s["split"] == {"train": 3, "val": 1, "test": 2}
    assert s["in_degree"]["max"] == int(np.diff(g.indptr).max()) and "out_degree" not in s


def test_given_masks_are_used(arrays):
    d = arrays.dir
    np.save(d / "e.npy", EDGES)
    np.save(d / "tr.npy", np.array([1, 1, 0, 0, 0, 0], dtype=np.int8))
    np.save(d / "va.npy", np.array([0, 0, 1, 0, 0, 0], dtype=bool))
    np.save(d / "te.npy", np.array([0, 0, 0, 1, 1, 0], dtype=bool))
    g = load(arrays(d / "e.npy", train_mask=str(d / "tr.npy"), val_mask=str(d / "va.npy"),
                    test_mask=str(d / "te.npy")))
    assert np.flatnonzero(g.train_mask).tolist() == [0, 1]
    assert np.flatnonzero(g.val_mask).tolist() == [2]
    assert np.flatnonzero(g.test_mask).tolist() == [3, 4]


# --------------------------------------------------------------------------- edge errors
def write(d, name, text):
    p = d / name
    p.write_text(text)
    return p


@pytest.mark.parametrize("text,match", [
    ("src dst\n0 1\n\n1 -2\n", r"e\.csv: line 4: node id -2 is outside \[0, 6\)"),
    ("0,1\n1,2\n2,6\n", r"e\.csv: line 3: node id 6 is outside \[0, 6\) \(6 = rows of .*features\.npy"),
    ("a,b\n0,1\n1,2,3\n", r"e\.csv: line 3: expected 2 columns .* separated by a comma, found 3"),
    ("0 1\n1\n", r"e\.csv: line 2: expected 2 columns .* separated by whitespace, found 1"),
    ("0 1 2\n1 2 3\n", r"e\.csv: line 1: expected 2 columns"),
    ("0,1\n1.5,2\n", r"e\.csv: line 2: node id '1\.5' is not an integer"),
    ("0,1\n1,x\n", r"e\.csv: line 2: node id 'x' is not an integer"),
    ("0,1\n1,99999999999999999999\n", r"e\.csv: line 2: node id 99999999999999999999 is too large"),
    ("src,dst\n", r"e\.csv: holds no edges"),
])
def test_text_edge_errors_name_file_and_line(arrays, text, match):
    with pytest.raises(GnnPipeError, match=match):
        load(arrays(write(arrays.dir, "e.csv", text)))


@pytest.mark.parametrize("suffix", ["csv", "npy", "npy_cols"])
def test_streamed_edges_equal_one_read_and_errors_count_from_the_start(tmp_path, suffix):
    """Chunks of 3 rows give the edges of one read, as int32; a bad id in a later chunk is named
    by its line / row in the whole file."""
    from gnnpipe.data.files import read_edges

    edges = np.random.default_rng(0).integers(0, N, (20, 2))
    path = tmp_path / f"e.{suffix.split('_')[0]}"
    save = (lambda e: path.write_text("src,dst\n" + "".join(f"{s},{t}\n" for s, t in e))) if suffix == "csv" \
        else (lambda e: np.save(path, e.T if suffix == "npy_cols" else e))
    save(edges)
    for chunk in (3, 10**6):
        src, dst = read_edges(path, N, chunk=chunk)
        assert src.dtype == dst.dtype == np.int32
        np.testing.assert_array_equal(np.stack([src, dst], 1), edges)
    edges[13, 1] = N
    save(edges)
    where = {"csv": "line 15", "npy": "row 13", "npy_cols": r"column 13 \(edge 13"}[suffix]
    with pytest.raises(GnnPipeError, match=rf"{where}.*: node id 6 is outside \[0, 6\)"):
        read_edges(path, N, chunk=3)


@pytest.mark.parametrize("array,match", [
    (np.array([[0, 1], [1, 9], [2, 3]]), r"e\.npy: row 1: node id 9 is outside \[0, 6\)"),
    (np.array([[0, 1, 2], [1, -1, 3]]), r"e\.npy: column 1 \(edge 1 of the \(2, E\) array\): node id -1"),
    (np.array([[0, 1], [1.5, 2]]), r"e\.npy: row 1: node ids must be integers, found \[1\.5, 2\.0\]"),
    (np.array([[0, 1, 2]]), r"e\.npy: edges must have shape \(E, 2\) or \(2, E\), got \(1, 3\)"),
    (np.array([[True, False]]), r"e\.npy: node ids must be integers, got dtype bool"),
])
def test_array_edge_errors_name_file_and_row(arrays, array, match):
    np.save(arrays.dir / "e.npy", array)
    with pytest.raises(GnnPipeError, match=match):
        load(arrays(arrays.dir / "e.npy"))


def test_npz_with_several_arrays_and_unknown_suffix_and_missing_file(arrays):
    d = arrays.dir
    np.savez(d / "e.npz", a=EDGES, b=EDGES)
    with pytest.raises(GnnPipeError, match=r"e\.npz: holds 2 arrays \(a, b\)"):
        load(arrays(d / "e.npz"))
    write(d, "e.parquet", "x")
    with pytest.raises(GnnPipeError, match=r"e\.parquet: unknown edge file type"):
        load(arrays(d / "e.parquet"))
    with pytest.raises(GnnPipeError, match=r"nope\.csv: no such file \(dataset\.files\.edges\)"):
        load(arrays(d / "nope.csv"))


# --------------------------------------------------------------------------- node arrays
@pytest.fixture
def edges_npy(arrays):
    np.save(arrays.dir / "e.npy", EDGES)
    return arrays.dir / "e.npy"


@pytest.mark.parametrize("which,array,match", [
    ("features", np.zeros(N), r"f\.npy: features must have shape \(N, F\)"),
    ("features", np.array([["a"]] * N), r"f\.npy: features must be real numbers"),
    ("features", np.vstack([np.zeros((2, 3)), [[0, np.nan, 0]], np.zeros((3, 3))]),
     r"f\.npy: row 2: features must be finite"),
    ("labels", np.zeros(N - 1, dtype=int), r"f\.npy: 5 labels but .*features\.npy has 6 rows"),
    ("labels", np.array([0, 1, 2, 0.5, 1, 2]), r"f\.npy: row 3: labels must be integer class ids"),
    ("labels", np.array([0, 1, -1, 0, 1, 2]), r"f\.npy: row 2: label -1 is negative"),
    ("labels", np.zeros((N, 2), dtype=int), r"f\.npy: labels must have shape \(N,\)"),
])
def test_node_array_errors(arrays, edges_npy, which, array, match):
    np.save(arrays.dir / "f.npy", array)
    with pytest.raises(GnnPipeError, match=match):
        load(arrays(edges_npy, **{which: str(arrays.dir / "f.npy")}))


def _masks(arrays, edges_npy, tr, va, te):
    d = arrays.dir
    for name, m in [("tr", tr), ("va", va), ("te", te)]:
        np.save(d / f"{name}.npy", np.asarray(m))
    return arrays(edges_npy, train_mask=str(d / "tr.npy"), val_mask=str(d / "va.npy"),
                  test_mask=str(d / "te.npy"))


@pytest.mark.parametrize("tr,va,te,match", [
    ([1, 1, 0, 0, 0], [0] * 5, [0] * 5, r"tr\.npy: train_mask must have shape \(6,\)"),
    ([1, 1, 0, 0, 0, 0], [0, 1, 1, 0, 0, 0], [0] * 6,
     r"va\.npy: row 1: node 1 is in both train_mask .*tr\.npy\) and val_mask"),
    ([1, 0, 0, 0, 0, 0], [0] * 6, [0, 0, 2, 0, 0, 0], r"te\.npy: row 2: test_mask must be bool or 0/1"),
    ([0] * 6, [1, 0, 0, 0, 0, 0], [0] * 6, r"tr\.npy: train_mask selects no node"),
])
def test_mask_errors(arrays, edges_npy, tr, va, te, match):
    with pytest.raises(GnnPipeError, match=match):
        load(_masks(arrays, edges_npy, tr, va, te))


def test_overlap_between_val_and_test_is_refused(arrays, edges_npy):
    with pytest.raises(GnnPipeError, match=r"te\.npy: row 3: node 3 is in both val_mask"):
        load(_masks(arrays, edges_npy, [1, 0, 0, 0, 0, 0], [0, 0, 0, 1, 0, 0], [0, 0, 0, 1, 1, 0]))


def test_masks_are_all_three_or_none(arrays, edges_npy):
    np.save(arrays.dir / "tr.npy", np.ones(N, dtype=bool))
    with pytest.raises(GnnPipeError, match=r"gives train_mask but not val_mask, test_mask"):
        load(arrays(edges_npy, train_mask=str(arrays.dir / "tr.npy")))


def test_bad_split_fractions(arrays, edges_npy):
    with pytest.raises(GnnPipeError, match=r"dataset\.files\.val_fraction"):
        load(arrays(edges_npy, train_fraction=0.7, val_fraction=0.3))
