"""Scheduled settings in dreamer_atari.py: what a researcher schedules reaches the update, also a captured one.

A CUDA graph replays the Python values its update read when it was captured. So every number a researcher might
schedule (learning rates, KL scales and free nats, entropy, discount, return normalisation, gradient clips) is a
0-d tensor the update reads (`Settings`), and the capture refuses to replay once a value it read as a
Python number has changed. There is no GPU here: `EagerGraph` below stands in for `CudaGraphed`'s CUDA calls
(warm-up, capture, replay run the function eagerly) and keeps its settings check, which is what is tested.
"""

import ast
import inspect
import textwrap

import numpy as np
import pytest
import torch

import dreamer_atari as da
import dreamer_tiny
from dreamer_tiny import obs_shape

NUM_ACTIONS = 6


class EagerGraph(da.CudaGraphed):
    """`CudaGraphed` with its CUDA calls replaced by eager calls of the same function."""

    def run_eagerly(self, inputs):
        return self.fn(inputs)

    def capture(self, inputs):
        return self.fn(inputs)

    def replay(self, inputs):
        return self.fn(inputs)


def make_agent(**overrides):
    args = dreamer_tiny.tiny_args(
        **{"batch_size": 3, "sequence_length": 6, "imagination_horizon": 4, **overrides}
    )
    torch.manual_seed(0)
    return args, dreamer_tiny.fast_agent(args, obs_shape(args), NUM_ACTIONS, "cpu")  # the settings as tensors


def batch(args, seed=0) -> dict[str, torch.Tensor]:
    rng = np.random.default_rng(seed)
    data = da.synthetic_batch(args, obs_shape(args))
    data["obs"] = rng.integers(0, 255, data["obs"].shape, dtype=np.uint8)
    data["action"] = rng.integers(0, NUM_ACTIONS, data["action"].shape).astype(np.uint8)
    data["reward"][:, 3] = 1.0
    return da.batch_tensors(data, "cpu")


def graphed_steps(agent, args):
    settings = da.capture_settings(agent)
    return (
        EagerGraph(lambda raw: da.train_world_model(agent, raw, args), settings=settings),
        EagerGraph(lambda start: da.train_behavior(agent, start, args), settings=settings),
    )


def test_every_scheduled_number_is_a_tensor_the_update_reads():
    args, agent = make_agent()
    for name in da.Settings.NAMES:
        tensor = agent.settings[name]
        assert isinstance(tensor, torch.Tensor) and tensor.dim() == 0, name
        assert tensor.item() == pytest.approx(getattr(args, name)), name
    for name in ("world_model_lr", "actor_lr", "critic_lr"):
        optimizer = agent.named_optimizers()[name.removesuffix("_lr")]
        assert agent.settings[name] is optimizer.param_groups[0]["lr"], name
    assert agent.settings["1 - return_norm_decay"].item() == pytest.approx(1 - args.return_norm_decay)
    assert agent.settings["1 - return_lambda"].item() == pytest.approx(1 - args.return_lambda)


UPDATE_FUNCTIONS = (
    da.world_model_loss,
    da.train_world_model,
    da.clip_and_step,
    da.imagine,
    da.imagined_heads,
    da.behavior_losses,
    da.imagined_targets,
    da.train_behavior,
)


@pytest.mark.parametrize("fn", UPDATE_FUNCTIONS, ids=lambda fn: fn.__name__)
def test_the_update_reads_no_scheduled_number_from_args(fn):
    """`args.kl_dyn_scale` inside the update would be baked into a captured graph; `settings[...]` is not."""
    scheduled = set(da.Settings.NAMES)
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    reads = {
        node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "args"
    }
    assert not reads & scheduled, f"{fn.__name__} reads {sorted(reads & scheduled)} from args"


def test_a_schedule_moved_through_the_tensors_reaches_a_captured_update():
    """After capture, `settings.set` changes the update's outputs: the KL weights, the learning rate, the entropy."""
    args, agent = make_agent(free_nats=0.0)
    world_model_step, behavior_step = graphed_steps(agent, args)
    raw = batch(args)
    for _ in range(4):  # 3 warm-up calls, then the capture
        metrics, _, start = world_model_step(raw)
        behavior_step(start)
    assert world_model_step.captured_settings is not None and behavior_step.captured_settings is not None

    kl_before = world_model_step(raw)[0]["losses/kl"].item()
    agent.settings.set("kl_dyn_scale", 0.0)
    agent.settings.set("kl_rep_scale", 0.0)
    metrics, _, start = world_model_step(raw)
    assert kl_before > 0 and metrics["losses/kl"].item() == 0.0

    agent.settings.set("world_model_lr", 0.0)
    weights = [p.detach().clone() for p in agent.world_model.parameters()]
    world_model_step(raw)
    assert all(torch.equal(w, p) for w, p in zip(weights, agent.world_model.parameters())), (
        "lr 0 moved weights"
    )
    agent.settings.set("world_model_lr", 1e-3)
    world_model_step(raw)
    assert not all(torch.equal(w, p) for w, p in zip(weights, agent.world_model.parameters()))

    torch.manual_seed(1)
    low = behavior_step(start)[0]["losses/actor"].item()
    agent.settings.set("entropy_coef", 10.0)
    torch.manual_seed(1)
    high = behavior_step(start)[0]["losses/actor"].item()
    assert high < low - 1.0  # the entropy bonus is subtracted: a larger weight, a lower loss


