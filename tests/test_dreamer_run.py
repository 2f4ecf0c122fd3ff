"""dreamer_atari.py end to end on real Pong: logged keys, checkpoints and resume, SIGTERM, bad arguments."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import dreamer_atari as da
import dreamer_tiny
import memory_utils as mu
from conftest import flip_200_bytes_inside_a_tensor
from dreamer_tiny import TINY_FLAGS, obs_shape

ROOT = Path(__file__).resolve().parent.parent
LOSS_KEYS = [
    "losses/world_model",
    "losses/image",
    "losses/reward",
    "losses/continue",
    "losses/kl",
    "losses/actor",
    "losses/critic",
    "losses/entropy",
]
CHART_KEYS = [
    "charts/episodic_return",
    "charts/episodic_length",
    "charts/SPS",
    "charts/updates_per_second",
    "charts/updates",
    "charts/train_seconds",
]


def tiny_args(**overrides) -> da.Args:
    """A whole short run: prefill, world-model warm-up, joint training; the default (async) vector env."""
    schedule = dict(
        total_timesteps=400,
        learning_starts=100,
        warmup_steps=100,
        train_ratio=2.0,
        log_interval=100,
        max_episode_steps=60,
        buffer_capacity=500,
        vector_mode="auto",
    )
    return dreamer_tiny.tiny_args(**{**schedule, **overrides})


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    torch.set_num_threads(1)
    return tmp_path


def read_scalars(run_dir) -> dict[str, list]:
    events = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    events.Reload()
    return {tag: events.Scalars(tag) for tag in events.Tags()["scalars"]}


def load_checkpoint(path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)


def test_end_to_end_run_logs_every_key(in_tmp):
    """Default async vector env with 2 envs, wandb offline, stage probes on, one update per vector step."""
    result = da.main(
        tiny_args(total_timesteps=300, train_ratio=8.0, track=True, memory_probes=True, save_model=True)
    )
    assert result["global_step"] == 300 and result["updates"] > 0 and result["behavior_updates"] > 0
    scalars = read_scalars(in_tmp / result["run_dir"])
    expected = [
        *CHART_KEYS,
        *LOSS_KEYS,
        *mu.CPU_KEYS,
        *mu.BUFFER_KEYS.values(),
        "debug/nonfinite_updates",
        "debug/probe/loop_start_mb",
        "debug/probe/after_decoder_mb",
        "debug/probe/after_optimizer_step_mb",
    ]
    missing = [key for key in expected if key not in scalars]
    assert not missing, f"missing TensorBoard keys: {missing}"
    assert [e.step for e in scalars[mu.KEY_USS_MB]] == [100, 200, 300]
    assert all(e.value > 0 for e in scalars[mu.KEY_RSS_MB])
    assert all(e.value == 0 for e in scalars["debug/nonfinite_updates"])
    assert all(e.value <= 500 + 2 * 16 for e in scalars[mu.BUFFER_KEYS["total_steps"]])
    assert {e.value for e in scalars["charts/episodic_length"]} == {60.0}
    assert list((in_tmp / "wandb").glob("offline-run-*")), "wandb did not write an offline run"
    checkpoint = load_checkpoint(in_tmp / result["run_dir"] / "checkpoint.pt")
    assert checkpoint["counters"]["global_step"] == 300


def test_resume_continues_the_same_run(in_tmp):
    first = da.main(tiny_args(total_timesteps=300, save_model=True, vector_mode="sync"))
    path = in_tmp / first["run_dir"] / "checkpoint.pt"
    saved = load_checkpoint(path)
    wm_steps = [float(s["step"]) for s in saved["optimizers"]["world_model"]["state"].values()]
    assert set(wm_steps) == {float(first["updates"])}
    # on disk: the index in the checkpoint, rows in files; at most a chunk per env more than the steps
    replay = dreamer_tiny.replay_of(path.parent, tiny_args())
    assert 0 < replay.total_steps == saved["replay"]["total_steps"] <= 500 + 2 * 16

    second = da.main(tiny_args(total_timesteps=500, save_model=True, vector_mode="sync", resume=str(path)))
    assert (
        Path(second["run_dir"]).resolve() == Path(first["run_dir"]).resolve()
    )  # written beside its checkpoint
    assert second["updates"] > first["updates"]
    resumed = load_checkpoint(path)
    assert resumed["counters"]["global_step"] == 500
    # Adam's step counts continue from the first run's, so its moments were restored, not started again
    wm_steps = [float(s["step"]) for s in resumed["optimizers"]["world_model"]["state"].values()]
    assert set(wm_steps) == {float(second["updates"])}
    scalars = read_scalars(in_tmp / first["run_dir"])
    assert [e.step for e in scalars[mu.KEY_RSS_MB]] == [100, 200, 300, 400, 500]


def test_the_replay_kept_on_disk_comes_back_as_the_checkpoint_held_it(in_tmp):
    first = da.main(tiny_args(total_timesteps=200, vector_mode="sync", replay_chunk_steps=32))
    saved = load_checkpoint(in_tmp / first["run_dir"] / "checkpoint.pt")["replay"]
    assert (
        saved["total_steps"] == 200 + 2 * 2
    )  # 100 vector steps, plus the first obs of the 2 + 2 episodes begun
    replay = dreamer_tiny.replay_of(in_tmp / first["run_dir"], tiny_args())
    assert replay.total_steps == 204 and [ep.done for ep in replay.episodes] == [True, True, False, False]
    assert all(
        replay.current[ep.env] is ep for ep in replay.episodes if not ep.done
    )  # in progress, as they were
    assert replay.sample(2, 8)["obs"].shape == (2, 8, *obs_shape(tiny_args()))


@pytest.mark.parametrize("to", ["process", "group"])
def test_sigterm_writes_a_checkpoint_and_the_run_resumes(in_tmp, to):
    """SIGTERM to the main process, and to its whole process group as `scancel`, `docker stop` and `timeout` send
    it (the async env workers get it too): a checkpoint, exit 143, no traceback, and the run resumes."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline"}
    cmd = [
        sys.executable,
        str(ROOT / "dreamer_atari.py"),
        *TINY_FLAGS,
        "--total-timesteps",
        "100000",
        "--learning-starts",
        "100",
        "--warmup-steps",
        "100",
        "--train-ratio",
        "2",
        "--log-interval",
        "100",
        "--max-episode-steps",
        "60",
        "--buffer-capacity",
        "500",
    ]
    proc = subprocess.Popen(
        cmd,
        cwd=in_tmp,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own process group: the main process and its two env workers
    )
    try:
        for line in proc.stdout:  # the first progress line: training is under way
            if line.startswith("step 200/"):
                break
        if to == "group":
            os.killpg(proc.pid, signal.SIGTERM)
        else:
            proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 128 + signal.SIGTERM, output
    assert "checkpoint (SIGTERM)" in output and "Traceback" not in output, output
    (run_dir,) = (in_tmp / "runs").iterdir()
    saved = load_checkpoint(run_dir / "checkpoint.pt")
    stopped_at = saved["counters"]["global_step"]
    assert 200 <= stopped_at < 100_000
    result = da.main(
        tiny_args(total_timesteps=stopped_at + 100, resume=str(run_dir / "checkpoint.pt"), vector_mode="sync")
    )
    assert result["global_step"] == stopped_at + 100
    assert result["updates"] > saved["counters"]["updates"]


