"""--precision bf16: Part 1 runs under the autocast the fast paths run under, with the observe scan in float32, and
each fast path is held to Part 1 under it within the tolerances stated beside each test (bf16 keeps 8 bits of
mantissa: two orders of the same sums differ by about 1e-2 relative in a bf16 result).

The tests use the CPU's bf16 autocast (the same operation lists as CUDA's for these layers)."""

import pytest
import torch
from test_dreamer_fast_path import NUM_ACTIONS, observe_backward, random_batch

import dreamer_atari as da
import dreamer_kernels as dk
import dreamer_tiny
from dreamer_tiny import obs_shape


def agents(**overrides) -> tuple[da.Args, da.Agent, da.Agent]:
    """Two agents from the same seed: Part 1's functions (`build_agent`) and the run's (`speed_up_agent` after it)."""
    args = dreamer_tiny.tiny_args(
        **{"batch_size": 3, "sequence_length": 6, "imagination_horizon": 4, "free_nats": 0.0, **overrides}
    )
    pair = []
    for fast in (False, True):
        torch.manual_seed(0)
        agent = da.build_agent(args, obs_shape(args), NUM_ACTIONS, "cpu")
        if fast:
            da.speed_up_agent(agent, args)
        pair.append(agent)
    return args, *pair


def world_model_results(agent: da.Agent, args: da.Args) -> tuple[dict, dict]:
    """The world-model losses and gradients of one batch under the agent's autocast, from fixed random numbers."""
    data = da.prepare_batch(da.batch_tensors(random_batch(args), "cpu"), NUM_ACTIONS, args.channels_last)
    torch.manual_seed(1)
    with agent.amp.autocast():
        loss, parts, _ = da.world_model_loss(agent, data, args)
    loss.backward()
    grads = {name: p.grad for name, p in agent.world_model.named_parameters() if p.grad is not None}
    return {key: value.detach() for key, value in parts.items()}, grads


def test_bf16_autocasts_the_networks_and_keeps_the_observe_scan_weights_state_and_losses_float32():
    args, part_1, _ = agents(precision="bf16")
    seen = {}
    wm = part_1.world_model
    wm.encoder.register_forward_hook(lambda m, i, out: seen.setdefault("encoder", out.dtype) and None)
    wm.decoder.register_forward_hook(lambda m, i, out: seen.setdefault("decoder", out.dtype) and None)
    parts, _ = world_model_results(part_1, args)
    data = da.prepare_batch(da.batch_tensors(random_batch(args), "cpu"), NUM_ACTIONS)
    with part_1.amp.autocast():
        _, _, (deter, stoch) = da.world_model_loss(part_1, data, args)
    assert seen == {"encoder": torch.bfloat16, "decoder": torch.bfloat16}
    assert deter.dtype == stoch.dtype == torch.float32  # the observe scan ran in float32
    assert parts["losses/world_model"].dtype == torch.float32
    assert all(p.dtype == torch.float32 for p in wm.parameters())
    da.train_world_model(part_1, da.batch_tensors(random_batch(args), "cpu"), args)
    state = part_1.world_model_optimizer.state
    assert all(v.dtype == torch.float32 for s in state.values() for k, v in s.items() if k != "step")


