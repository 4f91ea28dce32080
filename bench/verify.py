"""Check a tool's output against the source: a fast wrong result must not count.

* every output is read back with zarr-python (OME-Zarr multiscales, or a plain array);
* level 0 must have the source's shape and dtype, the benchmark's chunks and codec, and equal
  the source bit for bit (compared slab by slab, so memory stays bounded at any scale);
* each pyramid level must halve every spatial axis (floor or ceil: tools differ at odd edges);
* where the method is a mean, sampled interior blocks are compared with a NumPy reference
  (each level the 2x mean of the one above, in float64, cast back): ``exact`` if bitwise equal,
  "within" a rounding step per level (1 per level for integers, 1e-5 of the range for floats:
  tools that truncate at every level), FAILED beyond that. Other methods (gaussian, bilinear) are
  checked for shape and for values inside the source's range.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass

import h5py
import numpy as np
import zarr

from .config import CODEC, Case
from .containers import open_image

#: Blocks sampled per pyramid level, and their edge (in output voxels).
SAMPLES, SAMPLE_EDGE = 6, 16


@dataclass
class Verdict:
    ok: bool
    message: str


def open_levels(path: str) -> list[zarr.Array]:
    node = zarr.open(path, mode="r")
    if isinstance(node, zarr.Array):
        return [node]
    attrs = node.attrs.asdict()
    multiscales = (attrs.get("ome") or {}).get("multiscales") or attrs.get("multiscales")
    if not multiscales:
        raise ValueError(f"{path} is a Zarr group without OME multiscales metadata")
    return [node[d["path"]] for d in multiscales[0]["datasets"]]


def codec_text(arr: zarr.Array) -> str:
    """The array's codecs as "name:key=value …", whatever the Zarr format."""
    meta = arr.metadata.to_dict()
    codecs = meta.get("codecs") or [meta.get("compressor") or {}]
    parts = []
    for c in codecs:
        config = c.get("configuration", c)
        name = c.get("name") or c.get("id")
        if name == "sharding_indexed":
            return "sharded: " + " ".join(str(x) for x in config.get("codecs", []))
        if name != "bytes":
            parts.append(
                f"{name}:" + ",".join(f"{k}={v}" for k, v in sorted(config.items()) if k not in ("name", "id"))
            )
    return " ".join(parts) or "none"


def _codec_ok(arr: zarr.Array) -> bool:
    text = codec_text(arr)
    shuffle_ok = "shuffle=bitshuffle" in text or "shuffle=2" in text
    return (
        text.startswith("blosc:")
        and f"cname={CODEC['cname']}" in text
        and f"clevel={CODEC['clevel']}" in text
        and shuffle_ok
    )


