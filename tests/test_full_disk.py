"""A full disk: writes that really fail, in child processes, and what each script does about them.

Two real failures, no mocks: a file-size limit (RLIMIT_FSIZE, with SIGXFSZ ignored, so a write past the limit fails
with EFBIG "File too large"; works unprivileged everywhere) and, where this process may mount one (root), a small
tmpfs that runs out of room (ENOSPC "No space left on device"), the issue's case: room for one checkpoint, not two.
"""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import dqn_starcraft_split as dqn
import dreamer_atari as da
import memory_utils as mu
from dqn_tiny import TINY_FLAGS as DQN_TINY

ROOT = Path(__file__).resolve().parent.parent
LIMITED = """
import resource, signal, sys
sys.path[:0] = [{root!r}]
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead of killing us
resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, {limit}))
"""


def run_limited(code: str, limit: int, cwd, timeout: int = 300) -> subprocess.CompletedProcess:
    """`code` in a fresh Python whose files cannot grow past `limit` bytes."""
    script = LIMITED.format(root=str(ROOT), limit=limit) + textwrap.dedent(code)
    env = {**os.environ, "WANDB_MODE": "offline", "OMP_NUM_THREADS": "1", "PYTHONDONTWRITEBYTECODE": "1"}
    env = {k: v for k, v in env.items() if not k.startswith("RL_")}
    return subprocess.run(
        [sys.executable, "-c", script],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


@pytest.fixture
def small_disk(tmp_path):
    """A 3 MB tmpfs mounted at tmp_path/disk, where this process may mount one (root in a container); else skip."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(disk)], capture_output=True, check=False
    )
    if mounted.returncode != 0:
        pytest.skip(
            "cannot mount a small tmpfs here (needs root); the RLIMIT_FSIZE tests cover the same code"
        )
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], capture_output=True, check=False)


def leftovers(folder: Path) -> list[Path]:
    return [p for p in folder.rglob("*") if p.name.startswith(".tmp_") or p.name.endswith(".tmp")]


def test_a_write_past_a_file_size_limit_removes_the_partial_file_and_says_what_it_needed(tmp_path):
    (tmp_path / "state.pt").write_bytes(b"the last good one")
    result = run_limited(
        """
        import memory_utils as mu, torch
        state = {"weights": torch.zeros(100_000)}  # 400 kB, past the 100 kB limit
        try:
            mu.atomic_write("state.pt", lambda f: torch.save(state, f), mu.estimate_nbytes(state))
        except mu.WriteFailed as exc:
            print("WriteFailed:", exc)
            print("needed", exc.needed_bytes, "free", exc.free_bytes)
    """,
        limit=100_000,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    assert "WriteFailed: could not write state.pt (needs 400,615 bytes, " in result.stdout, result.stdout
    assert "File too large" in result.stdout and "enforce fail" not in result.stdout
    assert (tmp_path / "state.pt").read_bytes() == b"the last good one"
    assert leftovers(tmp_path) == []


def test_an_append_past_the_limit_leaves_the_file_whole(tmp_path):
    (tmp_path / "curve.csv").write_text("episode,score\n" + "1,2.0\n" * 100)
    result = run_limited(
        """
        import memory_utils as mu
        mu.atomic_append("curve.csv", "2,3.0\\n")  # fits
        try:
            mu.atomic_append("curve.csv", "3,4.0\\n" * 20)
        except mu.WriteFailed as exc:
            print("WriteFailed:", exc)
    """,
        limit=len("episode,score\n" + "1,2.0\n" * 101) + 20,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    assert "WriteFailed: could not write curve.csv (needs 740 bytes, " in result.stdout, result.stdout
    assert (tmp_path / "curve.csv").read_text() == "episode,score\n" + "1,2.0\n" * 100 + "2,3.0\n"
    assert leftovers(tmp_path) == []


def test_a_full_file_system_keeps_the_last_good_file_and_reports_the_free_space(small_disk):
    state = {
        "weights": torch.zeros(300_000)
    }  # 1.2 MB: one fits on the 3 MB disk beside the other, not a third
    path = small_disk / "checkpoint.pt"
    mu.atomic_write(path, lambda f: torch.save(state, f), mu.estimate_nbytes(state))
    (small_disk / "ballast").write_bytes(b"\0" * 1_000_000)
    with pytest.raises(mu.WriteFailed) as failed:
        mu.atomic_write(path, lambda f: torch.save({"weights": torch.ones(300_000)}, f), 1_200_000)
    assert "No space left on device" in str(failed.value) and str(path) in str(failed.value)
    assert failed.value.needed_bytes == 1_200_000 and failed.value.free_bytes < 1_200_000
    assert torch.load(path, weights_only=True)["weights"].sum() == 0  # the last good one
    assert leftovers(small_disk) == []
    assert mu.disk_space_warning(small_disk, 1_200_000) is not None  # less than two checkpoints' room
    assert mu.disk_space_warning(small_disk, 1_000) is None


def test_tensorboard_events_on_a_full_disk_are_one_warning_and_the_file_stays_readable(tmp_path):
    """TensorBoard's writer thread dies on a failed write and the next add_scalar raises: guarded, the writer
    drops what does not fit, keeps whole records only, and says so once."""
    result = run_limited(
        """
        import memory_utils as mu
        from torch.utils.tensorboard import SummaryWriter
        writer = SummaryWriter("events")
        assert mu.keep_events_on_write_errors(writer, print)
        for step in range(3000):
            writer.add_scalar("loss", float(step), step)
            if step % 500 == 0:
                writer.flush()
        writer.close()
        print("training went on to the end")
    """,
        limit=20_000,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "training went on to the end" in result.stdout
    warnings = [line for line in result.stdout.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "File too large" in warnings[0] and "events.out.tfevents" in warnings[0], (
        warnings
    )
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    (events_file,) = (tmp_path / "events").iterdir()
    assert events_file.stat().st_size <= 20_000
    events = EventAccumulator(str(tmp_path / "events"), size_guidance={"scalars": 0})
    events.Reload()
    steps = [e.step for e in events.Scalars("loss")]
    assert steps == list(range(len(steps))) and len(steps) > 100  # every record that is there is whole


def test_tensorboard_events_resume_whole_when_the_disk_has_room_again(small_disk):
    """A record torn by the full disk is cut off, so the records written once there is room again are readable."""
    from torch.utils.tensorboard import SummaryWriter

    said = []
    writer = SummaryWriter(str(small_disk / "events"))
    assert mu.keep_events_on_write_errors(writer, said.append)
    for step in range(200):
        writer.add_scalar("loss", float(step), step)
    writer.flush()
    ballast = small_disk / "ballast"
    fd = os.open(ballast, os.O_WRONLY | os.O_CREAT)
    try:  # fill the disk to the last byte
        while os.write(fd, b"\0" * 512):
            pass
    except OSError:
        pass
    finally:
        os.close(fd)
    for step in range(200, 700):
        writer.add_scalar("loss", float(step), step)
    writer.flush()
    ballast.unlink()
    for step in range(700, 900):
        writer.add_scalar("loss", float(step), step)
    writer.close()
    assert len(said) == 2 and "No space left on device" in said[0] and "written again" in said[1], said
    events = EventAccumulator(str(small_disk / "events"), size_guidance={"scalars": 0})
    events.Reload()
    steps = [e.step for e in events.Scalars("loss")]
    assert steps[:200] == list(range(200)) and steps[-200:] == list(range(700, 900)), steps[195:210]


DREAMER_RUN = """
    import dreamer_atari as da
    args = da.Args(**{tiny}, num_envs=1, vector_mode="sync", precision="float32", total_timesteps=300, learning_starts=60,
                   warmup_steps=0, train_ratio=2.0, log_interval=50, max_episode_steps=60, buffer_capacity=400,
                   checkpoint_every=100, save_model=True, video_every=150, replay_on_disk=False)
    da.main(args)
"""


def dreamer_code() -> str:
    import dreamer_tiny

    return DREAMER_RUN.replace("{tiny}", repr(dreamer_tiny.TINY))


def test_dreamer_periodic_checkpoints_that_fail_are_warnings_and_the_final_one_is_exit_6(tmp_path):
    """Every checkpoint is past the size limit: each periodic one is a warning line and training goes on to the
    end; the final one cannot be written, which is one sentence and its own exit status, no traceback."""
    result = run_limited(dreamer_code(), limit=400_000, cwd=tmp_path)
    output = result.stdout + result.stderr
    assert result.returncode == da.EXIT_WRITE_FAILED, output[-3000:]
    assert "Traceback" not in output and "enforce fail" not in output, output[-3000:]
    periodic = [line for line in output.splitlines() if "checkpoint (periodic) not written" in line]
    assert len(periodic) == 2 and all(  # at steps 100 and 200; at 300 the final one comes instead
        "File too large" in line and "checkpoint.pt (needs" in line for line in periodic
    )
    assert "step 300/300" in result.stdout  # training went on to its end
    (last,) = [line for line in result.stderr.splitlines() if line.startswith("stopping")]
    assert last.startswith("stopping: could not write runs/") and last.endswith(
        "the run cannot go on without this checkpoint (end of training)."
    ), last
    (run_dir,) = (tmp_path / "runs").iterdir()
    assert not (run_dir / "checkpoint.pt").exists() and leftovers(tmp_path) == []
    assert list((run_dir / "open_loop").iterdir()), output[-3000:]  # the small files were written


def test_dreamer_with_room_for_one_checkpoint_keeps_it_and_stops_at_the_final_one(small_disk):
    """The issue's case: a file system with room for one checkpoint but not two."""
    import dreamer_tiny

    args = da.Args(**{**dreamer_tiny.TINY, "num_envs": 1, "vector_mode": "sync", "precision": "float32"})
    agent = da.build_agent(args, dreamer_tiny.obs_shape(args), 6, "cpu")
    da.preflight(agent, args, dreamer_tiny.obs_shape(args))  # Adam's moments, as the run has them
    size = mu.estimate_nbytes(
        [{n: m.state_dict() for n, m in agent.modules().items()}, [o.state_dict() for o in agent.optimizers]]
    )
    ballast = (
        mu.free_bytes(small_disk) - int(1.6 * size) - 200_000
    )  # room for one checkpoint, events and GIFs
    (small_disk / "ballast").write_bytes(b"\0" * ballast)
    result = run_limited(dreamer_code(), limit=2**40, cwd=small_disk)
    output = result.stdout + result.stderr
    assert result.returncode == da.EXIT_WRITE_FAILED, output[-3000:]
    assert "less than 2 checkpoints of about" in output, output[-3000:]  # said at start-up
    assert "checkpoint (periodic): runs/" in output, output[-3000:]  # the first one fitted
    assert "No space left on device" in output and "Traceback" not in output, output[-3000:]
    (run_dir,) = (small_disk / "runs").iterdir()
    kept = torch.load(run_dir / "checkpoint.pt", weights_only=True)
    assert kept["counters"]["global_step"] == 100 and leftovers(small_disk) == []


def test_dreamer_says_at_start_up_when_two_checkpoints_do_not_fit(small_disk):
    (small_disk / "ballast").write_bytes(b"\0" * (mu.free_bytes(small_disk) - 150_000))
    result = run_limited(
        DREAMER_RUN.replace("{tiny}", "__import__('dreamer_tiny').TINY")
        .replace(
            "import dreamer_atari as da",
            f"import sys; sys.path.insert(0, {str(ROOT / 'tests')!r}); import dreamer_atari as da",
        )
        .replace("total_timesteps=300", "total_timesteps=70"),
        limit=2**40,
        cwd=small_disk,
    )
    lines = [
        line for line in result.stdout.splitlines() if line.startswith("warning:") and "free where" in line
    ]
    assert len(lines) == 1 and "less than 2 checkpoints of about" in lines[0], result.stdout[-2000:]


def test_a_replay_file_that_cannot_be_written_is_one_warning_and_the_run_goes_on_in_memory(small_disk):
    """The replay on disk on a 3 MB file system: a chunk that does not fit is one warning line (the file, the
    bytes it needed, the free space), no partial file stays, and the run trains on to its end; its checkpoints hold
    no replay from then on (a resume starts with an empty one)."""
    code = DREAMER_RUN.replace("{tiny}", "__import__('dreamer_tiny').TINY").replace(
        "import dreamer_atari as da",
        f"import sys; sys.path.insert(0, {str(ROOT / 'tests')!r}); import dreamer_atari as da",
    )
    # a chunk of 300 steps (3.7 MB) fills the disk: the first that comes cannot be written
    code = code.replace("replay_on_disk=False)", "replay_chunk_steps=300, checkpoint_minutes=0.0)")
    code = code.replace("checkpoint_every=100", "checkpoint_every=0").replace(
        "video_every=150", "video_every=0"
    )
    result = run_limited(code, limit=2**40, cwd=small_disk)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    # the start-up's warning counts the replay's files: two checkpoints fit, the replay's 400 steps do not
    (warned,) = [line for line in result.stdout.splitlines() if "free where checkpoints go" in line]
    assert "and the replay's" in warned and "on disk when full" in warned, warned
    (line,) = [line for line in result.stdout.splitlines() if "the replay is kept in memory only" in line]
    assert (
        line.startswith("warning: could not write runs/") and "free there): No space left on device" in line
    )
    (run_dir,) = (small_disk / "runs").iterdir()
    assert (
        not leftovers(small_disk)
        and torch.load(run_dir / "checkpoint.pt", weights_only=True)["replay"] is None
    )


def test_dqn_final_checkpoint_that_cannot_be_written_is_one_sentence_and_exit_6(tmp_path):
    code = f"""
        import sys
        sys.argv = ["dqn_starcraft_split.py", *{DQN_TINY!r}, "--num-episodes", "2", "--run-id", "full",
                    "--save-model", "--no-replay-on-disk"]
        import dqn_starcraft_split as dqn
        args, sources = dqn.parse_args()
        sys.exit(dqn.main(args, sources))
    """
    result = run_limited(code, limit=100_000, cwd=tmp_path)
    assert result.returncode == dqn.EXIT_WRITE_FAILED, (result.stdout + result.stderr)[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    (line,) = [line for line in result.stderr.splitlines() if line.startswith("stopped")]
    assert line.startswith("stopped: could not write results/full/checkpoint.pt (needs ") and line.endswith(
        "File too large; the run cannot go on without this file."
    ), line
    run = tmp_path / "results" / "full"
    assert (run / "eval" / "test_results.json").exists() and not (run / "checkpoint.pt").exists()
    assert not (tmp_path / "results" / "results.csv").exists() and leftovers(tmp_path) == []