CRASHING_RUN = """
import sys
sys.path[:0] = [{tests!r}, {root!r}]
import dreamer_atari as da
import test_dreamer_run as t

calls = []
real = da.{target}

def crash(*args, **kwargs):
    calls.append(1)
    if len(calls) > {after}:
        raise RuntimeError("a bug in the code")
    return real(*args, **kwargs)

da.{target} = crash
da.main(t.tiny_args(total_timesteps=400, vector_mode="async"))
"""


@pytest.mark.parametrize(
    "target, after, checkpointed",
    [("train_world_model", 3, True), ("preflight", 0, False)],
    ids=["in the loop", "at start-up"],
)
def test_an_unexpected_error_is_one_paragraph_keeps_what_was_trained_and_the_process_ends(
    in_tmp, target, after, checkpointed
):
    """A bug or a crashed env is not an incident we can explain: a run that has trained writes a checkpoint first,
    the traceback goes to the run's crash.log, one paragraph on stderr says what raised and where, the exit status
    is 8, and the process ends (async env workers ignore SIGTERM, so a worker left open would block the
    interpreter's exit forever). The checkpoint resumes."""
    script = CRASHING_RUN.format(tests=str(ROOT / "tests"), root=str(ROOT), target=target, after=after)
    proc = subprocess.run(
        [sys.executable, "-c", script],
        cwd=in_tmp,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline"},
    )
    assert proc.returncode == da.EXIT_CRASHED, proc.stderr[-2000:]
    (paragraph,) = [line for line in proc.stderr.splitlines() if "a bug in the code" in line]
    assert "RuntimeError: a bug in the code, raised in crash" in paragraph, paragraph
    assert "Traceback" not in proc.stderr and "Traceback" not in proc.stdout
    (run_dir,) = (in_tmp / "runs").iterdir()
    log = (run_dir / "crash.log").read_text()
    assert log.startswith("Traceback") and log.rstrip().endswith("RuntimeError: a bug in the code")
    assert f"the traceback is in runs/{run_dir.name}/crash.log" in paragraph
    assert (run_dir / "checkpoint.pt").exists() == checkpointed
    if checkpointed:
        assert "checkpoint (crashed with RuntimeError)" in proc.stdout
        saved = load_checkpoint(run_dir / "checkpoint.pt")
        assert saved["counters"]["updates"] == after
        assert f"--resume runs/{run_dir.name}/checkpoint.pt goes on from step" in paragraph
        step = saved["counters"]["global_step"]
        resumed = da.main(
            tiny_args(total_timesteps=step + 20, resume=str(run_dir / "checkpoint.pt"), vector_mode="sync")
        )
        assert resumed["global_step"] == step + 20 and resumed["updates"] > after
    else:
        assert "crashed during start-up, nothing trained" in paragraph