def test_under_bf16_the_fast_observe_trains_what_part_1_trains():
    """The observe scan runs in float32 under bf16 too, so the fast observe and its hand-written backward apply, and
    equal Part 1's loop to float32 rounding: losses within 1e-5 relative, every gradient within 1e-4 of its largest
    element (the same bf16 encoder and decoder feed and read both; channels-last off in both), and a gradient that is
    a bf16 result within two bf16 rounding steps more (see beside the assertion)."""
    args, part_1, fast = agents(precision="bf16", fast_imagine="off", channels_last="off")
    assert isinstance(fast.observe, dk.FastObserve) and not isinstance(part_1.observe, dk.FastObserve)
    data = da.prepare_batch(da.batch_tensors(random_batch(args), "cpu"), NUM_ACTIONS)
    with fast.amp.autocast():
        deter = da.world_model_loss(fast, data, args)[2][0]
    assert (
        observe_backward(deter) == "hand-written"
    )  # the observe scan outside autocast: its own backward runs
    (expected, expected_grads), (ours, our_grads) = (
        world_model_results(part_1, args),
        world_model_results(fast, args),
    )
    for key, value in expected.items():
        torch.testing.assert_close(ours[key], value, rtol=1e-5, atol=1e-6, msg=key)
    assert expected_grads.keys() == our_grads.keys()
    # one bf16 rounding step: at most 2^-7 of the value rounded (bf16 keeps 8 bits of mantissa)
    bf16_step = torch.finfo(torch.bfloat16).eps
    for name, grad in expected_grads.items():
        scale = grad.abs().max().clamp(min=1e-12)
        # The scan's own weights get float32 results: within 1e-4 of the scale. The layers autocast runs in bf16
        # (encoder, decoder, heads) get bf16 results (Part 1's gradient holds bf16 numbers only), which the two
        # backwards' float32 differences reach through bf16 roundings: where the scan's gradient enters the encoder
        # (an element there can land one step apart, and the encoder's backward carries it on), and in the product
        # that yields the weight's gradient (one step of an element, at most one of the scale). Which differences
        # cross a rounding boundary depends on the CPU's kernels (encoder.net.0.weight: 4.0e-3 of the scale with
        # bf16 arithmetic, one step of its largest element; 1.0e-3 without), so two steps of the scale more there.
        bf16_result = torch.equal(grad, grad.bfloat16().float())
        tolerance = (1e-4 + (2 * bf16_step if bf16_result else 0.0)) * scale
        assert (our_grads[name] - grad).abs().max() <= tolerance, name


def test_under_bf16_channels_last_convolutions_train_what_part_1_trains_to_bf16_rounding():
    """Channels-last convolutions add up the same products in another order, which bf16 shows: the losses within
    1e-4 relative, the whole world-model gradient within 2e-2 in relative L2 norm (a LayerNorm's bias gradient, a sum
    of thousands of bf16 terms that nearly cancel, can move by half its size on its own)."""
    args, part_1, fast = agents(precision="bf16", fast_imagine="off")
    (expected, expected_grads), (ours, our_grads) = (
        world_model_results(part_1, args),
        world_model_results(fast, args),
    )
    for key, value in expected.items():
        torch.testing.assert_close(ours[key], value, rtol=1e-4, atol=1e-5, msg=key)
    flat = [
        torch.cat([grads[name].flatten() for name in expected_grads]) for grads in (expected_grads, our_grads)
    ]
    assert (flat[1] - flat[0]).norm() <= 2e-2 * flat[0].norm()


def skip_without_kernels() -> None:
    pytest.importorskip("triton")
    if not dk.triton_interprets() and not torch.cuda.is_available():
        pytest.skip("the fused epilogues' kernels run on CUDA or in Triton's interpreter")


