"""A shortened learning proof in CI: dreamer_atari.py's own loop on Catch-v0 (benchmark/learning_proof.py).

The full proof (2,400 env steps, about three minutes on a 2-core CPU; results in
benchmark/results/learning_proof/) does not fit beside the rest of the suite, so CI trains 600 env steps (350 of
them with updates, a log point at 300 and at 600) and asserts the learning that has happened by then: the world model has learned to draw the game and to predict its
reward from pixels (both losses far below where they started, the sign of some real rewards predicted), its
latents carry information about the frames (KL above the free-nats floor, not collapsed onto the prior), and
the actor and critic trained alongside. Whether the policy learns is the full proof's question, not this test's."""

import contextlib
import dataclasses
import shlex

import pytest
import torch
import tyro

import dreamer_atari as da
from benchmark import bench_utils
from benchmark import learning_proof as lp


@pytest.mark.slow
def test_the_world_model_learns_catch_through_the_scripts_own_loop(tmp_path):
    out = lp.main(
        lp.Args(
            json=str(tmp_path / "proof.json"),
            seed=3,
            threads=1,  # beside the other test worker on 2 cores, a second thread would only contend
            total_timesteps=600,
            log_interval=300,
            learning_starts=250,  # the proof's 300 less 50: the first log point is 56 updates in, as it was at 700
            eval_episodes=20,
            work_dir=str(tmp_path / "work"),
        )
    )
    owed = 1.125 * (600 - 250)  # the proof's train ratio at 8 x 16: 1.125 updates per env step after 250
    assert (
        out["env_steps"] == 600
        and out["updates"] >= 0.95 * owed
        and out["behavior_updates"] == out["updates"]
    )
    assert out["optimal_return"] == 1.0 and out["random_return"] < 0 and len(out["final_returns"]) == 20
    (run_dir,) = (tmp_path / "work" / "runs").iterdir()
    scalars = bench_utils.read_scalars(
        str(run_dir),
        ["losses/image", "losses/reward", "losses/actor", "losses/kl", "charts/reward_sign_accuracy"],
    )
    # the image loss falls about 6x between the first log point (56 updates in) and the last (394): 759 -> 128, and
    # the reward loss 2.33 -> 0.24 (seed 3, one thread, 2026-12-07); never learning, each would stay near the first
    for key, fall in (("losses/image", 0.3), ("losses/reward", 0.2)):
        series = scalars[key]  # {env step: mean over the log interval}
        assert series[max(series)] < fall * series[min(series)], (key, series)
    kl, accuracy = scalars["losses/kl"], scalars["charts/reward_sign_accuracy"]
    assert kl[max(kl)] > lp.da.Args().free_nats, kl
    assert accuracy[max(accuracy)] > accuracy[min(accuracy)], accuracy
    assert len(scalars["losses/actor"]) >= 2  # the behaviour was trained from the first log interval on


def test_reached_at_is_the_first_step_where_the_recent_episodes_average_the_target():
    returns = {10 * i: (-1.0 if i < 30 else 1.0) for i in range(1, 61)}  # an episode every 10 env steps
    # the mean of the last 10 first reaches 0.8 when 9 of them are +1 (episode 38, at env step 380)
    assert lp.reached_at(returns, 0.8, 10) == 380
    assert lp.reached_at(returns, 1.1, 10) is None
    assert lp.reached_at({10: 1.0}, 0.8, 10) is None  # fewer episodes than the window


