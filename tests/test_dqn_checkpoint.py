"""Checkpoints that cannot lie: dqn_starcraft_split.py writes `checkpoint.pt.sha256` beside each checkpoint and
`--resume` refuses a checkpoint whose bytes are not the ones written, by that checksum or by the archive's own
CRC-32s (one sentence, exit 2, the file left as it is); one neither can verify resumes after one line. And the
checkpoints of format 3, whose heads' weights had other names, still load."""

import dataclasses
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import dqn_starcraft_split as dqn
from conftest import flip_200_bytes_inside_a_tensor
from dqn_tiny import TINY_FLAGS

SCRIPT = Path(dqn.__file__)
ONE_EPISODE = [*TINY_FLAGS, "--num-episodes", "1", "--eval-every-episodes", "0", "--num-test-episodes", "1"]


def main_in(cwd: Path, argv: list[str]) -> int:
    """dqn.main in `cwd`, as the command line `argv` would run it."""
    here, threads = os.getcwd(), torch.get_num_threads()
    os.chdir(cwd)
    try:
        return dqn.main(*dqn.parse_args(argv, {}))
    finally:
        os.chdir(here)
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory) -> Path:
    """Two finished one-episode runs, `first` (seed 1) and `other` (seed 2), each with its checkpoint."""
    root = tmp_path_factory.mktemp("runs")
    for run_id, seed in (("first", "1"), ("other", "2")):
        assert main_in(root, [*ONE_EPISODE, "--run-id", run_id, "--seed", seed]) == 0
    return root


@pytest.fixture
def run(two_runs, tmp_path) -> Path:
    """A copy of the `first` run's folder (results/first) to spoil, beside a copy of `other`."""
    shutil.copytree(two_runs / "results", tmp_path / "results")
    return tmp_path / "results" / "first"