@pytest.mark.parametrize(
    "change, named",
    [
        (
            lambda agent, args: agent.world_model_optimizer.param_groups[0].update(lr=1e-3),
            "world_model optimizer",
        ),
        (
            lambda agent, args: agent.critic_optimizer.param_groups[0].update(eps=1e-3),
            "critic optimizer's 'eps'",
        ),
        (
            lambda agent, args: agent.settings.tensors.update(free_nats=torch.tensor(0.0)),
            "settings['free_nats']",
        ),
    ],
    ids=["lr replaced by a float", "eps", "tensor replaced"],
)
def test_a_setting_changed_behind_the_captures_back_is_refused(change, named):
    args, agent = make_agent()
    world_model_step, behavior_step = graphed_steps(agent, args)
    raw = batch(args)
    for _ in range(4):
        _, _, start = world_model_step(raw)
        behavior_step(start)
    change(agent, args)
    with pytest.raises(da.CaptureInvalid) as refused:
        world_model_step(raw)
    message = str(refused.value)
    assert named in message and "settings.set" in message and "--no-cudagraph" in message, message
    assert len(message.splitlines()) == 1


def test_settings_may_change_freely_before_capture():
    """During warm-up nothing is captured yet: a change then is taken at capture."""
    args, agent = make_agent()
    world_model_step, _ = graphed_steps(agent, args)
    raw = batch(args)
    world_model_step(raw)
    agent.world_model_optimizer.param_groups[0]["eps"] = 1e-6
    for _ in range(4):
        world_model_step(raw)
    assert world_model_step.captured_settings["the world_model optimizer's 'eps'"] == 1e-6


@pytest.mark.parametrize("name", ["kl_dyn_scale", "entropy_coef", "actor_lr"])
def test_a_setting_assigned_on_args_in_the_loop_is_refused_at_once_on_the_cpu(name):
    """`args.kl_dyn_scale = x` in the loop would do nothing (the update reads `settings`; a captured graph replays
    what it was captured with): Args is frozen, so the line fails at once, on every device, saying what to use."""
    args, agent = make_agent()
    world_model_step, _ = graphed_steps(agent, args)
    world_model_step(batch(args))  # the run has started
    with pytest.raises(da.mu.SettingFixed) as refused:
        setattr(args, name, 0.3)
    message = str(refused.value)
    assert message.startswith(f"args.{name} cannot change") and len(message.splitlines()) == 1, message
    assert f"agent.settings.set({name!r}, value)" in message, message
    agent.settings.set(name, 0.3)  # the way it says works
    assert agent.settings[name].item() == pytest.approx(0.3) and getattr(args, name) != 0.3


def test_a_setting_that_is_not_scheduled_is_refused_with_its_flag():
    args, _ = make_agent()
    with pytest.raises(da.mu.SettingFixed, match="start the run with --batch-size"):
        args.batch_size = 4
    with pytest.raises(da.mu.SettingFixed):
        del args.batch_size


def test_an_unknown_setting_is_refused_by_name():
    _, agent = make_agent()
    with pytest.raises(KeyError, match="unimix"):
        agent.settings.set("unimix", 0.1)


def test_a_learning_rate_set_before_a_checkpoint_comes_back_into_the_optimizers_own_tensor(tmp_path):
    args, agent = make_agent()
    agent.settings.set("actor_lr", 1e-3)
    path = da.save_checkpoint(str(tmp_path / "checkpoint.pt"), agent, {"global_step": 1}, "run", args)
    _, fresh = make_agent()
    held = fresh.settings["actor_lr"]
    state = da.load_checkpoint(path)
    replay = da.EpisodeReplay(100, 1, seed=0)
    da.restore_checkpoint(state, fresh, replay, np.random.default_rng(0), args.frame_stack)
    assert fresh.actor_optimizer.param_groups[0]["lr"] is held, (
        "the optimizer no longer reads the settings tensor"
    )
    assert held.item() == pytest.approx(1e-3)


def test_part_1s_settings_reach_the_update_without_the_speed_part():
    """With the speed options off (an agent as `build_agent` makes it) the settings are already the tensors the
    update reads, and `set` reaches it: the KL weights and a learning rate."""
    args = dreamer_tiny.tiny_args(batch_size=3, sequence_length=6, imagination_horizon=4)
    torch.manual_seed(0)
    agent = da.build_agent(args, obs_shape(args), NUM_ACTIONS, "cpu")
    assert isinstance(agent.settings["kl_dyn_scale"], torch.Tensor)
    data = da.prepare_batch(batch(args), NUM_ACTIONS)
    torch.manual_seed(1)
    kl = da.world_model_loss(agent, data, args)[1]["losses/kl"]
    agent.settings.set("kl_dyn_scale", 0.0)
    agent.settings.set("kl_rep_scale", 0.0)
    torch.manual_seed(1)
    assert kl > 0 and da.world_model_loss(agent, data, args)[1]["losses/kl"] == 0
    agent.settings.set("world_model_lr", 0.0)
    before = [p.detach().clone() for p in agent.world_model.parameters()]
    da.train_world_model(agent, batch(args), args)
    assert all(torch.equal(a, p) for a, p in zip(before, agent.world_model.parameters()))