BAD_ARGS = {
    "capacity below sequence": dict(buffer_capacity=4, sequence_length=8),
    "batch below one": dict(batch_size=0),
    "unknown env": dict(env_id="ALE/NoSuchGame-v5"),
    "fp16 without CUDA": dict(precision="fp16", cuda=False),
    "an unknown precision": dict(precision="float16"),
    "missing resume file": dict(resume="nowhere.pt"),
    "bad gamma": dict(gamma=1.5),
    "image too small for the encoder": dict(image_size=32),
    "no frames in a stack": dict(frame_stack=0),
    "a side the dreamerv3 encoder cannot halve to the end": dict(image_size=60),
    "four convolutions for the nature model": dict(model="nature", encoder_channels=(4, 8, 8, 8)),
    "an unknown observe backward": dict(observe_backward="numerical"),
}


@pytest.mark.parametrize("overrides", BAD_ARGS.values(), ids=BAD_ARGS.keys())
def test_bad_arguments_exit_2_with_one_line(in_tmp, capsys, overrides):
    with pytest.raises(SystemExit) as exit_info:
        da.main(tiny_args(**overrides))
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and len(err.splitlines()) == 1, err
    assert not (in_tmp / "runs").exists(), "a run directory was created for bad input"


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
def test_corrupt_checkpoint_is_one_clear_error(in_tmp, capsys):
    (in_tmp / "broken.pt").write_bytes(b"\x80\x04this is not a checkpoint")
    with pytest.raises(SystemExit) as exit_info:
        da.main(tiny_args(resume="broken.pt"))
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "broken.pt" in err and "not a readable checkpoint" in err and len(err.splitlines()) == 1


