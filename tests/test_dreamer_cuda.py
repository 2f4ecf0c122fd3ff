"""The CUDA paths of dreamer_atari.py that a CPU cannot run: acting captured in a CUDA graph, the replay's frames on
the GPU, updates captured, all in a whole tiny run that resumes. Skipped without CUDA; the GPU lease runs them
(`dev/gpu/gpu_lease.sh finish`, with pytest among the carried wheels)."""

import numpy as np
import pytest
import torch

import dreamer_atari as da
from dreamer_tiny import dreamerv3_initial_state, obs_shape, tiny_args

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_cuda_captured_acting_reads_fresh_inputs_and_moves_its_state_as_the_eager_cell_does():
    """After the warm-up steps the policy step is a graph replay: each step must still read this step's
    observations and episode starts and the state the last step left, and write the new state in place."""
    args = tiny_args()
    torch.manual_seed(0)
    agent = da.build_agent(args, obs_shape(args), 6, "cuda")
    player = da.Player(agent, num_envs=3)
    player.policy = da.CudaGraphed(player.policy_step)  # as `install_speed` wraps it
    rng = np.random.default_rng(0)
    wm = agent.world_model
    for step in range(8):  # 3 eager, the capture, then replays
        obs = rng.integers(0, 255, (3, *obs_shape(args)), dtype=np.uint8)
        is_first = np.array([step == 0, step == 5, False])
        deter, stoch, prev_action = player.deter.clone(), player.stoch.clone(), player.prev_action.clone()
        actions = player.act(obs, is_first)
        with torch.no_grad():
            first = torch.as_tensor(is_first, device="cuda").unsqueeze(-1)
            initial_deter, initial_stoch = dreamerv3_initial_state(wm.rssm)
            expected = wm.rssm.img_step(
                torch.where(first, initial_deter, deter),
                torch.where(first, initial_stoch, stoch),
                torch.where(first, 0.0, prev_action),
            )
        torch.testing.assert_close(player.deter, expected, rtol=1e-4, atol=1e-5)
        assert actions.shape == (3,) and ((actions >= 0) & (actions < 6)).all()
        np.testing.assert_array_equal(player.prev_action.argmax(-1).cpu().numpy(), actions)
        latents = player.stoch.unflatten(-1, (args.stochastic_dim, args.stochastic_classes))
        # one class per latent: straight-through, (1 + p) - p is 1 to rounding and (0 + p) - p exactly 0
        assert torch.equal((latents != 0).sum(-1), torch.ones_like(latents[..., 0], dtype=torch.int64))
        torch.testing.assert_close(latents.sum(-1), torch.ones_like(latents[..., 0]))
    assert isinstance(player.policy, da.CudaGraphed) and player.policy.graph is not None


def test_cuda_tiny_run_with_frames_on_the_gpu_and_captured_updates_trains_and_resumes(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    schedule = dict(learning_starts=100, train_ratio=8.0, max_episode_steps=60, buffer_capacity=300)
    first = da.main(tiny_args(total_timesteps=300, save_model=True, model="nature", **schedule))
    assert first["updates"] > 10  # well past the warm-up updates and the capture
    state = torch.load(f"{first['run_dir']}/checkpoint.pt", map_location="cpu", weights_only=True)
    assert state["counters"]["nonfinite_updates"] == 0
    second = da.main(
        tiny_args(total_timesteps=400, model="nature", resume=f"{first['run_dir']}/checkpoint.pt", **schedule)
    )
    assert second["global_step"] == 400 and second["updates"] > first["updates"]


def test_cuda_a_change_to_acting_or_sampling_takes_effect_on_the_captured_path(tmp_path, monkeypatch):
    """A copy whose `Player.act` and `EpisodeReplay.sample` say when they run, trained on CUDA with the default flags
    (the policy captured, the frames on the device): both run at every step and update they belong to."""
    from test_dreamer_part1_changes import changed_copy, tiny_catch

    counted = (
        (
            "        (action,) = self.policy(inputs)\n",
            '        (action,) = self.policy(inputs)\n        CALLS.append("act")\n',
        ),
        (
            "        return self.fill(self.draw_windows(batch_size, sequence_length, rng), sequence_length)",
            '        CALLS.append("sample")\n'
            "        return self.fill(self.draw_windows(batch_size, sequence_length, rng), sequence_length)",
        ),
    )
    module = changed_copy(tmp_path, monkeypatch, *counted)
    args = tiny_catch(module, total_timesteps=60, preallocate=False)  # the preflight times acting too
    counters = module.main(args)
    assert module.CALLS.count("act") == args.total_timesteps - args.learning_starts
    assert module.CALLS.count("sample") >= counters["updates"] > 0


def test_cuda_preflight_times_a_second_pass_that_leaves_weights_gradients_and_random_numbers_as_they_were(
    capsys,
):
    """On CUDA the preflight times a second, warm pass (the first pays CUDA's one-time costs): it must leave every
    weight and optimizer moment as they were, no gradient behind, and the random numbers the run draws next."""
    args = tiny_args(total_timesteps=1_000)
    agent = da.build_agent(args, obs_shape(args), 6, torch.device("cuda"))
    weights = [p.detach().clone() for module in agent.modules().values() for p in module.parameters()]
    torch.manual_seed(3)
    expected = torch.rand(4, device="cuda")
    torch.manual_seed(3)
    da.preflight(agent, args, obs_shape(args))
    assert torch.equal(torch.rand(4, device="cuda"), expected)
    params = [p for module in agent.modules().values() for p in module.parameters()]
    assert all(torch.equal(p, w) for p, w in zip(params, weights)) and all(p.grad is None for p in params)
    assert all(
        torch.count_nonzero(value) == 0
        for optimizer in agent.optimizers
        for state in optimizer.state.values()
        for key, value in state.items()
        if key in ("exp_avg", "exp_avg_sq")
    )
    assert "this run, 1,000 env steps with" in capsys.readouterr().out
