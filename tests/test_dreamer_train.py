"""Learning pieces of dreamer_atari.py: lambda-returns, the world model learning Pong, non-finite updates."""

import dataclasses

import numpy as np
import pytest
import torch

import dreamer_atari as da
import dreamer_tiny
from dreamer_tiny import fast_agent, obs_shape


def tiny_args(**overrides) -> da.Args:
    """Batches of 4 from one env: enough sequences for the loss to fall in a few dozen updates."""
    return dreamer_tiny.tiny_args(**{"batch_size": 4, "num_envs": 1, **overrides})


def world_model_update(agent, batch, args) -> tuple[dict[str, float], bool, tuple]:
    """One update from a numpy batch; its logged values as floats (the training loop reads them once per interval)."""
    metrics, healthy, start = da.train_world_model(agent, da.batch_tensors(batch, "cpu"), args)
    return {key: value.item() for key, value in metrics.items()}, bool(healthy), start


def adam_state(optimizer) -> list[torch.Tensor]:
    return [value.clone() for state in optimizer.state.values() for value in state.values()]


def reference_lambda_return(reward, value, discount, lam, t):
    """By definition: (1 - lam) sum_n lam^(n-1) G_t^(n); the last n-step return takes what weight is left."""
    H = len(value) - 1

    def n_step(n):
        ret, running = 0.0, 1.0
        for k in range(1, n + 1):
            ret += running * reward[t + k]
            running *= discount[t + k]
        return ret + running * value[t + n]

    last = H - t
    total = sum((1 - lam) * lam ** (n - 1) * n_step(n) for n in range(1, last))
    return total + lam ** (last - 1) * n_step(last)


@pytest.mark.parametrize("lam", [0.0, 0.95, 1.0])
def test_lambda_returns_match_the_definition(lam):
    gen = torch.Generator().manual_seed(0)
    H, N = 6, 3
    reward = torch.randn(H + 1, N, generator=gen, dtype=torch.float64)
    value = torch.randn(H + 1, N, generator=gen, dtype=torch.float64)
    discount = 0.997 * (torch.rand(H + 1, N, generator=gen, dtype=torch.float64) > 0.2).double()
    returns = da.lambda_returns(reward, value, discount, lam)
    assert returns.shape == (H, N)
    for n in range(N):
        for t in range(H):
            expected = reference_lambda_return(
                reward[:, n].tolist(), value[:, n].tolist(), discount[:, n].tolist(), lam, t
            )
            assert returns[t, n].item() == pytest.approx(expected, rel=1e-10, abs=1e-10)


def test_world_model_loss_falls_on_real_pong_frames():
    args = tiny_args(world_model_lr=1e-3)
    torch.manual_seed(0)
    envs = da.make_vector_env(args, "test", seed=0)
    replay = da.EpisodeReplay(capacity=1_000, num_envs=1, seed=0)
    rng = np.random.default_rng(0)
    try:
        obs, _ = envs.reset(seed=0)
        replay.start_episode(0, obs[0])
        for _ in range(300):
            actions = rng.integers(6, size=1)
            obs, rewards, terminations, truncations, infos = envs.step(actions)
            replay.add(obs, actions, rewards, terminations, truncations, infos)
    finally:
        envs.close()
    agent = da.build_agent(args, obs_shape(args), 6, "cpu")
    losses = [world_model_update(agent, replay.sample(4, 8), args)[0] for _ in range(40)]
    first = np.mean([m["losses/world_model"] for m in losses[:5]])
    last = np.mean([m["losses/world_model"] for m in losses[-5:]])
    assert last < 0.8 * first, f"world-model loss went from {first:.1f} to {last:.1f}"
    assert np.mean([m["losses/image"] for m in losses[-5:]]) < np.mean(
        [m["losses/image"] for m in losses[:5]]
    )


@pytest.mark.parametrize("classes", [4, 0])
def test_latent_kinds_train(classes):
    """Categorical (DreamerV3) and Gaussian (DreamerV1, --stochastic-classes 0) latents both update."""
    args = tiny_args(stochastic_classes=classes)
    torch.manual_seed(0)
    agent = da.build_agent(args, obs_shape(args), 6, "cpu")
    batch = da.synthetic_batch(args, obs_shape(args))
    before = [p.detach().clone() for p in agent.world_model.parameters()]
    _, healthy, states = world_model_update(agent, batch, args)
    _, behavior_healthy = da.train_behavior(agent, states, args)
    assert healthy and bool(behavior_healthy)
    assert any(not torch.equal(b, p) for b, p in zip(before, agent.world_model.parameters()))


