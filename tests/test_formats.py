"""Format detection from content, and safe archive extraction."""

from __future__ import annotations

import io
import pickle
import tarfile
import zipfile
from pathlib import Path

import pytest

from services.errors import SourceUnreadable, UnsafeInput, UnsupportedFormat
from services.formats import ArchiveLimits, Format, detect_format, open_source, safe_extract
from services.formats.archives import list_members


def test_onnx_detected_by_content_not_name(cnn_onnx: Path, tmp_path: Path) -> None:
    renamed = tmp_path / "weights.bin"
    renamed.write_bytes(cnn_onnx.read_bytes())
    fmt, seen = detect_format(renamed)
    assert fmt is Format.ONNX
    assert "ir_version" in seen


def test_onnx_with_external_data_in_directory(cnn_onnx: Path, tmp_path: Path) -> None:
    import onnx

    model = onnx.load(str(cnn_onnx))
    d = tmp_path / "ext"
    d.mkdir()
    onnx.save_model(model, str(d / "m.onnx"), save_as_external_data=True, location="m.data", size_threshold=0)
    assert (d / "m.data").stat().st_size > 0
    src = open_source(d, tmp_path / "work")
    assert src.format is Format.ONNX
    assert src.path == d / "m.onnx"


def test_tflite_hdf5_and_openvino_magic(tmp_path: Path) -> None:
    tfl = tmp_path / "a"
    tfl.write_bytes(b"\x1c\x00\x00\x00TFL3" + b"\x00" * 64)
    assert detect_format(tfl)[0] is Format.TFLITE
    h5 = tmp_path / "b"
    h5.write_bytes(b"\x89HDF\r\n\x1a\n" + b"\x00" * 64)
    assert detect_format(h5)[0] is Format.KERAS
    xml = tmp_path / "model.xml"
    xml.write_text('<?xml version="1.0"?>\n<net name="m" version="11"><layers/></net>')
    assert detect_format(xml)[0] is Format.OPENVINO_IR
    with pytest.raises(SourceUnreadable, match=r"no model\.bin"):
        open_source(xml, tmp_path / "w")


def _zip(path: Path, members: dict[str, bytes]) -> Path:
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    return path


def test_zip_members_decide(tmp_path: Path) -> None:
    keras = _zip(tmp_path / "x.zip", {"config.json": b"{}", "metadata.json": b"{}", "model.weights.h5": b""})
    assert detect_format(keras)[0] is Format.KERAS
    ts = _zip(tmp_path / "y", {"m/code/__torch__.py": b"", "m/constants.pkl": b"", "m/data.pkl": b""})
    assert detect_format(ts)[0] is Format.TORCHSCRIPT
    pt2 = _zip(tmp_path / "z", {"m/models/model.json": b"{}", "m/archive_format": b"pt2"})
    assert detect_format(pt2)[0] is Format.TORCH_EXPORT
    sm = _zip(tmp_path / "s.zip", {"export/saved_model.pb": b"x", "export/variables/variables.index": b""})
    assert detect_format(sm)[0] is Format.SAVEDMODEL


def test_torch_pickle_is_unsafe(tmp_path: Path) -> None:
    pickled = _zip(tmp_path / "model.pt", {"m/data.pkl": b"\x80\x02", "m/version": b"3"})
    with pytest.raises(UnsafeInput) as exc:
        detect_format(pickled)
    assert "TorchScript" in exc.value.hint
    raw = tmp_path / "raw.pkl"
    raw.write_bytes(b"\x80\x04\x95" + b"\x00" * 20)
    with pytest.raises(UnsafeInput):
        detect_format(raw)