def test_the_results_table_has_every_seed_and_when_it_reached_the_target():
    machine = {"cpu": "AMD EPYC", "cpu_count": 2, "torch": "2.13.0+cpu"}
    runs = [
        {
            "seed": seed,
            "final_return": 0.9,
            "optimal_return": 1.0,
            "random_return": -0.6,
            "env_steps": 2_000,
            "updates": 1_700,
            "seconds": 150.0,
            "machine": machine,
            "command": f"python ... --seed {seed}",
            "reached_at": reach,
            "load_average": {"before": [3.2, 1, 1], "after": [2.1, 1, 1]},
            "proof_args": {"json": "x", "seed": seed, "reach_fraction": 0.8, "reach_window": 50},
            "curve": [{"env_step": 1_000, "mean_return": -0.5}, {"env_step": 2_000, "mean_return": 0.9}],
        }
        for seed, reach in ((2, 1_200), (1, 1_400))
    ]
    table = lp.summary_markdown(runs)
    rows = [line for line in table.splitlines() if line.startswith(("| 1 |", "| 2 |"))]
    assert rows[0].startswith("| 1 | 0.90 | 1.00 | -0.60 | 1,400 (70%) | 2,000 | 1,700 | 150 | 3.2 / 2.1 |")
    assert rows[1].startswith("| 2 | 0.90 | 1.00 | -0.60 | 1,200 (60%) |")
    assert "every seed reached 0.8 of optimal by env step 1,400 (70% of the budget)" in table
    runs[0]["reached_at"] = None
    assert "| 2 | 0.90 | 1.00 | -0.60 | never |" in lp.summary_markdown(runs)


def test_the_catch_run_the_preflight_names_is_the_proofs():
    """On a CPU the preflight names a Catch-v0 command as the way to see learning in minutes: it is the run this proof
    trains (which every seed of 1-10 learned), but for settings that do not change what is learned."""
    named = tyro.cli(da.Args, args=shlex.split(da.catch_command())[2:])
    assert named == da.Args(**da.CATCH_ON_CPU)
    assert da.catch_command().startswith("python dreamer_atari.py --env-id Catch-v0 ")
    proof = lp.training_args(lp.Args(json="proof.json"))
    differs = {
        f.name for f in dataclasses.fields(da.Args) if getattr(proof, f.name) != getattr(named, f.name)
    }
    assert differs <= {
        "log_interval",
        "video_every",
        "leak_warmup_steps",
        "save_model",
        "exp_name",
        "vector_mode",
    }


def test_emulated_bf16_products_round_as_the_bf16_kernels_do_forward_and_backward():
    """The proof's bf16 on a CPU without bf16 arithmetic: products in float32 on bf16 operands, rounded to bf16.
    They must give what torch's bf16 kernels give (to the order of their sums), and not float32's answer."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 4, 2), torch.nn.SiLU(), torch.nn.Flatten(), torch.nn.Linear(8 * 7 * 7, 16)
    )
    x = torch.randn(4, 3, 16, 16)

    mode = lp.EmulatedBF16Products()

    def run(precision, emulated=False):
        net.zero_grad()
        bf16 = torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16")
        with bf16, mode if emulated else contextlib.nullcontext():
            y = net(x)
            assert y.dtype == (torch.bfloat16 if precision == "bf16" else torch.float32)
            y.float().square().mean().backward()
        return [y.float()] + [p.grad.clone() for p in net.parameters()]

    native, emulated, full = run("bf16"), run("bf16", emulated=True), run("float32")
    # both products forward, and the convolution's and the linear layer's backward (weights and input)
    assert mode.products >= 4, mode.products
    a, w = torch.randn(5, 64).bfloat16(), torch.randn(64, 7).bfloat16()
    with mode:
        assert torch.equal(a @ w, (a.float() @ w.float()).bfloat16())  # exact float32 sums, one rounding
    for n, e, f in zip(native, emulated, full):
        scale = f.abs().max()
        # within a few bf16 roundings (2^-8 relative) of the native kernel, as far from float32 as it is
        assert (e - n).abs().max() <= 4 * 2**-8 * scale, ((e - n).abs().max(), scale)
        assert (e - f).abs().max() > 2**-16 * scale  # bf16 rounding shows: not a float32 product
        assert (n - f).abs().max() > 2**-16 * scale
