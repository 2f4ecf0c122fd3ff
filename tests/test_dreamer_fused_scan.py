"""The fused observe scan (--fused-scan, `FusedObserve` in dreamer_kernels.py): each observe step in four
Triton kernels and each step of its hand-written backward in four.

Triton's interpreter (TRITON_INTERPRET=1) runs the kernels on CPU tensors, float64 included, one program after
another: here they are held to Part 1's `RSSM.observe` and to autograd's gradients in float64, at tiny sizes that
split every kernel's columns over several programs, and once at the default model's widths. Each launch is one
torch operation (`torch.library.triton_op`), so the operation counter sees four per step each way. The run's wiring
(the start-up check and its exit 7, the fallbacks, --compile) is tested on the CPU under the interpreter too; the
compiled kernels are tested where CUDA is (the last test), and compiled for an H100 without one
(dev/gpu/fused_scan_compile.py). Skipped where Triton is not installed (requirements-dev.txt pins it; the CUDA
builds of torch bring their own).
"""

import collections
import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import dreamer_atari as da
import dreamer_kernels as dk
import dreamer_tiny
from dreamer_tiny import obs_shape

pytest.importorskip("triton", reason="the fused scan's kernels are Triton's (pinned in requirements-dev.txt)")

NUM_ACTIONS = 6
# at the tiny sizes below (H 5, D 6, 3 latents of 5 classes): two programs per kernel, and products in chunks, more
# chunks than programs in some: where programs share a LayerNorm's statistics and store what they made in turn
SPLIT = dk.ScanBlocks(batch=1, tile=64, img=4, gru=4, post=4, latents=2, logits=4, deter=4, state=8, stoch=8)


# the kernels in Triton's interpreter: TRITON_INTERPRET=1 before Triton is imported (tests/conftest.py, without CUDA)
interpreted = pytest.mark.skipif(
    not dk.triton_interprets(), reason="Triton was not started in its interpreter (TRITON_INTERPRET=1)"
)


@pytest.fixture
def fused_scan_on_the_cpu(monkeypatch):
    """A run on the CPU installs the fused scan as one on CUDA does (its kernels interpreted)."""
    monkeypatch.setattr(dk, "FUSED_SCAN_DEVICES", {"cuda", "cpu"})


class OpCounter(TorchDispatchMode):
    """The non-view operations dispatched inside it (as tests/test_dreamer_fast_path.py counts them)."""

    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not (
            func.is_view
            or str(func.overloadpacket) in ("aten.detach", "aten.lift_fresh", "aten._unsafe_view")
        ):
            self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def odd_rssm() -> da.RSSM:
    """A float64 RSSM whose sizes are no powers of two (embed 7, 3 actions, deter 6, 3 latents of 5 classes, hidden
    5), every parameter moved off its initial value, the initial state learned."""
    torch.manual_seed(0)
    rssm = da.RSSM(7, 3, 6, 3, 5, 5, 0.01, da.LayerNormGRUCell, True).double()
    with torch.no_grad():
        for p in rssm.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return rssm


def sequences(rssm: da.RSSM, embed_dim: int, num_actions: int, B: int, T: int) -> tuple:
    """embed (B, T, E), one-hot actions, is_first (every sequence starts, sequence 1 again at step 2 when T > 2),
    and the noise, whose uniforms sit in the middle of the classes they draw (`clear_draws`)."""
    generator = torch.Generator().manual_seed(T)
    embed = torch.randn(B, T, embed_dim, dtype=torch.float64, generator=generator)
    action = torch.nn.functional.one_hot(torch.randint(num_actions, (B, T), generator=generator), num_actions)
    is_first = torch.zeros(B, T, dtype=torch.bool)
    is_first[:, 0] = True
    if T > 2:
        is_first[1, 2] = True
    noise = torch.rand(T, B, rssm.stoch_dim, 1, generator=generator)
    return dk.clear_draws(rssm, (embed, action.double(), is_first, noise))


def readable(rssm: da.RSSM, inputs: tuple) -> dict[str, torch.Tensor]:
    """Part 1's results (`RSSM.observe`) and autograd's gradients of the fast observe's loop, by `scan_results`'
    names."""
    with torch.no_grad():
        results = dict(zip(("deter", "stoch", "posterior", "prior"), rssm.observe(*inputs)))
    gradients = dk.scan_results(dk.FastObserve(rssm, hand_written_backward=False), inputs)
    return results | {name: x for name, x in gradients.items() if name.startswith("gradient")}