def test_non_finite_loss_skips_the_update_on_the_device_and_changes_nothing():
    """A NaN reward makes the world-model loss NaN: the step is skipped without a host sync, and weights, Adam's
    moments and its step count stay exactly as they were; the behaviour update that follows on the skipped update's
    states changes nothing either (actor, critic, slow critic, return normaliser)."""
    args = tiny_args()
    torch.manual_seed(0)
    agent = da.build_agent(args, obs_shape(args), 6, "cpu")
    batch = da.synthetic_batch(args, obs_shape(args))
    batch["obs"] = np.random.default_rng(0).integers(0, 255, batch["obs"].shape, dtype=np.uint8)
    _, healthy, states = world_model_update(agent, batch, args)  # one good update: Adam has state now
    da.train_behavior(agent, states, args)
    modules = (agent.world_model, agent.actor, agent.critic, agent.slow_critic, agent.return_norm)
    before = [t.detach().clone() for m in modules for t in m.state_dict().values()]
    moments = [adam_state(o) for o in agent.optimizers]
    batch["reward"][0, 3] = np.nan
    metrics, healthy, states = world_model_update(agent, batch, args)
    assert not healthy and np.isnan(metrics["losses/reward"])
    states = {
        **states,
        "deter": states["deter"] * float("nan"),
        "stoch": states["stoch"] * float("nan"),
    }  # diverged
    _, behavior_healthy = da.train_behavior(agent, states, args)
    assert not behavior_healthy
    after = [t.detach() for m in modules for t in m.state_dict().values()]
    assert all(torch.equal(b, a) for b, a in zip(before, after)), "a non-finite update was applied"
    for old, optimizer in zip(moments, agent.optimizers):
        assert all(torch.equal(o, n) for o, n in zip(old, adam_state(optimizer))), "Adam's state moved"
    assert all(float(s["step"]) == 1 for s in agent.world_model_optimizer.state.values())


def test_categorical_latents_follow_their_probabilities_with_straight_through_gradients():
    torch.manual_seed(0)
    rssm = da.WorldModel(tiny_args(), obs_shape(tiny_args()), 6).rssm
    logits = torch.randn(1, 3, rssm.classes, requires_grad=True)
    stats = torch.log_softmax(logits, -1)  # (1, latents, classes) log-probabilities, as the RSSM keeps them
    draws = rssm.sample(stats.expand(20_000, -1, -1)).view(
        20_000, 3, rssm.classes
    )  # one-hot (+ straight-through)
    frequencies = draws.detach().mean(0)
    assert torch.allclose(frequencies, stats.exp()[0].detach(), atol=0.015)
    assert torch.allclose(draws.detach().sum(-1), torch.ones(20_000, 3))  # exactly one class per latent
    draws[:, 0, 0].sum().backward()
    assert logits.grad is not None and logits.grad.abs().sum() > 0  # gradients pass straight through


def random_batch(args) -> dict:
    """A synthetic batch with random frames and one rewarded step, so that every loss has something to learn."""
    batch = da.synthetic_batch(args, obs_shape(args))
    batch["obs"] = np.random.default_rng(0).integers(0, 255, batch["obs"].shape, dtype=np.uint8)
    batch["reward"][:, 3] = 1.0
    return batch


def two_updates(agent, batch, args) -> torch.Tensor:
    """Every logged value of two whole updates on the same batch, (2, K), from torch seed 1."""
    torch.manual_seed(1)
    updates = []
    for _ in range(2):
        world, _, start = da.train_world_model(agent, da.batch_tensors(batch, "cpu"), args)
        behavior, _ = da.train_behavior(agent, start, args)
        updates.append(torch.stack([*world.values(), *behavior.values()]))
    return torch.stack(updates)


def test_compile_gives_the_eager_values_on_the_same_batches(monkeypatch):
    """--compile against eager, two updates on the same batches from the same weights: every logged value agrees
    within 1e-3 relative (inductor may sum in another order). Inductor keeps torch's random numbers here
    (fallback_random), so that both draw the same latents and actions."""
    import torch._dynamo
    import torch._inductor.config

    monkeypatch.setattr(torch._inductor.config, "fallback_random", True)
    args = tiny_args()
    batch = random_batch(args)
    values = {}
    try:
        for compiled in (False, True):
            torch.manual_seed(0)
            agent = da.build_agent(args, obs_shape(args), 6, "cpu")
            da.speed_up_agent(
                agent, dataclasses.replace(args, compile=compiled)
            )  # the fast paths, compiled or not
            if compiled:
                assert set(agent.world_model.state_dict()) == set(
                    da.WorldModel(args, obs_shape(args), 6).state_dict()
                )
            values[compiled] = two_updates(agent, batch, args)
    finally:
        torch._dynamo.reset()
    torch.testing.assert_close(values[True], values[False], rtol=1e-3, atol=1e-5)


