"""Sources and memory, round three (the Sources items), each pinned by a test that failed before:

1. ``h5ngff verify OUT --source X`` through the CLI, for every source kind (plain, stacked,
   Imaris, BigDataViewer), with a negative control each;
2. BigDataViewer ``<Timepoints>`` of type list (``<Timepoint><id/>`` children, with a gap),
   pattern and range;
3. an unknown unit (Imaris ``furlong``, BigDataViewer ``inch``) decided by ``--units``/``--scale``,
   and the Greek mu (U+03BC) beside the micro sign (U+00B5);
4. Imaris voxel sizes read at their float32's shortest decimal;
5. Fiji's three ``element_size_um`` values on a t, y, x dataset: y and x take theirs, t none, and
   a notice says the z value was left out.

Real files, written by the fixtures' writers (npy2bdv for BigDataViewer, formats_fixtures.write_ims
for Imaris); nothing is mocked."""

from __future__ import annotations

import json
import re
import xml.etree.ElementTree as ET

import h5py
import numpy as np
import pytest

from conftest import smooth, spec_for, write_h5
from formats_fixtures import read_ims_independently, write_ims
from h5ngff import cli
from h5ngff.engine.sources import open_source, verify_source
from h5ngff.errors import ExitCode, UnsupportedDatasetError

LEVELS = 2


def write_bdv(path, data: np.ndarray, unit: str = "um") -> str:
    """data: (t, c, z, y, x) -> an npy2bdv XML/HDF5 pair; returns the XML."""
    import npy2bdv

    T, C = data.shape[:2]
    writer = npy2bdv.BdvWriter(str(path), nchannels=C, subsamp=((1, 1, 1),), blockdim=((4, 16, 16),))
    for t in range(T):
        for c in range(C):
            writer.append_view(data[t, c], time=t, channel=c, voxel_size_xyz=(0.5, 0.5, 2.0), voxel_units=unit)
    writer.write_xml()
    writer.close()
    return str(path)[:-3] + ".xml"


def verify_cli(out, source, capsys) -> tuple[int, dict | str]:
    """``h5ngff verify OUT --source SOURCE --json`` through the CLI's own entry point."""
    capsys.readouterr()
    code = cli.main(["verify", str(out), "--source", str(source), "--json"])
    printed = capsys.readouterr()
    try:
        return code, json.loads(printed.out)
    except ValueError:
        return code, printed.out + printed.err


# --- 1. verify --source through the CLI, for every source kind ---------------------------------


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """One file per source kind (the CLI's source text -> level 0 data), and a stand-in of each
    that holds different data (the negative controls)."""
    d = tmp_path_factory.mktemp("round3-sources")
    plain = smooth((10, 37, 29), seed=31)
    write_h5(d / "plain.h5", plain)
    write_h5(d / "plain-other.h5", plain + 1)
    channels = smooth((3, 10, 37, 29), seed=32)
    for name, data in (("stacked.h5", channels), ("stacked-other.h5", channels[::-1])):
        with h5py.File(d / name, "w") as f:
            for c in range(3):
                f.create_dataset(f"/ch{c}", data=data[c])
    ims = smooth((1, 2, 10, 37, 29), seed=33)
    write_ims(d / "cells.ims", ims)
    write_ims(d / "cells-other.ims", ims[:, ::-1].copy())
    assert np.array_equal(read_ims_independently(d / "cells.ims")[0], ims)
    bdv = smooth((2, 2, 10, 37, 29), seed=34)
    (d / "bdv").mkdir()
    (d / "bdv-other").mkdir()
    write_bdv(d / "bdv" / "dataset.h5", bdv)
    write_bdv(d / "bdv-other" / "dataset.h5", bdv[::-1].copy())
    return {
        "plain": (f"{d / 'plain.h5'}:/volume/data", f"{d / 'plain-other.h5'}:/volume/data", plain),
        "stacked": (f"{d / 'stacked.h5'}:/ch{{0..2}}", f"{d / 'stacked-other.h5'}:/ch{{0..2}}", channels),
        "imaris": (str(d / "cells.ims"), str(d / "cells-other.ims"), ims[0]),
        "bdv": (str(d / "bdv" / "dataset.xml"), str(d / "bdv-other" / "dataset.xml"), bdv),
    }