@pytest.fixture(scope="module")
def split_scan():
    """The fused scan of `odd_rssm` with its columns split over programs (`SPLIT`), at T = 3 and 2 with gradients
    and T = 2 and 1 without, each counted: {(T, with gradients): (results, operations)}."""
    rssm, runs = odd_rssm(), {}
    for T, grad in ((3, True), (2, True), (2, False), (1, False)):
        inputs = sequences(rssm, 7, 3, 3, T)
        fused = dk.FusedObserve(rssm, SPLIT)
        with OpCounter() as counter:
            if grad:
                results = dk.scan_results(fused, inputs)
            else:
                with torch.no_grad():
                    results = dict(zip(("deter", "stoch", "posterior", "prior"), fused(*inputs)))
        runs[T, grad] = results, counter.ops
    return rssm, runs


@interpreted
def test_the_fused_forward_is_the_readable_observe_in_float64(split_scan):
    """Deter, the one-hot samples, the posterior and the prior of Part 1's cell step by step (`RSSM.observe`), with
    an episode start inside a sequence, the learned initial state, and every kernel's columns over several programs;
    with gradients (inside `ObserveBackwardThroughTime`) and without (open-loop predictions)."""
    rssm, runs = split_scan
    for T, grad in ((3, True), (2, False)):
        ours, _ = runs[T, grad]
        expected = readable(rssm, sequences(rssm, 7, 3, 3, T))
        for name in ("deter", "stoch", "posterior", "prior"):
            torch.testing.assert_close(ours[name], expected[name], rtol=1e-12, atol=1e-12, msg=name)
    stoch = runs[3, True][0]["stoch"].unflatten(-1, (rssm.stoch_dim, rssm.classes))
    assert len(stoch.argmax(-1).unique()) > 1  # the draws pick different classes: the draw itself is compared


@interpreted
def test_the_fused_backward_is_autograds_and_the_hand_written_ones_in_float64(split_scan):
    """The gradients of embed and of every parameter through the fused backward steps, against autograd's backward
    of the per-step loop and against `ObserveBackwardThroughTime` with its torch steps: across the reset inside
    sequence 1 and into the learned initial state."""
    rssm, runs = split_scan
    ours, _ = runs[3, True]
    inputs = sequences(rssm, 7, 3, 3, 3)
    expected = readable(rssm, inputs)
    hand_written = dk.scan_results(dk.FastObserve(rssm), inputs)
    gradients = [name for name in expected if name.startswith("gradient")]
    assert len(gradients) == 1 + len(list(rssm.parameters()))
    for name in gradients:
        torch.testing.assert_close(ours[name], expected[name], rtol=1e-10, atol=1e-12, msg=name)
        torch.testing.assert_close(ours[name], hand_written[name], rtol=1e-10, atol=1e-12, msg=name)
    assert all(ours[name].abs().sum() > 0 for name in gradients if "prior_net" not in name)


def step_operations(
    observe: dk.FastObserve, rssm: da.RSSM, grad: bool, steps: tuple[int, int]
) -> collections.Counter:
    """The operations that (steps[1] - steps[0]) more steps add to `observe` of a batch of 3, with gradients (the
    forward and backward passes) or without."""
    counts = []
    for T in steps:
        inputs = sequences(rssm, 7, 3, 3, T)
        with OpCounter() as counter, torch.set_grad_enabled(grad):
            dk.scan_results(observe, inputs) if grad else observe(*inputs)
        counts.append(counter.ops)
    return counts[1] - counts[0]


@interpreted
def test_each_step_is_four_kernel_launches_each_way(split_scan):
    """Each more step adds four operations to the forward pass and four to the backward pass, one per kernel launch
    (`torch.library.triton_op`) and nothing else: at least 5 and 3 times fewer than the fast observe's step."""
    rssm, runs = split_scan
    forward_ops = ("scan_img_in", "scan_gru_in", "scan_gru_out", "scan_posterior")
    backward_ops = (
        "scan_posterior_backward",
        "scan_posterior_input_backward",
        "scan_gru_backward",
        "scan_img_backward",
    )
    one_step = runs[2, False][1] - runs[1, False][1]
    assert one_step == {f"dreamer_scan.{op}": 1 for op in forward_ops}
    one_step = runs[3, True][1] - runs[2, True][1]
    assert one_step == {f"dreamer_scan.{op}": 1 for op in forward_ops + backward_ops}
    fast = dk.FastObserve(rssm)
    fast_forward = step_operations(fast, rssm, False, (2, 3))
    fast_backward = step_operations(fast, rssm, True, (2, 3)) - fast_forward
    # the fast observe's step: 28 operations forward and 15 backward when this was written
    assert sum(fast_forward.values()) >= 5 * 4 and sum(fast_backward.values()) >= 3 * 4, (
        fast_forward,
        fast_backward,
    )


