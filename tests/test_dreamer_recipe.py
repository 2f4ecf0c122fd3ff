"""DreamerV3 2023's Atari100k recipe as the default: the settings, and each piece held to a small float64 reference
written here from DreamerV3's formulas (its configs.yaml `atari100k` + `small`, nets.py, agent.py and its replay).

- colour 64 x 64 frames, 1 env, batches of 16 x 64, one update per env step;
- a learned initial state: deter = tanh(w), stoch = the prior's mode from it, wherever an episode starts and at the
  first step of every replayed sequence (DreamerV3's replay marks it as a start), with no previous action there;
- every LayerNorm with epsilon 1e-3;
- imagination weights w_t = prod_{k <= t} (gamma c_k) / gamma, with c_0 = 1 - is_terminal(start).
"""

import numpy as np
import pytest
import torch
from torch import nn

import dreamer_atari as da
import dreamer_tiny
from dreamer_tiny import dreamerv3_initial_state, obs_shape

NUM_ACTIONS = 6


def tiny_args(**overrides) -> da.Args:
    """free_nats 0: a tiny model's KL is below the default 1 nat, whose clamp would leave the prior no gradient."""
    return dreamer_tiny.tiny_args(**{"free_nats": 0.0, **overrides})


def float64_agent(args) -> da.Agent:
    return dreamer_tiny.float64_agent(args, NUM_ACTIONS, head_noise=0.3)


def test_the_plain_command_runs_dreamerv3s_atari100k_schedule_on_colour_frames():
    args = da.Args(buffer_capacity=50_000)  # python dreamer_atari.py --buffer-capacity 50000
    da.check_args(args)
    # it stops where Atari100k stops, and its replay is capped below that, so it evicts (the incident's setting)
    assert args.total_timesteps == 100_000 and da.replay_capacity(args) == 50_000
    assert da.replay_capacity(da.Args()) == 100_000  # uncapped: every step of the run
    assert args.rgb and args.initial_state == "learned"
    assert (args.num_envs, args.batch_size, args.sequence_length) == (1, 16, 64)
    assert (
        args.num_envs * args.train_ratio / (args.batch_size * args.sequence_length) == 1.0
    )  # updates per env step
    assert da.env_spaces(args) == ((1, 3, 64, 64), 6)  # one RGB frame, Pong's 6 actions
    # grey is one flag away; the nature model and grey envs stay grey
    assert da.env_spaces(da.Args(rgb=False)) == ((1, 64, 64), 6)
    assert not da.Args(model="nature").rgb and not da.Args(env_id=da.CATCH_ID).rgb


def test_a_colour_step_takes_one_rgb_frame_and_seven_bytes_in_the_replay():
    """12,288 bytes of frame (64 x 64 x 3) and 7 of action, reward and flags per stored step: what the replay's size
    line and docs say."""
    args = da.Args(max_episode_steps=40, vector_mode="sync")
    envs = da.make_vector_env(args, "test", seed=0)
    replay = da.EpisodeReplay(capacity=10_000, num_envs=1, seed=0)
    try:
        obs, _ = envs.reset(seed=0)
        replay.start_episode(0, obs[0])
        for _ in range(120):
            obs, rewards, terminations, truncations, infos = envs.step(
                np.array([envs.action_space.sample()[0]])
            )
            replay.add(obs, np.zeros(1, np.int64), rewards, terminations, truncations, infos)
    finally:
        envs.close()
    finished = [ep for ep in replay.episodes if ep.done]
    assert finished
    steps = sum(ep.num_steps for ep in finished)
    assert sum(ep.frames.nbytes for ep in finished) == steps * 64 * 64 * 3
    assert (
        sum(getattr(ep, name).nbytes for ep in finished for name in da.Episode.FIELDS[1:])
        <= steps * da.REPLAY_AUX_BYTES_PER_STEP + 4096
    )  # chunk slack
    assert da.REPLAY_AUX_BYTES_PER_STEP == 7


@pytest.mark.parametrize("model", ["dreamerv3", "nature"])
def test_every_layer_norm_takes_dreamerv3s_epsilon(model):
    agent = da.build_agent(tiny_args(model=model), obs_shape(tiny_args(model=model)), NUM_ACTIONS, "cpu")
    norms = [
        layer
        for module in agent.modules().values()
        for layer in module.modules()
        if isinstance(layer, nn.LayerNorm)
    ]
    assert len(norms) >= 8 and {norm.eps for norm in norms} == {1e-3}