class WorldModelWithANewHead(da.WorldModel):
    """A researcher's new head, added where the world model's heads are made, meant to start predicting 0."""

    def __init__(self, args, obs_shape, num_actions):
        super().__init__(args, obs_shape, num_actions)
        feat_dim = args.deterministic_dim + self.rssm.stoch_flat
        self.new_head = da.mlp(feat_dim, 7, args.hidden_dim, zero_output=True)


@pytest.mark.parametrize("model", ["dreamerv3", "nature"])
def test_a_head_made_to_start_at_zero_predicts_zero_in_the_built_agent(monkeypatch, model):
    """An output layer made with zero_output=True stays zero through the agent's initialisation (DreamerV3's
    re-draws every other layer), as the reward head's and the critic's do."""
    monkeypatch.setattr(da, "WorldModel", WorldModelWithANewHead)
    args = tiny_args(model=model)
    agent = da.build_agent(args, obs_shape(args), 6, "cpu")
    feat = torch.randn(5, args.deterministic_dim + agent.world_model.rssm.stoch_flat)
    for head in (agent.world_model.new_head, agent.world_model.reward_head, agent.critic.net):
        assert torch.equal(head(feat), torch.zeros(5, head[-1].out_features))
    assert agent.world_model.continue_head(feat).abs().max() > 0, "a head not made to start at zero did"


@pytest.mark.parametrize("size", [da.MIN_IMAGE_SIZE, 64, 84, 96, 101])
def test_encoder_and_decoder_follow_the_image_size(size):
    """The decoder undoes the encoder's three convolutions whatever the side: strides that drop rows get them
    back as output padding."""
    encoder = da.NatureCNNEncoder(4, (4, 8, 8), 16, size)
    decoder = da.AtariConvDecoder(16, 4, 4, 4, size)
    image = torch.zeros(3, 4, size, size)
    assert encoder(image).shape == (3, 16)
    assert decoder(torch.zeros(3, 16)).shape == (3, 4, size, size)


def test_channels_last_images_give_the_same_update_without_layout_copies(monkeypatch):
    """The float images laid out channels-last (as the channels-last encoder and decoder use them) change no
    logged value of two updates from the same weights on the same batches, and the image loss then compares two
    tensors of one layout: no copy of the whole batch into another layout. With the 4 stacked frames of the nature
    model: a single-channel image has the same strides in both layouts."""
    args = tiny_args(model="nature")
    batch = random_batch(args)
    real = da.prepare_batch
    values = {}
    for layout in (False, True):  # the model is channels-last both times; only the images' layout differs
        monkeypatch.setattr(
            da,
            "prepare_batch",
            lambda raw, actions, channels_last=False, layout=layout: real(raw, actions, layout),
        )
        torch.manual_seed(0)
        values[layout] = two_updates(fast_agent(args, obs_shape(args), 6, "cpu"), batch, args)
    monkeypatch.undo()
    torch.testing.assert_close(values[True], values[False], rtol=1e-4, atol=1e-5)

    data = da.prepare_batch(da.batch_tensors(batch, "cpu"), 6, channels_last=True)
    image = data["image"].flatten(0, 1)
    assert image.is_contiguous(memory_format=torch.channels_last)
    agent = fast_agent(args, obs_shape(args), 6, "cpu")
    feat = torch.zeros(image.shape[0], args.deterministic_dim + agent.world_model.rssm.stoch_flat)
    reconstruction = agent.world_model.decoder(feat)
    assert reconstruction.stride() == image.stride()  # the loss reads both in one order: no layout copy


