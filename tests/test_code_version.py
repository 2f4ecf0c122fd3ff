"""Results that name their code: `benchmark.common.code_version()` from git in a checkout, from `.code-version.json`
(dev/code_version.py) where the code travels without .git, and unknown, said so, where neither is there; and
`pong_final_return` read with one meaning from results files of any age (`read_results`)."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from benchmark import common

ROOT = Path(__file__).resolve().parent.parent


def git(root: Path, *argv: str) -> str:
    return subprocess.run(
        ["git", "-C", str(root), *argv], check=True, capture_output=True, text=True
    ).stdout.strip()


@pytest.fixture
def checkout(tmp_path) -> Path:
    """A small git checkout with a code file, committed."""
    root = tmp_path / "repo"
    (root / "pkg").mkdir(parents=True)
    (root / "pkg" / "train.py").write_text("print('train')\n")
    (root / "notes.md").write_text("not code\n")
    (root / ".gitignore").write_text(".code-version.json\n")
    git(root, "init", "-q")
    git(root, "add", ".")
    git(root, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "first")
    return root


def test_a_checkout_names_its_commit_and_whether_the_tree_differs(checkout):
    clean = common.code_version(checkout)
    assert clean["commit"] == git(checkout, "rev-parse", "HEAD") and clean["tree_differs"] is False
    (checkout / "pkg" / "train.py").write_text("print('changed')\n")
    (checkout / "pkg" / "new.py").write_text("x = 1\n")
    changed = common.code_version(checkout)
    assert changed["tree_differs"] is True and changed["differing_count"] == 2
    assert set(changed["differing_paths"]) == {"pkg/train.py", "pkg/new.py"}
    assert (
        changed["diff_sha256"] == common.code_version(checkout)["diff_sha256"]
    )  # the same changes, the same digest
    (checkout / "pkg" / "new.py").write_text("x = 2\n")
    assert common.code_version(checkout)["diff_sha256"] != changed["diff_sha256"]
    assert "with 2 paths changed or added" in common.code_markdown(changed)


def test_this_repository_names_its_own_commit():
    assert common.code_version()["commit"] == git(ROOT, "rev-parse", "HEAD")


def test_a_copy_without_git_reads_the_file_written_before_it_left_and_checks_its_code_files(
    checkout, tmp_path
):
    """What a lease's machine gets: the working tree without .git, with .code-version.json carried beside it."""
    (checkout / "pkg" / "train.py").write_text("print('edited, not committed')\n")
    recorded = common.write_code_version(checkout)
    assert recorded["code_files"] == ["pkg/train.py"]  # code only: notes.md is not
    copy = tmp_path / "device"
    shutil.copytree(checkout, copy, ignore=shutil.ignore_patterns(".git"))
    version = common.code_version(copy)
    assert version["commit"] == git(checkout, "rev-parse", "HEAD") and version["tree_differs"] is True
    assert version["files_match"] is True and version["from"].startswith(".code-version.json, written by")
    (copy / "pkg" / "train.py").write_text("print('edited on the device')\n")
    assert common.code_version(copy)["files_match"] is False
    assert "differ from those the record was written for" in common.code_markdown(common.code_version(copy))
    (copy / ".code-version.json").unlink()
    unknown = common.code_version(copy)
    assert unknown["commit"] is None and unknown["from"].startswith("unknown: no git checkout here")
    assert common.code_markdown(unknown).startswith("Code: not recorded (unknown")


def test_the_command_writes_the_file_at_the_repository_root():
    target = ROOT / common.CODE_VERSION_FILE
    before = target.read_bytes() if target.exists() else None
    try:
        done = subprocess.run(
            [sys.executable, str(ROOT / "dev" / "code_version.py")],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0 and "wrote .code-version.json" in done.stdout
        assert json.loads(target.read_text())["commit"] == git(ROOT, "rev-parse", "HEAD")
        assert common.CODE_VERSION_FILE not in git(
            ROOT, "status", "--porcelain"
        )  # ignored: it never dirties the tree
    finally:
        if before is None:
            target.unlink(missing_ok=True)
        else:
            target.write_bytes(before)


def test_pong_final_return_means_the_evaluation_in_files_of_any_age(tmp_path):
    """The 2026-11-22 GPU report called the last 10 training episodes' mean `pong_final_return`; read today, that is
    `pong_train_return_last_10`, and nothing was evaluated. A staged lease file is read as it is."""
    old = common.read_results(ROOT / "benchmark" / "results" / "2026-11-22-nvidia-h100-80gb-hbm3.json")
    assert old["pong"]["pong_train_return_last_10"] == -19.7 and old["pong"]["pong_final_return"] is None
    staged_path = ROOT / "benchmark" / "results" / "2026-11-27-nvidia-h200.json"
    staged = common.read_results(staged_path)
    assert staged == json.loads(staged_path.read_text()) and staged["pong_final_return"] == -11.6