@interpreted
def test_the_default_widths_in_float64_and_float32():
    """The default model's RSSM (deter 512, hidden 512, 32 latents of 32 classes, embed 4096) at batch 2 x 2, with
    the interpreter's blocks (whole rows): the forward and gradients as Part 1's and autograd's in float64, and in
    float32 within the tolerance the start-up check allows against the fast observe (its products in full float32)."""
    args = da.Args()
    torch.manual_seed(0)
    rssm = da.RSSM(4096, NUM_ACTIONS, 512, 32, 32, 512, args.unimix, da.LayerNormGRUCell, True)
    da.dreamerv3_init_(rssm)
    reference = dk.float64_copy(rssm)
    with torch.no_grad():
        reference.initial_deter.normal_()  # a learned initial state that is not tanh(0) = 0
    inputs = sequences(reference, 4096, NUM_ACTIONS, 2, 2)
    ours, expected = dk.scan_results(dk.FusedObserve(reference), inputs), readable(reference, inputs)
    for name, x in expected.items():
        tolerance = 1e-10 if name.startswith("gradient") else 1e-12
        assert dk.relative_error(ours[name], x) <= tolerance, name
    model = copy.deepcopy(reference).float()
    inputs = tuple(x.float() if x.is_floating_point() else x for x in inputs)
    ours, expected = (
        dk.scan_results(dk.FusedObserve(model), inputs),
        dk.scan_results(dk.FastObserve(model), inputs),
    )
    errors = {name: dk.relative_error(ours[name], x) for name, x in expected.items()}
    assert max(errors.values()) <= dk.FLOAT32_TOLERANCE, errors


@interpreted
def test_the_check_catches_a_draw_or_a_backward_the_kernels_do_not_compute(monkeypatch):
    """`check_fused_scan` holds the kernels to the readable code: a change to the categorical draw (Part 1's
    `one_hot_draw`, which `RSSM.observe` and the fast observe both call) that the kernels do not make, or a slip in the
    backward steps, raises FastPathMismatch naming the function that launches the kernels and --fused-scan off."""
    args = dreamer_tiny.tiny_args()
    torch.manual_seed(0)
    rssm = da.build_agent(args, obs_shape(args), NUM_ACTIONS, "cpu").world_model.rssm
    real_draw, real_reverse_step = da.one_hot_draw, dk.FusedObserve.fused_reverse_step
    with monkeypatch.context() as patch:
        patch.setattr(da, "one_hot_draw", lambda probs, uniform: real_draw(probs, 1 - uniform))
        da.kernels_module()  # Part 1 as patched, handed to the kernels module again
        with pytest.raises(
            da.FastPathMismatch, match=r"FusedObserve.fused_step launches\) gives another"
        ) as e:
            dk.check_fused_scan(rssm, "cpu")
        assert "--fused-scan off" in str(e.value)

    def slipped(self, *inputs):
        deter_carry, stoch_carry, layer_grads = real_reverse_step(self, *inputs)
        return 0.9 * deter_carry, stoch_carry, layer_grads

    monkeypatch.setattr(dk.FusedObserve, "fused_reverse_step", slipped)
    with pytest.raises(
        da.FastPathMismatch, match=r"fused_reverse_step launches\) gives another gradient"
    ) as e:
        dk.check_fused_scan(rssm, "cpu")
    assert "--fused-scan off" in str(e.value)


# the Triton paths asked for (on CUDA `auto` leaves them off until a GPU result shows them)
TRITON_PATHS = dict(fused_scan="on", fused_epilogues="on")


def short_run(**overrides) -> da.Args:
    schedule = dict(total_timesteps=50, learning_starts=10, train_ratio=18.0, num_envs=1)
    return dreamer_tiny.tiny_args(
        **{"batch_size": 3, "sequence_length": 6, "free_nats": 0.0, **TRITON_PATHS, **schedule, **overrides}
    )


@interpreted
def test_a_fused_scan_that_differs_stops_the_run_before_training(
    fused_scan_on_the_cpu, monkeypatch, tmp_path, capsys
):
    """The start-up check (`check_fast_paths`) holds the fused scan the run installs (here on the CPU, interpreted)
    to the readable code: a step that computes something else stops the run with exit 7 and one sentence naming the
    function holding the formula and --fused-scan off, which then trains."""
    real_step = dk.FusedObserve.fused_step

    def changed_step(self, *inputs):
        deter, stoch, posterior = real_step(self, *inputs)
        return 1.01 * deter, stoch, posterior

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(dk.FusedObserve, "fused_step", changed_step)
    with pytest.raises(SystemExit) as stopped:
        da.main(short_run())
    said = capsys.readouterr().err.strip().splitlines()[-1]
    assert stopped.value.code == da.EXIT_FAST_PATH
    assert "FusedObserve.fused_step" in said and "--fused-scan off" in said
    assert da.main(short_run(fused_scan="off", total_timesteps=20))["global_step"] == 20