@pytest.fixture(scope="module")
def converted(sources, tmp_path_factory, shared_cluster):
    from h5ngff.backends.external import ExternalBackend
    from h5ngff.cliargs import split_source
    from h5ngff.runner import plan_job, run_job

    backend = ExternalBackend(shared_cluster.scheduler_address)
    d = tmp_path_factory.mktemp("round3-out")
    outs = {}
    for kind, (text, _, _) in sources.items():
        path, dataset = split_source(text)
        out = str(d / f"{kind}.ome.zarr")
        run_job(plan_job(spec_for(path, out, dataset=dataset, pyramid={"levels": LEVELS}), backend), backend)
        outs[kind] = out
    return outs


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.parametrize("kind", ["plain", "stacked", "imaris", "bdv"])
def test_cli_verify_with_the_source_convert_read(kind, sources, converted, capsys):
    import zarr

    text, other, data = sources[kind]
    out = converted[kind]
    np.testing.assert_array_equal(zarr.open_array(f"{out}/0", mode="r")[...], data)  # the conversion is right
    code, report = verify_cli(out, text, capsys)
    assert code == 0, report
    assert (
        isinstance(report, dict)
        and report["ok"]
        and report["compared_with_source"]
        and report["levels_compared"] == LEVELS
    ), report
    # The negative control: the same kind of source with other data is found out.
    code, report = verify_cli(out, other, capsys)
    assert code == 1, report
    assert isinstance(report, dict) and not report["ok"] and report["mismatches"], report


@pytest.mark.integration
def test_cli_verify_with_a_source_of_another_kind_fails(sources, converted, capsys):
    """The Imaris output against the stacked source: a different source is not waved through."""
    code, report = verify_cli(converted["imaris"], sources["stacked"][0], capsys)
    assert code == 1 and isinstance(report, dict) and not report["ok"], report
    assert any("shape" in p for p in report["problems"]), report


@pytest.mark.integration
def test_cli_verify_still_refuses_an_unreadable_source_up_front(sources, converted, capsys):
    text = sources["imaris"][0]
    code, printed = verify_cli(converted["imaris"], text + ".missing.ims", capsys)
    assert code == ExitCode.BAD_INPUT and "does not exist" in json.dumps(printed), printed


# --- 2. BigDataViewer time points: list, pattern, range -----------------------------------------


@pytest.fixture(scope="module")
def bdv_times(tmp_path_factory):
    """npy2bdv's pair for 3 time points x 1 channel (written as type="range" 0..2)."""
    data = smooth((3, 1, 6, 20, 18), seed=35)
    xml = write_bdv(tmp_path_factory.mktemp("bdv-times") / "dataset.h5", data)
    return xml, data


def _with_timepoints(xml: str, dest, build, keep: list[int]) -> str:
    """A copy of the pair at ``dest`` holding only time points ``keep`` (ids as in the source),
    with the XML's Timepoints element rewritten by ``build``."""
    import shutil

    dest.mkdir()
    h5 = str(dest / "dataset.h5")
    shutil.copy(xml[:-4] + ".h5", h5)
    with h5py.File(h5, "a") as f:
        for t in range(3):
            if t not in keep:
                del f[f"t{t:05d}"]
    root = ET.parse(xml).getroot()
    seq = root.find("SequenceDescription")
    old = seq.find("Timepoints")
    index = list(seq).index(old)
    seq.remove(old)
    seq.insert(index, build())
    regs = root.find("ViewRegistrations")
    for reg in list(regs):
        if int(reg.get("timepoint")) not in keep:
            regs.remove(reg)
    out = str(dest / "dataset.xml")
    ET.ElementTree(root).write(out)
    return out


def _list(ids):
    def build():
        tp = ET.Element("Timepoints", type="list")
        for i in ids:
            t = ET.SubElement(tp, "Timepoint")
            ET.SubElement(t, "id").text = str(i)
            ET.SubElement(t, "name").text = str(i)
        return tp

    return build


def _pattern(text):
    def build():
        tp = ET.Element("Timepoints", type="pattern")
        ET.SubElement(tp, "integerpattern").text = text
        return tp

    return build


def _range(first, last):
    def build():
        tp = ET.Element("Timepoints", type="range")
        ET.SubElement(tp, "first").text = str(first)
        ET.SubElement(tp, "last").text = str(last)
        return tp

    return build


def _read(xml):
    opened = open_source(spec_for(xml, "unused", dataset="/"))
    return opened, opened.reader[tuple(slice(0, n) for n in opened.reader.shape)]


