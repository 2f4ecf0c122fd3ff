"""The fused epilogues (--fused-epilogues, `fused_imagine_step` in dreamer_kernels.py): the work after each
product of an imagined step in one Triton kernel (a LayerNorm and its SiLU, the LayerNorm GRU's gates, a draw), and
the behaviour heads' LayerNorms and SiLUs as that kernel, learning through its backward kernel.

Triton's interpreter (TRITON_INTERPRET=1, set by tests/conftest.py without CUDA) runs the kernels on CPU tensors,
float64 included: each kernel is held to the torch code it replaces at sizes that are no powers of two and split
rows over several programs, the fused rollout to `gather_imagine_step`'s and Part 1's `imagine`, the fused heads to
their own layers (outputs and gradients), and the run's wiring (its start-up checks, exit 7, the off flag). Skipped
where Triton is not installed (requirements-dev.txt pins it).
"""

import pytest
import torch
import torch.nn.functional as F
from test_dreamer_fused_scan import OpCounter, interpreted, short_run, sped_up

import dreamer_atari as da
import dreamer_kernels as dk
import dreamer_tiny
from dreamer_tiny import obs_shape

pytest.importorskip(
    "triton", reason="the fused epilogues are Triton kernels (pinned in requirements-dev.txt)"
)

NUM_ACTIONS = 6


@pytest.fixture(autouse=True)
def kernels():
    dk.scan_kernels()  # Triton imported, the operations registered (compiled on CUDA, else interpreted)


@interpreted
def test_norm_silu_is_layer_norm_then_silu_with_the_gathered_row_added_first():
    torch.manual_seed(0)
    N, W = 1100, 37  # rows over several programs (128 rows each at this width), the last one partly filled
    wide = torch.randn(N, 50, dtype=torch.float64)
    x = wide[:, 5 : 5 + W]  # rows 50 apart, as a slice of the gathers' output
    weight, bias = torch.randn(W, dtype=torch.float64), torch.randn(W, dtype=torch.float64)
    table = torch.randn(W, NUM_ACTIONS, dtype=torch.float64).t()  # (A, W), columns contiguous: a transpose
    index = torch.randint(NUM_ACTIONS, (N,))
    ops = torch.ops.dreamer_scan
    for ours, x_in in (
        (ops.norm_silu(x, weight, bias, 1e-3, None, None), x),
        (ops.norm_silu(x, weight, bias, 1e-3, table, index), x + table[index]),
    ):
        expected = F.silu(F.layer_norm(x_in, (W,), weight, bias, 1e-3))
        assert ours.dtype == torch.float64 and dk.relative_error(ours, expected) < 1e-13


@interpreted
def test_gru_gates_are_the_layer_norm_grus_after_its_product():
    torch.manual_seed(1)
    cell = da.LayerNormGRUCell(5, 13).double()
    with torch.no_grad():
        for p in cell.parameters():
            p.add_(0.5 * torch.randn_like(p))
    x, deter = torch.randn(300, 5, dtype=torch.float64), torch.randn(300, 13, dtype=torch.float64)
    with torch.no_grad():
        pre = cell.linear(torch.cat([x, deter], -1))
        for scale in (1.0, 8.0):  # the gates saturated at x 8
            ours = torch.ops.dreamer_scan.gru_gates(
                scale * pre, cell.norm.weight, cell.norm.bias, 1e-3, deter
            )
            reference = da.LayerNormGRUCell(5, 13).double()
            reference.load_state_dict(cell.state_dict())
            reference.linear.weight.mul_(scale)
            assert dk.relative_error(ours, reference(x, deter)) < 1e-13


@interpreted
def test_logits_draw_draws_the_class_part_1_draws_and_offsets_latents():
    torch.manual_seed(2)
    N, G, C = 700, 3, 5
    logits = 2 * torch.randn(N, G, C, dtype=torch.float64)
    uniform = torch.rand(N, G, 1, dtype=torch.float64)
    uniform[0, 0] = 1.0 - 1e-12  # past the CDF's rounded end: the last class
    expected = da.draw_index(da.mix_uniform(F.softmax(logits, -1), 0.01), uniform)  # (N, G)
    ours = torch.ops.dreamer_scan.logits_draw(logits, uniform, 0.01, False)
    assert ours.dtype == torch.int64 and torch.equal(ours, expected) and ours[0, 0] == C - 1
    with_offsets = torch.ops.dreamer_scan.logits_draw(logits, uniform, 0.01, True)
    assert torch.equal(with_offsets, expected + C * torch.arange(G))
    # float32 logits: the softmax in float32, as `gather_imagine_step`'s upcast
    flipped = torch.ops.dreamer_scan.logits_draw(logits.float(), uniform.float(), 0.01, False) != expected
    assert flipped.float().mean() < 0.01  # only where a uniform lies within float32 rounding of a CDF step