def sped_up(capsys, **overrides) -> tuple[da.Agent, str]:
    """A tiny agent for `overrides` with the fast paths `speed_up_agent` installs (after its start-up checks), and
    what it printed."""
    args = dreamer_tiny.tiny_args(**{**TRITON_PATHS, **overrides})
    torch.manual_seed(0)
    agent = da.build_agent(args, obs_shape(args), NUM_ACTIONS, "cpu")
    capsys.readouterr()
    da.speed_up_agent(agent, args)
    return agent, capsys.readouterr().out


def observe_of(capsys, **overrides) -> tuple[dk.FastObserve, str]:
    """The observe `speed_up_agent` installs for tiny `overrides`, and what it printed."""
    agent, said = sped_up(capsys, **overrides)
    return agent.observe, said


@interpreted
@pytest.mark.parametrize(
    "overrides, reason",
    [
        (dict(model="nature"), "--model nature's cell is GRUCell"),
        (dict(stochastic_classes=0), "--stochastic-classes 0 makes them Gaussian"),
        (dict(observe_backward="autograd"), "--observe-backward is autograd"),
    ],
)
def test_where_the_fused_scan_does_not_apply_the_fast_observe_runs_and_one_line_says_why(
    fused_scan_on_the_cpu, capsys, overrides, reason
):
    observe, said = observe_of(capsys, **overrides)
    assert type(observe) is dk.FastObserve
    lines = [line for line in said.splitlines() if "--fused-scan" in line]
    assert len(lines) == 1 and reason in lines[0] and "FastObserve" in lines[0], said


@interpreted
def test_the_run_installs_the_fused_scan_where_triton_runs_it_and_checks_it(capsys, monkeypatch):
    """On the CPU (Triton has only its interpreter there) --fused-scan on keeps the fast observe, said in one line,
    and `auto` keeps it without a word; where the fused scan runs (CUDA, here the CPU interpreted) --fused-scan on
    installs it and its start-up check passes, `auto` leaves it out until a GPU result shows it (`SHOWN_ON`), and
    --fused-scan off keeps the fast observe."""
    observe, said = observe_of(capsys)
    assert type(observe) is dk.FastObserve and "--fused-scan runs on CUDA" in said, said
    observe, said = observe_of(capsys, fused_scan="auto")
    assert type(observe) is dk.FastObserve and "--fused-scan" not in said
    monkeypatch.setattr(dk, "FUSED_SCAN_DEVICES", {"cuda", "cpu"})
    observe, said = observe_of(capsys)
    assert type(observe) is dk.FusedObserve and "--fused-scan" not in said
    observe, said = observe_of(capsys, fused_scan="auto")
    assert type(observe) is dk.FastObserve and "--fused-scan" not in said
    observe, said = observe_of(capsys, fused_scan="off")
    assert type(observe) is dk.FastObserve and "--fused-scan" not in said


@interpreted
def test_compile_leaves_the_fused_steps_as_they_are():
    """--compile compiles the fast observe's steps; the fused scan's are kernels already, and stay (the compiled
    functions never call them, so a triton_op, which Inductor on the CPU cannot compile, meets no compiler)."""
    args = dreamer_tiny.tiny_args(compile=True)
    agent = da.build_agent(args, obs_shape(args), NUM_ACTIONS, "cpu")
    agent.observe = dk.FusedObserve(agent.world_model.rssm)
    da.compile_agent(agent, backend="eager")
    assert agent.observe.step == agent.observe.fused_step
    assert agent.observe.reverse_step == agent.observe.fused_reverse_step


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_the_compiled_kernels_pass_the_check_and_match_the_fast_observe_at_16_x_64(monkeypatch):
    """On a GPU: the start-up check of the compiled kernels on the default model's widths, and the fused scan at the
    default batch of 16 x 64 against the fast observe in float32 (full-float32 products) within the check's
    tolerance."""
    torch.manual_seed(0)
    rssm = da.RSSM(4096, NUM_ACTIONS, 512, 32, 32, 512, 0.01, da.LayerNormGRUCell, True)
    da.dreamerv3_init_(rssm)
    rssm = rssm.cuda()
    dk.check_fused_scan(rssm, "cuda")
    inputs = sequences(dk.float64_copy(rssm), 4096, NUM_ACTIONS, 16, 64)
    inputs = tuple(x.cuda().float() if x.is_floating_point() else x.cuda() for x in inputs)
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    ours, expected = (
        dk.scan_results(dk.FusedObserve(rssm), inputs),
        dk.scan_results(dk.FastObserve(rssm), inputs),
    )
    errors = {name: dk.relative_error(ours[name], x) for name, x in expected.items()}
    assert max(errors.values()) <= dk.FLOAT32_TOLERANCE, errors