def dreamerv3_observe(rssm, embed, action, is_first, noise):
    """DreamerV3's observe, step by step: where an episode starts (and before the first step) the previous state is
    the initial one and the previous action zero; then h_t = GRU(h, [z, a]), the posterior from [h_t, e_t] and its
    sample. Returns deter (B, T, D), stoch (B, T, S) and the posterior (B, T, S, C)."""
    B, T = embed.shape[:2]
    initial_deter, initial_stoch = dreamerv3_initial_state(rssm)
    deter, stoch = initial_deter.expand(B, -1), initial_stoch.expand(B, -1)
    deters, stochs, posteriors = [], [], []
    for t in range(T):
        first = is_first[:, t].unsqueeze(-1)
        previous_action = torch.where(first, torch.zeros_like(action[:, t]), action[:, t])
        deter = torch.where(first, initial_deter, deter)
        stoch = torch.where(first, initial_stoch, stoch)
        deter = rssm.img_step(deter, stoch, previous_action)
        posterior = rssm.posterior(deter, embed[:, t])
        stoch = rssm.sample(posterior, noise[t])
        deters.append(deter), stochs.append(stoch), posteriors.append(posterior)
    return torch.stack(deters, 1), torch.stack(stochs, 1), torch.stack(posteriors, 1)


@pytest.mark.parametrize("backward", ["hand-written", "autograd"])
def test_observe_starts_from_the_learned_initial_state_as_dreamerv3s_formulas_do(backward):
    """In float64, with an episode start inside one sequence and a sequence that starts mid-episode: the states and
    the gradient of every RSSM parameter, the initial vector w's included, equal the reference's."""
    args = tiny_args(observe_backward=backward)
    rssm = float64_agent(args).world_model.rssm
    B, T = 3, 6
    torch.manual_seed(1)
    embed = torch.randn(B, T, rssm.posterior_net[0].in_features - rssm.deter_dim, dtype=torch.float64)
    action = da.one_hot(torch.randint(0, NUM_ACTIONS, (B, T)), NUM_ACTIONS).double()
    is_first = torch.zeros(B, T, dtype=torch.bool)
    is_first[0, 0] = is_first[1, 0] = is_first[1, 3] = True  # sequence 2 starts mid-episode
    noise = rssm.noise((T, B), "cpu")
    weights = [torch.randn(B, T, rssm.deter_dim, dtype=torch.float64) for _ in range(2)]

    def run(observe) -> tuple:
        rssm.zero_grad(set_to_none=True)
        deter, stoch, posterior = observe(embed, action, is_first, noise)[:3]
        loss = (deter * weights[0]).sum() + stoch.sum() + (posterior.exp() * weights[1][..., :1, None]).sum()
        loss.backward()
        grads = {name: p.grad.clone() for name, p in rssm.named_parameters() if p.grad is not None}
        return (deter.detach(), stoch.detach(), posterior.detach()), grads

    states, grads = run(rssm.observe)
    expected_states, expected_grads = run(lambda *inputs: dreamerv3_observe(rssm, *inputs))
    for got, expected in zip(states, expected_states):
        torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)
    assert grads.keys() == expected_grads.keys() and "initial_deter" in grads
    assert grads["initial_deter"].abs().max() > 1e-3  # the initial state learns from every start
    for name in grads:
        torch.testing.assert_close(grads[name], expected_grads[name], rtol=1e-9, atol=1e-12, msg=name)
    # the initial state's stoch is the prior's mode: no gradient reaches the prior from it
    assert "prior_net.0.weight" not in grads


def test_zeros_as_the_initial_state_is_one_flag_away():
    rssm = float64_agent(tiny_args(initial_state="zeros")).world_model.rssm
    assert rssm.initial_deter is None
    deter, stoch = rssm.initial(3)
    assert not deter.any() and not stoch.any()