@interpreted
def test_norm_silu_backward_is_autograds_through_the_layer_norm_and_the_silu():
    """`norm_silu`'s backward (`norm_silu_backward_kernel`, then one sum of the programs' partial sums) gives x, the
    weight and the bias autograd's gradients through F.layer_norm and F.silu, for rows that are a slice of a wider
    tensor split over several programs, in two operations; with a gathered row it has none."""
    torch.manual_seed(5)
    N, W = 1100, 37
    wide = torch.randn(N, 50, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(W, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(W, dtype=torch.float64, requires_grad=True)
    grad = torch.randn(N, W, dtype=torch.float64)
    ours = torch.ops.dreamer_scan.norm_silu(wide[:, 5 : 5 + W], weight, bias, 1e-3, None, None)
    with OpCounter() as counter:
        grads = torch.autograd.grad(ours, (wide, weight, bias), grad)
    expected = F.silu(F.layer_norm(wide[:, 5 : 5 + W], (W,), weight, bias, 1e-3))
    for ours_grad, expected_grad in zip(grads, torch.autograd.grad(expected, (wide, weight, bias), grad)):
        assert dk.relative_error(ours_grad, expected_grad) < 1e-13
    assert counter.ops["dreamer_scan.norm_silu_grads"] == 1 and counter.ops["aten.sum"] == 1, counter.ops
    table, index = torch.randn(NUM_ACTIONS, W, dtype=torch.float64), torch.randint(NUM_ACTIONS, (N,))
    gathered = torch.ops.dreamer_scan.norm_silu(wide[:, :W], weight, bias, 1e-3, table, index)
    with pytest.raises(RuntimeError, match="gathered row"):
        gathered.sum().backward()


def moved_twin():
    """A float64 tiny agent with its behaviour heads moved off their initial values (the critic's and the reward's
    output layers start at zero and would pass no gradient back), and imagined features to run them on."""
    agent = dreamer_tiny.float64_agent(dreamer_tiny.tiny_args())
    torch.manual_seed(6)
    with torch.no_grad():
        for net in dk.behaviour_heads(agent).values():
            for parameter in net.parameters():
                parameter.add_(0.3 * torch.randn_like(parameter))
    rssm = agent.world_model.rssm
    deter = torch.randn(5, 3, rssm.deter_dim, dtype=torch.float64)
    classes = torch.randint(rssm.classes, (5, 3, rssm.stoch_dim))
    feat = torch.cat([deter, F.one_hot(classes, rssm.classes).flatten(-2).double()], -1)  # (H+1, N, F)
    return agent, feat, classes + dk.latent_offsets(rssm, "cpu")


def heads_results(agent, feat, stoch_index, fused):
    """The heads' outputs on feat, the learning heads' parameter gradients of a seeded sum of theirs, and the
    operations the forward and backward passes dispatched."""
    learning = [p for name in dk.LEARNING_HEADS for p in dk.behaviour_heads(agent)[name].parameters()]
    with OpCounter() as counter:
        outputs = dk.heads_on_features(agent, feat, stoch_index, fused)
        torch.manual_seed(7)
        loss = sum((outputs[name] * torch.randn_like(outputs[name])).sum() for name in dk.LEARNING_HEADS)
        grads = torch.autograd.grad(loss, learning)
    return outputs, grads, counter.ops


def assert_same_heads(agent, feat, stoch_index, tolerance: float) -> tuple:
    """The fused heads' outputs and gradients (`heads_results`) within `tolerance` of the heads' own layers'; the
    operations each dispatched, fused first."""
    (outputs, grads, ops), (expected, expected_grads, part_1_ops) = (
        heads_results(agent, feat, stoch_index, fused) for fused in (True, False)
    )
    for name, value in expected.items():
        assert dk.relative_error(outputs[name], value) < tolerance, name
    for grad, expected_grad in zip(grads, expected_grads, strict=True):
        assert dk.relative_error(grad, expected_grad) < tolerance
    return ops, part_1_ops


@interpreted
def test_the_fused_heads_are_the_heads_own_layers_in_fewer_operations():
    """With --fused-epilogues the heads on the imagined states run each LayerNorm and its SiLU as `norm_silu` (the
    actor's and the critic's learning through its backward): the same outputs and gradients as the heads' own layers
    in float64. Forward, 10 LayerNorms and 10 SiLUs become 10 operations; backward, each of the 4 pairs of the
    SiLU's and the LayerNorm's backward becomes the kernel and a sum, from x alone kept for it."""
    agent, feat, stoch_index = moved_twin()
    heads_results(agent, feat, stoch_index, True)  # the gathers' constants made (once a process)
    ops, part_1_ops = assert_same_heads(agent, feat, stoch_index, tolerance=1e-13)
    assert ops["dreamer_scan.norm_silu"] == 10 and ops["dreamer_scan.norm_silu_grads"] == 4, ops
    assert "aten.native_layer_norm" not in ops and "aten.silu" not in ops
    assert part_1_ops["aten.native_layer_norm"] == part_1_ops["aten.silu"] == 10
    assert part_1_ops["aten.native_layer_norm_backward"] == part_1_ops["aten.silu_backward"] == 4
    assert sum(ops.values()) == sum(part_1_ops.values()) - 10, (sum(ops.values()), sum(part_1_ops.values()))


def steeper(real_forward):
    """A layer's forward with the values of `real_forward` and a gradient 1 % larger."""

    def forward(self, x):
        y = real_forward(self, x)
        return y.detach() + 1.01 * (y - y.detach())

    return forward


@interpreted
def test_the_check_catches_a_head_whose_layers_the_kernels_do_not_compute(monkeypatch):
    """`check_fused_heads` holds the fused heads to the heads' own layers: a SiLU changed in its forward, or a
    LayerNorm whose gradient changes and whose values do not, and not in the kernels, raise FastPathMismatch naming
    the kernels and --fused-epilogues off."""
    args = dreamer_tiny.tiny_args()
    torch.manual_seed(0)
    agent = da.build_agent(args, obs_shape(args), NUM_ACTIONS, "cpu")
    dk.check_fused_heads(agent)  # as written: no difference
    steeper_norm = steeper(torch.nn.LayerNorm.forward)
    for layer, forward, what in (
        (torch.nn.SiLU, lambda self, x: F.silu(0.99 * x), "output"),
        (torch.nn.LayerNorm, steeper_norm, "gradient"),
    ):
        with monkeypatch.context() as patch:
            patch.setattr(layer, "forward", forward)
            with pytest.raises(da.FastPathMismatch, match=f"another {what}") as e:
                dk.check_fused_heads(agent)
        assert "norm_silu_backward_kernel" in str(e.value) and "--fused-epilogues off" in str(e.value)


def rollouts(agent, fused_values=(True, False), horizon=5, N=4):
    """FastImagine rollouts (features, actions) from the same seeded start with the same random numbers, for each
    of `fused_values`, and Part 1's `imagine` features."""
    rssm = agent.world_model.rssm
    torch.manual_seed(3)
    deter = torch.randn(N, rssm.deter_dim, dtype=torch.float64)
    start = (deter, rssm.sample(rssm.prior(deter)).detach(), None)
    results = []
    for fused in fused_values:
        torch.manual_seed(4)
        feat, _, actions = dk.FastImagine(gathers=True, fused=fused).rollout(agent, start, horizon)
        results.append((feat, actions))
    torch.manual_seed(4)
    return results, da.imagine(agent, start, horizon)[0]


@interpreted
def test_the_fused_rollout_is_the_gathered_one_and_part_1s_imagine_in_float64():
    agent = dreamer_tiny.float64_agent(dreamer_tiny.tiny_args())
    ((fused_feat, fused_actions), (feat, actions)), part_1 = rollouts(agent)
    assert torch.equal(fused_actions, actions)
    assert dk.relative_error(fused_feat, feat) < 1e-13
    assert dk.relative_error(fused_feat, part_1) < 1e-12


@interpreted
def test_an_imagined_step_is_half_the_operations_with_the_epilogues_fused():
    args = dreamer_tiny.tiny_args()
    torch.manual_seed(0)
    agent = da.build_agent(args, obs_shape(args), NUM_ACTIONS, "cpu")
    rssm, N = agent.world_model.rssm, 8
    tables = (*dk.imagine_tables(agent.actor, rssm), dk.bag_offsets(N, rssm.stoch_dim, "cpu"))
    deter, index = torch.randn(N, rssm.deter_dim), torch.randint(rssm.classes, (N, rssm.stoch_dim))
    index = index + dk.latent_offsets(rssm, "cpu")
    inputs = (agent.actor, rssm, tables, deter, index, torch.rand(N, 1), rssm.noise((N,), "cpu"))
    counts = {}
    for step in (dk.gather_imagine_step, dk.fused_imagine_step):
        with torch.no_grad():
            step(*inputs)  # the draws' constants made (once a process)
            with OpCounter() as counter:
                step(*inputs)
        counts[step.__name__] = sum(counter.ops.values())
    # 40 operations gathered (Part 1's probabilities and `draw_index` for both draws; `imagine_step` dispatches 41);
    # fused: the gather, 6 products and the concatenation before the GRU's, 4 LayerNorms with their SiLUs (img_in's
    # with the action's row), the gates, 2 draws
    assert counts == {"gather_imagine_step": 40, "fused_imagine_step": 15}, counts


@interpreted
def test_the_check_catches_a_formula_the_kernels_do_not_compute(monkeypatch):
    """`check_fused_epilogues` holds the kernels to `gather_imagine_step`, which runs Part 1's layers: a GRU whose
    gates change in `LayerNormGRUCell.forward`, or a drawn class moved in `draw_index`, and not in the kernels, raise
    FastPathMismatch naming the kernels and --fused-epilogues off."""
    args = dreamer_tiny.tiny_args()
    torch.manual_seed(0)
    agent = da.build_agent(args, obs_shape(args), NUM_ACTIONS, "cpu")
    dk.check_fused_epilogues(agent)  # as written: no difference
    real_forward, real_draw = da.LayerNormGRUCell.forward, dk.draw_index
    with monkeypatch.context() as patch:
        patch.setattr(
            da.LayerNormGRUCell, "forward", lambda self, x, state: 0.99 * real_forward(self, x, state)
        )
        with pytest.raises(da.FastPathMismatch, match="other features") as e:
            dk.check_fused_epilogues(agent)
        assert "gru_gates_kernel" in str(e.value) and "--fused-epilogues off" in str(e.value)
    monkeypatch.setattr(dk, "draw_index", lambda probs, uniform: real_draw(probs, 1 - uniform))
    with pytest.raises(da.FastPathMismatch, match="other (actions|features)"):
        dk.check_fused_epilogues(agent)


def imagine_of(capsys, **overrides):
    """The imagination `speed_up_agent` installs for tiny `overrides`, and what it printed."""
    agent, said = sped_up(capsys, **overrides)
    return agent.imagine, said


@interpreted
def test_the_run_installs_the_fused_epilogues_where_triton_runs_them(capsys, monkeypatch):
    """On the CPU (Triton has only its interpreter there) the gathers run unfused: said in one line with
    --fused-epilogues on, without a word with `auto`; where the kernels run (CUDA, here the CPU interpreted)
    --fused-epilogues on installs them, checked, and `auto` leaves them out until a GPU result shows them;
    --fused-epilogues off and --fast-imagine off leave them out, and Gaussian latents (no gathers) too."""
    imagine, said = imagine_of(capsys)
    assert imagine.gathers and not imagine.fused and "--fused-epilogues runs on CUDA" in said, said
    imagine, said = imagine_of(capsys, fused_epilogues="auto")
    assert imagine.gathers and not imagine.fused and "--fused-epilogues" not in said
    monkeypatch.setattr(dk, "FUSED_SCAN_DEVICES", {"cuda", "cpu"})
    imagine, said = imagine_of(capsys)
    assert imagine.fused and imagine.step is dk.fused_imagine_step and "--fused-epilogues" not in said
    assert not imagine_of(capsys, fused_epilogues="auto")[0].fused
    assert sped_up(capsys)[0].imagined_heads.fused  # the heads' epilogues with them
    assert not sped_up(capsys, fused_epilogues="off")[0].imagined_heads.fused
    assert not imagine_of(capsys, fused_epilogues="off")[0].fused
    assert imagine_of(capsys, fast_imagine="off")[0] is da.imagine
    assert not imagine_of(capsys, stochastic_classes=0)[0].fused


@interpreted
def test_a_gru_edited_in_part_1_steps_the_fused_epilogues_aside_in_one_line(monkeypatch, tmp_path, capsys):
    """A GRU edited in Part 1 (`LayerNormGRUCell.forward`, to which the fused epilogues are pinned): they step aside at
    start in one line naming it, with no exit 7, and the gathered imagination step runs the cell as written."""
    monkeypatch.setattr(dk, "FUSED_SCAN_DEVICES", {"cuda", "cpu"})
    monkeypatch.chdir(tmp_path)
    real_forward = da.LayerNormGRUCell.forward

    def clamped(self, x, h):
        return real_forward(self, x, h).clamp(-0.5, 0.5)

    monkeypatch.setattr(da.LayerNormGRUCell, "forward", clamped)
    run = short_run(fast_observe="off", fused_epilogues="on", imagine_gathers="on", total_timesteps=20)
    assert da.main(run)["global_step"] == 20
    said = [line for line in capsys.readouterr().out.splitlines() if "Part 1 changed where" in line]
    assert len(said) == 1 and "--fused-epilogues (LayerNormGRUCell.forward)" in said[0], said


@interpreted
def test_a_fused_head_whose_gradient_differs_stops_the_run_before_training(monkeypatch, tmp_path, capsys):
    """A LayerNorm whose gradient changes (its values do not) and not in `norm_silu`'s backward: the start-up check
    stops the run with exit 7 and one sentence naming the heads' kernels and --fused-epilogues off (the observe scan as
    written, whose own check would see the change first)."""
    monkeypatch.setattr(dk, "FUSED_SCAN_DEVICES", {"cuda", "cpu"})
    monkeypatch.chdir(tmp_path)
    steeper_norm = steeper(torch.nn.LayerNorm.forward)
    monkeypatch.setattr(torch.nn.LayerNorm, "forward", steeper_norm)
    with pytest.raises(SystemExit) as stopped:
        da.main(short_run(fast_observe="off"))
    said = capsys.readouterr().err.strip().splitlines()[-1]
    assert stopped.value.code == da.EXIT_FAST_PATH
    assert "norm_silu_backward_kernel" in said and "--fused-epilogues off" in said, said


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_the_compiled_kernels_pass_the_check_and_follow_the_gathers_at_16_x_64(monkeypatch):
    """On a GPU, the default model: the start-up check of the compiled kernels, then rollouts from 16 x 64 start
    states in float32 (full-float32 products) from the same random numbers: where no uniform lies within float32
    rounding of a CDF step the two draw alike, so at least 99 % of the rollouts keep the same actions and latents,
    and their deters agree within 1e-4 of the largest."""
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    args = da.Args()
    torch.manual_seed(0)
    agent = da.build_agent(args, (1, 3, 64, 64), NUM_ACTIONS, "cuda")
    agent.imagine = dk.FastImagine(gathers=True, fused=True)
    dk.check_fused_epilogues(agent)
    rssm, D = agent.world_model.rssm, args.deterministic_dim
    deter = torch.randn(16 * 64, D, device="cuda")
    start = (deter, rssm.sample(rssm.prior(deter)).detach(), None)
    results = []
    for fused in (True, False):
        torch.manual_seed(4)
        with torch.no_grad():
            feat, _, actions = dk.FastImagine(gathers=True, fused=fused).rollout(agent, start, 15)
        results.append((feat, actions))
    (feat, actions), (expected, expected_actions) = results
    same = (feat[..., D:] == expected[..., D:]).all(-1).all(0) & (actions == expected_actions).all(-1).all(0)
    assert same.float().mean() >= 0.99, int(same.sum())
    scale = expected[..., :D].abs().max()
    assert (feat[:, same, :D] - expected[:, same, :D]).abs().max() <= 1e-4 * scale


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_the_compiled_heads_pass_the_check_and_follow_the_heads_own_layers_at_16_x_64(monkeypatch):
    """On a GPU, the default model's heads moved off their initial values: the start-up check of the compiled
    `norm_silu` and its backward, then the heads on the features of a 16 x 64 batch's imagination (16 x 1,024 states)
    in float32 (full-float32 products): outputs and the learning heads' gradients within 1e-4 of the heads' own
    layers'."""
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    args = da.Args()
    torch.manual_seed(0)
    agent = da.build_agent(args, (1, 3, 64, 64), NUM_ACTIONS, "cuda")
    with torch.no_grad():
        for net in dk.behaviour_heads(agent).values():
            for parameter in net.parameters():
                parameter.add_(0.1 * torch.randn_like(parameter))
    dk.check_fused_heads(agent)
    rssm = agent.world_model.rssm
    deter = torch.randn(16, 16 * 64, rssm.deter_dim, device="cuda")
    classes = torch.randint(rssm.classes, (16, 16 * 64, rssm.stoch_dim), device="cuda")
    feat = torch.cat([deter, F.one_hot(classes, rssm.classes).flatten(-2).float()], -1)
    stoch_index = classes + dk.latent_offsets(rssm, "cuda")
    assert_same_heads(agent, feat, stoch_index, tolerance=1e-4)
