"""Learning pieces of dreamer_atari.py: lambda-returns, the world model learning Pong, non-finite updates."""

import numpy as np
import pytest
import torch

import dreamer_atari as da
import dreamer_tiny


def tiny_args(**overrides) -> da.Args:
    """Batches of 4 from one env: enough sequences for the loss to fall in a few dozen updates."""
    return dreamer_tiny.tiny_args(**{"batch_size": 4, "num_envs": 1, **overrides})



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
    discount = 0.997 * (torch.rand(H + 1, N, generator=gen, dtype=torch.float64) > 0.2)
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
    agent = da.build_agent(args, (4, 84, 84), 6, "cpu")
    losses = [da.train_world_model(agent, replay.sample(4, 8), args)[0] for _ in range(40)]
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
    agent = da.build_agent(args, (4, 84, 84), 6, "cpu")
    batch = da.synthetic_batch(args, (4, 84, 84))
    before = [p.detach().clone() for p in agent.world_model.parameters()]
    metrics, states = da.train_world_model(agent, batch, args)
    behavior = da.train_behavior(agent, states, args)
    assert metrics["debug/update_skipped"] == 0.0 and behavior["debug/update_skipped"] == 0.0
    assert any(not torch.equal(b, p) for b, p in zip(before, agent.world_model.parameters()))


def test_non_finite_loss_skips_the_update():
    args = tiny_args()
    torch.manual_seed(0)
    agent = da.build_agent(args, (4, 84, 84), 6, "cpu")
    batch = da.synthetic_batch(args, (4, 84, 84))
    batch["reward"][0, 3] = np.nan
    before = [p.detach().clone() for p in agent.world_model.parameters()]
    metrics, _ = da.train_world_model(agent, batch, args)
    assert metrics["debug/update_skipped"] == 1.0
    assert all(torch.equal(b, p) for b, p in zip(before, agent.world_model.parameters())), (
        "a NaN update was applied"
    )
    assert not agent.world_model_optimizer.state or all(
        float(s["step"]) == 0 for s in agent.world_model_optimizer.state.values()
    )


def test_categorical_latents_follow_their_probabilities_with_straight_through_gradients():
    torch.manual_seed(0)
    rssm = da.WorldModel(tiny_args(), (4, 84, 84), 6).rssm
    logits = torch.randn(1, 3, rssm.classes, requires_grad=True)
    stats = torch.log_softmax(logits, -1)  # (1, latents, classes) log-probabilities, as the RSSM keeps them
    draws = rssm.sample(stats.expand(20_000, -1, -1)).view(20_000, 3, rssm.classes)  # one-hot (+ straight-through)
    frequencies = draws.detach().mean(0)
    assert torch.allclose(frequencies, stats.exp()[0].detach(), atol=0.015)
    assert torch.allclose(draws.detach().sum(-1), torch.ones(20_000, 3))  # exactly one class per latent
    draws[:, 0, 0].sum().backward()
    assert logits.grad is not None and logits.grad.abs().sum() > 0  # gradients pass straight through