def _same(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Elementwise bitwise equality (so -0.0 vs 0.0 and NaN payloads count)."""
    if a.dtype.kind == "f":
        kind = f"u{a.dtype.itemsize}"
        return np.ascontiguousarray(a).view(kind) == np.ascontiguousarray(b).view(kind)
    return a == b


def check_level0(ds, arr: zarr.Array, case: Case) -> str | None:
    if arr.shape != ds.shape or np.dtype(arr.dtype) != ds.dtype:
        return f"level 0 is {arr.shape} {arr.dtype}, expected {ds.shape} {ds.dtype}"
    if tuple(arr.chunks) != case.chunks:
        return f"level 0 chunks {tuple(arr.chunks)}, expected {case.chunks}"
    if not _codec_ok(arr):
        return f"level 0 codec {codec_text(arr)}, expected blosc {CODEC}"
    step = case.user_slab
    for origin in np.ndindex(*[-(-n // s) for n, s in zip(ds.shape, step)]):
        sel = tuple(slice(o * s, min((o + 1) * s, n)) for o, s, n in zip(origin, step, ds.shape))
        bad = np.count_nonzero(~_same(ds[sel], arr[sel]))
        if bad:
            where = ", ".join(f"{s.start}:{s.stop}" for s in sel)
            return f"level 0 differs from the source in {bad:,} voxels of [{where}]"
    return None


def _mean2(block: np.ndarray, axes: tuple[int, ...]) -> np.ndarray:
    """2x mean over ``axes`` of a block whose extent there is even; float64, cast back."""
    shape = []
    for i, n in enumerate(block.shape):
        shape += [n // 2, 2] if i in axes else [n]
    reduce = tuple(i + 1 + sum(1 for a in axes if a < i) for i in axes)
    mean = block.astype(np.float64).reshape(shape).mean(axis=reduce)
    return np.rint(mean).astype(block.dtype) if block.dtype.kind in "iub" else mean.astype(block.dtype)


def _direct_mean(block: np.ndarray, axes: tuple[int, ...], f: int) -> np.ndarray:
    shape = []
    for i, n in enumerate(block.shape):
        shape += [n // f, f] if i in axes else [n]
    reduce = tuple(i + 1 + sum(1 for a in axes if a < i) for i in axes)
    return block.astype(np.float64).reshape(shape).mean(axis=reduce)


def check_level(
    ds: h5py.Dataset, arr: zarr.Array, k: int, spatial: tuple[int, ...], method: str, rng
) -> tuple[str | None, str]:
    """(failure or None, how it was checked) for pyramid level ``k``."""
    f = 2**k
    for i, (n, m) in enumerate(zip(ds.shape, arr.shape)):
        allowed = {n // f, -(-n // f)} if i in spatial else {n}
        if m not in allowed:
            return f"level {k} shape {arr.shape}, expected {sorted(allowed)} on axis {i} of source {ds.shape}", ""
    if method != "mean":
        sample = arr[tuple(slice(0, min(n, SAMPLE_EDGE)) for n in arr.shape)]
        lo, hi = _range(ds)
        if sample.min() < lo or sample.max() > hi:
            return f"level {k} values {sample.min()}..{sample.max()} outside the source range {lo}..{hi}", ""
        return None, "shape+range"
    worst, exact = 0.0, True
    for _ in range(SAMPLES):
        out_sel, src_sel = [], []
        for i, m in enumerate(arr.shape):
            edge = min(SAMPLE_EDGE, ds.shape[i] // f if i in spatial else m)
            start = int(rng.integers(0, max(1, (ds.shape[i] // f if i in spatial else m) - edge + 1)))
            out_sel.append(slice(start, start + edge))
            src_sel.append(slice(start * f, (start + edge) * f) if i in spatial else slice(start, start + edge))
        got = arr[tuple(out_sel)]
        ref = ds[tuple(src_sel)]
        for _level in range(k):
            ref = _mean2(ref, spatial)
        if not np.all(_same(got, ref)):
            exact = False
            direct = _direct_mean(ds[tuple(src_sel)], spatial, f)
            worst = max(worst, float(np.max(np.abs(got.astype(np.float64) - direct))))
    if exact:
        return None, "mean exact"
    # Integers: a tool that truncates (or rounds) at every level drifts by under one unit per level.
    tolerance = float(k) if ds.dtype.kind in "iu" else 1e-5 * max(abs(v) for v in _range(ds))
    if worst > tolerance:
        return f"level {k} differs from the mean of the source by up to {worst:g} (tolerance {tolerance:g})", ""
    return None, f"mean within {worst:.2g} (not exact)"


@functools.lru_cache(maxsize=8)
def _range_of(filename: str, name: str) -> tuple[float, float]:
    lo, hi = np.inf, -np.inf
    with h5py.File(filename, "r") as f:
        ds = f[name]
        for z in range(0, ds.shape[-3], 16):
            block = ds[..., z : z + 16, :, :]
            lo, hi = min(lo, float(block.min())), max(hi, float(block.max()))
    return lo, hi


def _range(ds: h5py.Dataset) -> tuple[float, float]:
    return _range_of(ds.file.filename, ds.name)


def verify(output: str, source: str, case: Case, levels: int, method: str, seed: int = 0) -> Verdict:
    """``method``: "mean" (checked against the NumPy reference), anything else (shape and range)."""
    try:
        arrays = open_levels(output)
    except Exception as exc:  # an unreadable output is a failed run, whatever the reason
        return Verdict(False, f"unreadable: {type(exc).__name__}: {exc}")
    if len(arrays) != levels:
        return Verdict(False, f"{len(arrays)} level(s), expected {levels}")
    try:
        return _verify_levels(arrays, source, case, method, seed)
    except Exception as exc:  # e.g. a chunk that does not decode: the output is wrong
        return Verdict(False, f"read-back error: {type(exc).__name__}: {exc}")


def _verify_levels(arrays: list[zarr.Array], source: str, case: Case, method: str, seed: int) -> Verdict:
    spatial = tuple(range(len(case.shape) - 3, len(case.shape)))
    rng = np.random.default_rng(seed)
    with open_image(source, case) as ds:
        problem = check_level0(ds, arrays[0], case)
        if problem:
            return Verdict(False, problem)
        notes = ["L0 exact"]
        for k, arr in enumerate(arrays[1:], start=1):
            problem, how = check_level(ds, arr, k, spatial, method, rng)
            if problem:
                return Verdict(False, problem)
            notes.append(f"L{k} {how}")
    return Verdict(True, "; ".join(_merge(notes)))


def _merge(notes: list[str]) -> list[str]:
    """ "L1 mean exact; L2 mean exact" -> "L1-2 mean exact"."""
    out: list[list] = []
    for note in notes:
        level, how = note.split(" ", 1)
        if out and out[-1][2] == how and how != "exact":
            out[-1][1] = level[1:]
        else:
            out.append([level, None, how])
    return [f"{a}-{b} {h}" if b else f"{a} {h}" for a, b, h in out]


if __name__ == "__main__":  # ad-hoc: python -m bench.verify OUT SOURCE CASE_JSON LEVELS METHOD
    import sys

    out, src, case_json, lv, how = sys.argv[1:6]
    print(verify(out, src, Case(**json.loads(case_json)), int(lv), how))