def test_truncated_and_garbage_files(cnn_onnx: Path, tmp_path: Path) -> None:
    garbage = tmp_path / "model.onnx"
    garbage.write_bytes(b"this is not a model at all")
    with pytest.raises(UnsupportedFormat) as exc:
        detect_format(garbage)
    assert "unrecognised content" in exc.value.message
    empty = tmp_path / "empty.onnx"
    empty.write_bytes(b"")
    with pytest.raises(SourceUnreadable):
        detect_format(empty)
    truncated = tmp_path / "trunc.onnx"
    truncated.write_bytes(cnn_onnx.read_bytes()[: cnn_onnx.stat().st_size // 2])
    # Still looks like ONNX by its first bytes; loading is what fails (SOURCE_UNREADABLE).
    assert detect_format(truncated)[0] is Format.ONNX
    from services.onnx_io import load_onnx

    with pytest.raises(SourceUnreadable):
        load_onnx(truncated)


def test_spec_override_is_recorded(cnn_onnx: Path, tmp_path: Path) -> None:
    same = open_source(cnn_onnx, tmp_path, Format.ONNX)
    assert same.format is Format.ONNX and "overridden" not in same.seen and len(same.sha256) == 64
    other = open_source(cnn_onnx, tmp_path, Format.KERAS)  # Keras' loader vets what it reads (keras_safety)
    assert other.format is Format.KERAS
    assert other.seen.startswith("protobuf") and other.seen.endswith("overridden to keras by the spec")
    # A forced format with a vetter is vetted as that format: an ONNX file is no TFLite FlatBuffer.
    with pytest.raises(SourceUnreadable) as refused:
        open_source(cnn_onnx, tmp_path, Format.TFLITE)
    assert "not a readable TFLite FlatBuffer" in refused.value.message


def test_override_takes_unrecognised_content_but_never_a_pickle(tmp_path: Path) -> None:
    blob = tmp_path / "model.bin"
    blob.write_bytes(b"\x13\x37" * 64)
    with pytest.raises(UnsupportedFormat):
        open_source(blob, tmp_path)
    src = open_source(blob, tmp_path, Format.KERAS)
    assert src.format is Format.KERAS and "content not recognised" in src.seen and "by the spec" in src.seen
    with pytest.raises(SourceUnreadable):  # vetted as ONNX: protobuf cannot parse it, so no loader gets it
        open_source(blob, tmp_path, Format.ONNX)
    pickled = tmp_path / "model.pt"
    pickled.write_bytes(pickle.dumps({"weights": [1, 2, 3]}))
    with pytest.raises(UnsafeInput):
        open_source(pickled, tmp_path, Format.TORCHSCRIPT)


def _tar(path: Path, members: list[tarfile.TarInfo], payloads: dict[str, bytes] | None = None) -> Path:
    payloads = payloads or {}
    with tarfile.open(path, "w:gz") as tf:
        for m in members:
            data = payloads.get(m.name)
            tf.addfile(m, io.BytesIO(data) if data is not None else None)
    return path


def test_archive_path_traversal_refused(tmp_path: Path) -> None:
    evil = _zip(tmp_path / "evil.zip", {"../../etc/passwd": b"x"})
    with pytest.raises(UnsafeInput, match=r"\.\."):
        safe_extract(evil, tmp_path / "out")
    absolute = _zip(tmp_path / "abs.zip", {"/etc/x": b"x"})
    with pytest.raises(UnsafeInput, match="absolute"):
        safe_extract(absolute, tmp_path / "out2")
    assert not (tmp_path / "out" / ".." / ".." / "etc" / "passwd").exists()


def test_archive_links_refused(tmp_path: Path) -> None:
    link = tarfile.TarInfo("model/link")
    link.type = tarfile.SYMTYPE
    link.linkname = "/etc/passwd"
    path = _tar(tmp_path / "l.tar.gz", [link])
    with pytest.raises(UnsafeInput, match="link"):
        safe_extract(path, tmp_path / "out")


def test_decompression_bomb_refused(tmp_path: Path) -> None:
    bomb = tmp_path / "bomb.zip"
    with zipfile.ZipFile(bomb, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("zeros.bin", b"\0" * (64 * 1024 * 1024))
    assert bomb.stat().st_size < 1024 * 1024
    with pytest.raises(UnsafeInput) as exc:
        safe_extract(bomb, tmp_path / "out", ArchiveLimits(max_total_bytes=32 * 1024 * 1024))
    assert "bomb" in exc.value.hint
    with pytest.raises(UnsafeInput, match="expands"):
        safe_extract(bomb, tmp_path / "out2")  # default limits: the ratio check fires
    assert not (tmp_path / "out" / "zeros.bin").exists()


def test_savedmodel_tar_extracts_to_loadable_dir(tmp_path: Path) -> None:
    pb = tarfile.TarInfo("export/saved_model.pb")
    # A SavedModel holding one empty MetaGraph: the smallest file vetting reads as one.
    pb.size = 2
    path = _tar(tmp_path / "sm.tar.gz", [pb], {"export/saved_model.pb": b"\x12\x00"})
    src = open_source(path, tmp_path / "work")
    assert src.format is Format.SAVEDMODEL
    assert (src.path / "saved_model.pb").read_bytes() == b"\x12\x00"


def test_saving_with_external_data_leaves_the_model_whole(cnn_onnx: Path, tmp_path: Path) -> None:
    # Past the size threshold weights go to <name>.data; the caller's model keeps its weights
    # (onnx's own save strips them, which left the optimiser a model pointing at a deleted file).
    import numpy as np
    import onnx
    from onnx import numpy_helper

    from services.onnx_io import load_onnx, save_onnx

    model = load_onnx(cnn_onnx)
    before = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    files = save_onnx(model, tmp_path / "m.onnx", threshold=0)
    assert [f.name for f in files] == ["m.onnx", "m.onnx.data"] and files[1].stat().st_size > 0
    for t in model.graph.initializer:
        assert t.data_location == onnx.TensorProto.DEFAULT and not t.external_data
        np.testing.assert_array_equal(numpy_helper.to_array(t), before[t.name])
    reloaded = load_onnx(files[0])
    for t in reloaded.graph.initializer:
        np.testing.assert_array_equal(numpy_helper.to_array(t), before[t.name])


def test_deep_and_long_member_names_are_refused_from_the_header(tmp_path: Path) -> None:
    """A member 2,100 folders deep once exhausted os.makedirs' recursion (500 INTERNAL): now UNSAFE_INPUT."""
    deep = tarfile.TarInfo("/".join(["d"] * 2100) + "/model.onnx")
    deep.size = 4
    path = _tar(tmp_path / "deep.tar.gz", [deep], {deep.name: b"\x08\x07\x12\x00"})
    for call in (lambda: open_source(path, tmp_path / "w"), lambda: safe_extract(path, tmp_path / "out")):
        with pytest.raises(UnsafeInput, match="has a name of 4210 bytes"):
            call()
    assert not (tmp_path / "out" / "d").exists()
    nested = tarfile.TarInfo("/".join(["d"] * 100) + "/model.onnx")  # short enough a name, too deep
    nested.size = 4
    with pytest.raises(UnsafeInput, match="100 folders deep"):
        safe_extract(_tar(tmp_path / "nested.tar.gz", [nested], {nested.name: b"\x08\x07\x12\x00"}), tmp_path / "o")
    long_name = _zip(tmp_path / "long.zip", {"m/" + "x" * 300 + ".onnx": b"x"})
    with pytest.raises(UnsafeInput, match="has a name of"):
        safe_extract(long_name, tmp_path / "out2")
    ok = tarfile.TarInfo("/".join(["d"] * 10) + "/saved_model.pb")
    ok.size = 2
    assert open_source(_tar(tmp_path / "ok.tar.gz", [ok], {ok.name: b"\x12\x00"}), tmp_path / "w3").format.value


def test_a_tar_bomb_is_refused_within_one_bounded_inflate(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """300 MiB of zeros in 1 MiB members (~300 KiB gzipped): refused having inflated a fraction, once."""
    bomb = tmp_path / "bomb.tar.gz"
    zeros = b"\0" * (1 << 20)
    with tarfile.open(bomb, "w:gz") as tf:
        for i in range(300):
            m = tarfile.TarInfo(f"export/part{i}.bin")
            m.size = len(zeros)
            tf.addfile(m, io.BytesIO(zeros))
    compressed = bomb.stat().st_size
    passes: list[int] = []  # how far into the inflated stream each pass over the archive read
    real_next = tarfile.TarFile.next

    def counting_next(self: tarfile.TarFile) -> tarfile.TarInfo | None:
        if self.offset == 0:
            passes.append(0)
        passes[-1] = max(passes[-1], self.offset)
        return real_next(self)

    monkeypatch.setattr(tarfile.TarFile, "next", counting_next)
    with pytest.raises(UnsafeInput, match="expands") as info:
        open_source(bomb, tmp_path / "work")
    assert "bomb" in info.value.hint
    # One pass went past the first member (detection's listing, which refused it: never extracted);
    # the others only peeked at the first header (is_tarfile).
    assert sum(p > len(zeros) for p in passes) == 1, passes
    bound = ArchiveLimits().max_ratio * compressed + 2 * len(zeros)  # the ratio's allowance plus one member
    assert sum(passes) <= bound < 300 * len(zeros), (passes, bound)
    assert not (tmp_path / "work" / "source").exists()


def test_a_tar_header_declaring_more_than_the_archive_could_hold_is_refused_before_its_data(tmp_path: Path) -> None:
    huge = tarfile.TarInfo("export/saved_model.pb")
    huge.size = 9 * 1024**3  # declared; the bytes are not there
    buf = io.BytesIO()
    buf.write(huge.tobuf(format=tarfile.GNU_FORMAT))
    buf.write(b"\0" * 4096)
    path = tmp_path / "liar.tar"
    path.write_bytes(buf.getvalue())
    with pytest.raises(UnsafeInput, match="more than"):
        list_members(path)
