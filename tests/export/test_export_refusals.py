"""Exports of hostile or unlucky inputs: a head edited after training, an export under a read-only directory,
a file over the size limit. Each is refused with the file and the fix, and nothing already written is lost."""

import errno
import json
import re
import resource
import signal
from contextlib import contextmanager
from pathlib import Path

import pytest
from typer.testing import CliRunner

from mtptrain.cli import app
from mtptrain.config import ExportConfig
from mtptrain.export.run import export_head
from mtptrain.export.source import load_head_directory
from mtptrain.heads import FrozenTarget
from mtptrain.heads.checkpoint import HeadCheckpointError
from mtptrain.io import WriteRefusedError

from export_helpers import EAGLE3, identity, save_trained_like_head, target_dir, target_model  # noqa: F401


def edit_json(path: Path, edit) -> None:
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data, indent=2) + "\n")


def test_a_head_whose_layer_ids_were_edited_is_neither_exported_nor_evaluated(target_dir, tmp_path):
    head_dir = save_trained_like_head(target_dir, tmp_path / "head", EAGLE3)
    edit_json(head_dir / "config.json", lambda c: c["head"].update(feature_layers=[1, 3, 4]))
    changed = rf"{re.escape(str(head_dir / 'config.json'))}: the head's config was changed after training"
    with pytest.raises(HeadCheckpointError, match=changed):
        export_head(head_dir, tmp_path / "out", ExportConfig(format="eagle3"))
    assert not (tmp_path / "out").exists()
    with pytest.raises(HeadCheckpointError, match=changed):  # what eval loads a head with
        load_head_directory(head_dir, FrozenTarget.of(target_model(target_dir)), identity(target_dir))


def test_an_export_whose_recorded_head_config_was_edited_is_not_evaluated(target_dir, tmp_path):
    head_dir = save_trained_like_head(target_dir, tmp_path / "head", EAGLE3)
    out = tmp_path / "out"
    export_head(head_dir, out, ExportConfig(format="eagle3"))
    edit_json(out / "mtptrain.json", lambda s: s["head_config"]["head"].update(feature_layers=[1, 3, 4]))
    with pytest.raises(HeadCheckpointError, match=rf"{re.escape(str(out / 'mtptrain.json'))}: the head's config "
                                                  "was changed after training"):
        load_head_directory(out, FrozenTarget.of(target_model(target_dir)), identity(target_dir))


def test_export_under_a_read_only_directory_is_an_error_message(target_dir, tmp_path, monkeypatch):
    """Tests run as root, which permission bits do not stop: the file system's answer is simulated."""
    head_dir = save_trained_like_head(target_dir, tmp_path / "head", EAGLE3)
    read_only, mkdir = tmp_path / "ro", Path.mkdir

    def refused(self, *args, **kwargs):
        if self.is_relative_to(read_only):
            raise OSError(errno.EROFS, "Read-only file system", str(self))
        return mkdir(self, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", refused)
    result = CliRunner().invoke(app, ["export", "--set", f"export.head={head_dir}",
                                      "--set", f"export.output_dir={read_only / 'out'}"])
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.output
    assert f"error: cannot write the export {read_only / 'out'}: {read_only} is read-only. Make it writable, or " \
           "set export.output_dir to a directory on another disk" in result.output
    assert "Traceback" not in result.output


def test_export_where_the_system_does_not_permit_a_directory_is_an_error_message(target_dir, tmp_path):
    """A real refusal that root meets too: sysfs permits no new directory (EPERM)."""
    head_dir = save_trained_like_head(target_dir, tmp_path / "head", EAGLE3)
    result = CliRunner().invoke(app, ["export", "--set", f"export.head={head_dir}",
                                      "--set", "export.output_dir=/sys/fs/mtptrain-test/out"])
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.output
    assert "error: cannot write the export /sys/fs/mtptrain-test/out: /sys/fs/mtptrain-test may not be written " \
           "here (operation not permitted)" in result.output
    assert "Traceback" not in result.output


@contextmanager
def file_size_limit(nbytes: int):
    """RLIMIT_FSIZE for this process (SIGXFSZ ignored, so a write past it fails with EFBIG), restored after."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, handler)


def test_an_export_over_the_file_size_limit_keeps_the_earlier_export(target_dir, tmp_path):
    head_dir = save_trained_like_head(target_dir, tmp_path / "head", EAGLE3)
    out = tmp_path / "exports" / "eagle3"
    export_head(head_dir, out, ExportConfig(format="eagle3"))
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with file_size_limit(4096), pytest.raises(WriteRefusedError) as refused:  # safetensors' own error: EFBIG
        export_head(head_dir, out, ExportConfig(format="eagle3"))
    assert str(refused.value) == (
        f"cannot write the export {out}: a file in {out.parent} would pass the file size limit of this process "
        "(ulimit -f). Raise the limit (ulimit -f unlimited in the shell that runs mtptrain). Nothing was left "
        f"half-written: {out} is as it was.")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert [p.name for p in out.parent.iterdir()] == ["eagle3"]  # no staging directory left