def test_one_critic_pass_gives_the_losses_and_gradients_of_separate_value_and_loss_passes():
    """The critic runs once over the imagined rollout: its detached output gives the values the targets bootstrap
    from, and the same logits its loss trains. Losses and every actor and critic gradient equal those of the
    definition written out with a no-grad value pass and a separate loss pass (the slow critic on all H+1 states)."""
    args = tiny_args()
    torch.manual_seed(0)
    agent = da.build_agent(args, obs_shape(args), 6, "cpu")
    _, _, start = da.train_world_model(agent, da.batch_tensors(random_batch(args), "cpu"), args)
    states = (start["deter"], start["stoch"], start["continue"])
    with torch.no_grad():  # a slow critic apart from the critic, so that both of its loss terms matter
        for p in agent.slow_critic.parameters():
            p.add_(0.05 * torch.randn_like(p))
    calls = []
    agent.critic.register_forward_hook(lambda module, inputs, output: calls.append(inputs[0].shape))

    def losses_and_grads(fn):
        torch.manual_seed(3)
        actor_loss, critic_loss = fn()
        agent.actor.zero_grad(), agent.critic.zero_grad()
        (actor_loss + critic_loss).backward()
        grads = [p.grad.clone() for p in [*agent.actor.parameters(), *agent.critic.parameters()]]
        return torch.stack([actor_loss.detach(), critic_loss.detach()]), grads

    def reference():
        wm, bins = agent.world_model, agent.critic.bins
        feat, log_prob, entropy = da.imagine(agent, states, args.imagination_horizon)
        with torch.no_grad():
            reward = da.twohot_mean(wm.reward_head(feat), wm.bins)
            continues = torch.sigmoid(wm.continue_head(feat).squeeze(-1))
            if args.continue_mode:
                continues = (continues > 0.5).float()
            continues[0] = states[2]
            discount = args.gamma * continues
            value = da.twohot_mean(agent.critic(feat), bins)
            slow_value = da.twohot_mean(agent.slow_critic(feat), agent.slow_critic.bins)
            returns = da.lambda_returns(reward, value, discount, args.return_lambda)
            weight = torch.cumprod(discount[:-1], 0) / args.gamma  # DreamerV3's imagination weights
            advantage = (returns - value[:-1]) / agent.return_norm.scale()
        actor_loss = -(weight * (log_prob * advantage + args.entropy_coef * entropy)).mean()
        logits = agent.critic(feat[:-1])
        critic_loss = (
            weight * (da.twohot_loss(logits, returns, bins) + da.twohot_loss(logits, slow_value[:-1], bins))
        ).mean()
        return actor_loss, critic_loss

    expected, expected_grads = losses_and_grads(reference)
    calls.clear()

    def part_1():
        heads = da.imagined_heads(agent, states, args)
        return da.behavior_losses(agent, heads, states[2], args, update_norm=False)[:2]

    got, got_grads = losses_and_grads(part_1)
    assert len(calls) == 1 and calls[0][0] == args.imagination_horizon + 1  # one pass, over s_0..s_H
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    for g, e in zip(got_grads, expected_grads):
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("switched_off", ["no_decoder_loss", "no_reward_loss", "no_kl_loss"])
def test_each_loss_branch_switches_off_alone(switched_off):
    """--no-decoder-loss, --no-reward-loss, --no-kl-loss: the world-model loss is the sum of the branches left on, the
    branch switched off is still logged, and the parameters only it trains get no gradient."""
    term = {"no_decoder_loss": "losses/image", "no_reward_loss": "losses/reward", "no_kl_loss": "losses/kl"}
    only_it_trains = {
        "no_decoder_loss": "decoder",
        "no_reward_loss": "reward_head",
        "no_kl_loss": "rssm.prior_net",
    }
    args = tiny_args(free_nats=0.0, **{switched_off: True})  # free nats 0: the tiny model's KL has a gradient
    torch.manual_seed(0)
    agent = da.build_agent(args, obs_shape(args), 6, "cpu")
    with torch.no_grad():  # the reward head starts at zero, which would hide its gradient
        for p in agent.world_model.reward_head.parameters():
            p.add_(0.05 * torch.randn_like(p))
    data = da.prepare_batch(da.batch_tensors(random_batch(args), "cpu"), 6)
    loss, parts, _ = da.world_model_loss(agent, data, args)
    kept = [key for key in ("losses/image", "losses/reward", "losses/kl") if key != term[switched_off]]
    expected = parts["losses/continue"] + sum(parts[key] for key in kept)
    torch.testing.assert_close(loss, expected)
    assert torch.isfinite(parts[term[switched_off]]) and parts[term[switched_off]] != 0
    loss.backward()
    for name, p in agent.world_model.named_parameters():
        if name.startswith(only_it_trains[switched_off]):
            assert p.grad is None or not p.grad.any(), name
    full_args = tiny_args(free_nats=0.0)  # with every branch on, those parameters do learn
    agent.world_model.zero_grad(set_to_none=True)
    da.world_model_loss(agent, data, full_args)[0].backward()
    grads = [
        p.grad
        for name, p in agent.world_model.named_parameters()
        if name.startswith(only_it_trains[switched_off])
    ]
    assert grads and all(g is not None and g.any() for g in grads)