def spoil(run: Path, how: str) -> None:
    checkpoint = run / "checkpoint.pt"
    if how == "flipped":
        flip_200_bytes_inside_a_tensor(checkpoint)
        torch.load(checkpoint, weights_only=True)  # torch reads it without a word: only the checksum tells
    elif how == "truncated":
        checkpoint.write_bytes(checkpoint.read_bytes()[: checkpoint.stat().st_size // 2])
    elif how == "another run's":  # copied over it without its .sha256
        shutil.copyfile(run.parent / "other" / "checkpoint.pt", checkpoint)
    else:
        checkpoint.write_text("not a checkpoint\n")


@pytest.mark.parametrize("how", ["flipped", "truncated", "another run's", "not a checkpoint"])
def test_a_checkpoint_that_is_not_the_one_written_is_refused_in_one_sentence(run, capsys, how):
    spoil(run, how)
    spoiled = (run / "checkpoint.pt").read_bytes()
    checksum = (run / "checkpoint.pt.sha256").read_bytes()
    code = main_in(
        run.parent.parent, [*ONE_EPISODE, "--num-episodes", "2", "--resume", str(run / "checkpoint.pt")]
    )
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert err.startswith(f"error: --resume: {run / 'checkpoint.pt'} does not match its checksum in ")
    assert err.strip().endswith("it is left as it is.") and "Traceback" not in err
    assert (run / "checkpoint.pt").read_bytes() == spoiled and (
        run / "checkpoint.pt.sha256"
    ).read_bytes() == checksum
    assert "resumed" not in (run / "train.log").read_text()  # nothing was trained from it


def test_a_damaged_checkpoint_copied_without_its_checksum_is_refused_naming_the_damaged_record(run, capsys):
    """Without its .sha256, a checkpoint is still checked against its archive's own CRC-32s before it is loaded:
    200 bytes flipped inside a tensor, which torch loads without a word, are refused in one sentence naming the
    record and the file, and the file is left as it is."""
    checkpoint = run / "checkpoint.pt"
    (run / "checkpoint.pt.sha256").unlink()
    assert (
        dqn.mu.verify_checkpoint(checkpoint) is None
    )  # undamaged: its own CRC-32s verify it, without a note
    record = flip_200_bytes_inside_a_tensor(checkpoint)
    torch.load(checkpoint, weights_only=True)
    damaged = checkpoint.read_bytes()
    code = main_in(run.parent.parent, [*ONE_EPISODE, "--num-episodes", "2", "--resume", str(checkpoint)])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith(
        f"error: --resume: {checkpoint} is damaged: its record {record} does not match the CRC-32 "
    )
    assert err.strip().endswith("it is left as it is.")
    assert checkpoint.read_bytes() == damaged and not (run / "checkpoint.pt.sha256").exists()
    assert "resumed" not in (run / "train.log").read_text()


@pytest.mark.parametrize("checksum", ["with its checksum", "copied without it"])
def test_the_command_line_refuses_a_changed_checkpoint_with_exit_2_and_no_traceback(run, checksum):
    if checksum == "copied without it":
        (run / "checkpoint.pt.sha256").unlink()
    record = flip_200_bytes_inside_a_tensor(run / "checkpoint.pt")
    done = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            *ONE_EPISODE,
            "--num-episodes",
            "2",
            "--resume",
            str(run / "checkpoint.pt"),
        ],
        cwd=run.parent.parent,
        env={k: v for k, v in os.environ.items() if not k.startswith("RL_")},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr[-2000:]
    said = "does not match its checksum" if checksum == "with its checksum" else f"its record {record} "
    assert said in done.stderr and "Traceback" not in done.stderr, done.stderr


def test_a_checkpoint_neither_check_can_verify_resumes_after_one_line(run, capsys):
    """A checkpoint without its checksum that is no zip archive either (torch's legacy format: no CRC-32s to
    check) is read, after one line saying it could not be verified."""
    (run / "checkpoint.pt.sha256").unlink()
    state = torch.load(run / "checkpoint.pt", weights_only=True)
    torch.save(state, run / "checkpoint.pt", _use_new_zipfile_serialization=False)
    code = main_in(
        run.parent.parent, [*ONE_EPISODE, "--num-episodes", "2", "--resume", str(run / "checkpoint.pt")]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 0 and len(err) == 1 and "could not be verified" in err[0], err
    assert "resumed first at episode 2" in (run / "train.log").read_text()
    assert torch.load(run / "checkpoint.pt", weights_only=True)["episode"] == 2
    assert (
        dqn.mu.verify_checkpoint(run / "checkpoint.pt") is None
    )  # the new checkpoint has its checksum again


def test_every_checkpoint_is_written_with_its_checksum(run):
    assert dqn.mu.verify_checkpoint(run / "checkpoint.pt") is None
    assert (run / "checkpoint.pt.sha256").read_text().startswith("sha256:")


def test_a_format_3_checkpoint_loads_and_resumes(run, capsys):
    """Format 3 kept the heads' layers on the network itself (`nonspatial_head.0.weight`, `spatial_coarse.*`,
    `spatial_fine.*`): its networks load into today's, weight for weight, and the run resumes from it."""
    state = torch.load(run / "checkpoint.pt", weights_only=True)
    new_to_old = {new: old for old, new in dqn.FORMAT_3_KEYS}
    for network in ("q_network", "target_network"):
        renamed = {}
        for key, value in state[network].items():
            prefix = next((new for new in new_to_old if key.startswith(new)), None)
            renamed[new_to_old[prefix] + key[len(prefix) :] if prefix else key] = value
        state[network] = renamed
    assert "nonspatial_head.0.weight" in state["q_network"] and "spatial_fine.weight" in state["q_network"]
    state["format"] = "dqn_starcraft_split/3"
    (run / "checkpoint.pt.sha256").unlink()
    torch.save(state, run / "checkpoint.pt")
    net = dqn.make_q_network(map_name="MoveToBeacon", res=8)
    net.load_state_dict(state["q_network"])
    assert torch.equal(net.nonspatial_head.mlp[0].weight, state["q_network"]["nonspatial_head.0.weight"])
    assert torch.equal(net.spatial_head.fine.weight, state["q_network"]["spatial_fine.weight"])
    code = main_in(
        run.parent.parent, [*ONE_EPISODE, "--num-episodes", "2", "--resume", str(run / "checkpoint.pt")]
    )
    assert code == 0, capsys.readouterr().err
    assert torch.load(run / "checkpoint.pt", weights_only=True)["format"] == dqn.CHECKPOINT_FORMAT


def test_the_loss_scalers_state_round_trips_through_a_checkpoint(tmp_path, monkeypatch):
    """fp16's GradScaler (here an enabled one on the CPU, its scale doubled every 2 updates without an overflow) is
    saved with the run and resumed where it stood: its scale after 17 updates and 8 more is 2^12 times the first,
    not 2^4 (a fresh scaler at resume), and the start-up preallocation's step moves it not at all."""
    real_amp = dqn.mu.amp

    def enabled_scaler(mode, device):
        setup = real_amp(mode, device)
        return dataclasses.replace(
            setup, scaler=torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
        )

    monkeypatch.setattr(dqn.mu, "amp", enabled_scaler)
    three = [*TINY_FLAGS, "--eval-every-episodes", "0", "--num-test-episodes", "1", "--run-id", "scaled"]
    assert main_in(tmp_path, [*three, "--num-episodes", "3"]) == 0  # updates at steps 12, 14, ..., 44: 17
    checkpoint = tmp_path / "results" / "scaled" / "checkpoint.pt"
    saved = torch.load(checkpoint, weights_only=True)["scaler"]
    assert (saved["scale"], saved["_growth_tracker"]) == (2.0**18, 1)
    assert main_in(tmp_path, [*three, "--num-episodes", "4", "--resume", str(checkpoint)]) == 0  # 8 more
    resumed = torch.load(checkpoint, weights_only=True)["scaler"]
    assert (resumed["scale"], resumed["_growth_tracker"]) == (2.0**22, 1)