@pytest.mark.parametrize("fused", [False, True])
def test_under_bf16_the_gathered_imagination_follows_part_1_to_bf16_rounding(fused):
    """Imagination's gathers of weight rows add the terms of its one-hot products in float32 and round once, where
    Part 1's products round their inputs to bf16 first: the two deters differ by bf16 rounding (about 3e-3 of the
    largest), and now and then a uniform lies within that of a CDF step and the two draw other classes, after which
    the rollouts part (2 to 6 rows in 64 over seeds 3-7). So, from the same random numbers on 64 start states: at
    least 90 % of the rollouts follow Part 1's (the same latents, deter within 1e-2 of the largest), and in them the
    actor's log-probabilities and entropies are within 2e-2. The same with the fused epilogues (their kernels in
    Triton's interpreter), which compute in float32 after each bf16 product."""
    args, part_1, fast = agents(precision="bf16")
    assert isinstance(fast.imagine, dk.FastImagine) and fast.imagine.gathers
    if fused:
        skip_without_kernels()
        fast.imagine = dk.FastImagine(gathers=True, fused=True)
    D = args.deterministic_dim
    torch.manual_seed(3)
    deter = torch.randn(64, D)
    stoch = part_1.world_model.rssm.sample(part_1.world_model.rssm.prior(deter)).detach()
    start = (deter, stoch, torch.ones(64))
    results = []
    for agent in (part_1, fast):
        torch.manual_seed(4)
        with agent.amp.autocast():
            results.append(agent.imagine(agent, start, args.imagination_horizon))
    (expected, expected_log_prob, expected_entropy), (feat, log_prob, entropy) = results
    scale = expected[..., :D].abs().amax((0, 2), keepdim=True)  # (1, N, 1)
    deter_error = ((feat[..., :D] - expected[..., :D]).abs() / scale).amax((0, 2))  # (N,)
    follows = (feat[..., D:] == expected[..., D:]).all(-1).all(0) & (deter_error < 1e-2)  # (N,)
    assert follows.float().mean() >= 0.9, f"{int(follows.sum())} of 64 rollouts follow Part 1's"
    torch.testing.assert_close(log_prob[:, follows], expected_log_prob[:, follows], rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(entropy[:, follows], expected_entropy[:, follows], rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("fused", [False, True])
def test_under_bf16_the_shared_heads_train_what_part_1_trains(fused):
    """On the same gathered rollout (both agents imagine by `FastImagine` with the gathers, from the same random
    numbers): Part 1's `imagined_heads` and the shared heads (`FastHeads`: one first-layer product for the five heads,
    its latent part a gather in float32) give the same features, the losses within 3e-2, and the actor's and critic's
    whole gradients within 3e-2 in relative L2 norm (a bf16 product over all heads in place of one per head: the
    same sums, other roundings). The same with the fused epilogues (the heads' LayerNorms and SiLUs, and their
    backward, as kernels in Triton's interpreter, in float32 as autocast's LayerNorm)."""
    args, part_1, fast = agents(precision="bf16")
    assert isinstance(fast.imagined_heads, dk.FastHeads) and part_1.imagined_heads is da.imagined_heads
    if fused:
        skip_without_kernels()
        fast.imagined_heads = dk.FastHeads(dk.FastImagine(gathers=True, fused=True))
    part_1.imagine = dk.FastImagine(gathers=True, fused=fused)
    torch.manual_seed(3)
    deter = torch.randn(5, args.deterministic_dim)
    stoch = part_1.world_model.rssm.sample(part_1.world_model.rssm.prior(deter)).detach()
    start = (deter, stoch, torch.tensor([1.0, 0.0, 1.0, 1.0, 1.0]))
    results = []
    for agent in (part_1, fast):
        for net in behaviour_nets(agent):  # heads that start at zero would hide a slip in their products
            with torch.no_grad():
                torch.manual_seed(6)
                for parameter in net.parameters():
                    parameter.add_(0.3 * torch.randn_like(parameter))
        torch.manual_seed(5)
        with agent.amp.autocast():
            heads = agent.imagined_heads(agent, start, args)
            actor_loss, critic_loss, _ = agent.behavior_losses(
                agent, heads, start[2], args, update_norm=False
            )
        (actor_loss + critic_loss).backward()
        grads = torch.cat([p.grad.flatten() for m in (agent.actor, agent.critic) for p in m.parameters()])
        results.append((actor_loss.detach(), critic_loss.detach(), grads))
    (actor_loss, critic_loss, grads), expected = results[1], results[0]
    torch.testing.assert_close(actor_loss, expected[0], rtol=3e-2, atol=3e-3)
    torch.testing.assert_close(critic_loss, expected[1], rtol=3e-2, atol=3e-3)
    assert (grads - expected[2]).norm() <= 3e-2 * expected[2].norm()


def behaviour_nets(agent: da.Agent) -> list[torch.nn.Module]:
    wm = agent.world_model
    return [agent.actor, agent.critic, agent.slow_critic, wm.reward_head, wm.continue_head]


@pytest.mark.parametrize("precision", ["float32", "bf16"])
def test_a_tiny_run_trains_in_either_precision(tmp_path, monkeypatch, precision):
    monkeypatch.chdir(tmp_path)
    counters = da.main(
        dreamer_tiny.tiny_args(
            precision=precision, num_envs=1, total_timesteps=40, learning_starts=20, train_ratio=16.0
        )
    )
    assert counters["updates"] > 0 and counters["nonfinite_updates"] == 0