def test_each_sampled_sequence_starts_from_the_initial_state():
    """DreamerV3's replay marks the first step of each sampled sequence as a start: the state there is the initial
    one, not the state of steps the sequence does not hold."""
    replay = da.EpisodeReplay(capacity=1_000, num_envs=1, seed=0, chunk_size=16)
    frame = lambda t: np.full((4, 4), t % 256, np.uint8)  # each frame carries its step
    replay.start_episode(0, np.stack([frame(0)] * 4))
    for t in range(
        1, 200
    ):  # one long episode: every window starts inside it or wraps round the ring to its start
        replay.add_step(0, frame(t), 1, 0.0, False, False)
    batch = replay.sample(64, 16)
    steps = batch["obs"][:, :, -1, 0, 0].astype(int)  # (B, T): the step of each newest frame
    assert batch["is_first"][:, 0].all()
    np.testing.assert_array_equal(batch["is_first"][:, 1:], steps[:, 1:] == 0)  # elsewhere only at the start


@pytest.mark.parametrize("continue_mode", [True, False])
def test_imagination_weights_are_dreamerv3s(continue_mode):
    """weight_t = cumprod(gamma * cont)_t / gamma over the imagined states s_0..s_{H-1}: cont_0 = 1 -
    is_terminal(start), so a rollout from a terminal start weighs nothing, and each later state's own continue
    flag (the continue head's mode, or its probability) counts."""
    args = tiny_args(continue_mode=continue_mode, gamma=0.9)
    agent = float64_agent(args)
    H, N = 5, 4
    torch.manual_seed(2)
    feat = torch.randn(
        H + 1, N, args.deterministic_dim + agent.world_model.rssm.stoch_flat, dtype=torch.float64
    )
    start_continue = torch.tensor([1.0, 0.0, 1.0, 1.0], dtype=torch.float64)  # the second start is terminal
    with torch.no_grad():
        heads = {"critic": agent.critic(feat), "slow critic": agent.slow_critic(feat[:-1])}
        heads |= {
            "reward": agent.world_model.reward_head(feat),
            "continue": agent.world_model.continue_head(feat),
        }
        _, weight, _, _ = da.imagined_targets(agent, heads, start_continue, args, False)
        probs = torch.sigmoid(agent.world_model.continue_head(feat).squeeze(-1))  # (H+1, N)
    cont = (probs > 0.5).double() if continue_mode else probs
    cont[0] = start_continue
    expected = torch.stack([torch.prod(0.9 * cont[: t + 1], 0) / 0.9 for t in range(H)])  # (H, N)
    torch.testing.assert_close(weight, expected, rtol=1e-12, atol=0.0)
    assert not weight[:, 1].any() and (weight[0, [0, 2, 3]] == 1).all()
    if continue_mode:
        assert not torch.equal(cont[1:], torch.ones_like(cont[1:])), (
            "the head should end some imagined states"
        )


def test_the_image_loss_scale_weighs_the_image_loss_alone():
    """--image-loss-scale x: the world-model loss moves by (x - 1) times the image loss; 0 is --no-decoder-loss."""
    losses = {}
    for scale in (1.0, 3.0, 0.0):
        args = tiny_args(image_loss_scale=scale)
        agent = float64_agent(args)
        batch = da.synthetic_batch(args, obs_shape(args))
        batch["obs"] = np.random.default_rng(0).integers(0, 255, batch["obs"].shape, dtype=np.uint8)
        data = da.prepare_batch(da.batch_tensors(batch, "cpu"), NUM_ACTIONS)
        data = {key: value.double() if value.is_floating_point() else value for key, value in data.items()}
        torch.manual_seed(3)
        loss, parts, _ = da.world_model_loss(agent, data, args)
        losses[scale] = (loss.item(), parts["losses/image"].item())
    (one, image), (three, _), (zero, _) = losses[1.0], losses[3.0], losses[0.0]
    assert three - one == pytest.approx(2 * image, rel=1e-9)
    assert one - zero == pytest.approx(image, rel=1e-9)


def test_one_update_per_env_step_when_the_ratio_equals_the_batch(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    """train_ratio / (B x T) updates per env step: DreamerV3's 1024 at 16 x 64 is one; here at the tiny batch."""
    args = tiny_args(
        num_envs=1, total_timesteps=60, learning_starts=20, train_ratio=16.0, max_episode_steps=30
    )  # 2 x 8 = 16
    counters = da.main(args)
    assert counters["updates"] == counters["global_step"] - args.learning_starts + 1
