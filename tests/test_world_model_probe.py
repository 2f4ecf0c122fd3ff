"""The world-model probe's plumbing at tiny sizes: real Pong data at both frame sizes, the held-out split, a results
file with one entry per configuration, and its folder's README. (Whether a model learns the ball is the probe's own
question, answered in benchmark/results/world_model_probe/, not here.)"""

import json

import numpy as np
import pytest
import torch

from benchmark.investigations import world_model_probe as probe


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("probe")
    args = probe.Args(
        json=str(folder / "results" / "probe.json"),
        configs=("nature", "dreamerv3-grey-image-x3.75"),
        updates=2,
        batch_size=2,
        sequence_length=16,
        eval_every=2,
        eval_sequences=2,
        dataset_steps=400,
        held_out_steps=100,
        threads=1,
        cache_dir=str(folder / "cache"),
        note="a test",
    )
    torch.manual_seed(0)
    return args, probe.main(args), probe.collect(args)


def test_the_dataset_holds_the_same_steps_at_both_sizes_and_in_colour_with_the_ball_in_play(tiny):
    _, result, data = tiny
    assert data["frames64"].shape == (400, 64, 64) and data["frames84"].shape == (400, 84, 84)
    assert data["frames64rgb"].shape == (400, 3, 64, 64)
    # the same emulator steps: the frames change at the same steps at both sizes and in colour
    moved64 = (np.diff(data["frames64"].astype(np.int16), axis=0) != 0).any((1, 2))
    moved84 = (np.diff(data["frames84"].astype(np.int16), axis=0) != 0).any((1, 2))
    moved_rgb = (np.diff(data["frames64rgb"].astype(np.int16), axis=0) != 0).any((1, 2, 3))
    assert (moved64 == moved84).all() and (moved64 == moved_rgb).all()
    assert data["is_first"][0] and data["action"][0] == 0 and data["reward"][0] == 0
    assert result["dataset"]["ball_in_play_share_64"] > 0.5


def test_the_held_out_steps_are_apart_from_the_training_ones(tiny):
    args, _, data = tiny
    train_args = probe.da.Args(model="nature")
    train, held_out = probe.split_replays(data, args, train_args)
    assert (train.total_steps, held_out.total_steps) == (300, 100)
    held_out_frames = {frame.tobytes() for frame in data["frames84"][-args.held_out_steps :]}
    batch = held_out.sample(4, 16, rng=np.random.default_rng(0))
    assert all(frame.tobytes() in held_out_frames for frame in batch["obs"][:, :, -1].reshape(-1, 84, 84))
    assert held_out.episodes[0].frames.item_shape == (84, 84)


def test_the_results_file_has_one_entry_per_configuration_and_a_readme(tiny):
    args, result, _ = tiny
    saved = json.loads(probe.Path(args.json).read_text())
    assert saved == json.loads(json.dumps(result))
    config, scaled = saved["configurations"]
    assert config["name"] == "nature" and config["is_default"] is False and config["updates"] == 2
    assert scaled["name"] == "dreamerv3-grey-image-x3.75" and scaled["updates"] == 2
    assert [p["updates"] for p in config["curve"]] == [0, 2]
    for horizon in ("observed", "open_loop_5", "open_loop_10"):
        assert {f"ball_f1_{horizon}", f"ball_f1_chance_{horizon}"} <= set(config), horizon
        assert {f"ball_precision_{horizon}", f"ball_recall_{horizon}"} <= set(config["curve"][-1]), horizon
    assert config["frames_reconstructed"] == 2 * 2 * 16
    readme = (probe.Path(args.json).parent / "README.md").read_text()
    assert "| [probe.json](probe.json) |" in readme and "| nature |" in readme and "a test" in readme
    assert "| F1 |" in readme
    assert probe.Path(args.json).with_suffix(".png").stat().st_size > 0


def test_results_from_before_ball_f1_keep_their_ball_recall_in_the_readme():
    """The committed results files measured ball recall: their rows say so, with the figures they measured."""
    folder = probe.ROOT / "benchmark" / "results" / "world_model_probe"
    results = {path.name: json.loads(path.read_text()) for path in sorted(folder.glob("*.json"))}
    readme = probe.summary_markdown(results)
    old = [config for result in results.values() for config in result["configurations"]]
    assert old and all("ball_recall_observed" in config for config in old)
    assert readme.count("| recall |") == len(old)


def test_unknown_configurations_are_refused():
    with pytest.raises(SystemExit, match="unknown"):
        probe.main(probe.Args(json="unused.json", configs=("nope",)))


def test_every_configuration_is_a_valid_run_and_the_cause_finding_ones_change_only_what_they_name():
    """The probe's configurations run unchanged at a lease: each is a set of flags the script accepts; the ones that
    can name why the ball stays out of the model change colour, the representation KL or the image loss's weight."""
    defaults = probe.da.Args(env_id=probe.ENV_ID)
    for name, overrides in probe.CONFIGS.items():
        probe.da.check_args(probe.da.Args(**overrides, env_id=probe.ENV_ID))
    assert set(probe.CAUSE_CONFIGS) <= set(probe.CONFIGS)
    for name in probe.CAUSE_CONFIGS:
        train_args = probe.da.Args(**probe.CONFIGS[name], env_id=probe.ENV_ID)
        changed = {
            field
            for field in ("rgb", "kl_rep_scale", "image_loss_scale", "model", "encoder_channels")
            if getattr(train_args, field) != getattr(defaults, field)
        }
        assert changed <= {"rgb", "kl_rep_scale", "image_loss_scale"}, name
    grey = {name for name in probe.CAUSE_CONFIGS if not probe.da.Args(**probe.CONFIGS[name]).rgb}
    assert len(grey) == 3 and len(probe.CAUSE_CONFIGS) == 6