def test_bdv_timepoints_list_with_a_gap_maps_each_index_to_its_id(bdv_times, tmp_path):
    """BDV writes type="list" as <Timepoint><id/><name/></Timepoint> when the ids are not a range
    (here 0 and 2): t index 1 is the HDF5 group t00002. Before: IndexError."""
    xml, data = bdv_times
    listed = _with_timepoints(xml, tmp_path / "list", _list([0, 2]), keep=[0, 2])
    opened, read = _read(listed)
    assert opened.info.attr_axes == "tzyx" and opened.reader.pieces == ("/t00000/s00/0/cells", "/t00002/s00/0/cells")
    np.testing.assert_array_equal(read, data[[0, 2], 0])
    assert "[0, 2]" in opened.identity.dataset  # the identity names the ids, not a range 0..2


def test_bdv_timepoints_list_of_one_and_listed_out_of_order(bdv_times, tmp_path):
    xml, data = bdv_times
    one = _with_timepoints(xml, tmp_path / "one", _list([1]), keep=[1])
    opened, read = _read(one)
    assert opened.reader.pieces == ("/t00001/s00/0/cells",)
    np.testing.assert_array_equal(read, data[1, 0])
    shuffled = _with_timepoints(xml, tmp_path / "shuffled", _list([2, 0, 1]), keep=[0, 1, 2])
    np.testing.assert_array_equal(_read(shuffled)[1], data[:, 0])


def test_bdv_timepoints_pattern(bdv_times, tmp_path):
    xml, data = bdv_times
    pattern = _with_timepoints(xml, tmp_path / "pattern", _pattern("0-2:2"), keep=[0, 2])
    opened, read = _read(pattern)
    assert opened.reader.pieces == ("/t00000/s00/0/cells", "/t00002/s00/0/cells")
    np.testing.assert_array_equal(read, data[[0, 2], 0])


def test_bdv_timepoints_range_not_from_zero(bdv_times, tmp_path):
    xml, data = bdv_times
    ranged = _with_timepoints(xml, tmp_path / "range", _range(1, 2), keep=[1, 2])
    opened, read = _read(ranged)
    assert opened.reader.pieces == ("/t00001/s00/0/cells", "/t00002/s00/0/cells")
    np.testing.assert_array_equal(read, data[1:, 0])


def test_bdv_timepoints_list_naming_a_missing_group_is_a_clear_error(bdv_times, tmp_path):
    xml, _ = bdv_times
    wrong = _with_timepoints(xml, tmp_path / "wrong", _list([0, 5]), keep=[0, 2])
    with pytest.raises(Exception, match="t00005"):
        _read(wrong)


# --- 3. unknown units: flags win; the Greek mu --------------------------------------------------


def _ims_with_unit(path, unit: str, encoding: str = "utf-8") -> str:
    """Imaris's attribute: one one-byte string per byte of the text."""
    write_ims(path, smooth((1, 1, 4, 20, 18), seed=36))
    with h5py.File(path, "a") as f:
        f["DataSetInfo/Image"].attrs["Unit"] = np.array([bytes([b]) for b in unit.encode(encoding)], dtype="S1")
    return str(path)


def _bdv_with_unit(dest, unit: str) -> str:
    dest.mkdir()
    return write_bdv(dest / "dataset.h5", smooth((1, 1, 4, 20, 18), seed=37), unit=unit)


def _plan(path, **image):
    from h5ngff.backends.local import LocalBackend
    from h5ngff.runner import plan_job

    return plan_job(
        spec_for(path, "unused.ome.zarr", dataset="/", **({"image": image} if image else {})), LocalBackend()
    ).plan


@pytest.mark.parametrize("kind,unit", [("imaris", "furlong"), ("bdv", "inch")])
def test_an_unknown_unit_is_decided_by_the_flags_the_message_names(kind, unit, tmp_path):
    path = _ims_with_unit(tmp_path / "cells.ims", unit) if kind == "imaris" else _bdv_with_unit(tmp_path / "bdv", unit)
    with pytest.raises(
        UnsupportedDatasetError, match=f"{unit}.*--units"
    ) as refused:  # the control: no flags, a refusal
        _plan(path)
    assert "--scale" in str(refused.value)
    plan = _plan(path, units=["micrometer"], scale=[2.0, 0.5, 0.5])  # the flags the message recommends
    assert plan.levels[0].scale == (2.0, 0.5, 0.5) and plan.units == ("micrometer",) * 3
    plan = _plan(path, units=["nanometer"])  # --units alone: the file's sizes, in the user's unit
    assert plan.units == ("nanometer",) * 3
    plan = _plan(path, scale=[2.0, 0.5, 0.5])  # --scale alone: the user's sizes; the file's unit is unknown, so none
    assert plan.levels[0].scale == (2.0, 0.5, 0.5) and plan.units == ("",) * 3
    # verify compares data only: a file whose unit the flags decided is still a source to compare with.
    assert verify_source(path, "/").shape[-3:] == (4, 20, 18)