def test_command_line_bad_argument_exits_2(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, str(ROOT / "dreamer_atari.py"), "--batch-size", "0"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert result.stderr.strip() == "error: --batch-size must be at least 1, got 0."
    assert not (tmp_path / "runs").exists()


def test_out_of_memory_frees_the_step_writes_a_report_and_a_checkpoint(in_tmp, monkeypatch, capsys):
    """The OOM path up to the CUDA calls (here the update raises torch.OutOfMemoryError itself)."""
    import weakref

    alive = {}

    def failing_update(agent, batch, args):
        activations = torch.ones(1024, 1024)  # stands for the failed step's tensors
        alive["ref"] = weakref.ref(activations)
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB")

    seen_at_report = {}
    real_report = mu.write_oom_report

    def report(run_dir, exc, last_report, **kwargs):
        seen_at_report["activations_alive"] = alive["ref"]() is not None
        return real_report(run_dir, exc, last_report, **kwargs)

    monkeypatch.setattr(da, "train_world_model", failing_update)
    monkeypatch.setattr(mu, "write_oom_report", report)
    with pytest.raises(SystemExit) as exit_info:
        da.main(tiny_args(vector_mode="sync"))
    assert exit_info.value.code == da.EXIT_OOM
    assert seen_at_report == {"activations_alive": False}, (
        "the failed step's tensors were alive during the report"
    )
    (run_dir,) = (in_tmp / "runs").iterdir()
    assert (run_dir / "oom" / "report.json").exists()
    step = load_checkpoint(run_dir / "checkpoint.pt")["counters"]["global_step"]
    assert step > 100  # the first update comes after learning starts
    err = capsys.readouterr().err
    assert f"out of memory at step {step}" in err and "--sequence-length" in err  # this script's own flags
    assert da.OOM_ADVICE in err and "--amp" not in err  # not the DQN's


def test_a_run_of_non_finite_updates_stops_with_the_last_finite_weights(in_tmp, monkeypatch, capsys):
    real_loss = da.world_model_loss

    def nan_loss(agent, data, args):
        loss, parts, states = real_loss(agent, data, args)
        return loss * float("nan"), parts, states

    monkeypatch.setattr(da, "world_model_loss", nan_loss)
    args = tiny_args(vector_mode="sync", max_nonfinite=3, train_ratio=8.0)
    with pytest.raises(SystemExit) as exit_info:
        da.main(args)
    assert exit_info.value.code == da.EXIT_NONFINITE
    (run_dir,) = (in_tmp / "runs").iterdir()
    saved = load_checkpoint(run_dir / "checkpoint.pt")
    assert saved["counters"]["global_step"] == 200  # the first log point after updates start
    assert saved["counters"]["nonfinite_updates"] == saved["counters"]["updates"] > 3
    torch.manual_seed(args.seed)  # the world model main built: every one of its steps was skipped
    initial = da.build_agent(args, obs_shape(args), 6, "cpu").world_model.state_dict()
    for name, value in saved["models"]["world_model"].items():
        assert torch.equal(value, initial[name]), f"{name} moved although every step was skipped"
    err = capsys.readouterr().err  # the gradient of the NaN loss is what was not finite: the source is named
    assert (
        f"{saved['counters']['updates']} updates in a row had a non-finite value (the world model's gradient)"
        in err
    )
    assert "--precision float32" not in err, "the run was float32 already"


def test_abort_on_leak_stops_with_a_checkpoint(in_tmp, monkeypatch, capsys):
    leaking = mu.LeakVerdict(True, "host_references", "memory leak suspected: test", {}, abort=True)
    monkeypatch.setattr(mu.LeakDetector, "check", lambda self: leaking)
    with pytest.raises(SystemExit) as exit_info:
        da.main(tiny_args(vector_mode="sync", abort_on_leak=True))
    assert exit_info.value.code == da.EXIT_LEAK
    (run_dir,) = (in_tmp / "runs").iterdir()
    assert load_checkpoint(run_dir / "checkpoint.pt")["counters"]["global_step"] == 100
    assert "memory leak suspected: test" in capsys.readouterr().out


def refused(capsys, args: da.Args) -> str:
    """The one line a run of `args` is refused with (exit 2), output before it dropped."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        da.main(args)
    assert exit_info.value.code == 2
    return capsys.readouterr().err.strip()


def test_resume_with_other_model_sizes_is_refused_before_anything_starts(in_tmp, capsys):
    first = da.main(tiny_args(total_timesteps=110, save_model=True, vector_mode="sync"))
    path = in_tmp / first["run_dir"] / "checkpoint.pt"
    assert (
        refused(capsys, tiny_args(total_timesteps=200, hidden_dim=32, resume=str(path)))
        == "error: --resume checkpoint was trained with --hidden-dim 16, but this run asks for 32."
    )


def test_resume_with_the_other_model_is_refused(in_tmp, capsys):
    first = da.main(tiny_args(total_timesteps=110, save_model=True, vector_mode="sync"))
    path = in_tmp / first["run_dir"] / "checkpoint.pt"
    assert (
        refused(capsys, tiny_args(model="nature", total_timesteps=200, resume=str(path)))
        == "error: --resume checkpoint was trained with --model dreamerv3, but this run asks for nature."
    )


def test_nature_model_at_64_pixels_trains_on_pong_and_resuming_at_84_is_refused(in_tmp, capsys):
    """The nature model on DreamerV3's 64x64 Atari frames: the emulator's frames are resized, the decoder draws
    64x64 (one row of output padding), the replay stores 64x64 frames, and the checkpoint remembers the size."""
    first = da.main(
        tiny_args(model="nature", total_timesteps=120, learning_starts=60, image_size=64, save_model=True)
    )
    assert first["updates"] > 0
    path = in_tmp / first["run_dir"] / "checkpoint.pt"
    saved = load_checkpoint(path)
    assert saved["models"]["world_model"]["decoder.net.4.weight"].shape[-1] == 8
    assert saved["models"]["world_model"]["encoder.net.7.weight"].shape[-1] == 8 * 4 * 4  # c3 x 4 x 4
    assert (
        refused(capsys, tiny_args(model="nature", total_timesteps=200, resume=str(path)))
        == "error: --resume checkpoint was trained with --image-size 64, but this run asks for 84."
    )


def test_one_frame_stacks_train_resume_with_their_replay_and_resuming_with_four_is_refused(in_tmp, capsys):
    """--frame-stack 1 with the nature model (the default model's own): the env gives one frame an observation, the
    encoder reads one channel and the decoder draws one, the replay stores each frame once and gives it back from a
    checkpoint as one-frame stacks, and the checkpoint remembers the stack."""
    first = da.main(
        tiny_args(
            model="nature",
            frame_stack=1,
            total_timesteps=120,
            learning_starts=60,
            save_model=True,
        )
    )
    assert first["updates"] > 0
    path = in_tmp / first["run_dir"] / "checkpoint.pt"
    saved = load_checkpoint(path)
    assert saved["models"]["world_model"]["encoder.net.0.weight"].shape[1] == 1
    assert saved["models"]["world_model"]["decoder.net.4.weight"].shape[1] == 1
    replay = dreamer_tiny.replay_of(path.parent, tiny_args(model="nature", frame_stack=1))
    assert all(len(ep.frames) == len(ep.action) for ep in replay.episodes)  # no older frames before the first
    batch = replay.sample(2, 8)
    assert batch["obs"].shape == (2, 8, 1, 84, 84)
    stored = []
    for ep in replay.episodes:
        frames = np.empty((len(ep.frames), 84, 84), np.uint8)
        ep.frames.read_into(frames, ep.frames.start, ep.frames.end)
        stored.append(frames)
    stored = np.concatenate(stored)
    for frame in batch["obs"][:, :, 0].reshape(-1, 84, 84):  # every sampled frame is a stored one
        assert (stored == frame).all((1, 2)).any()
    second = da.main(
        tiny_args(model="nature", frame_stack=1, total_timesteps=200, save_model=True, resume=str(path))
    )
    assert second["updates"] > first["updates"]
    assert (
        refused(capsys, tiny_args(model="nature", total_timesteps=300, resume=str(path)))
        == "error: --resume checkpoint was trained with --frame-stack 1, but this run asks for 4."
    )


def _oom(*args, **kwargs):
    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB")


def test_out_of_memory_while_acting_writes_a_report_and_a_checkpoint(in_tmp, monkeypatch, capsys):
    real_act, calls = da.Player.act, {"n": 0}

    def act(self, obs, is_first):
        calls["n"] += 1
        if calls["n"] > 60:  # after learning starts: there is something to save
            _oom()
        return real_act(self, obs, is_first)

    monkeypatch.setattr(da.Player, "act", act)
    with pytest.raises(SystemExit) as exit_info:
        da.main(tiny_args(vector_mode="sync"))
    assert exit_info.value.code == da.EXIT_OOM
    (run_dir,) = (in_tmp / "runs").iterdir()
    assert (run_dir / "oom" / "report.json").exists()
    assert load_checkpoint(run_dir / "checkpoint.pt")["counters"]["updates"] > 0
    err = capsys.readouterr().err
    assert "out of memory at step" in err and "(in learn, line" in err and "Traceback" not in err


def test_out_of_memory_at_start_up_writes_a_report_and_stops_before_training(in_tmp, monkeypatch, capsys):
    """The first optimizer step (the preflight) runs out of memory: a report, no checkpoint, exit 3."""
    monkeypatch.setattr(torch.optim.Adam, "step", _oom)
    with pytest.raises(SystemExit) as exit_info:
        da.main(tiny_args(vector_mode="sync"))
    assert exit_info.value.code == da.EXIT_OOM
    (run_dir,) = (in_tmp / "runs").iterdir()
    assert (run_dir / "oom" / "report.json").exists() and not (run_dir / "checkpoint.pt").exists()
    err = capsys.readouterr().err
    assert "out of memory at start-up (in preflight" in err and "--batch-size 2 x --sequence-length 8" in err


def test_memory_is_read_on_one_heap_with_tensorboards_queue_written(in_tmp, monkeypatch):
    from conftest import assert_memory_order, record_memory_order

    events = record_memory_order(monkeypatch)
    da.main(tiny_args(total_timesteps=200, vector_mode="sync"))
    assert_memory_order(events)


def truncate(path) -> None:
    data = Path(path).read_bytes()
    Path(path).write_bytes(data[: len(data) - 1000])


@pytest.mark.parametrize("damage", ["flipped", "truncated", "another run's"])
def test_a_checkpoint_changed_since_it_was_written_is_refused_and_left_as_it_is(in_tmp, capsys, damage):
    first = da.main(tiny_args(total_timesteps=110, save_model=True, vector_mode="sync"))
    path = in_tmp / first["run_dir"] / "checkpoint.pt"
    assert (in_tmp / first["run_dir"] / "checkpoint.pt.sha256").exists()
    if damage == "flipped":
        flip_200_bytes_inside_a_tensor(path)
        load_checkpoint(path)  # torch loads it without a word: the checksum is what catches it
    elif damage == "truncated":
        truncate(path)
    else:
        other = da.main(tiny_args(total_timesteps=110, save_model=True, vector_mode="sync", seed=2))
        (in_tmp / other["run_dir"] / "checkpoint.pt").replace(path)
    damaged = path.read_bytes()
    message = refused(capsys, tiny_args(total_timesteps=200, resume=str(path)))
    assert message.startswith("error: --resume: ") and "does not match its checksum" in message, message
    assert len(message.splitlines()) == 1 and "Traceback" not in message
    assert path.read_bytes() == damaged, "the refused checkpoint was changed"


@pytest.mark.parametrize("damage", ["flipped", "truncated"])
def test_a_damaged_checkpoint_copied_without_its_checksum_is_refused_naming_the_damage(
    in_tmp, capsys, damage
):
    """Without its .sha256, a checkpoint is still checked against its archive's own CRC-32s before it is loaded: 200
    bytes flipped inside a tensor, which torch loads without a word, are refused in one sentence naming the record
    and the file (a cut-off archive, naming the file); the file is left as it is."""
    first = da.main(tiny_args(total_timesteps=110, save_model=True, vector_mode="sync"))
    path = in_tmp / "copied" / "checkpoint.pt"
    path.parent.mkdir()
    path.write_bytes((in_tmp / first["run_dir"] / "checkpoint.pt").read_bytes())  # without its .sha256
    if damage == "flipped":
        record = flip_200_bytes_inside_a_tensor(path)
        load_checkpoint(path)
        said = f"{path} is damaged: its record {record} does not match the CRC-32 stored with it"
    else:
        truncate(path)
        said = f"{path} begins as a zip archive (torch.save's format) but cannot be read as one"
    damaged = path.read_bytes()
    message = refused(capsys, tiny_args(total_timesteps=200, resume=str(path)))
    assert message.startswith(f"error: --resume: {said}") and message.endswith("it is left as it is."), (
        message
    )
    assert len(message.splitlines()) == 1 and "Traceback" not in message
    assert path.read_bytes() == damaged and sorted(p.name for p in path.parent.iterdir()) == ["checkpoint.pt"]


def test_a_checkpoint_neither_check_can_verify_resumes_and_says_so(in_tmp, capsys):
    """A checkpoint copied without its .sha256 is verified by its archive's own CRC-32s; one that is no zip archive
    either (torch's legacy format, nothing to check) still resumes, after one line saying it could not be verified."""
    first = da.main(tiny_args(total_timesteps=110, save_model=True, vector_mode="sync"))
    path = in_tmp / first["run_dir"] / "checkpoint.pt"
    (in_tmp / first["run_dir"] / "checkpoint.pt.sha256").unlink()
    assert mu.verify_checkpoint(path) is None, "its own CRC-32s verify it"
    torch.save(load_checkpoint(path), path, _use_new_zipfile_serialization=False)
    capsys.readouterr()
    result = da.main(tiny_args(total_timesteps=200, save_model=True, vector_mode="sync", resume=str(path)))
    assert result["global_step"] == 200
    out = capsys.readouterr().out
    assert out.count("could not be verified") == 1, out
    assert mu.verify_checkpoint(path) is None, "the resumed run's checkpoint has a checksum again"


SAME_CLOCK = """
import os, runpy, sys, time
time.time = lambda: 1_800_000_000.0  # both processes see the same second
sys.argv = {argv!r}
sys.path.insert(0, os.path.dirname(sys.argv[0]))
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_two_runs_started_in_the_same_second_with_the_same_seed_get_a_folder_each(in_tmp):
    """A shell loop over learning rates starts runs in the same second with the same seed: each claims its own
    folder (the second name gets a suffix, said in one line), and neither writes into the other's."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline"}
    runs = []
    for lr in ("1e-4", "3e-4"):
        argv = [
            str(ROOT / "dreamer_atari.py"),
            *TINY_FLAGS,
            "--total-timesteps",
            "150",
            "--learning-starts",
            "100",
        ]
        argv += ["--train-ratio", "2", "--max-episode-steps", "60", "--vector-mode", "sync", "--save-model"]
        argv += ["--world-model-lr", lr]
        code = SAME_CLOCK.format(argv=argv)
        runs.append(
            subprocess.Popen(
                [sys.executable, "-c", code],
                cwd=in_tmp,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    outputs = [proc.communicate(timeout=300)[0] for proc in runs]
    assert [proc.returncode for proc in runs] == [0, 0], outputs
    folders = sorted((in_tmp / "runs").iterdir())
    base = folders[0].name
    assert [f.name for f in folders] == [base, base + "-2"], folders
    assert base.endswith("__1800000000")
    said = [line for out in outputs for line in out.splitlines() if "is taken" in line]
    assert len(said) == 1 and said[0].endswith(f"runs/{base}-2"), outputs
    lrs = set()
    for folder in folders:
        assert len(list(folder.glob("events.out.tfevents.*"))) == 1, "TensorBoard files of two runs mixed"
        state = load_checkpoint(folder / "checkpoint.pt")
        assert state["run_name"] == folder.name
        lrs.add(state["args"]["world_model_lr"])
    assert lrs == {1e-4, 3e-4}, "one run's checkpoint overwrote the other's"


def test_colour_frames_train_log_ball_f1_and_resume_only_in_colour(in_tmp, capsys):
    """Colour (the default): frames stored as (3, S, S) uint8, the model reads stack x 3 channels, the open-loop GIF in
    colour with its error column grey, ball F1 on the frames in grey; a grey run (--no-rgb) cannot resume a colour
    checkpoint."""
    first = da.main(
        tiny_args(rgb=True, total_timesteps=300, save_model=True, vector_mode="sync", video_every=200)
    )
    run_dir = in_tmp / first["run_dir"]
    assert first["updates"] > 0
    scalars = read_scalars(run_dir)
    assert "world_model/ball_f1_observed" in scalars and "losses/image" in scalars
    state = load_checkpoint(run_dir / "checkpoint.pt")
    assert state["models"]["world_model"]["encoder.net.0.weight"].shape[1] == 3  # (out, 3 channels, k, k)
    gif, side = Image.open(run_dir / "open_loop" / "step_200.gif"), tiny_args().image_size
    frame = np.asarray(gif.convert("RGB")).astype(int)  # (4 S, 3 S, 3): truth | model | error per sequence
    truth, error = frame[:side, :side], frame[:side, 2 * side :]
    assert (truth[..., 0] - truth[..., 2] > 50).mean() > 0.5  # Pong's brown field, as the model reads it
    assert np.abs(error - error[..., :1]).mean() < 1  # grey, but for the GIF's palette of 256 colours a frame
    resumed = da.main(
        tiny_args(rgb=True, total_timesteps=400, vector_mode="sync", resume=str(run_dir / "checkpoint.pt"))
    )
    assert resumed["global_step"] == 400
    assert (
        refused(capsys, tiny_args(rgb=False, total_timesteps=500, resume=str(run_dir / "checkpoint.pt")))
        == "error: --resume checkpoint was trained with --rgb True, but this run asks for False."
    )