@pytest.mark.parametrize("unit", ["\u03bcm", "\u00b5m", "\u03bcM"])
def test_the_greek_mu_and_the_micro_sign_are_micrometres(unit, tmp_path):
    assert _plan(_ims_with_unit(tmp_path / "cells.ims", unit)).units == ("micrometer",) * 3
    assert _plan(_bdv_with_unit(tmp_path / "bdv", unit)).units == ("micrometer",) * 3


def test_the_micro_sign_as_one_latin1_byte_is_micrometres(tmp_path):
    """A Windows writer stores the micro sign as the single byte 0xB5, which is not UTF-8."""
    assert _plan(_ims_with_unit(tmp_path / "cells.ims", "\u00b5m", encoding="latin-1")).units == ("micrometer",) * 3


# --- 4. Imaris voxel sizes at their float32's shortest decimal ------------------------------------


def test_imaris_voxel_sizes_lose_their_float32_noise(tmp_path):
    """The issue's numbers: ImarisWriter stores the float32 extents printed at 9 decimals,
    ExtMax0="60.900001526" for 609 voxels of 0.1. The voxel size is 0.1, not 0.10000000250..."""
    Z, Y, X = 3, 20, 609
    path = write_ims(tmp_path / "cells.ims", smooth((1, 1, Z, Y, X), seed=38), block=(4, 16, 64))
    with h5py.File(path, "a") as f:
        attrs = f["DataSetInfo/Image"].attrs
        for i, (n, v) in enumerate(zip((X, Y, Z), (0.1, 0.1, 0.3))):
            attrs[f"ExtMin{i}"] = np.array([b"0"], dtype="S1")
            attrs[f"ExtMax{i}"] = np.array([c.encode() for c in f"{np.float32(n * v):.9f}"], dtype="S1")
        assert b"".join(attrs["ExtMax0"]).decode() == "60.900001526"
    assert _plan(path).levels[0].scale == (0.3, 0.1, 0.1)


# --- 5. Fiji's three element_size_um values on a dataset without z -------------------------------


def _tyx(path, labels: bool) -> str:
    with h5py.File(path, "w") as f:
        ds = f.create_dataset("/data", data=smooth((5, 20, 18), seed=39))
        ds.attrs["element_size_um"] = np.array([2.0, 0.3, 0.3], dtype=np.float32)  # Fiji: z, y, x, float32
        if labels:
            for dim, label in zip(ds.dims, "tyx"):
                dim.label = label
    return str(path)


def _plan_plain(path, **image):
    from h5ngff.backends.local import LocalBackend
    from h5ngff.runner import plan_job

    return plan_job(
        spec_for(path, "unused.ome.zarr", dataset="/data", **({"image": image} if image else {})), LocalBackend()
    )


@pytest.mark.parametrize("how", ["DIMENSION_LABELS", "--axes"])
def test_fiji_zyx_sizes_on_a_tyx_dataset_give_t_none_and_say_so(how, tmp_path):
    path = _tyx(tmp_path / "tyx.h5", labels=how == "DIMENSION_LABELS")
    job = _plan_plain(path, **({"axes": "tyx"} if how == "--axes" else {}))
    assert job.plan.axes == "tyx"
    assert job.plan.levels[0].scale == (1.0, 0.3, 0.3)  # not t = 2.0, the z spacing
    assert job.plan.units == ("", "micrometer", "micrometer")
    said = [n for n in job.notices if "element_size_um" in n]
    assert len(said) == 1 and re.search(r"z size 2\.0 is not used", said[0]) and "--scale" in said[0], job.notices


def test_fiji_sizes_on_a_zyx_dataset_and_a_user_scale_say_nothing(tmp_path):
    path = _tyx(tmp_path / "tyx.h5", labels=True)
    job = _plan_plain(path, scale=[1.0, 0.25, 0.25])  # the user decided: no notice
    assert job.plan.levels[0].scale == (1.0, 0.25, 0.25) and not [n for n in job.notices if "element_size_um" in n]
    zyx = _tyx(tmp_path / "zyx.h5", labels=False)  # 3-D without labels is z, y, x: every value applies
    job = _plan_plain(zyx)
    assert job.plan.axes == "zyx" and job.plan.levels[0].scale == (2.0, 0.3, 0.3)
    assert not [n for n in job.notices if "element_size_um" in n]
