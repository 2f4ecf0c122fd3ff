"""The faster equivalents of dreamer_atari.py's functions: hand-written backward passes, gathers in place of products
with one-hot vectors, and Triton kernels. The script trains without this file; a copy of the script that sits beside
it installs it (`install`), handing over its own Part 1 (`bind`: this module never imports the script).

One section per operation, each holding its torch version, its Triton version where it has one, when it applies (a
`*_problem` function says why not, in a clause) and its check against the Part 1 function it replaces (`check_*`,
in float64, on the weights the run is using: at start-up, after --resume and every --check-every updates). The interface,
at the end: `bind`, `install`, `check_fast_paths`, `compile_paths`, `FAST_PATHS` (each path's flag, where it is on
by default and the GPU result that showed it).

A path that cannot import, compile or launch here, or whose float32 kernels disagree while their float64 check
agrees, raises `KernelUnavailable` (the script leaves it out with one line); a float64 disagreement raises the
script's `FastPathMismatch`, naming the function that holds the formula and the flag that switches the path off.
"""

from __future__ import annotations

import ast
import contextlib
import copy
import dataclasses
import hashlib
import importlib.util
import inspect
import io
import itertools
import json
import os
import sys
import textwrap
import tokenize
import types
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

# Part 1's classes and functions that the kernels compute and are checked against: the script's own, handed over by
# `bind` before anything here runs (a researcher's copy of the script hands its own).
PART1 = (
    "Actor",
    "Agent",
    "Args",
    "FastPathMismatch",
    "LayerNormGRUCell",
    "NORM_EPS",
    "RSSM",
    "behavior_losses",
    "draw_index",
    "imagine",
    "imagined_heads",
    "imagined_targets",
    "one_hot",
    "one_hot_draw",
    "policy_terms",
    "upcast",
)
Actor = Agent = Args = FastPathMismatch = LayerNormGRUCell = NORM_EPS = RSSM = None
behavior_losses = draw_index = imagine = imagined_heads = imagined_targets = None
one_hot = one_hot_draw = policy_terms = upcast = None


class KernelUnavailable(RuntimeError):
    """A fast path cannot run on this device (a clause: why): its kernels do not import, compile or launch here, or
    their float32 results disagree at the run's shapes while their float64 check agrees. The script leaves it out."""


# --- What the checks share --------------------------------------------------------------------------------------------


def relative_error(ours: torch.Tensor, expected: torch.Tensor, floor: float = 1e-12) -> float:
    """The largest difference between `ours` and `expected`, relative to `expected`'s largest size (or `floor`)."""
    return (ours - expected).abs().max().item() / max(expected.abs().max().item(), floor)


def float64_copy(rssm: RSSM, gru_scale: float = 1.0) -> RSSM:
    """A float64 copy of `rssm` on the CPU, the GRU's parameters multiplied by `gru_scale`: at 8 its units saturate,
    where a clamp or a cut of the state shows."""
    reference = copy.deepcopy(rssm).cpu().double()
    with torch.no_grad():
        for p in getattr(reference, "gru", reference).parameters():
            p.mul_(gru_scale)
    return reference


# float32 against float32: the same sums in another order, and a GPU's approximate exp, division and square root
FLOAT32_TOLERANCE = 1e-4


# --- The categorical draw as two products -----------------------------------------------------------------------------


_DRAW_MATRICES: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def fast_one_hot_draw(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """`one_hot_draw` in four kernels (a GPU's cumulative sum is slow): the CDF is a product with a triangular matrix of
    ones, the one-hot a product with a difference matrix, the last CDF column doubled. The product runs in full
    float32 (TF32 would round the probabilities to 10 bits) and outside autocast. Compiled (--compile), Part 1's
    cumulative sum, which Inductor fuses with the work around it. `check_draw` holds the two to the same classes."""
    if torch.compiler.is_compiling():
        return one_hot_draw(probs, uniform)
    classes, key = probs.shape[-1], (probs.shape[-1], probs.device)
    if key not in _DRAW_MATRICES:
        eye = torch.eye(classes, dtype=torch.float32, device=probs.device)
        cdf = torch.ones_like(eye).triu()
        cdf[:, -1] = 2.0
        diff = eye - eye.roll(1, 1).triu()
        _DRAW_MATRICES[key] = cdf, diff
    cdf_matrix, diff_matrix = _DRAW_MATRICES[key]
    precision = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        with torch.autocast(probs.device.type, enabled=False):
            above = (probs.float() @ cdf_matrix >= uniform).float()  # 0 up to the drawn class, 1 from it
            return above @ diff_matrix
    finally:
        torch.set_float32_matmul_precision(precision)


_COMPILED_DRAW: list[Callable] = []  # torch.compile(fast_one_hot_draw), made at its first check


def check_draw(device: torch.device, compiled: bool) -> None:
    """The draws the fast observe and imagination use (`fast_one_hot_draw`: as products; with --compile, compiled)
    against `one_hot_draw`, on 4,096 rows of 32 classes on the run's device (a
    row certain of one class and a uniform past the CDF's rounded end included; rows whose uniform lies within 1e-5
    of a CDF step are left out, where two sums may round apart): other classes raise FastPathMismatch. With
    --compile, compiles once (seconds)."""
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(0)
        probs = torch.softmax(3 * torch.randn(4096, 32, device=device), -1)
        uniform = torch.rand(4096, 1, device=device)
    probs[0] = 0.0
    probs[0, 5] = 1.0  # one class certain
    uniform[1] = 1.0 - 1e-7  # beyond any CDF that rounding left short of 1
    clear = (probs.double().cumsum(-1) - uniform.double()).abs().min(-1).values > 1e-5  # (4096,)
    clear[:2] = True
    expected = one_hot_draw(probs, uniform)[clear]
    draws = {"the draw as products (fast_one_hot_draw)": fast_one_hot_draw}
    if compiled:
        if not _COMPILED_DRAW:
            _COMPILED_DRAW.append(torch.compile(fast_one_hot_draw, fullgraph=True, dynamic=False))
        draws["the compiled draw (under --compile)"] = _COMPILED_DRAW[0]
    for name, draw in draws.items():
        ours = draw(probs, uniform)[clear]
        if not torch.equal(ours, expected):
            rows = int((ours != expected).any(-1).sum())
            raise FastPathMismatch(
                f"{name} picks other classes than one_hot_draw in {rows} of {len(expected)} rows: carry the change "
                f"into fast_one_hot_draw, or run with --fast-observe off "
                f"--fast-imagine off (and without --compile).",
                off={"compile": False}
                if "compiled" in name
                else {"fast_observe": "off", "fast_imagine": "off"},
            )


# --- The fast observe: the RSSM's loop in fewer kernels, and its hand-written backward pass ---------------------------


def silu_derivative(x: torch.Tensor) -> torch.Tensor:
    """d silu(x) / dx = sigmoid(x) (1 + x (1 - sigmoid(x)))."""
    sigmoid = torch.sigmoid(x)
    return sigmoid * (1 + x * (1 - sigmoid))


def layer_norm_stats(x: torch.Tensor, norm: nn.LayerNorm) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`norm(x)` (..., N), with the mean and 1 / std (..., 1) of each row that its backward pass reads."""
    return torch.native_layer_norm(x, norm.normalized_shape, norm.weight, norm.bias, norm.eps)


def layer_norm_input_grad(grad, x, mean, rstd, norm: nn.LayerNorm) -> torch.Tensor:
    """The gradient of a LayerNorm's input x (..., N) from that of its output, in one operation: with
    n = (x - mean) rstd and g = grad * weight, d x = rstd (g - mean(g) - n mean(g n)), means over the row."""
    mask = [True, False, False]
    return torch.ops.aten.native_layer_norm_backward(
        grad, x, norm.normalized_shape, mean, rstd, norm.weight, norm.bias, mask
    )[0]


def layer_norm_affine_grads(grad, x, mean, rstd, norm: nn.LayerNorm) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradients of a LayerNorm's weight and bias (N,), summed over all rows of x (..., N): sum(grad n) and
    sum(grad), n = (x - mean) rstd."""
    mask = [False, True, True]
    _, weight_grad, bias_grad = torch.ops.aten.native_layer_norm_backward(
        grad, x, norm.normalized_shape, mean, rstd, norm.weight, norm.bias, mask
    )
    return weight_grad, bias_grad


class LayerNormGRUBackward:
    """`LayerNormGRUCell`'s part of `ObserveBackwardThroughTime`: its activations for all steps at once, the input
    gradients of one step, and the weight gradients of all steps.

    Forward: [reset, candidate, update] = LayerNorm(W [x, state]) (3 x (.., D)); cand = tanh(sigmoid(reset)
    candidate); u = sigmoid(update - 1); deter = u cand + (1 - u) state.
    """

    def __init__(self, gru: LayerNormGRUCell, x: torch.Tensor, state: torch.Tensor):
        """x (T, B, H) and state (T, B, D): each step's input and (reset-masked) previous deter."""
        self.gru, self.x_dim = gru, x.shape[-1]
        self.inputs = torch.cat([x, state], -1)  # (T, B, H + D)
        self.pre_norm = F.linear(self.inputs, gru.linear.weight)  # (T, B, 3D)
        normed, self.mean, self.rstd = layer_norm_stats(self.pre_norm, gru.norm)
        reset, candidate, update = normed.chunk(3, -1)  # (T, B, D) each
        reset = torch.sigmoid(reset)
        cand = torch.tanh(reset * candidate)
        update = torch.sigmoid(update - 1.0)
        d_cand = update * (1 - cand * cand)  # d deter / d (sigmoid(reset) candidate)
        # d deter / d [reset, candidate, update] (the LayerNorm's output), unit by unit
        self.gate_grads = torch.stack(
            [
                d_cand * candidate * reset * (1 - reset),
                d_cand * reset,
                (cand - state) * update * (1 - update),
            ],
            -2,
        )  # (T, B, 3, D)
        self.state_grad = 1 - update  # (T, B, D): d deter / d state, the direct path

    def step_inputs(self) -> list[torch.Tensor]:
        """What `step` reads of each step, time-major (T, B, ...)."""
        return [self.gate_grads, self.pre_norm, self.mean, self.rstd, self.state_grad]

    @staticmethod
    def step(gru: LayerNormGRUCell, grad, gate_grads, pre_norm, mean, rstd, state_grad) -> tuple:
        """d x (B, H) and d state (B, D) of one step from d deter (B, D) and that step's `step_inputs`, with what
        `weight_grads` reads: (the LayerNorm's output gradient, its input gradient) (B, 3D) each."""
        norm_grad = (grad.unsqueeze(-2) * gate_grads).flatten(-2)  # (B, 3D)
        pre_norm_grad = layer_norm_input_grad(norm_grad, pre_norm, mean, rstd, gru.norm)  # (B, 3D)
        input_grad = pre_norm_grad @ gru.linear.weight  # (B, H + D)
        x_dim = gru.linear.in_features - grad.shape[-1]
        x_grad, state_part = input_grad[:, :x_dim], input_grad[:, x_dim:]
        return x_grad, torch.addcmul(state_part, state_grad, grad), (norm_grad, pre_norm_grad)

    def weight_grads(self, saved: list[torch.Tensor]) -> list[torch.Tensor]:
        """Gradients of linear.weight (3D, H + D), norm.weight and norm.bias (3D,), summed over all steps, from
        `step`'s saved gradients stacked time-major (T, B, 3D)."""
        norm_grad, pre_norm_grad = (grad.flatten(0, 1) for grad in saved)  # (T * B, 3D)
        linear_grad = pre_norm_grad.T @ self.inputs.flatten(0, 1)
        norm_weight_grad, norm_bias_grad = layer_norm_affine_grads(
            norm_grad,
            self.pre_norm.flatten(0, 1),
            self.mean.flatten(0, 1),
            self.rstd.flatten(0, 1),
            self.gru.norm,
        )
        return [linear_grad, norm_weight_grad, norm_bias_grad]


class TorchGRUBackward:
    """`nn.GRUCell`'s part of `ObserveBackwardThroughTime` (the nature model), as `LayerNormGRUBackward`.

    Forward: [r, z, n] input parts i = W_ih x + b_ih and state parts s = W_hh state + b_hh (3 x (.., D)); r =
    sigmoid(i_r + s_r), z = sigmoid(i_z + s_z), n = tanh(i_n + r s_n); deter = (1 - z) n + z state.
    """

    def __init__(self, gru: nn.GRUCell, x: torch.Tensor, state: torch.Tensor):
        """x (T, B, H) and state (T, B, D): each step's input and (reset-masked) previous deter."""
        self.gru, self.x, self.state = gru, x, state
        input_r, input_z, input_n = F.linear(x, gru.weight_ih, gru.bias_ih).chunk(3, -1)  # (T, B, D) each
        state_r, state_z, state_n = F.linear(state, gru.weight_hh, gru.bias_hh).chunk(3, -1)
        r = torch.sigmoid(input_r + state_r)
        z = torch.sigmoid(input_z + state_z)
        n = torch.tanh(input_n + r * state_n)
        d_n = (1 - z) * (1 - n * n)  # d deter / d (i_n + r s_n)
        d_r = d_n * state_n * r * (1 - r)  # d deter / d (i_r + s_r)
        d_z = (state - n) * z * (1 - z)  # d deter / d (i_z + s_z)
        self.input_part_grads = torch.stack([d_r, d_z, d_n], -2)  # (T, B, 3, D): d deter / d i
        self.state_part_grads = torch.stack([d_r, d_z, d_n * r], -2)  # (T, B, 3, D): d deter / d s
        self.state_grad = z  # (T, B, D): d deter / d state, the direct path

    def step_inputs(self) -> list[torch.Tensor]:
        """What `step` reads of each step, time-major (T, B, ...)."""
        return [self.input_part_grads, self.state_part_grads, self.state_grad]

    @staticmethod
    def step(gru: nn.GRUCell, grad, input_part_grads, state_part_grads, direct_grad) -> tuple:
        """d x (B, H) and d state (B, D) of one step from d deter (B, D) and that step's `step_inputs`, with what
        `weight_grads` reads: the gradients of the input and state parts (B, 3D) each."""
        input_grad = (grad.unsqueeze(-2) * input_part_grads).flatten(-2)  # (B, 3D)
        state_grad = (grad.unsqueeze(-2) * state_part_grads).flatten(-2)  # (B, 3D)
        x_grad = input_grad @ gru.weight_ih  # (B, H)
        return x_grad, torch.addmm(direct_grad * grad, state_grad, gru.weight_hh), (input_grad, state_grad)

    def weight_grads(self, saved: list[torch.Tensor]) -> list[torch.Tensor]:
        """Gradients of weight_ih (3D, H), weight_hh (3D, D), bias_ih and bias_hh (3D,), summed over all steps,
        from `step`'s saved gradients stacked time-major (T, B, 3D)."""
        input_grad, state_grad = (grad.flatten(0, 1) for grad in saved)  # (T * B, 3D)
        return [
            input_grad.T @ self.x.flatten(0, 1),
            state_grad.T @ self.state.flatten(0, 1),
            input_grad.sum(0),
            state_grad.sum(0),
        ]


# each cell whose backward is written here: the class that holds its formulas ({LayerNormGRUCell:
# LayerNormGRUBackward, nn.GRUCell: TorchGRUBackward}, filled by `bind`, which hands over Part 1's cell)
GRU_BACKWARDS: dict[type, type] = {}


def fast_observe_problem(rssm: RSSM) -> str | None:
    """Why `FastObserve` cannot run `rssm` (a clause to say), or None: it takes the first layer of `img_in` and of
    `posterior_net`, an nn.Linear named `linear`, out of the loop."""
    for name in ("img_in", "posterior_net"):
        layers = list(getattr(rssm, name, nn.Sequential()).named_children())
        if not layers or layers[0][0] != "linear" or type(layers[0][1]) is not nn.Linear:
            return f"RSSM.{name} does not start with an nn.Linear named linear"
    return None


def hand_written_backward_problem(rssm: RSSM) -> str | None:
    """Why `ObserveBackwardThroughTime` cannot run `rssm` (a clause to say), or None: its formulas are those of
    categorical latents, of `img_in` and `posterior_net` as `dense` makes them, and of the cells in GRU_BACKWARDS."""
    if not rssm.classes:
        return "the latents are Gaussian"
    for name, kinds in (
        ("img_in", (nn.Linear, nn.LayerNorm, nn.SiLU)),
        ("posterior_net", (nn.Linear, nn.LayerNorm, nn.SiLU, nn.Linear)),
    ):
        layers = [(layer_name, type(layer)) for layer_name, layer in getattr(rssm, name).named_children()]
        if layers != list(zip(("linear", "norm", "act", "out"), kinds)):
            found = ", ".join(kind.__name__ for _, kind in layers)
            return f"RSSM.{name} is {found}, not {', '.join(kind.__name__ for kind in kinds)}"
    if type(rssm.gru) not in GRU_BACKWARDS:
        known = ", ".join(kind.__name__ for kind in GRU_BACKWARDS)
        return f"its cell is {type(rssm.gru).__name__}, and the backward is written for {known}"
    return None


class ObserveInputs(NamedTuple):
    """What the fast observe's steps read besides the state they carry: the whole sequence's in `FastObserve.__call__`
    (first (B, T, 1), action_in and embed_in (B, T, H), noise (T, B, ...)), one step's in `observe_step` ((B, ...)
    each: the step's slices, `steps`)."""

    # bool: True where an episode starts (the initial state replaces the previous one there)
    first: torch.Tensor
    initial_deter: torch.Tensor  # (1, D)
    initial_stoch: torch.Tensor  # (1, S)
    action_in: torch.Tensor  # the action's share of img_in's first layer, its bias included
    embed_in: torch.Tensor  # the embedding's share of the posterior's first layer, its bias included
    noise: torch.Tensor  # the sampling noise (`RSSM.noise`)
    stoch_weight: torch.Tensor  # (H, S): the share of img_in's first layer on stoch
    deter_weight: torch.Tensor  # (H, D): the share of the posterior's first layer on deter

    def steps(self) -> list[ObserveInputs]:
        """Each step's inputs, in order: views of the sequence's (unbind: one view per step, and one stack in the
        backward pass, where indexing [:, t] would zero-fill and add a whole (B, T, H) gradient at every step)."""
        slices = zip(
            self.first.unbind(1), self.action_in.unbind(1), self.embed_in.unbind(1), self.noise.unbind(0)
        )
        return [
            self._replace(first=first, action_in=action_in, embed_in=embed_in, noise=noise)
            for first, action_in, embed_in, noise in slices
        ]


class FastObserve:
    """`RSSM.observe` in fewer kernels, with a hand-written backward pass (`ObserveBackwardThroughTime`) where it
    applies: the same arguments and results (`check_observe_forward`, `check_observe_backward`). The first layers of
    `img_in` and of the posterior are split: the action's and the embedding's shares for all steps at once before
    the loop, so a step is two fused products and the rest of the cell. --fast-observe off leaves `RSSM.observe`."""

    def __init__(self, rssm: RSSM, hand_written_backward: bool = True):
        self.rssm = rssm
        # img_in's and the posterior's layers after their first (`linear`, split out of the loop)
        self.img_rest, self.post_rest = (
            nn.Sequential(*(layer for name, layer in net.named_children() if name != "linear"))
            for net in (rssm.img_in, rssm.posterior_net)
        )
        # False: autograd's backward of the per-step loop (the same gradients, more operations)
        self.hand_written_backward = hand_written_backward
        # the functions each step runs; `compile_paths` (--compile) puts compiled ones in their place
        self.step, self.reverse_step = self.observe_step, ObserveBackwardThroughTime.reverse_step

    def observe_step(self, deter, stoch, step: ObserveInputs):
        """One posterior step, `img_step` then `posterior` then `sample`, from deter (B, D) and stoch (B, S), with the
        parts that do not depend on the previous step computed for the whole sequence beforehand (`__call__`): the
        step's `ObserveInputs`. Returns deter, stoch, posterior."""
        rssm = self.rssm
        deter, stoch = rssm.episode_start(step.first, deter, stoch, (step.initial_deter, step.initial_stoch))
        # one fused product-and-sum each: = img_in.linear(cat[stoch, action]), = posterior_net.linear(cat[deter, embed])
        hidden = torch.addmm(step.action_in, stoch, step.stoch_weight.t())
        deter = rssm.gru(upcast(self.img_rest(hidden)), deter)
        hidden = torch.addmm(step.embed_in, deter, step.deter_weight.t())
        posterior = rssm._stats(self.post_rest(hidden))
        return deter, rssm.sample(posterior, step.noise, fast_one_hot_draw), posterior

    def __call__(self, embed: torch.Tensor, action: torch.Tensor, is_first: torch.Tensor, noise=None):
        """`RSSM.observe(embed, action, is_first, noise)`, see there."""
        rssm = self.rssm
        B, T = embed.shape[:2]
        first = is_first.unsqueeze(-1)  # (B, T, 1) bool: where an episode starts
        keep = (~first).to(
            embed.dtype
        )  # (B, T, 1): 0 where an episode starts (and its previous action is zero)
        if noise is None:
            noise = rssm.noise((T, B), embed.device)
        # the first layers of img_in (on [stoch, action]) and of the posterior (on [deter, embed]), split: the action
        # and embed halves for all steps at once, before the loop (the same weights and sums, far fewer kernels)
        img_first, post_first = rssm.img_in.linear, rssm.posterior_net.linear
        action_in = F.linear(
            action * keep, img_first.weight[:, rssm.stoch_flat :], img_first.bias
        )  # (B, T, H)
        embed_in = F.linear(embed, post_first.weight[:, rssm.deter_dim :], post_first.bias)  # (B, T, H)
        stoch_weight, deter_weight = (
            img_first.weight[:, : rssm.stoch_flat],
            post_first.weight[:, : rssm.deter_dim],
        )
        initial_deter, initial_stoch = rssm.initial(1)  # (1, D), (1, S)
        inputs = ObserveInputs(
            first, initial_deter, initial_stoch, action_in, embed_in, noise, stoch_weight, deter_weight
        )
        if self.backward_through_time_applies(embed):
            deter, stoch, posterior = ObserveBackwardThroughTime.apply(self, *inputs, *self.scan_parameters())
        else:
            deter, stoch, posterior = self.observe_loop(inputs)
        # the prior depends on deter alone: all steps at once, after the loop
        return deter, stoch, posterior, rssm.prior(deter)

    def observe_loop(self, inputs: ObserveInputs):
        """`observe_step` at each step of a sequence (`__call__`'s `ObserveInputs`): deter (B, T, D), stoch (B, T,
        S), posterior (B, T, ...). Autograd records every step, unless `ObserveBackwardThroughTime` runs it. Before
        the first step the state is the initial one."""
        B = inputs.first.shape[0]
        # (B, D), (B, S); the first step's inputs shaped as the later steps' (a compiled step compiles once)
        deter = inputs.initial_deter.expand(B, -1).contiguous()
        stoch = inputs.initial_stoch.expand(B, -1).contiguous()
        deters, stochs, posteriors = [], [], []
        for step in inputs.steps():
            deter, stoch, posterior = self.step(deter, stoch, step)
            deters.append(deter), stochs.append(stoch), posteriors.append(posterior)
        return torch.stack(deters, 1), torch.stack(stochs, 1), torch.stack(posteriors, 1)

    def backward_through_time_applies(self, embed: torch.Tensor) -> bool:
        """Whether the call takes `ObserveBackwardThroughTime` (its hand-written backward pass): with gradients,
        categorical latents and no autocast. Gaussian latents (classes 0) and autocast take autograd's backward of
        `observe_loop` (tests/test_dreamer_fast_path.py checks which runs); without gradients both are the loop."""
        return (
            self.hand_written_backward
            and self.rssm.classes > 0
            and torch.is_grad_enabled()
            and not torch.is_autocast_enabled(embed.device.type)
        )

    def scan_parameters(self) -> list[torch.Tensor]:
        """The parameters `observe_step` uses besides the first layers' (whose shares `__call__` passes in), in the
        order `ObserveBackwardThroughTime` returns their gradients: img_in's and the posterior's LayerNorms, the
        posterior's output layer, then the GRU's own (`LayerNormGRUCell` or `nn.GRUCell`)."""
        rssm = self.rssm
        img_norm, post_norm, post_out = rssm.img_in.norm, rssm.posterior_net.norm, rssm.posterior_net.out
        return [
            img_norm.weight,
            img_norm.bias,
            post_norm.weight,
            post_norm.bias,
            post_out.weight,
            post_out.bias,
            *rssm.gru.parameters(),
        ]


class ReverseStepInputs(NamedTuple):
    """What a step of the hand-written backward (`ObserveBackwardThroughTime.reverse_step`) reads besides the
    gradients it carries: the sequence's, time-major (T, B, ...), in `reverse_steps`; one step's (B, ...) each in
    `reverse_step` (`steps`). The share of the step's own output gradients, the factor of the carried stoch gradient,
    the step's activations (`ObserveActivations`), the previous step's output gradient of deter, `keep`, and what the
    cell's backward step reads (`gru`: its `step_inputs`)."""

    own_grad: torch.Tensor
    carried_factor: torch.Tensor
    probs: torch.Tensor
    post_silu_grad: torch.Tensor
    post_pre: torch.Tensor
    post_mean: torch.Tensor
    post_rstd: torch.Tensor
    img_silu_grad: torch.Tensor
    img_pre: torch.Tensor
    img_mean: torch.Tensor
    img_rstd: torch.Tensor
    deter_grad_prev: torch.Tensor
    keep: torch.Tensor
    gru: tuple

    def steps(self) -> list[ReverseStepInputs]:
        """Each step's inputs, in order: views of the sequence's."""
        fields = [tensor.unbind(0) for tensor in self[:-1]]
        cell = [tensor.unbind(0) for tensor in self.gru]
        return [ReverseStepInputs(*step, gru=tuple(gru)) for step, gru in zip(zip(*fields), zip(*cell))]


class ObserveBackwardThroughTime(torch.autograd.Function):
    """`RSSM.observe`'s loop with a hand-written backward pass through time (categorical latents, no autocast).

    Autograd's backward pass of the per-step loop computes, at every step, that step's share of the gradient of each
    of the ~12 weight tensors the step uses, and adds it up: most of its operations. Only the gradients of the state
    (deter, stoch) must be computed one step after another, in reverse; a weight's gradient is a sum over all B x T
    rows of (its layer's output gradient) x (its layer's input), so it is computed once, after the loop, as one large
    product. So the forward pass runs `FastObserve.observe_loop` without a graph, keeping only its inputs and outputs; the
    backward pass recomputes the steps' activations for all steps at once (given the states, no step depends on
    another), walks the steps in reverse for the state gradients, then forms the weight gradients. Equal to
    autograd's in float64 (tests/test_dreamer_fast_path.py). The forward pass calls `observe_step` and the backward
    pass `FastObserve.reverse_step` at each step, both compiled with --compile.

    A step (`observe_step`), with the previous deter and stoch replaced by the initial state where an episode starts
    (keep = 0 there; the initial deter's gradient is the sum of the previous deter's gradients at those steps):
    img = silu(LN(stoch Ws^T + action_in)); deter = GRU(img, deter); post = silu(LN(deter Wd^T + embed_in));
    probs = softmax(post Wo^T + bo) (B, S, C); mixed = (1 - unimix) probs + unimix / C; posterior = log(mixed);
    stoch = one_hot + mixed - sg(mixed) (straight-through: d stoch / d posterior = mixed).
    """

    @staticmethod
    def forward(ctx, fast: FastObserve, *inputs):
        """`fast.observe_loop` of `inputs[:8]` (`ObserveInputs`, as tensors: autograd.Function runs this without a
        graph); `inputs[8:]` are `fast.scan_parameters()`, passed so that autograd knows the outputs depend on them."""
        deter, stoch, posterior = fast.observe_loop(ObserveInputs(*inputs[:8]))
        ctx.fast = fast
        ctx.save_for_backward(*inputs, deter, stoch)
        return deter, stoch, posterior

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, deter_grad, stoch_grad, posterior_grad):
        """d outputs (B, T, ...) -> d inputs, in `forward`'s order (None for fast, first, initial_stoch, noise)."""
        fast = ctx.fast
        rssm = fast.rssm
        first, initial_deter, initial_stoch, action_in, embed_in, _, stoch_weight, deter_weight, *rest = (
            ctx.saved_tensors
        )
        deter, stoch = rest[-2:]
        # time-major from here, (T, B, ...): a step's rows are contiguous
        first = first.transpose(0, 1)  # (T, B, 1) bool
        keep = (~first).to(deter.dtype)  # (T, B, 1)
        deter, stoch = deter.transpose(0, 1), stoch.transpose(0, 1)  # (T, B, D), (T, B, S*C)
        grads = (deter_grad.transpose(0, 1), stoch_grad.transpose(0, 1), posterior_grad.transpose(0, 1))
        # 1. every step's activations at once, from the states the forward pass returned
        initial = (initial_deter, initial_stoch)
        acts = ObserveActivations(
            rssm, first, initial, action_in, embed_in, stoch_weight, deter_weight, deter, stoch
        )
        # 2. the steps in reverse: the state gradients (the only sequential part) and each layer's output gradient
        layer_grads = ObserveBackwardThroughTime.reverse_steps(
            acts, keep, *grads, reverse_step=fast.reverse_step
        )
        # 3. the weight gradients, each a sum over all T x B rows: one product or one reduction
        return ObserveBackwardThroughTime.weight_grads(acts, first, layer_grads)

    @staticmethod
    def reverse_steps(
        acts: ObserveActivations, keep, deter_grad, stoch_grad, posterior_grad, reverse_step: Callable
    ) -> tuple:
        """The steps in reverse, time-major (T, B, ...) gradients of the outputs in: the gradients of each layer's
        output at every step (T, B, ...), for `weight_grads`: logits, post_norm, post_pre, img_norm, img_pre, then
        the GRU's own (see its `step`). `reverse_step` is `ObserveBackwardThroughTime.reverse_step`, or its compiled
        form with --compile."""
        rssm = acts.rssm
        S, C, T = rssm.stoch_dim, rssm.classes, acts.deter.shape[0]
        probs_share, mixed = acts.probs_share, acts.mixed
        # softmax's backward reads probs * d probs. Through posterior = log(mixed): d probs = (1 - unimix) d posterior
        # / mixed; through the straight-through stoch (d stoch / d posterior = mixed, so d stoch / d mixed = 1):
        # d probs = (1 - unimix) d stoch. `own_grad` is the share of each step's own output gradients, for all steps
        # at once; `carried_factor` multiplies the stoch gradient that step t + 1 sends back (0 where it starts an
        # episode, and after the last step)
        own_grad = probs_share / mixed * posterior_grad
        own_grad = torch.addcmul(own_grad, probs_share, stoch_grad.unflatten(-1, (S, C)))  # (T, B, S, C)
        keep_next = torch.cat([keep[1:], torch.zeros_like(keep[:1])]).unsqueeze(-1)  # (T, B, 1, 1)
        carried_factor = probs_share * keep_next  # (T, B, S, C)
        # (T, B, D): at step t, step t - 1's output gradient of deter
        deter_grad_prev = torch.cat([torch.zeros_like(deter_grad[:1]), deter_grad[:-1]])
        sequence = ReverseStepInputs(
            own_grad,
            carried_factor,
            acts.probs,
            acts.post_silu_grad,
            acts.post_pre,
            acts.post_mean,
            acts.post_rstd,
            acts.img_silu_grad,
            acts.img_pre,
            acts.img_mean,
            acts.img_rstd,
            deter_grad_prev,
            keep,
            tuple(acts.gru.step_inputs()),
        )
        steps = sequence.steps()
        deter_carry = deter_grad[T - 1].contiguous()  # (B, D): d deter_t from the outputs and the later steps
        # (B, S*C): d (stoch_t * keep_{t+1}), from step t + 1 (none after the last step)
        stoch_carry = torch.zeros_like(acts.stoch_prev[0])
        saved = []
        for t in reversed(range(T)):
            deter_carry, stoch_carry, layer_grads = reverse_step(
                rssm, acts.gru.step, acts.deter_weight, acts.stoch_weight, deter_carry, stoch_carry, steps[t]
            )
            saved.append(layer_grads)
        return tuple(torch.stack(grads[::-1]) for grads in zip(*saved))  # (T, B, ...) each

    @staticmethod
    def reverse_step(
        rssm, gru_step, deter_weight, stoch_weight, deter_carry, stoch_carry, step: ReverseStepInputs
    ) -> tuple:
        """One step of `reverse_steps`, step t's tensors in (`ReverseStepInputs`, (B, ...) each): d deter_t and
        d stoch_t carried from the later steps in, those of step t - 1 out (masked where step t starts an episode),
        with the gradients of each layer's output at step t. --compile compiles it once for every step
        (`FastObserve.reverse_step`)."""
        S, C = rssm.stoch_dim, rssm.classes
        post_norm, post_out = rssm.posterior_net.norm, rssm.posterior_net.out
        own_grad, carried_factor, probs, post_silu_grad, post_pre, post_mean, post_rstd = step[:7]
        img_silu_grad, img_pre, img_mean, img_rstd, deter_grad_prev, keep, gru_inputs = step[7:]
        # posterior head: probs * d probs -> d logits (softmax) -> d post_pre (silu, LayerNorm)
        probs_grad = torch.addcmul(own_grad, carried_factor, stoch_carry.unflatten(-1, (S, C)))  # (B, S, C)
        logits_grad = torch.addcmul(probs_grad, probs, probs_grad.sum(-1, keepdim=True), value=-1)
        logits_grad = logits_grad.flatten(-2)  # (B, S*C)
        post_norm_grad = (logits_grad @ post_out.weight) * post_silu_grad  # (B, H)
        post_pre_grad = layer_norm_input_grad(
            post_norm_grad, post_pre, post_mean, post_rstd, post_norm
        )  # (B, H)
        deter_total = torch.addmm(deter_carry, post_pre_grad, deter_weight)  # (B, D): all of d deter_t
        # GRU, then img_in: d img -> d img_pre (silu, LayerNorm) -> d stoch_prev
        img_grad, deter_prev_grad, gru_grads = gru_step(rssm.gru, deter_total, *gru_inputs)  # (B, H), (B, D)
        img_norm_grad = img_grad * img_silu_grad
        img_pre_grad = layer_norm_input_grad(img_norm_grad, img_pre, img_mean, img_rstd, rssm.img_in.norm)
        # the previous step's state gradients, masked where this step starts an episode (keep is in
        # carried_factor for stoch); there, and at t = 0, deter's goes to the initial state (`weight_grads`)
        deter_carry = torch.addcmul(deter_grad_prev, keep, deter_prev_grad)
        stoch_carry = img_pre_grad @ stoch_weight  # (B, S*C)
        layer_grads = (
            logits_grad,
            post_norm_grad,
            post_pre_grad,
            img_norm_grad,
            img_pre_grad,
            deter_prev_grad,
        )
        return deter_carry, stoch_carry, (*layer_grads, *gru_grads)

    @staticmethod
    def weight_grads(acts: ObserveActivations, first, layer_grads: tuple) -> tuple:
        """`backward`'s result from the layers' output gradients (`reverse_steps`): each weight's gradient one
        product or one reduction over all T x B rows; the initial deter's, the previous deter's gradient summed over
        the steps that start from it (first (T, B, 1), and every sequence's step 0)."""
        rssm = acts.rssm
        img_norm, post_norm = rssm.img_in.norm, rssm.posterior_net.norm
        logits_grad, post_norm_grad, post_pre_grad, img_norm_grad, img_pre_grad = layer_grads[:5]
        deter_prev_grad, gru_grads = layer_grads[5], layer_grads[6:]

        def rows(x: torch.Tensor) -> torch.Tensor:
            """(T, B, ...) -> (T * B, ...)."""
            return x.flatten(0, 1)

        img_norm_weight_grad, img_norm_bias_grad = layer_norm_affine_grads(
            rows(img_norm_grad), rows(acts.img_pre), rows(acts.img_mean), rows(acts.img_rstd), img_norm
        )
        post_norm_weight_grad, post_norm_bias_grad = layer_norm_affine_grads(
            rows(post_norm_grad), rows(acts.post_pre), rows(acts.post_mean), rows(acts.post_rstd), post_norm
        )
        parameter_grads = [
            img_norm_weight_grad,
            img_norm_bias_grad,
            post_norm_weight_grad,
            post_norm_bias_grad,
            rows(logits_grad).T @ rows(acts.post),  # (S*C, H)
            rows(logits_grad).sum(0),
            *acts.gru.weight_grads(gru_grads),
        ]
        stoch_weight_grad = rows(img_pre_grad).T @ rows(acts.stoch_prev)  # (H, S*C)
        deter_weight_grad = rows(post_pre_grad).T @ rows(acts.deter)  # (H, D)
        action_in_grad, embed_in_grad = (
            img_pre_grad.transpose(0, 1),
            post_pre_grad.transpose(0, 1),
        )  # (B, T, H)
        from_initial = first.clone()
        from_initial[0] = True  # (T, B, 1): the steps whose previous deter is the initial one
        initial_deter_grad = torch.where(from_initial, deter_prev_grad, 0).sum((0, 1)).unsqueeze(0)  # (1, D)
        return (
            None,
            None,
            initial_deter_grad,
            None,
            action_in_grad,
            embed_in_grad,
            None,
            stoch_weight_grad,
            deter_weight_grad,
            *parameter_grads,
        )


class ObserveActivations:
    """Every step's activations of `FastObserve.observe_step` at once, time-major (T, B, ...), recomputed from the states
    the forward pass returned (given deter and stoch, no step depends on another): what `ObserveBackwardThroughTime`
    reads."""

    def __init__(self, rssm, first, initial, action_in, embed_in, stoch_weight, deter_weight, deter, stoch):
        """first (T, B, 1) bool, deter (T, B, D), stoch (T, B, S*C) time-major, initial the initial deter (1, D) and
        stoch (1, S*C); action_in and embed_in (B, T, H)."""
        img_norm, post_norm, post_out = rssm.img_in.norm, rssm.posterior_net.norm, rssm.posterior_net.out
        S, C, unimix = rssm.stoch_dim, rssm.classes, rssm.unimix
        self.rssm, self.stoch_weight, self.deter_weight, self.deter = rssm, stoch_weight, deter_weight, deter
        # each step's previous state: the one before, or the initial one where an episode starts and at step 0
        initial_deter, initial_stoch = (x.expand_as(state[:1]) for x, state in zip(initial, (deter, stoch)))
        deter_prev = torch.where(first, initial_deter, torch.cat([initial_deter, deter[:-1]]))  # (T, B, D)
        self.stoch_prev = torch.where(
            first, initial_stoch, torch.cat([initial_stoch, stoch[:-1]])
        )  # (T, B, S*C)
        self.img_pre = F.linear(self.stoch_prev, stoch_weight) + action_in.transpose(0, 1)  # (T, B, H)
        img_normed, self.img_mean, self.img_rstd = layer_norm_stats(self.img_pre, img_norm)
        img = F.silu(img_normed)  # (T, B, H): the GRU's input
        self.img_silu_grad = silu_derivative(img_normed)
        self.gru = GRU_BACKWARDS[type(rssm.gru)](rssm.gru, img, deter_prev)
        self.post_pre = F.linear(deter, deter_weight) + embed_in.transpose(0, 1)  # (T, B, H)
        post_normed, self.post_mean, self.post_rstd = layer_norm_stats(self.post_pre, post_norm)
        self.post = F.silu(post_normed)  # (T, B, H)
        self.post_silu_grad = silu_derivative(post_normed)
        self.probs = F.softmax(post_out(self.post).unflatten(-1, (S, C)), -1)  # (T, B, S, C)
        self.probs_share = (1 - unimix) * self.probs  # (T, B, S, C)
        self.mixed = self.probs_share + unimix / C  # the posterior's probabilities, as `_stats` computes them


def check_inputs(rssm: RSSM, B: int = 2, T: int = 6) -> tuple:
    """A small seeded batch for the checks: embed (B, T, E), one-hot actions, is_first (both sequences start, one has
    an episode start inside), the sampling noise. The global random state is left as it was."""
    embed_dim = rssm.posterior_net.linear.in_features - rssm.deter_dim
    num_actions = rssm.img_in.linear.in_features - rssm.stoch_flat
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        embed = torch.randn(B, T, embed_dim, dtype=torch.float64)
        action = F.one_hot(torch.randint(num_actions, (B, T)), num_actions).double()
        is_first = torch.zeros(B, T, dtype=torch.bool)
        is_first[:, 0], is_first[1, 2] = True, True
        noise = rssm.noise((T, B), "cpu")
    return embed, action, is_first, noise


def check_observe_forward(rssm: RSSM, tolerance: float = 1e-9) -> None:
    """The fast observe's forward (`FastObserve`: its first layers split out of the loop, `observe_step`) against
    `RSSM.observe` (`img_step`, `posterior`, `sample` at each step), in float64, on `rssm`'s weights and with its GRU
    saturated: a change to one that is not carried into the other raises FastPathMismatch."""
    for scale, weights in ((1.0, "the run's weights"), (8.0, "the run's weights with the GRU's x 8")):
        reference = float64_copy(rssm, scale)
        inputs = check_inputs(reference)
        with torch.no_grad():
            fast = FastObserve(reference)(*inputs)
            readable = reference.observe(*inputs)
        for name, ours, expected in zip(("deter", "stoch", "posterior", "prior"), fast, readable):
            error = relative_error(ours, expected)
            if not error <= tolerance:
                raise FastPathMismatch(
                    f"the fast observe (FastObserve.observe_step) gives another {name} than the readable cell "
                    f"(RSSM.observe) on {weights} (relative error {error:.1e}): carry the change into both, or "
                    f"run with --fast-observe off.",
                    off={"fast_observe": "off"},
                )


def observe_gradients(reference: RSSM, hand_written: bool) -> dict[str, torch.Tensor]:
    """The gradients of a fixed loss on `reference`'s observe (`check_inputs`): the fast observe's with its
    hand-written backward, or autograd's through `RSSM.observe` as written: {"embed": ..., parameter name: ...} (zeros
    where a parameter gets none)."""
    embed, action, is_first, noise = check_inputs(reference)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        weights = [
            torch.randn(*is_first.shape, n, dtype=torch.float64)
            for n in (reference.deter_dim, reference.stoch_flat)
        ]
    named = {"embed": embed.requires_grad_(True), **dict(reference.named_parameters())}
    observe = FastObserve(reference) if hand_written else reference.observe
    deter, stoch, posterior, _ = observe(embed, action, is_first, noise)
    loss = (deter * weights[0]).sum() + (stoch * weights[1]).sum() + posterior.exp().square().sum()
    grads = torch.autograd.grad(loss, list(named.values()), allow_unused=True)
    return {name: torch.zeros_like(x) if g is None else g for (name, x), g in zip(named.items(), grads)}


def check_observe_backward(rssm: RSSM, tolerance: float = 1e-8) -> None:
    """The hand-written backward against autograd's, on a float64 copy of `rssm` (its weights, and with its GRU
    saturated). `ObserveBackwardThroughTime` recomputes the step with its own code, so a change to `observe_step`
    that is not carried into it would train on wrong gradients without a word; this raises FastPathMismatch
    instead. The global random state is left as it was."""
    if rssm.classes == 0:  # Gaussian latents take autograd's backward
        return
    for scale in (1.0, 8.0):
        reference = float64_copy(rssm, scale)
        ours, autograd = observe_gradients(reference, True), observe_gradients(reference, False)
        for name, expected in autograd.items():
            error = relative_error(ours[name], expected)
            if not error <= tolerance:
                raise FastPathMismatch(
                    f"the fast observe's hand-written backward gives another gradient of {name} than autograd's "
                    f"through RSSM.observe (relative error {error:.1e}): carry the change into its formulas "
                    f"(ObserveBackwardThroughTime.reverse_step, and {GRU_BACKWARDS[type(rssm.gru)].__name__} for the "
                    f"cell), or run with --observe-backward autograd.",
                    off={"observe_backward": "autograd"},
                )


# --- The fused observe scan (Triton): an observe step in 4 kernels, its backward step in 4 ----------------------------
#
# --fused-scan (CUDA): `FusedObserve` is `FastObserve` whose two per-step functions, `step` (one observe step) and
# `reverse_step` (one step of `ObserveBackwardThroughTime`'s backward), launch four Triton kernels each, where the
# fast observe's dispatch about 28 and 15 torch operations (tests/test_dreamer_fused_scan.py counts both). What comes
# before and after the loops stays `FastObserve`'s and `ObserveBackwardThroughTime`'s (the first layers' shares for
# all steps, the activations the backward reads, the weight gradients as products over all T x B rows): the kernels
# compute only what must go step by step.
#
# A step is four dependent products, each followed by a LayerNorm over whole rows (or a softmax over a latent's
# classes), so each kernel is one product: its prologue makes the product's input from the last kernel's output
# (normalise a row, the GRU's gates), its epilogue does what needs only its own columns. At batch 16 a product has
# 16 rows, so the work is divided by output columns: each program computes one block of columns for every row,
# reading whole input rows and its columns of the weight, and the blocks are sized so that the programs fill the
# GPU's SMs (`scan_blocks`). Two consequences, met the same way in every kernel:
# - A LayerNorm needs statistics of whole rows, which no program has: each program stores those of its own columns
#   (forward: the mean and the sum of squared deviations M2; backward: the sums of g and g n), and the next kernel
#   combines them (Chan's formula, exact to rounding: M2 = sum_p M2_p + n_p (mean_p - mean)^2).
# - The next kernel's prologue makes its whole input row in every program (each needs all of it); where that row is
#   also an output (deter, the gradients `weight_grads` reads), its chunk k is stored by program k mod programs.
# The products are broadcast multiply-and-sums rather than `tl.dot`: any float type (float64 for the tests and the
# checks, on the CPU under TRITON_INTERPRET=1 and on the GPU), full float32 (no TF32), no 16-row minimum. The
# categorical draw is `one_hot_draw`'s: a float32 CDF of exp(posterior) against the step's uniform.

# Triton's language, imported at the fused scan's first use (`scan_kernels`): importing Triton takes half a second,
# and a machine without it runs everything else. Until then `tl` serves only the kernels' `tl.constexpr`
# annotations, which Python reads when it defines them.
tl = types.SimpleNamespace(constexpr="constexpr")


def merged_layer_norm_stats(
    stats_ptr, rows, row_ok, B, width, block, repeats: tl.constexpr, eps, BLOCK_P: tl.constexpr
):
    """A LayerNorm's mean and 1 / std for `rows` (BLOCK_B,), merged by Chan's formula from the mean and M2 that each
    of the cdiv(width, block) programs of the kernel before wrote for its columns (stats (2, B, programs)); each of a
    program's columns counts `repeats` times (the GRU's three parts). Called from the scan's kernels."""
    dtype = stats_ptr.dtype.element_ty
    producers = tl.cdiv(width, block)
    parts = tl.arange(0, BLOCK_P)
    part_ok = row_ok[:, None] & (parts < producers)[None, :]
    counts = repeats * tl.where(parts < producers, tl.minimum(width - parts * block, block), 0).to(dtype)
    means = tl.load(stats_ptr + rows[:, None] * producers + parts[None, :], mask=part_ok, other=0.0)
    m2s = tl.load(stats_ptr + (B + rows[:, None]) * producers + parts[None, :], mask=part_ok, other=0.0)
    mean = tl.sum(counts[None, :] * means, 1) / (repeats * width)
    spread = tl.where(part_ok, means - mean[:, None], 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(m2s + counts[None, :] * spread * spread, 1) / (repeats * width) + eps)
    return mean, rstd


def row_layer_norm_stats(x, ok, W, eps):
    """A LayerNorm's statistics over whole rows of x (BLOCK_R, BLOCK_W), the columns past W masked out by `ok`: x less
    each row's mean (zero where masked) and each row's 1 / std. Called from the epilogues' kernels."""
    mean = tl.sum(x, 1) / W
    deviation = tl.where(ok, x - mean[:, None], 0.0)
    return deviation, 1.0 / tl.sqrt(tl.sum(deviation * deviation, 1) / W + eps)


def scan_img_in_kernel(
    stoch_ptr,
    first_ptr,
    first_stride,
    initial_stoch_ptr,
    action_in_ptr,
    action_in_stride,
    weight_ptr,
    weight_stride,
    img_pre_ptr,
    stats_ptr,
    B,
    S,
    H,
    BLOCK_B: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Forward 1 of 4, img_in's product: img_pre = stoch_prev Ws^T + action_in (B, H), this program's block of H's
    columns; stoch_prev is stoch (B, S), or the initial stoch (S,) where `first` (B,) says an episode starts. With
    each row's mean and M2 over these columns (stats (2, B, programs))."""
    pid = tl.program_id(0)
    rows = tl.arange(0, BLOCK_B)
    cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < B
    col_ok = cols < H
    ok = row_ok[:, None] & col_ok[None, :]
    first = tl.load(first_ptr + rows * first_stride, mask=row_ok, other=0) != 0
    acc = tl.zeros([BLOCK_B, BLOCK_K, BLOCK_N], dtype=img_pre_ptr.dtype.element_ty)
    for k in range(0, S, BLOCK_K):
        ks = k + tl.arange(0, BLOCK_K)
        k_ok = ks < S
        stoch = tl.load(
            stoch_ptr + rows[:, None] * S + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0
        )
        initial = tl.load(initial_stoch_ptr + ks, mask=k_ok, other=0.0)
        stoch = tl.where(first[:, None], initial[None, :], stoch)  # (BLOCK_B, BLOCK_K)
        w_ok = k_ok[:, None] & col_ok[None, :]
        weight = tl.load(weight_ptr + cols[None, :] * weight_stride + ks[:, None], mask=w_ok, other=0.0)
        acc += stoch[:, :, None] * weight[None, :, :]  # weight (BLOCK_K, BLOCK_N): Ws[col, k]
    action_in = tl.load(action_in_ptr + rows[:, None] * action_in_stride + cols[None, :], mask=ok, other=0.0)
    img_pre = tl.sum(acc, 1) + action_in  # (BLOCK_B, BLOCK_N)
    tl.store(img_pre_ptr + rows[:, None] * H + cols[None, :], img_pre, mask=ok)
    programs = tl.num_programs(0)
    mean = tl.sum(tl.where(ok, img_pre, 0.0), 1) / tl.sum(col_ok.to(tl.int32), 0)
    deviation = tl.where(ok, img_pre - mean[:, None], 0.0)
    tl.store(stats_ptr + rows * programs + pid, mean, mask=row_ok)
    tl.store(stats_ptr + (B + rows) * programs + pid, tl.sum(deviation * deviation, 1), mask=row_ok)


def scan_gru_in_kernel(
    img_pre_ptr,
    img_stats_ptr,
    norm_weight_ptr,
    norm_bias_ptr,
    deter_ptr,
    first_ptr,
    first_stride,
    initial_deter_ptr,
    weight_ptr,
    constants_ptr,
    pre_ptr,
    stats_ptr,
    B,
    H,
    D,
    IMG_BLOCK,
    BLOCK_B: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    """Forward 2 of 4, the GRU's product: pre = [img, deter_prev] Wg^T (B, 3D) for this program's block of units,
    their reset, candidate and update columns (j, D + j, 2D + j); img = silu(LayerNorm(img_pre)) with img_in's
    LayerNorm (its statistics combined from kernel 1's, whose programs took IMG_BLOCK columns each); deter_prev =
    deter (B, D), or the initial deter where an episode starts. With each row's mean and M2 over this program's
    3 x BLOCK_N columns (stats (2, B, programs))."""
    pid = tl.program_id(0)
    dtype = pre_ptr.dtype.element_ty
    rows = tl.arange(0, BLOCK_B)
    units = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < B
    unit_ok = units < D
    ok = row_ok[:, None] & unit_ok[None, :]
    # img_in's LayerNorm statistics from kernel 1's
    mean, rstd = merged_layer_norm_stats(
        img_stats_ptr, rows, row_ok, B, H, IMG_BLOCK, 1, tl.load(constants_ptr), BLOCK_P
    )
    first = tl.load(first_ptr + rows * first_stride, mask=row_ok, other=0) != 0
    reset_acc = tl.zeros([BLOCK_B, BLOCK_K, BLOCK_N], dtype=dtype)
    candidate_acc = tl.zeros([BLOCK_B, BLOCK_K, BLOCK_N], dtype=dtype)
    update_acc = tl.zeros([BLOCK_B, BLOCK_K, BLOCK_N], dtype=dtype)
    for k in range(0, H, BLOCK_K):  # the input's first part: img
        ks = k + tl.arange(0, BLOCK_K)
        k_ok = ks < H
        x_ok = row_ok[:, None] & k_ok[None, :]
        img = tl.load(img_pre_ptr + rows[:, None] * H + ks[None, :], mask=x_ok, other=0.0)
        norm_weight = tl.load(norm_weight_ptr + ks, mask=k_ok, other=0.0)
        norm_bias = tl.load(norm_bias_ptr + ks, mask=k_ok, other=0.0)
        img = (img - mean[:, None]) * rstd[:, None] * norm_weight[None, :] + norm_bias[None, :]
        img = tl.where(x_ok, img / (1.0 + tl.exp(-img)), 0.0)  # silu
        w_ok = k_ok[:, None] & unit_ok[None, :]
        weight = weight_ptr + units[None, :] * (H + D) + ks[:, None]  # (BLOCK_K, BLOCK_N): Wg[j, k]
        reset_acc += img[:, :, None] * tl.load(weight, mask=w_ok, other=0.0)[None, :, :]
        candidate_acc += img[:, :, None] * tl.load(weight + D * (H + D), mask=w_ok, other=0.0)[None, :, :]
        update_acc += img[:, :, None] * tl.load(weight + 2 * D * (H + D), mask=w_ok, other=0.0)[None, :, :]
    for k in range(0, D, BLOCK_K):  # its second part: deter_prev
        ks = k + tl.arange(0, BLOCK_K)
        k_ok = ks < D
        x_ok = row_ok[:, None] & k_ok[None, :]
        deter = tl.load(deter_ptr + rows[:, None] * D + ks[None, :], mask=x_ok, other=0.0)
        initial = tl.load(initial_deter_ptr + ks, mask=k_ok, other=0.0)
        deter = tl.where(first[:, None], initial[None, :], deter)
        w_ok = k_ok[:, None] & unit_ok[None, :]
        weight = weight_ptr + units[None, :] * (H + D) + H + ks[:, None]
        reset_acc += deter[:, :, None] * tl.load(weight, mask=w_ok, other=0.0)[None, :, :]
        candidate_acc += deter[:, :, None] * tl.load(weight + D * (H + D), mask=w_ok, other=0.0)[None, :, :]
        update_acc += deter[:, :, None] * tl.load(weight + 2 * D * (H + D), mask=w_ok, other=0.0)[None, :, :]
    reset = tl.sum(reset_acc, 1)
    candidate = tl.sum(candidate_acc, 1)
    update = tl.sum(update_acc, 1)
    out = pre_ptr + rows[:, None] * 3 * D + units[None, :]
    tl.store(out, reset, mask=ok)
    tl.store(out + D, candidate, mask=ok)
    tl.store(out + 2 * D, update, mask=ok)
    programs = tl.num_programs(0)
    mean = tl.sum(tl.where(ok, reset + candidate + update, 0.0), 1) / (3 * tl.sum(unit_ok.to(tl.int32), 0))
    reset = tl.where(ok, reset - mean[:, None], 0.0)
    candidate = tl.where(ok, candidate - mean[:, None], 0.0)
    update = tl.where(ok, update - mean[:, None], 0.0)
    tl.store(stats_ptr + rows * programs + pid, mean, mask=row_ok)
    m2 = tl.sum(reset * reset + candidate * candidate + update * update, 1)
    tl.store(stats_ptr + (B + rows) * programs + pid, m2, mask=row_ok)


def scan_gru_out_kernel(
    pre_ptr,
    gru_stats_ptr,
    norm_weight_ptr,
    norm_bias_ptr,
    deter_ptr,
    first_ptr,
    first_stride,
    initial_deter_ptr,
    embed_in_ptr,
    embed_in_stride,
    weight_ptr,
    weight_stride,
    constants_ptr,
    deter_out_ptr,
    post_pre_ptr,
    stats_ptr,
    B,
    D,
    H,
    GRU_BLOCK,
    BLOCK_B: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    """Forward 3 of 4, the GRU's gates, then the posterior's product: deter = lerp(deter_prev, tanh(sigmoid(reset)
    candidate), sigmoid(update - 1)) (B, D) from LayerNorm(pre) (its statistics combined from kernel 2's, whose
    programs took GRU_BLOCK units each), made whole in every program and stored chunk by chunk; post_pre = deter Wd^T
    + embed_in (B, H) for this program's block of H's columns, with each row's mean and M2 over them (stats)."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    dtype = post_pre_ptr.dtype.element_ty
    rows = tl.arange(0, BLOCK_B)
    cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < B
    col_ok = cols < H
    ok = row_ok[:, None] & col_ok[None, :]
    # the GRU's LayerNorm statistics over its 3D columns (each program's D / programs units, 3 columns each), from
    # kernel 2's
    mean, rstd = merged_layer_norm_stats(
        gru_stats_ptr, rows, row_ok, B, D, GRU_BLOCK, 3, tl.load(constants_ptr), BLOCK_P
    )
    first = tl.load(first_ptr + rows * first_stride, mask=row_ok, other=0) != 0
    acc = tl.zeros([BLOCK_B, BLOCK_K, BLOCK_N], dtype=dtype)
    for k in range(0, D, BLOCK_K):
        ks = k + tl.arange(0, BLOCK_K)
        k_ok = ks < D
        x_ok = row_ok[:, None] & k_ok[None, :]
        pre = pre_ptr + rows[:, None] * 3 * D + ks[None, :]
        reset = (tl.load(pre, mask=x_ok, other=0.0) - mean[:, None]) * rstd[:, None]
        candidate = (tl.load(pre + D, mask=x_ok, other=0.0) - mean[:, None]) * rstd[:, None]
        update = (tl.load(pre + 2 * D, mask=x_ok, other=0.0) - mean[:, None]) * rstd[:, None]
        reset = (
            reset * tl.load(norm_weight_ptr + ks, mask=k_ok, other=0.0)[None, :]
            + tl.load(norm_bias_ptr + ks, mask=k_ok, other=0.0)[None, :]
        )
        candidate = (
            candidate * tl.load(norm_weight_ptr + D + ks, mask=k_ok, other=0.0)[None, :]
            + tl.load(norm_bias_ptr + D + ks, mask=k_ok, other=0.0)[None, :]
        )
        update = (
            update * tl.load(norm_weight_ptr + 2 * D + ks, mask=k_ok, other=0.0)[None, :]
            + tl.load(norm_bias_ptr + 2 * D + ks, mask=k_ok, other=0.0)[None, :]
        )
        candidate = candidate / (1.0 + tl.exp(-reset))  # sigmoid(reset) candidate
        decay = tl.exp(-2.0 * tl.abs(candidate))
        candidate = tl.where(candidate >= 0, 1.0, -1.0) * (1.0 - decay) / (1.0 + decay)  # tanh
        update = 1.0 / (1.0 + tl.exp(1.0 - update))  # sigmoid(update - 1)
        deter = tl.load(deter_ptr + rows[:, None] * D + ks[None, :], mask=x_ok, other=0.0)
        initial = tl.load(initial_deter_ptr + ks, mask=k_ok, other=0.0)
        deter = tl.where(first[:, None], initial[None, :], deter)
        # torch.lerp(deter, candidate, update), as torch computes it
        lerp_low = deter + update * (candidate - deter)
        lerp_high = candidate - (candidate - deter) * (1.0 - update)
        deter = tl.where(x_ok, tl.where(update < 0.5, lerp_low, lerp_high), 0.0)
        owner = (ks // BLOCK_K) % programs == pid  # this chunk's program
        tl.store(deter_out_ptr + rows[:, None] * D + ks[None, :], deter, mask=x_ok & owner[None, :])
        w_ok = k_ok[:, None] & col_ok[None, :]
        weight = tl.load(weight_ptr + cols[None, :] * weight_stride + ks[:, None], mask=w_ok, other=0.0)
        acc += deter[:, :, None] * weight[None, :, :]  # weight (BLOCK_K, BLOCK_N): Wd[col, k]
    embed_in = tl.load(embed_in_ptr + rows[:, None] * embed_in_stride + cols[None, :], mask=ok, other=0.0)
    post_pre = tl.sum(acc, 1) + embed_in  # (BLOCK_B, BLOCK_N)
    tl.store(post_pre_ptr + rows[:, None] * H + cols[None, :], post_pre, mask=ok)
    mean = tl.sum(tl.where(ok, post_pre, 0.0), 1) / tl.sum(col_ok.to(tl.int32), 0)
    deviation = tl.where(ok, post_pre - mean[:, None], 0.0)
    tl.store(stats_ptr + rows * programs + pid, mean, mask=row_ok)
    tl.store(stats_ptr + (B + rows) * programs + pid, tl.sum(deviation * deviation, 1), mask=row_ok)


def scan_posterior_kernel(
    post_pre_ptr,
    post_stats_ptr,
    norm_weight_ptr,
    norm_bias_ptr,
    weight_ptr,
    bias_ptr,
    noise_ptr,
    constants_ptr,
    posterior_ptr,
    stoch_ptr,
    B,
    H,
    LATENTS,
    C,
    POST_BLOCK,
    BLOCK_B: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    """Forward 4 of 4, the posterior of this program's BLOCK_L latents: logits = silu(LayerNorm(post_pre)) Wo^T + bo
    for their C classes each (the statistics combined from kernel 3's, whose programs took POST_BLOCK columns each),
    posterior = log((1 - unimix) softmax(logits) + unimix / C) (B, LATENTS, C), and the one-hot sample stoch
    (B, LATENTS * C) that `one_hot_draw` makes of exp(posterior) with the step's uniforms (B, LATENTS)."""
    pid = tl.program_id(0)
    dtype = posterior_ptr.dtype.element_ty
    rows = tl.arange(0, BLOCK_B)
    latents = pid * BLOCK_L + tl.arange(0, BLOCK_L)
    classes = tl.arange(0, BLOCK_C)
    cols = latents[:, None] * C + classes[None, :]  # (BLOCK_L, BLOCK_C): columns of the flat logits
    row_ok = rows < B
    col_ok = (latents < LATENTS)[:, None] & (classes < C)[None, :]
    ok = row_ok[:, None, None] & col_ok[None, :, :]
    # the posterior's LayerNorm statistics from kernel 3's
    mean, rstd = merged_layer_norm_stats(
        post_stats_ptr, rows, row_ok, B, H, POST_BLOCK, 1, tl.load(constants_ptr), BLOCK_P
    )
    flat_cols = tl.reshape(cols, [BLOCK_L * BLOCK_C])
    flat_ok = tl.reshape(col_ok, [BLOCK_L * BLOCK_C])
    acc = tl.zeros([BLOCK_B, BLOCK_K, BLOCK_L * BLOCK_C], dtype=dtype)
    for k in range(0, H, BLOCK_K):
        ks = k + tl.arange(0, BLOCK_K)
        k_ok = ks < H
        x_ok = row_ok[:, None] & k_ok[None, :]
        post = tl.load(post_pre_ptr + rows[:, None] * H + ks[None, :], mask=x_ok, other=0.0)
        norm_weight = tl.load(norm_weight_ptr + ks, mask=k_ok, other=0.0)
        norm_bias = tl.load(norm_bias_ptr + ks, mask=k_ok, other=0.0)
        post = (post - mean[:, None]) * rstd[:, None] * norm_weight[None, :] + norm_bias[None, :]
        post = tl.where(x_ok, post / (1.0 + tl.exp(-post)), 0.0)  # silu
        w_ok = k_ok[:, None] & flat_ok[None, :]
        weight = tl.load(weight_ptr + flat_cols[None, :] * H + ks[:, None], mask=w_ok, other=0.0)
        acc += post[:, :, None] * weight[None, :, :]  # weight (BLOCK_K, BLOCK_L * BLOCK_C): Wo[col, k]
    logits = tl.reshape(tl.sum(acc, 1), [BLOCK_B, BLOCK_L, BLOCK_C])
    logits = logits + tl.load(bias_ptr + cols, mask=col_ok, other=0.0)[None, :, :]
    logits = tl.where(col_ok[None, :, :], logits, -float("inf"))
    maximum = tl.where((latents < LATENTS)[None, :], tl.max(logits, 2), 0.0)  # (BLOCK_B, BLOCK_L)
    exps = tl.where(col_ok[None, :, :], tl.exp(logits - maximum[:, :, None]), 0.0)
    probs = exps / tl.where(latents < LATENTS, tl.sum(exps, 2), 1.0)[:, :, None]
    posterior = tl.log(
        tl.load(constants_ptr + 1) * probs + tl.load(constants_ptr + 2)
    )  # 1 - unimix, unimix / C
    out = rows[:, None, None] * LATENTS * C + cols[None, :, :]
    tl.store(posterior_ptr + out, posterior, mask=ok)
    # the draw: the first class whose float32 CDF reaches the uniform (the last class takes what rounding leaves)
    cdf = tl.cumsum(tl.where(ok, tl.exp(posterior), 0.0).to(tl.float32), 2)
    uniform_ok = row_ok[:, None] & (latents < LATENTS)[None, :]
    uniform = tl.load(noise_ptr + rows[:, None] * LATENTS + latents[None, :], mask=uniform_ok, other=0.0)
    below = (cdf < uniform[:, :, None]) & (classes < C - 1)[None, None, :]
    drawn = tl.sum(below.to(tl.int32), 2)  # (BLOCK_B, BLOCK_L)
    tl.store(stoch_ptr + out, (classes[None, None, :] == drawn[:, :, None]).to(dtype), mask=ok)


def scan_posterior_backward_kernel(
    stoch_carry_ptr,
    own_grad_ptr,
    carried_factor_ptr,
    probs_ptr,
    weight_ptr,
    silu_grad_ptr,
    post_pre_ptr,
    mean_ptr,
    rstd_ptr,
    norm_weight_ptr,
    logits_grad_ptr,
    post_norm_grad_ptr,
    sums_ptr,
    B,
    LATENTS,
    C,
    H,
    BLOCK_B: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Backward 1 of 4, the posterior's head: d probs = own_grad + carried_factor d stoch (d stoch carried from step
    t + 1), d logits = d probs - probs sum(d probs) per latent (B, LATENTS * C), made whole in every program,
    BLOCK_L latents at a time (chunk k stored by program k mod programs); d post_norm = (d logits Wo) silu'(post)
    (B, H) for this program's block of H's columns, with each row's sums of g and g n over them, g = d post_norm
    times the LayerNorm's weight and n the normalised post_pre (sums (2, B, programs))."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    rows = tl.arange(0, BLOCK_B)
    classes = tl.arange(0, BLOCK_C)
    cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < B
    col_ok = cols < H
    ok = row_ok[:, None] & col_ok[None, :]
    acc = tl.zeros([BLOCK_B, BLOCK_L * BLOCK_C, BLOCK_N], dtype=post_norm_grad_ptr.dtype.element_ty)
    for latent in range(0, LATENTS, BLOCK_L):
        latents = latent + tl.arange(0, BLOCK_L)
        ks = latents[:, None] * C + classes[None, :]  # (BLOCK_L, BLOCK_C): columns of the flat logits
        k_ok = (latents < LATENTS)[:, None] & (classes < C)[None, :]
        x_ok = row_ok[:, None, None] & k_ok[None, :, :]
        offsets = rows[:, None, None] * LATENTS * C + ks[None, :, :]
        carried = tl.load(carried_factor_ptr + offsets, mask=x_ok, other=0.0)
        stoch_grad = tl.load(stoch_carry_ptr + offsets, mask=x_ok, other=0.0)
        probs_grad = tl.load(own_grad_ptr + offsets, mask=x_ok, other=0.0) + carried * stoch_grad
        probs = tl.load(probs_ptr + offsets, mask=x_ok, other=0.0)
        logits_grad = probs_grad - probs * tl.sum(probs_grad, 2)[:, :, None]  # the softmax's backward
        owner = (latents // BLOCK_L) % programs == pid  # this chunk's program
        tl.store(logits_grad_ptr + offsets, logits_grad, mask=x_ok & owner[None, :, None])
        flat_ks = tl.reshape(ks, [BLOCK_L * BLOCK_C])
        w_ok = tl.reshape(k_ok, [BLOCK_L * BLOCK_C])[:, None] & col_ok[None, :]
        weight = tl.load(weight_ptr + flat_ks[:, None] * H + cols[None, :], mask=w_ok, other=0.0)
        logits_grad = tl.reshape(logits_grad, [BLOCK_B, BLOCK_L * BLOCK_C])
        acc += logits_grad[:, :, None] * weight[None, :, :]  # weight (BLOCK_L * BLOCK_C, BLOCK_N): Wo[k, col]
    hidden = rows[:, None] * H + cols[None, :]
    post_norm_grad = tl.sum(acc, 1) * tl.load(silu_grad_ptr + hidden, mask=ok, other=0.0)
    tl.store(post_norm_grad_ptr + hidden, post_norm_grad, mask=ok)
    mean = tl.load(mean_ptr + rows, mask=row_ok, other=0.0)
    rstd = tl.load(rstd_ptr + rows, mask=row_ok, other=0.0)
    normed = (tl.load(post_pre_ptr + hidden, mask=ok, other=0.0) - mean[:, None]) * rstd[:, None]
    g = tl.where(ok, post_norm_grad * tl.load(norm_weight_ptr + cols, mask=col_ok, other=0.0)[None, :], 0.0)
    tl.store(sums_ptr + rows * programs + pid, tl.sum(g, 1), mask=row_ok)
    tl.store(sums_ptr + (B + rows) * programs + pid, tl.sum(g * normed, 1), mask=row_ok)


def scan_posterior_input_backward_kernel(
    post_norm_grad_ptr,
    post_sums_ptr,
    post_pre_ptr,
    post_mean_ptr,
    post_rstd_ptr,
    post_norm_weight_ptr,
    weight_ptr,
    weight_stride,
    deter_carry_ptr,
    gate_grads_ptr,
    pre_norm_ptr,
    gru_mean_ptr,
    gru_rstd_ptr,
    gru_norm_weight_ptr,
    post_pre_grad_ptr,
    deter_total_ptr,
    norm_grad_ptr,
    sums_ptr,
    B,
    H,
    D,
    PRODUCERS,
    BLOCK_B: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    """Backward 2 of 4, the posterior's LayerNorm and product, and the GRU's gates: d post_pre = rstd (g - mean(g) -
    n mean(g n)) (B, H) from the sums of kernel 1's PRODUCERS programs, made whole in every program and stored by
    chunk; d deter = d deter carried + d post_pre Wd (B, D) for this program's block of units; d LayerNorm(pre) =
    d deter gate_grads (B, 3D) for their reset, candidate and update columns, with each row's sums of g and g n over
    them (sums (2, B, programs))."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    dtype = deter_total_ptr.dtype.element_ty
    rows = tl.arange(0, BLOCK_B)
    units = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < B
    unit_ok = units < D
    ok = row_ok[:, None] & unit_ok[None, :]
    parts = tl.arange(0, BLOCK_P)
    part_ok = row_ok[:, None] & (parts < PRODUCERS)[None, :]
    sums = post_sums_ptr + rows[:, None] * PRODUCERS + parts[None, :]
    mean_g = tl.sum(tl.load(sums, mask=part_ok, other=0.0), 1) / H
    mean_gn = tl.sum(tl.load(sums + B * PRODUCERS, mask=part_ok, other=0.0), 1) / H
    mean = tl.load(post_mean_ptr + rows, mask=row_ok, other=0.0)
    rstd = tl.load(post_rstd_ptr + rows, mask=row_ok, other=0.0)
    acc = tl.zeros([BLOCK_B, BLOCK_K, BLOCK_N], dtype=dtype)
    for k in range(0, H, BLOCK_K):
        ks = k + tl.arange(0, BLOCK_K)
        k_ok = ks < H
        x_ok = row_ok[:, None] & k_ok[None, :]
        hidden = rows[:, None] * H + ks[None, :]
        g = tl.load(post_norm_grad_ptr + hidden, mask=x_ok, other=0.0)
        g = g * tl.load(post_norm_weight_ptr + ks, mask=k_ok, other=0.0)[None, :]
        normed = (tl.load(post_pre_ptr + hidden, mask=x_ok, other=0.0) - mean[:, None]) * rstd[:, None]
        post_pre_grad = tl.where(x_ok, rstd[:, None] * (g - mean_g[:, None] - normed * mean_gn[:, None]), 0.0)
        tl.store(
            post_pre_grad_ptr + hidden,
            post_pre_grad,
            mask=x_ok & ((ks // BLOCK_K) % programs == pid)[None, :],
        )
        w_ok = k_ok[:, None] & unit_ok[None, :]
        weight = tl.load(weight_ptr + ks[:, None] * weight_stride + units[None, :], mask=w_ok, other=0.0)
        acc += post_pre_grad[:, :, None] * weight[None, :, :]  # weight (BLOCK_K, BLOCK_N): Wd[k, j]
    state = rows[:, None] * D + units[None, :]
    deter_total = tl.sum(acc, 1) + tl.load(deter_carry_ptr + state, mask=ok, other=0.0)  # all of d deter_t
    tl.store(deter_total_ptr + state, deter_total, mask=ok)
    gru_mean = tl.load(gru_mean_ptr + rows, mask=row_ok, other=0.0)
    gru_rstd = tl.load(gru_rstd_ptr + rows, mask=row_ok, other=0.0)
    g_sum = tl.zeros([BLOCK_B], dtype=dtype)
    gn_sum = tl.zeros([BLOCK_B], dtype=dtype)
    for part in tl.static_range(3):  # reset, candidate, update
        gate = rows[:, None] * 3 * D + part * D + units[None, :]
        norm_grad = deter_total * tl.load(gate_grads_ptr + gate, mask=ok, other=0.0)
        tl.store(norm_grad_ptr + gate, norm_grad, mask=ok)
        normed = (tl.load(pre_norm_ptr + gate, mask=ok, other=0.0) - gru_mean[:, None]) * gru_rstd[:, None]
        norm_weight = tl.load(gru_norm_weight_ptr + part * D + units, mask=unit_ok, other=0.0)
        g = tl.where(ok, norm_grad * norm_weight[None, :], 0.0)
        g_sum += tl.sum(g, 1)
        gn_sum += tl.sum(g * normed, 1)
    tl.store(sums_ptr + rows * programs + pid, g_sum, mask=row_ok)
    tl.store(sums_ptr + (B + rows) * programs + pid, gn_sum, mask=row_ok)


def scan_gru_backward_kernel(
    norm_grad_ptr,
    gru_sums_ptr,
    pre_norm_ptr,
    gru_mean_ptr,
    gru_rstd_ptr,
    gru_norm_weight_ptr,
    weight_ptr,
    img_silu_grad_ptr,
    img_pre_ptr,
    img_mean_ptr,
    img_rstd_ptr,
    img_norm_weight_ptr,
    state_grad_ptr,
    deter_total_ptr,
    deter_grad_prev_ptr,
    keep_ptr,
    keep_stride,
    pre_norm_grad_ptr,
    img_norm_grad_ptr,
    deter_prev_grad_ptr,
    deter_carry_ptr,
    sums_ptr,
    B,
    H,
    D,
    PRODUCERS,
    BLOCK_B: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    """Backward 3 of 4, the GRU's LayerNorm and product: d pre = rstd (g - mean(g) - n mean(g n)) (B, 3D) from the
    sums of kernel 2's PRODUCERS programs, made whole in every program and stored by chunk; d [img, deter_prev] =
    d pre Wg for this program's block of the H + D columns. Of these, img's: d img_norm = d img silu'(img) (B, H),
    with each row's sums of g and g n over them (sums (2, B, programs)); deter_prev's: d deter_prev = its part +
    (1 - update) d deter (B, D), and what is carried to step t - 1, d deter_{t-1} = its output gradient + keep d
    deter_prev (keep (B,) 0 where step t starts an episode)."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    rows = tl.arange(0, BLOCK_B)
    cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < B
    col_ok = cols < H + D
    parts = tl.arange(0, BLOCK_P)
    part_ok = row_ok[:, None] & (parts < PRODUCERS)[None, :]
    sums = gru_sums_ptr + rows[:, None] * PRODUCERS + parts[None, :]
    mean_g = tl.sum(tl.load(sums, mask=part_ok, other=0.0), 1) / (3 * D)
    mean_gn = tl.sum(tl.load(sums + B * PRODUCERS, mask=part_ok, other=0.0), 1) / (3 * D)
    mean = tl.load(gru_mean_ptr + rows, mask=row_ok, other=0.0)
    rstd = tl.load(gru_rstd_ptr + rows, mask=row_ok, other=0.0)
    acc = tl.zeros([BLOCK_B, BLOCK_K, BLOCK_N], dtype=deter_carry_ptr.dtype.element_ty)
    for k in range(0, 3 * D, BLOCK_K):
        ks = k + tl.arange(0, BLOCK_K)
        k_ok = ks < 3 * D
        x_ok = row_ok[:, None] & k_ok[None, :]
        gates = rows[:, None] * 3 * D + ks[None, :]
        g = tl.load(norm_grad_ptr + gates, mask=x_ok, other=0.0)
        g = g * tl.load(gru_norm_weight_ptr + ks, mask=k_ok, other=0.0)[None, :]
        normed = (tl.load(pre_norm_ptr + gates, mask=x_ok, other=0.0) - mean[:, None]) * rstd[:, None]
        pre_grad = tl.where(x_ok, rstd[:, None] * (g - mean_g[:, None] - normed * mean_gn[:, None]), 0.0)
        tl.store(
            pre_norm_grad_ptr + gates, pre_grad, mask=x_ok & ((ks // BLOCK_K) % programs == pid)[None, :]
        )
        w_ok = k_ok[:, None] & col_ok[None, :]
        weight = tl.load(weight_ptr + ks[:, None] * (H + D) + cols[None, :], mask=w_ok, other=0.0)
        acc += pre_grad[:, :, None] * weight[None, :, :]  # weight (BLOCK_K, BLOCK_N): Wg[k, col]
    input_grad = tl.sum(acc, 1)  # (BLOCK_B, BLOCK_N): columns [0, H) are img's, [H, H + D) deter_prev's
    # img's columns: d img_norm, and this block's sums for img_in's LayerNorm backward
    img_ok = row_ok[:, None] & (cols < H)[None, :]
    hidden = rows[:, None] * H + cols[None, :]
    img_norm_grad = input_grad * tl.load(img_silu_grad_ptr + hidden, mask=img_ok, other=0.0)
    tl.store(img_norm_grad_ptr + hidden, img_norm_grad, mask=img_ok)
    img_mean = tl.load(img_mean_ptr + rows, mask=row_ok, other=0.0)
    img_rstd = tl.load(img_rstd_ptr + rows, mask=row_ok, other=0.0)
    normed = (tl.load(img_pre_ptr + hidden, mask=img_ok, other=0.0) - img_mean[:, None]) * img_rstd[:, None]
    norm_weight = tl.load(img_norm_weight_ptr + cols, mask=cols < H, other=0.0)
    g = tl.where(img_ok, img_norm_grad * norm_weight[None, :], 0.0)
    tl.store(sums_ptr + rows * programs + pid, tl.sum(g, 1), mask=row_ok)
    tl.store(sums_ptr + (B + rows) * programs + pid, tl.sum(g * normed, 1), mask=row_ok)
    # deter_prev's columns: its gradient, and the one carried to the previous step
    deter_ok = row_ok[:, None] & ((cols >= H) & col_ok)[None, :]
    state = rows[:, None] * D + (cols - H)[None, :]
    deter_total = tl.load(deter_total_ptr + state, mask=deter_ok, other=0.0)
    deter_prev_grad = input_grad + tl.load(state_grad_ptr + state, mask=deter_ok, other=0.0) * deter_total
    tl.store(deter_prev_grad_ptr + state, deter_prev_grad, mask=deter_ok)
    keep = tl.load(keep_ptr + rows * keep_stride, mask=row_ok, other=0.0)
    deter_carry = (
        tl.load(deter_grad_prev_ptr + state, mask=deter_ok, other=0.0) + keep[:, None] * deter_prev_grad
    )
    tl.store(deter_carry_ptr + state, deter_carry, mask=deter_ok)


def scan_img_backward_kernel(
    img_norm_grad_ptr,
    img_sums_ptr,
    img_pre_ptr,
    img_mean_ptr,
    img_rstd_ptr,
    img_norm_weight_ptr,
    weight_ptr,
    weight_stride,
    img_pre_grad_ptr,
    stoch_carry_ptr,
    B,
    H,
    S,
    PRODUCERS,
    BLOCK_B: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    """Backward 4 of 4, img_in's LayerNorm and product: d img_pre = rstd (g - mean(g) - n mean(g n)) (B, H) from the
    sums of kernel 3's PRODUCERS programs, made whole in every program and stored by chunk; what is carried to step
    t - 1's stoch, d stoch = d img_pre Ws (B, S), for this program's block of S's columns."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    rows = tl.arange(0, BLOCK_B)
    cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < B
    col_ok = cols < S
    parts = tl.arange(0, BLOCK_P)
    part_ok = row_ok[:, None] & (parts < PRODUCERS)[None, :]
    sums = img_sums_ptr + rows[:, None] * PRODUCERS + parts[None, :]
    mean_g = tl.sum(tl.load(sums, mask=part_ok, other=0.0), 1) / H
    mean_gn = tl.sum(tl.load(sums + B * PRODUCERS, mask=part_ok, other=0.0), 1) / H
    mean = tl.load(img_mean_ptr + rows, mask=row_ok, other=0.0)
    rstd = tl.load(img_rstd_ptr + rows, mask=row_ok, other=0.0)
    acc = tl.zeros([BLOCK_B, BLOCK_K, BLOCK_N], dtype=stoch_carry_ptr.dtype.element_ty)
    for k in range(0, H, BLOCK_K):
        ks = k + tl.arange(0, BLOCK_K)
        k_ok = ks < H
        x_ok = row_ok[:, None] & k_ok[None, :]
        hidden = rows[:, None] * H + ks[None, :]
        g = tl.load(img_norm_grad_ptr + hidden, mask=x_ok, other=0.0)
        g = g * tl.load(img_norm_weight_ptr + ks, mask=k_ok, other=0.0)[None, :]
        normed = (tl.load(img_pre_ptr + hidden, mask=x_ok, other=0.0) - mean[:, None]) * rstd[:, None]
        img_pre_grad = tl.where(x_ok, rstd[:, None] * (g - mean_g[:, None] - normed * mean_gn[:, None]), 0.0)
        tl.store(
            img_pre_grad_ptr + hidden, img_pre_grad, mask=x_ok & ((ks // BLOCK_K) % programs == pid)[None, :]
        )
        w_ok = k_ok[:, None] & col_ok[None, :]
        weight = tl.load(weight_ptr + ks[:, None] * weight_stride + cols[None, :], mask=w_ok, other=0.0)
        acc += img_pre_grad[:, :, None] * weight[None, :, :]  # weight (BLOCK_K, BLOCK_N): Ws[k, col]
    tl.store(
        stoch_carry_ptr + rows[:, None] * S + cols[None, :],
        tl.sum(acc, 1),
        mask=row_ok[:, None] & col_ok[None, :],
    )


KERNEL_HELPERS = (merged_layer_norm_stats, row_layer_norm_stats)
SCAN_KERNELS = (
    scan_img_in_kernel,
    scan_gru_in_kernel,
    scan_gru_out_kernel,
    scan_posterior_kernel,
    scan_posterior_backward_kernel,
    scan_posterior_input_backward_kernel,
    scan_gru_backward_kernel,
    scan_img_backward_kernel,
)


_JITTED_SCAN_KERNELS: list[types.SimpleNamespace] = []


def triton_interprets() -> bool:
    """Whether Triton runs kernels in its interpreter (TRITON_INTERPRET=1 when Triton was imported: on CPU tensors,
    float64 included, one program after another), as the tests do, rather than compiling them for the GPU."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on")


def scan_kernels() -> types.SimpleNamespace:
    """The fused scan's and the fused epilogues' kernels by name, made by `triton.jit` at first use (compiled for the
    GPU, or interpreted: `triton_interprets`). Imports Triton, and registers the operations that launch the kernels
    (`SCAN_OPS`, `EPILOGUE_OPS`)."""
    global tl
    if not _JITTED_SCAN_KERNELS:
        import triton
        import triton.language

        tl = triton.language  # what the kernels' source reads
        for helper in KERNEL_HELPERS:  # what the kernels call, by name: jitted first, in their place
            globals()[helper.__name__] = triton.jit(helper)
        kernels = {}
        for kernel in SCAN_KERNELS + EPILOGUE_KERNELS:
            # not specialised on the batch size and the strides that follow T: the check's calls and the run's
            # share one compiled kernel
            arguments = kernel.__code__.co_varnames[: kernel.__code__.co_argcount]
            varying = [name for name in ("B", "first_stride", "keep_stride") if name in arguments]
            kernels[kernel.__name__] = triton.jit(kernel, do_not_specialize=varying)
        _JITTED_SCAN_KERNELS.append(types.SimpleNamespace(**kernels))
        register_scan_ops()
    return _JITTED_SCAN_KERNELS[0]


@dataclass(frozen=True)
class ScanBlocks:
    """How the fused scan's kernels divide their work: `batch` the least BLOCK_B (rows are padded to a power of two
    at least this); `tile` the elements of a program's product tile (BLOCK_B x BLOCK_K x its columns: a product's
    chunk BLOCK_K follows, `reduction_block`); and the output columns each program computes: forward `img` (of H), `gru`
    (units of D, three columns each), `post` (of H), `latents` (of the posterior's, C columns each); backward
    `logits` (of H), `deter` (units of D), `state` (of H + D), `stoch` (of S)."""

    batch: int
    tile: int
    img: int
    gru: int
    post: int
    latents: int
    logits: int
    deter: int
    state: int
    stoch: int


def power_of_two_at_least(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def reduction_block(blocks: ScanBlocks, rows: int, columns: int, reduced: int) -> int:
    """BLOCK_K of a product (rows x reduced) @ (reduced x columns) whose tile holds `blocks.tile` elements: a power of
    two, at most the reduction's own length."""
    block = 1
    while 2 * block * rows * columns <= blocks.tile and block < reduced:
        block *= 2
    return block


def scan_blocks(H: int, D: int, S: int, latents: int, sms: int | None) -> ScanBlocks:
    """For an RSSM of hidden width H, deter D, flat stoch S of `latents` latents, on a GPU of `sms` SMs: each
    kernel's columns in the fewest programs that still give every SM one (at batch 16 a block of 4 columns is 16 x 4
    outputs, each a sum of 512 to 1,536 products: the default model's kernels run 128 programs on an H100's 132 SMs,
    the posterior's one latent per program 32), tiles of 2,048 elements (16 registers a thread in 4 warps), and rows
    padded to 16, so that every batch up to 16 shares one compiled kernel. With `sms` None, for Triton's
    interpreter, which runs programs one after another at milliseconds of Python per operation: whole rows in one or
    two programs, and large tiles."""
    if sms is not None:

        def fill(n: int) -> int:
            block = 1
            while -(-n // block) > sms:
                block *= 2
            return block

        return ScanBlocks(16, 2048, fill(H), fill(D), fill(H), 1, fill(H), fill(D), fill(H + D), fill(S))

    def whole(n: int) -> int:
        return min(power_of_two_at_least(n), 1024)

    columns = [whole(n) for n in (H, D, H)] + [power_of_two_at_least(latents)]
    return ScanBlocks(1, 2**20, *columns, whole(H), whole(D), whole(H + D), whole(S))


@dataclass(frozen=True)
class ScanWeights:
    """The weights the fused scan's kernels read (`FusedObserve.launch_settings`): the shares of the first layers
    that the step computes (stoch_weight (H, S) and deter_weight (H, D), their rows strided), then
    `FastObserve.scan_parameters()` in its order (the LayerNorm GRU's own last)."""

    stoch_weight: torch.Tensor
    deter_weight: torch.Tensor
    img_norm_weight: torch.Tensor
    img_norm_bias: torch.Tensor
    post_norm_weight: torch.Tensor
    post_norm_bias: torch.Tensor
    post_out_weight: torch.Tensor
    post_out_bias: torch.Tensor
    gru_weight: torch.Tensor
    gru_norm_weight: torch.Tensor
    gru_norm_bias: torch.Tensor


def row_stride(x: torch.Tensor) -> int:
    """The stride between the rows of a per-step tensor x (B, ...) whose rows are each contiguous (a step of a
    time-major or a batch-major tensor). Another layout is a caller's mistake, not something to copy quietly: the
    copy would be a kernel that the operation counts do not see."""
    if not x[0].is_contiguous():
        raise ValueError(
            f"the fused scan reads contiguous rows, not a tensor {tuple(x.shape)} of strides {x.stride()}"
        )
    return x.stride(0)


def contiguous_only(*tensors: torch.Tensor) -> None:
    """Checks that the tensors are contiguous, as the kernels read them (see `row_stride`)."""
    for x in tensors:
        if not x.is_contiguous():
            raise ValueError(
                f"the fused scan reads contiguous tensors, not one {tuple(x.shape)} of strides {x.stride()}"
            )


def launch(kernel: str, programs: int, *args, **constants) -> None:
    """One launch of the fused scan's `kernel` on `programs` programs, through `wrap_triton` (so that the operation
    around it traces as the kernel itself)."""
    torch.library.wrap_triton(getattr(scan_kernels(), kernel))[(programs,)](*args, **constants)


def rows_block(B: int, blocks: ScanBlocks) -> int:
    return max(power_of_two_at_least(B), blocks.batch)


# The kernels' launches as torch operations, one operation per launch (`torch.library.triton_op`, registered by
# `register_scan_ops` as torch.ops.dreamer_scan.<name>): a dispatch mode counts each as one, and torch.compile could
# trace into it. Each returns new tensors; `weights` is a `ScanWeights`, `blocks` a `ScanBlocks`, both as lists.


def scan_img_in(
    stoch: torch.Tensor,
    first: torch.Tensor,
    initial_stoch: torch.Tensor,
    action_in: torch.Tensor,
    weights: list[torch.Tensor],
    blocks: list[int],
) -> tuple[torch.Tensor, torch.Tensor]:
    """`scan_img_in_kernel`: stoch (B, S), first (B, 1) uint8, initial_stoch (1, S), action_in (B, H) -> img_pre
    (B, H), its per-program statistics (2, B, programs)."""
    w, blocks = ScanWeights(*weights), ScanBlocks(*blocks)
    (B, S), H = stoch.shape, w.stoch_weight.shape[0]
    programs = -(-H // blocks.img)
    contiguous_only(stoch, initial_stoch)
    img_pre, stats = stoch.new_empty(B, H), stoch.new_empty(2, B, programs)
    launch(
        "scan_img_in_kernel",
        programs,
        stoch,
        first,
        row_stride(first),
        initial_stoch,
        action_in,
        row_stride(action_in),
        w.stoch_weight,
        row_stride(w.stoch_weight),
        img_pre,
        stats,
        B,
        S,
        H,
        BLOCK_B=rows_block(B, blocks),
        BLOCK_K=reduction_block(blocks, rows_block(B, blocks), blocks.img, S),
        BLOCK_N=blocks.img,
    )
    return img_pre, stats


def scan_gru_in(
    img_pre: torch.Tensor,
    img_stats: torch.Tensor,
    deter: torch.Tensor,
    first: torch.Tensor,
    initial_deter: torch.Tensor,
    weights: list[torch.Tensor],
    constants: torch.Tensor,
    blocks: list[int],
) -> tuple[torch.Tensor, torch.Tensor]:
    """`scan_gru_in_kernel`: img_pre (B, H) and its statistics, deter (B, D), first (B, 1) uint8, initial_deter
    (1, D) -> pre (B, 3D), its per-program statistics (2, B, programs)."""
    w, blocks = ScanWeights(*weights), ScanBlocks(*blocks)
    (B, H), D = img_pre.shape, deter.shape[1]
    programs = -(-D // blocks.gru)
    contiguous_only(deter, initial_deter, w.gru_weight)
    pre, stats = img_pre.new_empty(B, 3 * D), img_pre.new_empty(2, B, programs)
    launch(
        "scan_gru_in_kernel",
        programs,
        img_pre,
        img_stats,
        w.img_norm_weight,
        w.img_norm_bias,
        deter,
        first,
        row_stride(first),
        initial_deter,
        w.gru_weight,
        constants,
        pre,
        stats,
        B,
        H,
        D,
        blocks.img,
        BLOCK_B=rows_block(B, blocks),
        BLOCK_K=reduction_block(blocks, rows_block(B, blocks), blocks.gru, max(H, D)),
        BLOCK_N=blocks.gru,
        BLOCK_P=power_of_two_at_least(img_stats.shape[-1]),
    )
    return pre, stats


def scan_gru_out(
    pre: torch.Tensor,
    gru_stats: torch.Tensor,
    deter: torch.Tensor,
    first: torch.Tensor,
    initial_deter: torch.Tensor,
    embed_in: torch.Tensor,
    weights: list[torch.Tensor],
    constants: torch.Tensor,
    blocks: list[int],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`scan_gru_out_kernel`: pre (B, 3D) and its statistics, deter (B, D), first (B, 1) uint8, initial_deter (1, D),
    embed_in (B, H) -> the new deter (B, D), post_pre (B, H), its per-program statistics (2, B, programs)."""
    w, blocks = ScanWeights(*weights), ScanBlocks(*blocks)
    (B, D), H = deter.shape, embed_in.shape[1]
    programs = -(-H // blocks.post)
    contiguous_only(deter, initial_deter)
    new_deter, post_pre, stats = deter.new_empty(B, D), deter.new_empty(B, H), deter.new_empty(2, B, programs)
    launch(
        "scan_gru_out_kernel",
        programs,
        pre,
        gru_stats,
        w.gru_norm_weight,
        w.gru_norm_bias,
        deter,
        first,
        row_stride(first),
        initial_deter,
        embed_in,
        row_stride(embed_in),
        w.deter_weight,
        row_stride(w.deter_weight),
        constants,
        new_deter,
        post_pre,
        stats,
        B,
        D,
        H,
        blocks.gru,
        BLOCK_B=rows_block(B, blocks),
        BLOCK_K=reduction_block(blocks, rows_block(B, blocks), blocks.post, D),
        BLOCK_N=blocks.post,
        BLOCK_P=power_of_two_at_least(gru_stats.shape[-1]),
    )
    return new_deter, post_pre, stats


def scan_posterior(
    post_pre: torch.Tensor,
    post_stats: torch.Tensor,
    noise: torch.Tensor,
    weights: list[torch.Tensor],
    constants: torch.Tensor,
    blocks: list[int],
) -> tuple[torch.Tensor, torch.Tensor]:
    """`scan_posterior_kernel`: post_pre (B, H) and its statistics, noise (B, S / C, 1) the step's uniforms ->
    posterior (B, S / C, C), stoch (B, S)."""
    w, blocks = ScanWeights(*weights), ScanBlocks(*blocks)
    (B, H), latents = post_pre.shape, noise.shape[1]
    classes = w.post_out_weight.shape[0] // latents
    contiguous_only(noise, w.post_out_weight)
    posterior, stoch = post_pre.new_empty(B, latents, classes), post_pre.new_empty(B, latents * classes)
    columns = blocks.latents * power_of_two_at_least(classes)
    launch(
        "scan_posterior_kernel",
        -(-latents // blocks.latents),
        post_pre,
        post_stats,
        w.post_norm_weight,
        w.post_norm_bias,
        w.post_out_weight,
        w.post_out_bias,
        noise,
        constants,
        posterior,
        stoch,
        B,
        H,
        latents,
        classes,
        blocks.post,
        BLOCK_B=rows_block(B, blocks),
        BLOCK_K=reduction_block(blocks, rows_block(B, blocks), columns, H),
        BLOCK_L=blocks.latents,
        BLOCK_C=power_of_two_at_least(classes),
        BLOCK_P=power_of_two_at_least(post_stats.shape[-1]),
    )
    return posterior, stoch


def scan_posterior_backward(
    stoch_carry: torch.Tensor,
    own_grad: torch.Tensor,
    carried_factor: torch.Tensor,
    probs: torch.Tensor,
    post_silu_grad: torch.Tensor,
    post_pre: torch.Tensor,
    post_mean: torch.Tensor,
    post_rstd: torch.Tensor,
    weights: list[torch.Tensor],
    blocks: list[int],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`scan_posterior_backward_kernel`: d stoch carried (B, S), own_grad, carried_factor and probs (B, S / C, C),
    post_silu_grad and post_pre (B, H), post_mean and post_rstd (B, 1) -> d logits (B, S), d post_norm (B, H),
    per-program sums (2, B, programs)."""
    w, blocks = ScanWeights(*weights), ScanBlocks(*blocks)
    B, latents, classes = probs.shape
    H = post_pre.shape[1]
    programs = -(-H // blocks.logits)
    contiguous_only(
        stoch_carry, own_grad, carried_factor, probs, post_silu_grad, post_pre, post_mean, post_rstd
    )
    logits_grad = probs.new_empty(B, latents * classes)
    post_norm_grad, sums = probs.new_empty(B, H), probs.new_empty(2, B, programs)
    launch(
        "scan_posterior_backward_kernel",
        programs,
        stoch_carry,
        own_grad,
        carried_factor,
        probs,
        w.post_out_weight,
        post_silu_grad,
        post_pre,
        post_mean,
        post_rstd,
        w.post_norm_weight,
        logits_grad,
        post_norm_grad,
        sums,
        B,
        latents,
        classes,
        H,
        BLOCK_B=rows_block(B, blocks),
        BLOCK_L=reduction_block(
            blocks, rows_block(B, blocks) * power_of_two_at_least(classes), blocks.logits, latents
        ),
        BLOCK_C=power_of_two_at_least(classes),
        BLOCK_N=blocks.logits,
    )
    return logits_grad, post_norm_grad, sums


def scan_posterior_input_backward(
    post_norm_grad: torch.Tensor,
    post_sums: torch.Tensor,
    post_pre: torch.Tensor,
    post_mean: torch.Tensor,
    post_rstd: torch.Tensor,
    deter_carry: torch.Tensor,
    gate_grads: torch.Tensor,
    pre_norm: torch.Tensor,
    gru_mean: torch.Tensor,
    gru_rstd: torch.Tensor,
    weights: list[torch.Tensor],
    blocks: list[int],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`scan_posterior_input_backward_kernel`: d post_norm (B, H) and its sums, post_pre (B, H), post_mean and
    post_rstd (B, 1), d deter carried (B, D), the GRU's gate_grads (B, 3, D), pre_norm (B, 3D), mean and rstd
    (B, 1) -> d post_pre (B, H), d deter (B, D), d LayerNorm(pre) (B, 3D), per-program sums (2, B, programs)."""
    w, blocks = ScanWeights(*weights), ScanBlocks(*blocks)
    (B, H), D = post_pre.shape, deter_carry.shape[1]
    programs = -(-D // blocks.deter)
    contiguous_only(post_pre, post_mean, post_rstd, deter_carry, gate_grads, pre_norm, gru_mean, gru_rstd)
    post_pre_grad, deter_total = post_pre.new_empty(B, H), post_pre.new_empty(B, D)
    norm_grad, sums = post_pre.new_empty(B, 3 * D), post_pre.new_empty(2, B, programs)
    launch(
        "scan_posterior_input_backward_kernel",
        programs,
        post_norm_grad,
        post_sums,
        post_pre,
        post_mean,
        post_rstd,
        w.post_norm_weight,
        w.deter_weight,
        row_stride(w.deter_weight),
        deter_carry,
        gate_grads,
        pre_norm,
        gru_mean,
        gru_rstd,
        w.gru_norm_weight,
        post_pre_grad,
        deter_total,
        norm_grad,
        sums,
        B,
        H,
        D,
        post_sums.shape[-1],
        BLOCK_B=rows_block(B, blocks),
        BLOCK_K=reduction_block(blocks, rows_block(B, blocks), blocks.deter, H),
        BLOCK_N=blocks.deter,
        BLOCK_P=power_of_two_at_least(post_sums.shape[-1]),
    )
    return post_pre_grad, deter_total, norm_grad, sums


def scan_gru_backward(
    norm_grad: torch.Tensor,
    gru_sums: torch.Tensor,
    pre_norm: torch.Tensor,
    gru_mean: torch.Tensor,
    gru_rstd: torch.Tensor,
    img_silu_grad: torch.Tensor,
    img_pre: torch.Tensor,
    img_mean: torch.Tensor,
    img_rstd: torch.Tensor,
    state_grad: torch.Tensor,
    deter_total: torch.Tensor,
    deter_grad_prev: torch.Tensor,
    keep: torch.Tensor,
    weights: list[torch.Tensor],
    blocks: list[int],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`scan_gru_backward_kernel`: d LayerNorm(pre) (B, 3D) and its sums, pre_norm (B, 3D), the GRU's mean and rstd
    (B, 1), img_silu_grad and img_pre (B, H), img_mean and img_rstd (B, 1), state_grad (B, D), d deter (B, D),
    deter_grad_prev (B, D), keep (B, 1) -> d pre (B, 3D), d img_norm (B, H), d deter_prev (B, D), d deter carried to
    step t - 1 (B, D), per-program sums (2, B, programs)."""
    w, blocks = ScanWeights(*weights), ScanBlocks(*blocks)
    (B, H), D = img_pre.shape, state_grad.shape[1]
    programs = -(-(H + D) // blocks.state)
    contiguous_only(
        pre_norm, gru_mean, gru_rstd, img_silu_grad, img_pre, img_mean, img_rstd, state_grad, deter_grad_prev
    )
    contiguous_only(w.gru_weight)
    pre_norm_grad, img_norm_grad = pre_norm.new_empty(B, 3 * D), pre_norm.new_empty(B, H)
    deter_prev_grad, deter_carry = pre_norm.new_empty(B, D), pre_norm.new_empty(B, D)
    sums = pre_norm.new_empty(2, B, programs)
    launch(
        "scan_gru_backward_kernel",
        programs,
        norm_grad,
        gru_sums,
        pre_norm,
        gru_mean,
        gru_rstd,
        w.gru_norm_weight,
        w.gru_weight,
        img_silu_grad,
        img_pre,
        img_mean,
        img_rstd,
        w.img_norm_weight,
        state_grad,
        deter_total,
        deter_grad_prev,
        keep,
        row_stride(keep),
        pre_norm_grad,
        img_norm_grad,
        deter_prev_grad,
        deter_carry,
        sums,
        B,
        H,
        D,
        gru_sums.shape[-1],
        BLOCK_B=rows_block(B, blocks),
        BLOCK_K=reduction_block(blocks, rows_block(B, blocks), blocks.state, 3 * D),
        BLOCK_N=blocks.state,
        BLOCK_P=power_of_two_at_least(gru_sums.shape[-1]),
    )
    return pre_norm_grad, img_norm_grad, deter_prev_grad, deter_carry, sums


def scan_img_backward(
    img_norm_grad: torch.Tensor,
    img_sums: torch.Tensor,
    img_pre: torch.Tensor,
    img_mean: torch.Tensor,
    img_rstd: torch.Tensor,
    weights: list[torch.Tensor],
    blocks: list[int],
) -> tuple[torch.Tensor, torch.Tensor]:
    """`scan_img_backward_kernel`: d img_norm (B, H) and its sums, img_pre (B, H), img_mean and img_rstd (B, 1) ->
    d img_pre (B, H), d stoch carried to step t - 1 (B, S)."""
    w, blocks = ScanWeights(*weights), ScanBlocks(*blocks)
    (B, H), S = img_pre.shape, w.stoch_weight.shape[1]
    programs = -(-S // blocks.stoch)
    contiguous_only(img_pre, img_mean, img_rstd)
    img_pre_grad, stoch_carry = img_pre.new_empty(B, H), img_pre.new_empty(B, S)
    launch(
        "scan_img_backward_kernel",
        programs,
        img_norm_grad,
        img_sums,
        img_pre,
        img_mean,
        img_rstd,
        w.img_norm_weight,
        w.stoch_weight,
        row_stride(w.stoch_weight),
        img_pre_grad,
        stoch_carry,
        B,
        H,
        S,
        img_sums.shape[-1],
        BLOCK_B=rows_block(B, blocks),
        BLOCK_K=reduction_block(blocks, rows_block(B, blocks), blocks.stoch, H),
        BLOCK_N=blocks.stoch,
        BLOCK_P=power_of_two_at_least(img_sums.shape[-1]),
    )
    return img_pre_grad, stoch_carry


SCAN_OPS = (
    scan_img_in,
    scan_gru_in,
    scan_gru_out,
    scan_posterior,
    scan_posterior_backward,
    scan_posterior_input_backward,
    scan_gru_backward,
    scan_img_backward,
)


_SCAN_OPS_REGISTERED: list[bool] = []


def register_scan_ops() -> None:
    """Each of `SCAN_OPS` and `EPILOGUE_OPS` as torch.ops.dreamer_scan.<name>, norm_silu with its backward (once a
    process)."""
    if not _SCAN_OPS_REGISTERED:
        for op in SCAN_OPS + EPILOGUE_OPS:
            torch.library.triton_op(f"dreamer_scan::{op.__name__}", op, mutates_args=())
        torch.library.register_autograd(
            "dreamer_scan::norm_silu", norm_silu_backward, setup_context=keep_norm_silu_inputs
        )
        _SCAN_OPS_REGISTERED.append(True)


class FusedObserve(FastObserve):
    """--fused-scan: `FastObserve` whose step (`fused_step`) and backward step (`fused_reverse_step`) are the fused
    scan's kernels, four launches each, for the LayerNorm GRU with categorical latents (`fused_scan_problem` says
    where it does not apply). The same arguments and results as `RSSM.observe` and the hand-written backward, held to
    them by `check_fused_scan`. Where autograd must record the step (under autocast, which takes autograd's backward
    of the loop) the step is `observe_step`."""

    def __init__(self, rssm: RSSM, blocks: ScanBlocks | None = None):
        super().__init__(rssm, hand_written_backward=True)
        self.blocks = blocks  # None: `scan_blocks` for the device, at the first step
        self.constants: dict[tuple, torch.Tensor] = {}  # (dtype, device) -> [eps, 1 - unimix, unimix / C]
        # what `observe_loop` and `ObserveBackwardThroughTime` call at each step (--compile leaves them: kernels)
        self.step, self.reverse_step = self.fused_step, self.fused_reverse_step
        scan_kernels()  # Triton imported, the operations registered

    def launch_settings(
        self, stoch_weight: torch.Tensor, deter_weight: torch.Tensor
    ) -> tuple[list, list, torch.Tensor]:
        """The weights (a `ScanWeights`), the blocks and the constants [eps, 1 - unimix, unimix / C] of the weights'
        dtype and device, each as the operations take them. The constants are made at the first step, outside any
        CUDA graph's capture (a copy to the device is not allowed inside one)."""
        if self.blocks is None:
            (H, S), device = stoch_weight.shape, stoch_weight.device
            compiled = device.type == "cuda" and not triton_interprets()
            sms = torch.cuda.get_device_properties(device).multi_processor_count if compiled else None
            self.blocks = scan_blocks(H, self.rssm.deter_dim, S, self.rssm.stoch_dim, sms)
        key = (stoch_weight.dtype, stoch_weight.device)
        if key not in self.constants:
            rssm = self.rssm
            # every LayerNorm's eps is NORM_EPS
            values = [NORM_EPS, 1 - rssm.unimix, rssm.unimix / rssm.classes]
            self.constants[key] = torch.tensor(values, dtype=stoch_weight.dtype, device=stoch_weight.device)
        weights = [stoch_weight, deter_weight, *self.scan_parameters()]
        return weights, list(dataclasses.astuple(self.blocks)), self.constants[key]

    def fused_step(self, deter, stoch, step: ObserveInputs):
        """`observe_step` (the same arguments and results, see there) in four kernel launches, without a graph."""
        if torch.is_grad_enabled() or torch.is_autocast_enabled(deter.device.type):
            return self.observe_step(deter, stoch, step)
        weights, blocks, constants = self.launch_settings(step.stoch_weight, step.deter_weight)
        scan = torch.ops.dreamer_scan
        first = step.first.view(torch.uint8)  # (B, 1) as bytes (a view: no kernel)
        img_pre, img_stats = scan.scan_img_in(
            stoch, first, step.initial_stoch, step.action_in, weights, blocks
        )
        pre, gru_stats = scan.scan_gru_in(
            img_pre, img_stats, deter, first, step.initial_deter, weights, constants, blocks
        )
        deter, post_pre, post_stats = scan.scan_gru_out(
            pre, gru_stats, deter, first, step.initial_deter, step.embed_in, weights, constants, blocks
        )
        posterior, stoch = scan.scan_posterior(post_pre, post_stats, step.noise, weights, constants, blocks)
        return deter, stoch, posterior

    def fused_reverse_step(
        self, rssm, gru_step, deter_weight, stoch_weight, deter_carry, stoch_carry, step: ReverseStepInputs
    ) -> tuple:
        """`ObserveBackwardThroughTime.reverse_step` (the same arguments and results, see there; the kernels hold the
        formula of `gru_step`, `LayerNormGRUBackward.step`) in four kernel launches."""
        own_grad, carried_factor, probs, post_silu_grad, post_pre, post_mean, post_rstd = step[:7]
        img_silu_grad, img_pre, img_mean, img_rstd, deter_grad_prev, keep = step[7:13]
        gate_grads, pre_norm, gru_mean, gru_rstd, state_grad = step.gru  # `LayerNormGRUBackward.step_inputs`
        weights, blocks, _ = self.launch_settings(stoch_weight, deter_weight)
        scan = torch.ops.dreamer_scan
        logits_grad, post_norm_grad, post_sums = scan.scan_posterior_backward(
            stoch_carry,
            own_grad,
            carried_factor,
            probs,
            post_silu_grad,
            post_pre,
            post_mean,
            post_rstd,
            weights,
            blocks,
        )
        post_pre_grad, deter_total, norm_grad, gru_sums = scan.scan_posterior_input_backward(
            post_norm_grad,
            post_sums,
            post_pre,
            post_mean,
            post_rstd,
            deter_carry,
            gate_grads,
            pre_norm,
            gru_mean,
            gru_rstd,
            weights,
            blocks,
        )
        pre_norm_grad, img_norm_grad, deter_prev_grad, deter_carry, img_sums = scan.scan_gru_backward(
            norm_grad,
            gru_sums,
            pre_norm,
            gru_mean,
            gru_rstd,
            img_silu_grad,
            img_pre,
            img_mean,
            img_rstd,
            state_grad,
            deter_total,
            deter_grad_prev,
            keep,
            weights,
            blocks,
        )
        img_pre_grad, stoch_carry = scan.scan_img_backward(
            img_norm_grad, img_sums, img_pre, img_mean, img_rstd, weights, blocks
        )
        layer_grads = (
            logits_grad,
            post_norm_grad,
            post_pre_grad,
            img_norm_grad,
            img_pre_grad,
            deter_prev_grad,
        )
        return deter_carry, stoch_carry, (*layer_grads, norm_grad, pre_norm_grad)


def fused_scan_problem(rssm: RSSM, args: Args, device: torch.device) -> str | None:
    """Why --fused-scan cannot run this run's observe scan (said in one line: the fast observe runs instead), or
    None."""
    if rssm.classes == 0:
        return "its kernels draw categorical latents, and --stochastic-classes 0 makes them Gaussian"
    if args.observe_backward != "hand-written":
        return "its backward is the hand-written one, and --observe-backward is autograd"
    if type(rssm.gru) is not LayerNormGRUCell:
        return f"its kernels compute the LayerNorm GRU, and --model {args.model}'s cell is {type(rssm.gru).__name__}"
    if problem := hand_written_backward_problem(rssm):
        return f"its kernels compute the hand-written backward's layers ({problem})"
    return triton_problem(device)


# Where --fused-scan runs: compiled on CUDA. (On the CPU, Triton has only its interpreter, started by
# TRITON_INTERPRET=1 before Triton is imported: a test's speed, not a run's; tests add "cpu" here.)
FUSED_SCAN_DEVICES = {"cuda"}


def fused_observe(rssm: RSSM, args: Args, fast: FastObserve) -> tuple[FastObserve, str | None]:
    """The observe a run with --fused-scan trains with on a device of `FUSED_SCAN_DEVICES` (`install`):
    `FusedObserve`, or `fast` (the fast observe) with the line that says why not."""
    problem = fused_scan_problem(rssm, args, next(rssm.parameters()).device)
    if problem is None:
        return FusedObserve(rssm), None
    return (
        fast,
        f"speed: --fused-scan does not apply ({problem}); the fast observe (FastObserve) runs instead",
    )


def clear_draws(reference: RSSM, inputs: tuple) -> tuple:
    """`inputs` (`check_inputs`) with each uniform moved to the middle of the class it draws in `reference.observe`:
    the same draws, each at least half its class's probability (at least unimix / 2C) from a step of the CDF, where
    two sums of the same probabilities that round apart could draw different classes."""
    embed, action, is_first, noise = inputs
    with torch.no_grad():
        _, stoch, posterior, _ = reference.observe(*inputs)
    probs = posterior.exp()  # (B, T, S / C, C)
    drawn = stoch.unflatten(-1, probs.shape[-2:]).argmax(-1, keepdim=True)  # (B, T, S / C, 1)
    middle = probs.cumsum(-1).gather(-1, drawn) - probs.gather(-1, drawn) / 2
    return embed, action, is_first, middle.transpose(0, 1).to(noise.dtype).contiguous()  # (T, B, S / C, 1)


def scan_results(observe: FastObserve, inputs: tuple) -> dict[str, torch.Tensor]:
    """`observe`'s results (`FastObserve.__call__`) and the gradients of `observe_gradients`' loss of them with
    respect to embed and each parameter of its RSSM, in float64 on the CPU: {"deter", "stoch", "posterior", "prior",
    "gradient of embed", "gradient of <parameter name>", ...} (zeros where a parameter gets none)."""
    embed, action, is_first, noise = inputs
    rssm = observe.rssm
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        weights = [
            torch.randn(*is_first.shape, n, dtype=torch.float64) for n in (rssm.deter_dim, rssm.stoch_flat)
        ]
    weights = [w.to(embed) for w in weights]
    named = {"embed": embed.detach().requires_grad_(True), **dict(rssm.named_parameters())}
    results = observe(named["embed"], action, is_first, noise)
    deter, stoch, posterior, _ = results
    loss = (deter * weights[0]).sum() + (stoch * weights[1]).sum() + posterior.exp().square().sum()
    grads = torch.autograd.grad(loss, list(named.values()), allow_unused=True)
    grads = {
        f"gradient of {name}": torch.zeros_like(x) if g is None else g
        for (name, x), g in zip(named.items(), grads)
    }
    results = dict(zip(("deter", "stoch", "posterior", "prior"), results))
    return {name: x.detach().cpu().double() for name, x in (results | grads).items()}


def check_fused_scan(
    rssm: RSSM, device, steps: int = 3, tolerance: float = 1e-9, backward_tolerance: float = 1e-8
) -> None:
    """The fused scan as the run launches it (its kernels compiled for `device`, or interpreted on the CPU under
    TRITON_INTERPRET=1), on the run's weights and `check_inputs`' batch of 2 x `steps` (3: a step from the initial
    state, one from the step before, one from an episode start inside the sequence, the backward across all three);
    a difference raises FastPathMismatch, naming the kernels and --fused-scan off. The same kernels compiled for
    float64: its results against `RSSM.observe`'s and its gradients against autograd's, also with the GRU saturated
    (x 8), within 1e-9 and 1e-8 as the other checks, so that a formula changed in the readable code and not in the
    kernels shows, however small the change (`check_fused_scan_float32` checks the run's own float32 kernels). Each
    uniform sits in the middle of the class it draws (`clear_draws`). Milliseconds of GPU time, once Triton has
    compiled the float64 kernels (seconds, then cached for later runs)."""
    device = torch.device(device)
    for scale, weights in ((1.0, "the run's weights"), (8.0, "the run's weights with the GRU's x 8")):
        reference = float64_copy(rssm, scale)
        inputs = clear_draws(reference, check_inputs(reference, T=steps))
        ours = scan_results(
            FusedObserve(copy.deepcopy(reference).to(device)), tuple(x.to(device) for x in inputs)
        )
        with torch.no_grad():
            expected = dict(zip(("deter", "stoch", "posterior", "prior"), reference.observe(*inputs)))
        expected |= {
            name: x
            for name, x in scan_results(FastObserve(reference, hand_written_backward=False), inputs).items()
            if "gradient" in name
        }
        for name, x in expected.items():
            error = relative_error(ours[name], x)
            if not error <= (backward_tolerance if "gradient" in name else tolerance):
                kernels, launcher, readable = (
                    (
                        "scan_posterior_backward_kernel to scan_img_backward_kernel",
                        "fused_reverse_step",
                        "autograd",
                    )
                    if "gradient" in name
                    else ("scan_img_in_kernel to scan_posterior_kernel", "fused_step", "RSSM.observe")
                )
                raise FastPathMismatch(
                    f"the fused observe scan (the kernels {kernels}, which FusedObserve.{launcher} launches) gives "
                    f"another {name} than {readable} on {weights}, in float64 on {device} (relative error "
                    f"{error:.1e}): carry the change into the kernels, or run with --fused-scan off.",
                    off={"fused_scan": "off"},
                )


def check_fused_scan_float32(rssm: RSSM, device, batch: int, steps: int = 3) -> None:
    """The fused scan's float32 kernels, the run's own, at the run's batch size (their tiling follows it), against
    `FastObserve` on the same device with full-float32 products (no TF32): results and gradients within
    FLOAT32_TOLERANCE. Kernels that do not compile or launch here raise as Triton does; a disagreement
    raises KernelUnavailable (the float64 check, `check_fused_scan`, holds the formulas)."""
    device = torch.device(device)
    model = copy.deepcopy(rssm).to(device, torch.float32)
    inputs = clear_draws(float64_copy(rssm), check_inputs(rssm, B=max(batch, 2), T=steps))
    inputs = tuple(x.to(device, torch.float32) if x.is_floating_point() else x.to(device) for x in inputs)
    precision = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        ours, expected = scan_results(FusedObserve(model), inputs), scan_results(FastObserve(model), inputs)
    finally:
        torch.set_float32_matmul_precision(precision)
    for name, x in expected.items():
        error = relative_error(ours[name], x)
        if not error <= FLOAT32_TOLERANCE:
            raise KernelUnavailable(
                f"its float32 kernels give another {name} than the fast observe at batch {batch}, relative error "
                f"{error:.1e}, above the {FLOAT32_TOLERANCE:.0e} that float32 rounding leaves"
            )


# --- The fast imagination: gathers in place of products with one-hot vectors ------------------------------------------
# Imagined latents are one-hot in the forward pass (a sample drawn without gradients is the one-hot itself), and so
# are the actions: the product of a one-hot (N, S x C) with a weight is the sum of the S weight rows its ones pick,
# one gather-and-sum (`F.embedding_bag`) in place of a product S x C long. Each imagination step gathers so
# (`gather_imagine_step`, in `FastImagine`); the five heads that read the imagined states (`FastHeads`) share one
# first-layer product, whose latent part is such a gather, and Part 1's targets and losses take their outputs. The
# same terms summed in another order: equal to float64 rounding
# (`check_fast_imagine`, `check_fast_heads`), not bit for bit in float32. Part 1's layers are found by name
# (`img_in.linear`) or by type (a head is an nn.Sequential that starts with an nn.Linear on the features); the cell and
# every other layer run as Part 1 writes them.


_CONSTANTS: dict[tuple, torch.Tensor | tuple] = {}


def constant(key: tuple, make: Callable[[], torch.Tensor | tuple]) -> torch.Tensor | tuple:
    """`make()`, made once for `key` (what it depends on: sizes, a device): the index and draw constants below, made
    by eager code, never inside a captured or compiled step."""
    if key not in _CONSTANTS:
        _CONSTANTS[key] = make()
    return _CONSTANTS[key]


def latent_offsets(rssm: RSSM, device) -> torch.Tensor:
    """(S,) int64: s x C, where latent s's classes start in the flattened one-hot (compiled: made in the graph, where
    Inductor fuses it into its use)."""
    S, C = rssm.stoch_dim, rssm.classes
    if torch.compiler.is_compiling():
        return torch.arange(S, device=device) * C
    key = ("latent offsets", S, C, torch.device(device))
    return constant(key, lambda: torch.arange(S, device=device) * C)


def latent_index(stoch: torch.Tensor, rssm: RSSM) -> torch.Tensor:
    """Each latent's class in a one-hot stoch (..., S x C), as the row of the flattened one-hot that holds its one
    (..., S): s x C + class. Not exact for a start state: its stoch comes from a straight-through sample (one_hot +
    probs - probs), whose ones are 1 only up to a rounding, so a gather of weight rows differs from Part 1's product
    with it by that rounding (about 1e-7 of a row in float32, 1e-16 in float64); every imagined state is exact."""
    return stoch.unflatten(-1, (rssm.stoch_dim, rssm.classes)).argmax(-1) + latent_offsets(rssm, stoch.device)


def bag_offsets(rows: int, per_row: int, device) -> torch.Tensor:
    """(rows,) int64: where each row's indices start in the flattened index, for `gather_sum`."""
    key = ("bag offsets", rows, per_row, torch.device(device))
    return constant(key, lambda: torch.arange(0, rows * per_row, per_row, device=device))


def gather_sum(index: torch.Tensor, table: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """The product of a one-hot (N, S x C) with a weight, where `index` (N, S) says which row holds each latent's one
    (`latent_index`) and `table` (S x C, width) is the weight's transpose: the sum of the S rows picked, (N, width),
    in one `embedding_bag` (`offsets`: `bag_offsets(N, S)`)."""
    return F.embedding_bag(index.reshape(-1), table, offsets, mode="sum")


def first_linear(net: nn.Module, in_features: int) -> nn.Linear | None:
    """A head's first layer where the head is an nn.Sequential (not a subclass, whose forward may differ) whose first
    layer is an nn.Linear (with a bias) on `in_features` inputs, as `mlp` makes every head (Linear, LayerNorm, SiLU,
    Linear, LayerNorm, SiLU, Linear), found by type; None for any other head. The layers after it run as they are
    (`after_first`), whatever they are."""
    layers = list(net.children()) if type(net) is nn.Sequential else []
    if layers and type(layers[0]) is nn.Linear and layers[0].in_features == in_features:
        return layers[0] if layers[0].bias is not None else None
    return None


def after_first(net: nn.Sequential, x: torch.Tensor) -> torch.Tensor:
    """A head's layers after its first (`first_linear`) on x, as the head runs them."""
    for layer in list(net.children())[1:]:
        x = layer(x)
    return x


def gather_imagine_problem(agent: Agent) -> str | None:
    """Why `gather_imagine_step` cannot imagine with the agent's RSSM and actor (a clause to say), or None."""
    rssm = agent.world_model.rssm
    if not rssm.classes:
        return "the latents are Gaussian, not one-hot"
    if type(dict(rssm.img_in.named_children()).get("linear")) is not nn.Linear:
        return "RSSM.img_in has no nn.Linear named linear"
    if first_linear(getattr(agent.actor, "net", None), rssm.deter_dim + rssm.stoch_flat) is None:
        return "the actor's net is not an nn.Sequential that starts with an nn.Linear on the features"
    return None


def imagine_tables(actor: Actor, rssm: RSSM) -> tuple:
    """What `gather_imagine_step` reads in place of its products, from the live weights, once per rollout:
    stoch_table (S x C, H_actor + H_img), whose row s x C + k is what latent s in class k adds to the actor's first
    layer and to img_in's (the actor's bias folded into latent 0's rows: every state picks one of them); action_table
    (A, H_img), what each action adds to img_in's, its bias folded in; the actor's first layer on deter (H_actor, D).
    `--compile` compiles it (its copies fuse)."""
    D, flat = rssm.deter_dim, rssm.stoch_flat
    actor_first, img_first = first_linear(actor.net, D + flat), rssm.img_in.linear
    stoch_table = torch.cat([actor_first.weight[:, D:].t(), img_first.weight[:, :flat].t()], 1)
    stoch_table[: rssm.classes, : actor_first.out_features] += actor_first.bias
    action_table = img_first.weight[:, flat:].t() + img_first.bias  # (A, H_img)
    return stoch_table, action_table, actor_first.weight[:, :D]


def gather_imagine_step(actor: Actor, rssm: RSSM, tables, deter, stoch_index, action_uniform, latent_noise):
    """`imagine_step` with its products of one-hot latents and actions as gathers of the rows of `imagine_tables`
    (`tables`: those, then the gathers' `bag_offsets`): from deter (N, D) and stoch_index (N, S) (`latent_index`),
    the action drawn from `action_uniform` (N, 1) as its index (N, 1), the next deter and the next stoch_index (from
    `latent_noise`). The cell (`RSSM.gru`), the prior, the actor's probabilities and the draw (`draw_index`) are Part
    1's. A step of 40 operations where one with `imagine_step` takes 41 on the CPU (tests/test_dreamer_fused_epilogues.py).
    `--compile` compiles it once."""
    stoch_table, action_table, deter_weight, offsets = tables
    actor_width = deter_weight.shape[0]
    stoch_part = gather_sum(stoch_index, stoch_table, offsets)  # (N, H_actor + H_img)
    logits = after_first(actor.net, torch.addmm(stoch_part[:, :actor_width], deter, deter_weight.t()))
    action_index = draw_index(actor.probs(logits), action_uniform)  # (N,)
    hidden = stoch_part[:, actor_width:] + F.embedding(action_index, action_table)  # img_in.linear's output
    for name, layer in rssm.img_in.named_children():
        hidden = hidden if name == "linear" else layer(hidden)
    deter = rssm.gru(upcast(hidden), deter)
    # `RSSM.sample`'s class of each latent, as the row of the flattened one-hot
    stoch_index = draw_index(rssm.prior(deter).exp(), latent_noise) + latent_offsets(rssm, deter.device)
    return action_index.unsqueeze(-1), deter, stoch_index


class FastImagine:
    """`imagine` in fewer operations: the same arguments, random numbers and results (--fast-imagine off leaves
    `imagine`; tests/test_dreamer_fast_path.py holds them equal in float64).

    The rollout runs without gradients: the actor learns by REINFORCE and the critic from fixed targets, so only
    the actor's log-probabilities and entropy need a graph. The actor therefore runs once more after the loop, with
    gradients, on all imagined states at once: one forward and one backward pass for the whole rollout instead of
    one per step (the same values). The random numbers of the whole rollout are drawn in two calls. With `gathers`
    (where `gather_imagine_problem` finds none) each step is `gather_imagine_step`: its products with one-hot
    latents and actions are gathers of weight rows; with `fused` too (--fused-epilogues), `fused_imagine_step`: the
    work after each product in one kernel. Returns feat (H+1, N, F) detached, log_prob (H, N), entropy (H, N).
    """

    def __init__(self, gathers: bool = False, fused: bool = False):
        self.gathers, self.fused = gathers, gathers and fused
        # one imagined step, and the gathers' tables (`compile_paths` puts compiled ones here)
        self.step = fused_imagine_step if self.fused else (gather_imagine_step if gathers else imagine_step)
        self.tables = imagine_tables
        if self.fused:
            scan_kernels()  # Triton imported, the operations registered

    def __call__(self, agent: Agent, start_states, horizon: int):
        feat, _, action_index = self.rollout(agent, start_states, horizon)
        probs = agent.actor(feat[:-1])  # (H, N, A), with gradients
        return feat, *action_terms(probs, action_index)

    def rollout(self, agent: Agent, start_states, horizon: int) -> tuple:
        """The imagined states, without gradients: feat (H+1, N, F); with `gathers` their latents as indices too,
        stoch_index (H+1, N, S) (`latent_index`), else None; and the actions drawn, action_index (H, N, 1)."""
        deter, stoch, _ = start_states
        rssm = agent.world_model.rssm
        action_uniforms = torch.rand(horizon, deter.shape[0], 1, device=deter.device)  # (H, N, 1)
        latent_noise = rssm.noise((horizon, deter.shape[0]), deter.device)  # (H, N, ...)
        step = self.step
        with torch.no_grad():
            if self.gathers:
                return self.gather_rollout(agent, deter, stoch, action_uniforms, latent_noise)
            deters, stochs, actions = [deter], [stoch], []
            for action_uniform, noise in zip(action_uniforms.unbind(0), latent_noise.unbind(0)):
                action, deter, stoch = step(agent.actor, rssm, deter, stoch, action_uniform, noise)
                deters.append(deter), stochs.append(stoch), actions.append(action)
            feat = torch.cat([torch.stack(deters), torch.stack(stochs)], -1)  # (H+1, N, F)
            return feat, None, torch.stack(actions).argmax(-1, keepdim=True)  # (H, N, 1)

    def gather_rollout(self, agent: Agent, deter, stoch, action_uniforms, latent_noise) -> tuple:
        """`rollout` by `gather_imagine_step`, on one set of tables from the live weights (`imagine_tables`)."""
        rssm = agent.world_model.rssm
        tables = (*self.tables(agent.actor, rssm), bag_offsets(deter.shape[0], rssm.stoch_dim, deter.device))
        index = latent_index(stoch, rssm)  # (N, S)
        deters, indices, actions = [deter], [index], []
        for action_uniform, noise in zip(action_uniforms.unbind(0), latent_noise.unbind(0)):
            action, deter, index = self.step(agent.actor, rssm, tables, deter, index, action_uniform, noise)
            deters.append(deter), indices.append(index), actions.append(action)
        stoch_index = torch.stack(indices)  # (H+1, N, S)
        # the imagined latents one-hot again; the start's as it came (see `latent_index`)
        stochs = stoch.new_zeros(*stoch_index[1:].shape[:2], stoch.shape[-1])  # (H, N, S x C)
        stochs = torch.cat([stoch.unsqueeze(0), stochs.scatter_(-1, stoch_index[1:], 1.0)])  # (H+1, N, S x C)
        return torch.cat([torch.stack(deters), stochs], -1), stoch_index, torch.stack(actions)


def imagine_step(actor: Actor, rssm: RSSM, deter, stoch, action_uniform, latent_noise) -> tuple:
    """One imagined step from deter (N, D), stoch (N, S), without gradients: the actor picks an action (from
    `action_uniform` (N, 1)), the prior moves on (`latent_noise`). Returns the one-hot action (N, A), the next deter
    and stoch. `--compile` compiles this function once and reuses it at every step."""
    action = fast_one_hot_draw(actor(torch.cat([deter, stoch], -1)), action_uniform)  # (N, A)
    deter = rssm.img_step(deter, stoch, action.to(deter.dtype))
    return action, deter, rssm.sample(rssm.prior(deter), latent_noise, fast_one_hot_draw)


def action_terms(probs: torch.Tensor, action_index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`imagine`'s log-probabilities of the actions drawn and the policy's entropies (H, N), from the probabilities
    (H, N, A) and the actions' indices (H, N, 1): Part 1's `policy_terms` on the one-hot actions."""
    return policy_terms(probs, one_hot(action_index.squeeze(-1), probs.shape[-1]).to(probs.dtype))


def check_fast_imagine(agent: Agent, tolerance: float = 1e-9) -> None:
    """The fast imagination (`FastImagine`, with the gathers where the run's has them) against `imagine`, on float64
    copies of the run's actor and RSSM, with the same random numbers: the imagined features, log-probabilities and
    entropies, and the actor's gradients from them. A change to one that is not carried into the other raises
    FastPathMismatch."""
    rssm = float64_copy(agent.world_model.rssm)
    actor = copy.deepcopy(agent.actor).cpu().double()
    twin = types.SimpleNamespace(world_model=types.SimpleNamespace(rssm=rssm), actor=actor)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(2)
        N = 3
        deter = torch.randn(N, rssm.deter_dim, dtype=torch.float64)
        stoch = rssm.sample(rssm.prior(deter)).detach()
        results = []
        for rollout in (FastImagine(agent.imagine.gathers), imagine):
            torch.manual_seed(4)  # the same random numbers for both
            feat, log_prob, entropy = rollout(twin, (deter, stoch, None), 4)
            grads = torch.autograd.grad((log_prob.sum() + entropy.sum()), list(actor.parameters()))
            results.append((feat, log_prob, entropy, *grads))
    names = ["feat", "log_prob", "entropy"] + [
        f"gradient of actor.{name}" for name, _ in actor.named_parameters()
    ]
    for name, ours, expected in zip(names, *results):
        error = relative_error(ours, expected)
        if not error <= tolerance:
            raise FastPathMismatch(
                f"the fast imagination (FastImagine) gives another {name} than imagine (relative error {error:.1e}): "
                f"carry the change into both (imagine, RSSM.img_step, RSSM.prior, RSSM.sample and Actor.forward hold "
                f"the formulas; imagine_step and gather_imagine_step their operations), or run with --fast-imagine off.",
                off={"fast_imagine": "off"},
            )


# --- Fused epilogues (Triton): an imagined step's work after each product in one kernel -------------------------------
# --fused-epilogues (CUDA, on `gather_imagine_step`): the work that follows each product of an imagined step, which
# torch runs as a kernel per operation, runs as one Triton kernel: a LayerNorm and the SiLU after it (`norm_silu`;
# img_in's with the action's weight row added first, in place of the gather and the add), the LayerNorm GRU's norm,
# gates and mix (`gru_gates`), and a categorical draw from logits: the softmax, the unimix, the CDF and the class it
# picks (`logits_draw`, `draw_index`'s draw). The products stay torch's: at N = B x T rows they are large.
# Imagination runs without gradients. The heads on the imagined states (`heads_on_features`) run their LayerNorms and
# SiLUs as `norm_silu` too, and the actor's and the critic's learn through them: `norm_silu`'s backward is one more
# kernel (`norm_silu_backward_kernel`) and a sum. Each program takes BLOCK_R whole rows. The kernels compute in float32
# (float64 on float64 inputs, for the checks), as the LayerNorms do under autocast. Part 1's layers are found by type
# (an nn.LayerNorm followed by an nn.SiLU; a cell of type LayerNormGRUCell); any other layer runs as it is. Held to
# `gather_imagine_step` and to the heads' own layers on the device in float64 (`check_fused_epilogues`,
# `check_fused_heads`).


def norm_silu_kernel(
    x_ptr,
    x_stride,
    table_ptr,
    table_strides_0,
    table_strides_1,
    index_ptr,
    weight_ptr,
    bias_ptr,
    out_ptr,
    N,
    W,
    eps,
    GATHER: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_W: tl.constexpr,
):
    """out = silu(LayerNorm(x)) (N, W) for this program's rows (x's rows `x_stride` apart), with the LayerNorm's
    weight and bias; with GATHER, x plus the row of table (A, W) (of any strides) that index (N,) names, added
    first."""
    dtype = out_ptr.dtype.element_ty
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_W)
    row_ok = rows < N
    col_ok = cols < W
    ok = row_ok[:, None] & col_ok[None, :]
    x = tl.load(x_ptr + rows[:, None] * x_stride + cols[None, :], mask=ok, other=0.0).to(dtype)
    if GATHER:
        index = tl.load(index_ptr + rows, mask=row_ok, other=0)
        at = table_ptr + index[:, None] * table_strides_0 + cols[None, :] * table_strides_1
        x += tl.load(at, mask=ok, other=0.0).to(dtype)
    deviation, rstd = row_layer_norm_stats(x, ok, W, eps)
    weight = tl.load(weight_ptr + cols, mask=col_ok, other=0.0).to(dtype)
    bias = tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(dtype)
    y = deviation * rstd[:, None] * weight[None, :] + bias[None, :]
    tl.store(out_ptr + rows[:, None] * W + cols[None, :], y / (1.0 + tl.exp(-y)), mask=ok)


def gru_gates_kernel(
    pre_ptr,
    weight_ptr,
    bias_ptr,
    deter_ptr,
    out_ptr,
    N,
    D,
    eps,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """`LayerNormGRUCell.forward` after its product, for this program's rows: from pre (N, 3D) and deter (N, D), the
    next deter = lerp(deter, tanh(sigmoid(reset) candidate), sigmoid(update - 1)), where reset, candidate and update
    are LayerNorm(pre)'s thirds (the LayerNorm over all 3D columns)."""
    dtype = out_ptr.dtype.element_ty
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_D)
    row_ok = rows < N
    col_ok = cols < D
    ok = row_ok[:, None] & col_ok[None, :]
    at = pre_ptr + rows[:, None] * 3 * D + cols[None, :]
    reset = tl.load(at, mask=ok, other=0.0).to(dtype)
    candidate = tl.load(at + D, mask=ok, other=0.0).to(dtype)
    update = tl.load(at + 2 * D, mask=ok, other=0.0).to(dtype)
    mean = (tl.sum(reset, 1) + tl.sum(candidate, 1) + tl.sum(update, 1)) / (3 * D)
    reset = tl.where(ok, reset - mean[:, None], 0.0)
    candidate = tl.where(ok, candidate - mean[:, None], 0.0)
    update = tl.where(ok, update - mean[:, None], 0.0)
    m2 = tl.sum(reset * reset, 1) + tl.sum(candidate * candidate, 1) + tl.sum(update * update, 1)
    rstd = (1.0 / tl.sqrt(m2 / (3 * D) + eps))[:, None]
    weight, bias = weight_ptr + cols, bias_ptr + cols
    reset = reset * rstd * tl.load(weight, mask=col_ok, other=0.0).to(dtype)[None, :]
    reset += tl.load(bias, mask=col_ok, other=0.0).to(dtype)[None, :]
    candidate = candidate * rstd * tl.load(weight + D, mask=col_ok, other=0.0).to(dtype)[None, :]
    candidate += tl.load(bias + D, mask=col_ok, other=0.0).to(dtype)[None, :]
    update = update * rstd * tl.load(weight + 2 * D, mask=col_ok, other=0.0).to(dtype)[None, :]
    update += tl.load(bias + 2 * D, mask=col_ok, other=0.0).to(dtype)[None, :]
    candidate = candidate / (1.0 + tl.exp(-reset))  # sigmoid(reset) candidate
    decay = tl.exp(-2.0 * tl.abs(candidate))
    candidate = tl.where(candidate >= 0, 1.0, -1.0) * (1.0 - decay) / (1.0 + decay)  # tanh
    update = 1.0 / (1.0 + tl.exp(1.0 - update))  # sigmoid(update - 1)
    deter = tl.load(deter_ptr + rows[:, None] * D + cols[None, :], mask=ok, other=0.0).to(dtype)
    # torch.lerp(deter, candidate, update), as torch computes it
    low, high = deter + update * (candidate - deter), candidate - (candidate - deter) * (1.0 - update)
    tl.store(out_ptr + rows[:, None] * D + cols[None, :], tl.where(update < 0.5, low, high), mask=ok)


def logits_draw_kernel(
    logits_ptr,
    uniform_ptr,
    out_ptr,
    N,
    G,
    C,
    keep,
    share,
    DOUBLE: tl.constexpr,
    OFFSETS: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """For this program's rows of logits (N, C): the class `draw_index` draws from their softmax with the unimix
    mixed in (keep p + share, the CDF's step k adding share), from the row's uniform (N,): how many of the CDF's first
    C - 1 steps lie below it. The softmax in float32 (float64 with DOUBLE), the CDF in float32 as `draw_index`'s; with
    OFFSETS, the row's latent (row mod G) times C added (`latent_index`'s rows)."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_C)
    row_ok = rows < N
    ok = row_ok[:, None] & (cols < C)[None, :]
    logits = tl.load(logits_ptr + rows[:, None] * C + cols[None, :], mask=ok, other=0.0)
    if DOUBLE:
        logits = logits.to(tl.float64)
    else:
        logits = logits.to(tl.float32)
    top = tl.where(row_ok, tl.max(tl.where(ok, logits, float("-inf")), 1), 0.0)
    exps = tl.where(ok, tl.exp(logits - top[:, None]), 0.0)
    probs = (exps / tl.where(row_ok, tl.sum(exps, 1), 1.0)[:, None]).to(tl.float32)
    cdf = keep * tl.cumsum(probs, 1) + share * (cols + 1).to(tl.float32)[None, :]
    uniform = tl.load(uniform_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    below = ok & (cols < C - 1)[None, :] & (cdf < uniform[:, None])
    index = tl.sum(below.to(tl.int64), 1)
    if OFFSETS:
        index += (rows % G).to(tl.int64) * C
    tl.store(out_ptr + rows, index, mask=row_ok)


def norm_silu_backward_kernel(
    grad_ptr,
    x_ptr,
    x_stride,
    weight_ptr,
    bias_ptr,
    grad_x_ptr,
    partial_ptr,
    N,
    W,
    eps,
    BLOCK_R: tl.constexpr,
    BLOCK_W: tl.constexpr,
):
    """`norm_silu_kernel`'s gradients (without GATHER) for this program's rows, from its output's gradient grad
    (N, W): x's (N, W), and what the LayerNorm's weight and bias get from these rows, summed, in the program's row
    pair of partial (programs, 2, W). The LayerNorm's statistics are computed again from x (rows `x_stride` apart)."""
    dtype = partial_ptr.dtype.element_ty
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_W)
    row_ok = rows < N
    col_ok = cols < W
    ok = row_ok[:, None] & col_ok[None, :]
    x = tl.load(x_ptr + rows[:, None] * x_stride + cols[None, :], mask=ok, other=0.0).to(dtype)
    deviation, rstd = row_layer_norm_stats(x, ok, W, eps)
    normed = deviation * rstd[:, None]
    weight = tl.load(weight_ptr + cols, mask=col_ok, other=0.0).to(dtype)
    bias = tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(dtype)
    y = normed * weight[None, :] + bias[None, :]
    sigmoid = 1.0 / (1.0 + tl.exp(-y))
    grad = tl.load(grad_ptr + rows[:, None] * W + cols[None, :], mask=ok, other=0.0).to(dtype)
    grad_y = tl.where(ok, grad * sigmoid * (1.0 + y * (1.0 - sigmoid)), 0.0)  # silu'(y) = s + y s (1 - s)
    grad_normed = grad_y * weight[None, :]
    # LayerNorm's input gradient: rstd (g - mean(g) - normed mean(g normed)), g the normalised values' gradient
    along = tl.sum(grad_normed * normed, 1) / W
    grad_x = rstd[:, None] * (grad_normed - tl.sum(grad_normed, 1)[:, None] / W - normed * along[:, None])
    tl.store(grad_x_ptr + rows[:, None] * W + cols[None, :], grad_x, mask=ok)
    partial = partial_ptr + tl.program_id(0) * 2 * W + cols
    tl.store(partial, tl.sum(grad_y * normed, 0), mask=col_ok)
    tl.store(partial + W, tl.sum(grad_y, 0), mask=col_ok)


EPILOGUE_KERNELS = (norm_silu_kernel, gru_gates_kernel, logits_draw_kernel, norm_silu_backward_kernel)


def epilogue_blocks(width: int, parts: int = 1) -> tuple[int, int]:
    """(BLOCK_R, BLOCK_W) of an epilogue kernel on rows of `parts` blocks `width` long: whole rows, at most 4,096
    elements a program (powers of two, as Triton's ranges are)."""
    block_w = power_of_two_at_least(width)
    rows = max(1, 4096 // (parts * block_w))
    return 1 << (rows.bit_length() - 1), block_w


def epilogue_dtype(x: torch.Tensor) -> torch.dtype:
    """What an epilogue kernel computes and returns: float64 for float64 inputs (the check), else float32."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def launch_epilogue(kernel: str, rows: int, block_r: int, *args, **constants) -> None:
    """One launch of the epilogue `kernel` on enough programs of `block_r` rows for `rows`, through `wrap_triton`."""
    programs = -(-rows // block_r)
    torch.library.wrap_triton(getattr(scan_kernels(), kernel))[(programs,)](
        *args, BLOCK_R=block_r, **constants
    )


# The launches as torch operations, one each (`torch.library.triton_op`, registered with the scan's, as
# torch.ops.dreamer_scan.<name>). Each returns a new tensor.


def norm_silu(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    eps: float,
    table: torch.Tensor | None,
    index: torch.Tensor | None,
) -> torch.Tensor:
    """`norm_silu_kernel`: silu(layer_norm(x, (W,), weight, bias, eps)) of x (N, W), with table (A, W)'s rows that
    index (N,) names added to x first where both are given."""
    (N, W), gather = x.shape, table is not None
    contiguous_only(weight, bias, *((index,) if gather else ()))
    out = x.new_empty(N, W, dtype=epilogue_dtype(x))
    block_r, block_w = epilogue_blocks(W)
    extra = (table, *table.stride(), index) if gather else (x, 0, 0, x)  # unread without GATHER
    arguments = (x, row_stride(x), *extra, weight, bias, out, N, W, eps)
    launch_epilogue("norm_silu_kernel", N, block_r, *arguments, GATHER=gather, BLOCK_W=block_w)
    return out


def gru_gates(
    pre: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float, deter: torch.Tensor
) -> torch.Tensor:
    """`gru_gates_kernel`: the next deter (N, D) from the LayerNorm GRU's product pre (N, 3D) and deter (N, D)."""
    (N, D) = deter.shape
    contiguous_only(pre, weight, bias, deter)
    out = deter.new_empty(N, D, dtype=torch.promote_types(deter.dtype, epilogue_dtype(pre)))
    block_r, block_d = epilogue_blocks(D, parts=3)  # a row's three thirds, each in a block this wide
    launch_epilogue("gru_gates_kernel", N, block_r, pre, weight, bias, deter, out, N, D, eps, BLOCK_D=block_d)
    return out


def logits_draw(logits: torch.Tensor, uniform: torch.Tensor, unimix: float, offsets: bool) -> torch.Tensor:
    """`logits_draw_kernel`: from logits (N, G, C) and a uniform per row (N, G, 1), each row's class (N, G) int64,
    as `draw_index(mix_uniform(softmax(logits), unimix), uniform)`; with `offsets`, as the flattened one-hot's row (g C + class)."""
    N, G, C = logits.shape
    contiguous_only(logits, uniform)
    out = torch.empty(N, G, dtype=torch.int64, device=logits.device)
    block_r, block_c = epilogue_blocks(C)
    launch_epilogue(
        "logits_draw_kernel",
        N * G,
        block_r,
        logits,
        uniform,
        out,
        N * G,
        G,
        C,
        1.0 - unimix,
        unimix / C,
        DOUBLE=logits.dtype == torch.float64,
        OFFSETS=offsets,
        BLOCK_C=block_c,
    )
    return out


def norm_silu_grads(
    grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`norm_silu_backward_kernel`: from the gradient grad (N, W) of `norm_silu(x, weight, bias, eps)` (no gathered
    row), x's gradient (N, W, in x's dtype) and the programs' partial sums (programs, 2, W) of the weight's and the
    bias's, whose sum over programs is theirs."""
    (N, W) = x.shape
    contiguous_only(grad, weight, bias)
    block_r, block_w = epilogue_blocks(W)
    grad_x = torch.empty(N, W, dtype=x.dtype, device=x.device)
    partials = torch.empty(-(-N // block_r), 2, W, dtype=epilogue_dtype(x), device=x.device)
    arguments = (grad, x, row_stride(x), weight, bias, grad_x, partials, N, W, eps)
    launch_epilogue("norm_silu_backward_kernel", N, block_r, *arguments, BLOCK_W=block_w)
    return grad_x, partials


EPILOGUE_OPS = (norm_silu, gru_gates, logits_draw, norm_silu_grads)


def keep_norm_silu_inputs(ctx, inputs: tuple, output: torch.Tensor) -> None:
    """`norm_silu`'s autograd: what its backward reads."""
    x, weight, bias, eps, table, _ = inputs
    ctx.save_for_backward(x, weight, bias)
    ctx.eps, ctx.gathered = eps, table is not None


def norm_silu_backward(ctx, grad: torch.Tensor) -> tuple:
    """`norm_silu`'s gradients for x, weight and bias: `norm_silu_grads`, then one sum of its partial sums. A
    gathered row has none: the imagination that adds one runs without gradients."""
    if ctx.gathered:
        raise RuntimeError(
            "norm_silu has no backward with a gathered row (imagination runs without gradients)"
        )
    x, weight, bias = ctx.saved_tensors
    grad_x, partials = torch.ops.dreamer_scan.norm_silu_grads(grad.contiguous(), x, weight, bias, ctx.eps)
    grad_weight, grad_bias = partials.sum(0).to(weight.dtype).unbind(0)
    return grad_x, grad_weight, grad_bias, None, None, None


def fusable_norm(layer: nn.Module) -> bool:
    """Whether `norm_silu` computes this LayerNorm: an nn.LayerNorm over the last dimension, with weight and bias."""
    return (
        type(layer) is nn.LayerNorm
        and len(layer.normalized_shape) == 1
        and layer.weight is not None
        and layer.bias is not None
    )


def run_layers(layers: list[nn.Module], x: torch.Tensor, action=None) -> torch.Tensor:
    """The layers on x in turn, each LayerNorm followed by a SiLU (`fusable_norm`) as one `norm_silu`; `action`
    (table, index): a row of table to add to x first (fused into the first LayerNorm, if the layers start with one)."""
    ops, i = torch.ops.dreamer_scan, 0
    if action is not None and not (
        len(layers) > 1 and fusable_norm(layers[0]) and type(layers[1]) is nn.SiLU
    ):
        x, action = x + F.embedding(action[1], action[0]), None
    while i < len(layers):
        layer = layers[i]
        if i + 1 < len(layers) and fusable_norm(layer) and type(layers[i + 1]) is nn.SiLU:
            table, index = action if action is not None else (None, None)
            x, action, i = ops.norm_silu(x, layer.weight, layer.bias, layer.eps, table, index), None, i + 2
        else:
            x, i = layer(x), i + 1
    return x


def fused_imagine_step(actor: Actor, rssm: RSSM, tables, deter, stoch_index, action_uniform, latent_noise):
    """`gather_imagine_step` with the work after each product in one kernel (--fused-epilogues): the same arguments
    and results. The products and any layer the kernels do not compute run as they are. A step of 15 operations
    where `gather_imagine_step` dispatches 40 (tests/test_dreamer_fused_epilogues.py counts both)."""
    ops = torch.ops.dreamer_scan
    stoch_table, action_table, deter_weight, offsets = tables
    actor_width = deter_weight.shape[0]
    stoch_part = gather_sum(stoch_index, stoch_table, offsets)  # (N, H_actor + H_img)
    layers = list(actor.net.children())[1:]
    logits = run_layers(layers, torch.addmm(stoch_part[:, :actor_width], deter, deter_weight.t()))
    action_index = ops.logits_draw(
        logits.unsqueeze(1), action_uniform.unsqueeze(1), actor.unimix, False
    )  # (N, 1)
    img_in = [layer for name, layer in rssm.img_in.named_children() if name != "linear"]
    hidden = run_layers(img_in, stoch_part[:, actor_width:], (action_table, action_index.squeeze(-1)))
    gru = rssm.gru
    if type(gru) is LayerNormGRUCell and fusable_norm(gru.norm):
        pre = gru.linear(torch.cat([upcast(hidden), deter], -1))
        deter = ops.gru_gates(pre, gru.norm.weight, gru.norm.bias, gru.norm.eps, deter)
    else:
        deter = gru(upcast(hidden), deter)
    prior = rssm.prior_net
    logits = run_layers(list(prior.children()), deter) if type(prior) is nn.Sequential else prior(deter)
    logits = logits.unflatten(-1, (rssm.stoch_dim, rssm.classes))
    return action_index, deter, ops.logits_draw(logits, latent_noise, rssm.unimix, True)


def fused_epilogues_problem(args: Args, device: torch.device) -> str | None:
    """Why --fused-epilogues cannot run on `device` (a clause to say), or None."""
    if args.compile:
        return "--compile compiles the imagination step, and Inductor fuses its epilogues"
    return triton_problem(device)


def check_fused_epilogues(agent: Agent, tolerance: float = 1e-9) -> None:
    """The fused epilogues (`fused_imagine_step`, its kernels compiled for the run's device, or interpreted on the
    CPU) against `gather_imagine_step`, which `check_fast_imagine` holds to `imagine`: rollouts of float64 copies of
    the run's actor and RSSM on the device, also with the GRU saturated (x 8), from the same states with the same
    random numbers; the imagined features within `tolerance` and the same actions. A change to a layer the kernels
    compute (a LayerNorm, a SiLU, the GRU's gates, a draw) that is not carried into them raises FastPathMismatch."""
    device = agent.device
    actor = copy.deepcopy(agent.actor).to(device, torch.float64)
    for scale, weights in ((1.0, "the run's weights"), (8.0, "the run's weights with the GRU's x 8")):
        rssm = float64_copy(agent.world_model.rssm, scale).to(device)
        twin = types.SimpleNamespace(world_model=types.SimpleNamespace(rssm=rssm), actor=actor)
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            torch.manual_seed(2)
            deter = torch.randn(3, rssm.deter_dim, dtype=torch.float64, device=device)
            start = (deter, rssm.sample(rssm.prior(deter)).detach(), None)
            results = []
            for fused in (True, False):
                torch.manual_seed(4)  # the same random numbers for both
                feat, _, actions = FastImagine(gathers=True, fused=fused).rollout(twin, start, 4)
                results.append((feat, actions))
        (feat, actions), (expected_feat, expected_actions) = results
        error = relative_error(feat.cpu(), expected_feat.cpu())
        if not (error <= tolerance and torch.equal(actions.cpu(), expected_actions.cpu())):
            what = f"features (relative error {error:.1e})" if error > tolerance else "actions"
            raise FastPathMismatch(
                f"the fused epilogues (norm_silu_kernel, gru_gates_kernel and logits_draw_kernel, which "
                f"fused_imagine_step launches) imagine other {what} than gather_imagine_step on {weights}, in float64 "
                f"on {device}: carry the change into the kernels, or run with --fused-epilogues off.",
                off={"fused_epilogues": "off"},
            )


def check_fused_epilogues_float32(agent: Agent, rows: int, horizon: int = 2) -> None:
    """The fused epilogues' float32 kernels, the run's own, at the run's number of imagined starts (`rows`: their
    tiling follows it), on the run's weights: a rollout against `gather_imagine_step`'s from the same states and
    random numbers, and with fused heads (`FastHeads`) the heads' outputs and the learning heads' gradients against
    their own layers. Features and heads within FLOAT32_TOLERANCE on the starts whose actions agree (two
    float32 sums can round a draw apart at a class boundary; all but 1 % must agree). Kernels that do not compile or
    launch here raise as Triton does; a disagreement raises KernelUnavailable (the float64 checks hold the formulas)."""
    device, rssm = agent.device, agent.world_model.rssm
    generator = torch.Generator(device).manual_seed(2)
    deter = torch.randn(rows, rssm.deter_dim, device=device, generator=generator)
    precision = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            start = (deter, rssm.sample(rssm.prior(deter)), None)
            results = []
            for fused in (True, False):
                torch.manual_seed(4)  # the same random numbers for both
                results.append(FastImagine(gathers=True, fused=fused).rollout(agent, start, horizon))
        (feat, stoch_index, actions), (expected_feat, _, expected_actions) = results
        agree = (actions == expected_actions).all(0).squeeze(-1)  # (rows,)
        if agree.float().mean().item() < 0.99:
            raise KernelUnavailable(
                f"its float32 kernels draw other actions in {int((~agree).sum())} of {rows} starts"
            )
        error = relative_error(feat[:, agree], expected_feat[:, agree])
        if not error <= FLOAT32_TOLERANCE:
            raise KernelUnavailable(
                f"its float32 kernels imagine other features (relative error {error:.1e})"
            )
        if isinstance(agent.imagined_heads, FastHeads) and agent.imagined_heads.fused:
            outputs = []
            for fused in (True, False):
                heads = heads_on_features(agent, feat, stoch_index, fused)
                learning = [p for name in LEARNING_HEADS for p in behaviour_heads(agent)[name].parameters()]
                loss = sum(heads[name].float().square().mean() for name in LEARNING_HEADS)
                grads = torch.autograd.grad(loss, learning, allow_unused=True)
                outputs.append([*(h.detach() for h in heads.values()), *(g for g in grads if g is not None)])
            for ours, expected in zip(*outputs):
                if not (error := relative_error(ours, expected, floor=1e-6)) <= FLOAT32_TOLERANCE:
                    raise KernelUnavailable(
                        f"its float32 heads give other values (relative error {error:.1e})"
                    )
    finally:
        torch.set_float32_matmul_precision(precision)


# --- The behaviour heads on imagined states sharing one first-layer product -------------------------------------------


# the heads `imagined_heads` runs on the imagined states (with the actor's in `imagine`); the learning ones (the losses'
# gradients reach them) first
LEARNING_HEADS = ("actor", "critic")


def behaviour_heads(agent: Agent) -> dict[str, nn.Module | None]:
    """The nets of the heads on the imagined states, by the attributes that hold them: the actor's and the critic's,
    which learn from the behaviour losses, then the slow critic's and the world model's reward and continue heads."""
    wm = agent.world_model
    return {
        "actor": getattr(agent.actor, "net", None),
        "critic": getattr(agent.critic, "net", None),
        "slow critic": getattr(agent.slow_critic, "net", None),
        "reward": getattr(wm, "reward_head", None),
        "continue": getattr(wm, "continue_head", None),
    }


def fast_heads_problem(agent: Agent, args: Args) -> str | None:
    """Why `FastHeads` cannot replace `imagined_heads` for this agent (a clause to say), or None."""
    if not isinstance(agent.imagine, FastImagine):
        return "they read the fast imagination's states, and --fast-imagine is off"
    if args.compile:
        return "--compile compiles the heads and the targets as Part 1 writes them"
    feat_dim = agent.world_model.rssm.deter_dim + agent.world_model.rssm.stoch_flat
    for name, net in behaviour_heads(agent).items():
        if net is None or first_linear(net, feat_dim) is None:
            return f"the {name} head is not an nn.Sequential that starts with an nn.Linear on the features"
    return None


def head_tables(firsts: list[nn.Linear], rssm: RSSM, gathers: bool) -> tuple:
    """The heads' first layers side by side for `SharedFirstLayer`, from the live weights, once per update: with
    gathers their weights on deter (sum of widths, D), their stoch table (S x C, sum of widths; row s x C + k is what
    latent s in class k adds to each, the biases folded into latent 0's rows) and no bias; else their whole weights
    (sum of widths, F), no table, and their biases."""
    bias = torch.cat([first.bias for first in firsts])
    if not gathers:
        return torch.cat([first.weight for first in firsts]), None, bias
    D = rssm.deter_dim
    stoch_table = torch.cat([first.weight[:, D:].t() for first in firsts], 1)
    stoch_table[: rssm.classes] += bias
    return torch.cat([first.weight[:, :D] for first in firsts]), stoch_table, None


class SharedFirstLayer(torch.autograd.Function):
    """The first layers of all heads on the imagined features feat (M, F) in one product: feat's deter part times
    their weights side by side, plus the rows of their stoch table that the latents pick (`head_tables`); with
    Gaussian latents one product with their whole weights. Each head's output is its columns of it, on the leading
    rows it reads. The backward pass computes the gradients of the learning heads' weights and biases alone (those
    passed in after the tables, whose values the tables hold), one product with feat and one sum each: feat is
    detached, and the heads read without gradients learn nothing here, where autograd's backward of the product
    would compute their weights' gradients too (zeros)."""

    @staticmethod
    def forward(ctx, feat, stoch_index, weight, stoch_table, bias, rows: tuple, widths: tuple, *learning):
        """feat (M, F), stoch_index (M, S) or None, `head_tables`' three, the rows and the width of each head's
        output, then the learning heads' weights and biases in pairs -> each head's output (rows, width), the learning
        heads first."""
        ctx.set_materialize_grads(False)  # a head read without gradients gives None
        ctx.save_for_backward(feat)
        ctx.rows, ctx.learning = rows, len(learning) // 2
        if stoch_index is None:
            hidden = torch.addmm(bias, feat, weight.t())
        else:
            stoch_part = gather_sum(stoch_index, stoch_table, bag_offsets(*stoch_index.shape, feat.device))
            hidden = torch.addmm(stoch_part, feat[:, : weight.shape[1]], weight.t())
        return tuple(part[:n] for part, n in zip(hidden.split(widths, -1), rows))

    @staticmethod
    def backward(ctx, *grads):
        (feat,) = ctx.saved_tensors
        parameter_grads = []
        for grad, n in zip(grads[: ctx.learning], ctx.rows):
            grad = None if grad is None else grad.to(feat.dtype)  # autocast's float16 or bfloat16 back
            parameter_grads += [None, None] if grad is None else [grad.t() @ feat[:n], grad.sum(0)]
        return None, None, None, None, None, None, None, *parameter_grads


# the heads `imagine` and `imagined_targets` run on the imagined states but the last (feat[:-1])
ALL_BUT_THE_LAST_STATE = ("actor", "slow critic")


def heads_on_features(
    agent: Agent, feat: torch.Tensor, stoch_index: torch.Tensor | None, fused: bool = False
) -> dict:
    """Each behaviour head's output on the imagined states it reads, from feat (H+1, N, F): (H+1 or H, N, its out).
    The first layers in one `SharedFirstLayer`, then each head's others as they are, with gradients for the learning
    heads alone; with `fused` (--fused-epilogues), each LayerNorm and the SiLU after it as one `norm_silu`
    (`run_layers`), whose backward is a kernel and a sum."""
    heads = behaviour_heads(agent)
    firsts = [first_linear(net, feat.shape[-1]) for net in heads.values()]
    with torch.no_grad():
        tables = head_tables(firsts, agent.world_model.rssm, stoch_index is not None)
    learning = [(first.weight, first.bias) for name, first in zip(heads, firsts) if name in LEARNING_HEADS]
    states = [feat.shape[0] - (name in ALL_BUT_THE_LAST_STATE) for name in heads]
    rows, widths = tuple(n * feat.shape[1] for n in states), tuple(first.out_features for first in firsts)
    index = None if stoch_index is None else stoch_index.flatten(0, 1)
    hidden = SharedFirstLayer.apply(
        feat.flatten(0, 1), index, *tables, rows, widths, *itertools.chain(*learning)
    )
    outputs = {}
    for name, net, part, n in zip(heads, heads.values(), hidden, states):
        with torch.set_grad_enabled(torch.is_grad_enabled() and name in LEARNING_HEADS):
            out = run_layers(list(net.children())[1:], part) if fused else after_first(net, part)
            outputs[name] = out.unflatten(0, (n, feat.shape[1]))
    return outputs


class FastHeads:
    """`imagined_heads` with the five heads on the imagined states (actor, critic, slow critic, reward, continue)
    sharing one first-layer product: the same arguments and results (`check_fast_heads`; --fast-heads off leaves
    `imagined_heads`). Where the imagination's epilogues are fused, the heads' are too (`heads_on_features`).

    The fast imagination's rollout (`FastImagine.rollout`), then every head on all the states it reads at once
    (`heads_on_features`); the actor's outputs become its log-probabilities and entropies by Part 1's `Actor.probs`
    and `policy_terms`, and Part 1's `imagined_targets` and `behavior_losses` take the heads from here."""

    def __init__(self, imagine: FastImagine):
        self.imagine, self.fused = imagine, imagine.fused
        self.rollout = imagine.rollout  # what imagines (dev/gpu/update_regions.py labels it)

    def __call__(self, agent: Agent, start_states, args: Args) -> dict:
        feat, stoch_index, action_index = self.rollout(agent, start_states, args.imagination_horizon)
        heads = heads_on_features(agent, feat, stoch_index, self.fused)
        log_prob, entropy = action_terms(agent.actor.probs(heads.pop("actor")), action_index)
        return {"log_prob": log_prob, "entropy": entropy} | heads


def float64_twin(agent: Agent) -> Agent:
    """A copy of `agent` for the checks, in float64 on the CPU, with Part 1's functions in its slots: its world model
    (without the encoder and decoder, which imagination never runs), actor, critics, return normaliser and settings
    (a dict of 0-d tensors)."""
    wm = agent.world_model
    left_out = {id(wm.encoder): None, id(wm.decoder): None}  # deepcopy's memo: these are copied as None
    modules = {"world_model": copy.deepcopy(wm, memo=left_out)}
    modules |= {
        name: copy.deepcopy(getattr(agent, name))
        for name in ("actor", "critic", "slow_critic", "return_norm")
    }
    return dataclasses.replace(
        agent,
        **{name: module.cpu().double() for name, module in modules.items()},
        settings={name: value.detach().cpu().double() for name, value in agent.settings.tensors.items()},
        imagine=imagine,
        imagined_heads=imagined_heads,
        imagined_targets=imagined_targets,
        behavior_losses=behavior_losses,
    )


def moved_heads(twin: Agent) -> None:
    """The heads on the imagined states of a float64 twin moved by seeded noise, and its return normaliser's range
    set to [-1, 2]: the critic, slow critic and reward heads start at zero (`mlp`'s zero_output), and a term
    multiplied by one of them shows no change to its formula on fresh weights."""
    torch.manual_seed(3)
    with torch.no_grad():
        for net in behaviour_heads(twin).values():
            for parameter in net.parameters():
                parameter.add_(0.3 * torch.randn_like(parameter))
        twin.return_norm.low.fill_(-1.0), twin.return_norm.high.fill_(2.0)


def check_fast_heads(agent: Agent, args: Args, tolerance: float = 1e-9) -> None:
    """The behaviour losses on the shared heads (`FastHeads` on `FastImagine`'s rollout) against them on
    `imagined_heads` and `imagine` as Part 1 writes them (Part 1's `behavior_losses` on both), on float64 copies of the run's weights, return normaliser and settings
    (`float64_twin`), and again with the heads moved (`moved_heads`), with the same random numbers: the losses and
    logged values, the return normaliser's update, and every gradient of the actor and the critic. A change to one
    that is not carried into the other raises FastPathMismatch. Each is compared relative to its size, or to 1e-3
    below that: a mean of returns near 0 (from heads that start at zero) keeps only the rounding of its terms, which
    the sums' order moves."""
    short = dataclasses.replace(args, imagination_horizon=4)
    for weights in ("the run's weights", "the run's weights with the heads moved"):
        results = []
        with torch.random.fork_rng(devices=[]):
            for fast in (True, False):
                twin = float64_twin(agent)
                if weights != "the run's weights":
                    moved_heads(twin)
                if fast:
                    twin.imagine = FastImagine(agent.imagined_heads.imagine.gathers)
                    twin.imagined_heads = FastHeads(twin.imagine)
                rssm = twin.world_model.rssm
                torch.manual_seed(2)
                deter = torch.randn(3, rssm.deter_dim, dtype=torch.float64)
                start = (
                    deter,
                    rssm.sample(rssm.prior(deter)).detach(),
                    torch.tensor([1.0, 0.0, 1.0]).double(),
                )
                torch.manual_seed(4)  # the same random numbers for both
                heads = twin.imagined_heads(twin, start, short)
                actor_loss, critic_loss, parts = twin.behavior_losses(twin, heads, start[2], short)
                learning = {f"actor.{name}": p for name, p in twin.actor.named_parameters()}
                learning |= {f"critic.{name}": p for name, p in twin.critic.named_parameters()}
                grads = torch.autograd.grad(actor_loss + critic_loss, list(learning.values()))
                values = {name: value.detach() for name, value in parts.items()}
                values |= {"the return normaliser's low": twin.return_norm.low, "high": twin.return_norm.high}
                results.append(values | {f"gradient of {name}": g for name, g in zip(learning, grads)})
        ours, reference = results
        for name, expected in reference.items():
            error = relative_error(ours[name], expected, floor=1e-3)
            if not error <= tolerance:
                raise FastPathMismatch(
                    f"the behaviour losses with the shared heads (FastHeads) give another {name} than "
                    f"imagined_heads on {weights} (relative error {error:.1e}): carry the change into "
                    f"FastHeads and heads_on_features (imagined_heads, Actor.forward and the heads hold the "
                    f"formulas), or run with --fast-heads off.",
                    off={"fast_heads": "off"},
                )


def check_fused_heads(agent: Agent, tolerance: float = 1e-9) -> None:
    """The heads on the imagined states with their LayerNorms and SiLUs fused (`heads_on_features` with `fused`:
    `norm_silu` and its backward, compiled for the run's device or interpreted on the CPU) against the heads' own
    layers: float64 copies of the heads on the device, as the run has them and moved by seeded noise (the zero
    output layers of fresh critic and reward heads pass no gradient back), from the same imagined features. Each
    head's output and every gradient of the learning heads' parameters within `tolerance`; a change to a LayerNorm or
    a SiLU that is not carried into the kernels raises FastPathMismatch."""
    device = agent.device
    rssm = float64_copy(agent.world_model.rssm).to(device)
    for weights in ("the run's weights", "the run's weights moved by noise"):
        nets = [copy.deepcopy(net).to(device, torch.float64) for net in behaviour_heads(agent).values()]
        if weights != "the run's weights":
            with torch.random.fork_rng(devices=[]), torch.no_grad():
                torch.manual_seed(3)
                for parameter in itertools.chain(*(net.parameters() for net in nets)):
                    parameter.add_(0.3 * torch.randn(parameter.shape, dtype=torch.float64).to(device))
        heads = dict(zip(behaviour_heads(agent), nets))
        twin = types.SimpleNamespace(
            world_model=types.SimpleNamespace(
                rssm=rssm, reward_head=heads["reward"], continue_head=heads["continue"]
            ),
            actor=types.SimpleNamespace(net=heads["actor"]),
            critic=types.SimpleNamespace(net=heads["critic"]),
            slow_critic=types.SimpleNamespace(net=heads["slow critic"]),
        )
        generator = torch.Generator().manual_seed(2)
        deter = torch.randn(5, 3, rssm.deter_dim, dtype=torch.float64, generator=generator)  # (H+1, N, D)
        classes = torch.randint(rssm.classes, (5, 3, rssm.stoch_dim), generator=generator)
        stoch = F.one_hot(classes, rssm.classes).flatten(-2).double()
        feat = torch.cat([deter, stoch], -1).to(device)
        stoch_index = classes.to(device) + latent_offsets(rssm, device)  # (H+1, N, S), as `latent_index`'s
        learning = [p for name in LEARNING_HEADS for p in heads[name].parameters()]
        results = []
        for fused in (True, False):
            outputs = heads_on_features(twin, feat, stoch_index, fused)
            probe = torch.Generator().manual_seed(4)
            loss = sum(
                (out * torch.randn(out.shape, dtype=torch.float64, generator=probe).to(device)).sum()
                for name, out in outputs.items()
                if name in LEARNING_HEADS
            )
            grads = torch.autograd.grad(loss, learning)
            results.append({f"output of the {name} head": out.detach() for name, out in outputs.items()})
            results[-1] |= {f"gradient {i} of the learning heads": g for i, g in enumerate(grads)}
        ours, expected = results
        for what, value in expected.items():
            error = relative_error(ours[what].cpu(), value.cpu())
            if not error <= tolerance:
                raise FastPathMismatch(
                    f"the fused heads (norm_silu_kernel and norm_silu_backward_kernel, which heads_on_features "
                    f"launches) give another {what} than the heads' own layers on {weights} (relative error "
                    f"{error:.1e}), in float64 on {device}: carry the change into the kernels, or run with "
                    f"--fused-epilogues off.",
                    off={"fused_epilogues": "off"},
                )


# --- Every check, on the weights the run is using ---------------------------------------------------------------------


def check_fast_paths(agent: Agent, args: Args, kernels: bool = True) -> None:
    """Each fast path in use against the Part 1 function it replaces, on the weights the run is using: the fast
    observe against `RSSM.observe` and its hand-written backward against autograd (float64 copies, also with the GRU
    saturated), with --fused-scan its kernels against both on the device (`check_fused_scan`), the fast imagination
    against `imagine` (its fused epilogues on the device: `check_fused_epilogues`), the shared heads against
    `imagined_heads` (`check_fast_heads`; fused, against their own layers on the device: `check_fused_heads`), and
    the draws they use (`check_draw`, compiled
    with --compile). Run at start-up, after --resume on the loaded weights, and every --check-every
    updates on the live ones; FastPathMismatch names the path and the flag that switches it off. About a second
    on a CPU for the default model, in float64 whatever the device (the compiled draw's first check compiles it:
    seconds more). Without `kernels`, the Triton paths' checks are left to `check_kernels_run` (at start-up)."""
    if isinstance(agent.observe, FastObserve):
        check_observe_forward(agent.world_model.rssm)
        if agent.observe.hand_written_backward:
            check_observe_backward(agent.world_model.rssm)
    if kernels and isinstance(agent.observe, FusedObserve):
        check_fused_scan(agent.world_model.rssm, agent.device)
    if isinstance(agent.imagine, FastImagine):
        check_fast_imagine(agent)
        if kernels and agent.imagine.fused:
            check_fused_epilogues(agent)
    if isinstance(agent.imagined_heads, FastHeads):
        check_fast_heads(agent, args)
        if kernels and agent.imagined_heads.fused:
            check_fused_heads(agent)
    if isinstance(agent.observe, FastObserve) or isinstance(agent.imagine, FastImagine):
        check_draw(agent.device, compiled=args.compile)


# --- Pinned to Part 1: each path steps aside where the code it stands for changed -----------------------------------


def code_tokens(source: str) -> list[str]:
    """The tokens of `source` that make its code: comments, docstrings, line breaks inside brackets, a trailing comma
    before a closing bracket and the quotes of a plain string left out, so that reformatting or rewording changes
    nothing. The same list on Python 3.11 and 3.12 (whose tokenizer splits an f-string: joined back here)."""
    source = textwrap.dedent(source)
    tree = ast.parse(source)
    docstrings = {
        (node.body[0].lineno, node.body[0].col_offset)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
        and isinstance(node.body[0].value.value, str)
    }
    starts = [0]
    for line in source.splitlines(keepends=True):
        starts.append(starts[-1] + len(line))
    out, fstring_at, depth, skip_newline = [], None, 0, False
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        kind = tokenize.tok_name[token.type]
        if kind == "FSTRING_START":  # Python 3.12: an f-string's parts, joined into its text as 3.11 gives it
            depth += 1
            fstring_at = token.start if depth == 1 else fstring_at
            continue
        if depth:
            if kind == "FSTRING_END" and (depth := depth - 1) == 0:
                (row, col), (end_row, end_col) = fstring_at, token.end
                out.append(source[starts[row - 1] + col : starts[end_row - 1] + end_col])
            continue
        if kind in ("COMMENT", "NL", "ENCODING", "ENDMARKER") or (kind == "NEWLINE" and skip_newline):
            skip_newline = False
            continue
        if kind == "STRING" and token.start in docstrings:
            skip_newline = True
            continue
        if token.string in (")", "]", "}") and out and out[-1] == ",":
            out.pop()
        text = token.string
        if kind == "STRING" and not text.lstrip("rRbBuU").startswith(("f", "F")):
            with contextlib.suppress(Exception):
                text = repr(ast.literal_eval(text))
        out.append({"NEWLINE": "<newline>", "INDENT": "<indent>", "DEDENT": "<dedent>"}.get(kind, text))
    return out


def code_digest(source: str) -> str:
    """16 hex digits of the digest of `source`'s code tokens (`code_tokens`)."""
    return hashlib.sha256("\x00".join(code_tokens(source)).encode()).hexdigest()[:16]


def part_1_source(script) -> str | None:
    """The script's Part 1 as its file holds it (banner to banner), or None where it has no file to read."""
    try:
        text = Path(script.__file__).read_text()
        return text[text.index("# PART 1: THE ALGORITHM") : text.index("# PART 2: SPEED")]
    except (AttributeError, OSError, TypeError, ValueError):
        return None


def name_digest(script, name: str) -> str | None:
    """The digest of Part 1's `name` in `script` (a function, a class, or `Class.method` with its class's own
    `__init__`; decorators included), or None where its source cannot be read: a copy without a file counts as
    changed."""
    try:
        owner, _, method = name.partition(".")
        found = getattr(script, owner)
        sources = [inspect.getsource(getattr(found, method) if method else found)]
        if method and method != "__init__" and "__init__" in vars(found):
            sources.append(inspect.getsource(found.__init__))
        return code_digest("\n".join(textwrap.dedent(source) for source in sources))
    except (AttributeError, OSError, TypeError, SyntaxError, tokenize.TokenError):
        return None


# Each path's pinned Part 1 code: the names whose formulas it holds a copy of, written out (functions reached through
# `agent.imagine`, `agent.actor` or `rssm.gru` cannot be found by reading calls), each with the digest of its code
# when the path's copy last matched it. The layers a path reads by name or type (`dense`'s, `mlp`'s) are not pinned:
# one it does not know makes it step aside by its `*_problem` function, in a line of its own. Written by
# `python dreamer_kernels.py pin [PATH ...]` once a path's copy carries a change to Part 1; tests/test_dreamer_pins.py
# holds them to today's script.
# pinned: start
PINNED = {
    "fast_observe": {
        "RSSM.observe": "413a9c64c7ddeb0c",
        "RSSM.img_step": "4d7c2b4de5eaf615",
        "RSSM.posterior": "b93810392a5fcd37",
        "RSSM.sample": "6401bcaa270c3545",
        "one_hot_draw": "73e0ff08473b2055",
        "draw_index": "9aa2fce3b11c2d93",
    },
    "observe_backward": {
        "RSSM.observe": "413a9c64c7ddeb0c",
        "RSSM.img_step": "4d7c2b4de5eaf615",
        "RSSM.posterior": "b93810392a5fcd37",
        "RSSM.sample": "6401bcaa270c3545",
        "RSSM._stats": "b0f6fd1f09139bf4",
        "RSSM.episode_start": "ef47eab3cb30bf73",
        "LayerNormGRUCell.forward": "e3df90fdd2c3c767",
        "one_hot_draw": "73e0ff08473b2055",
        "draw_index": "9aa2fce3b11c2d93",
        "upcast": "a4af19516ae1bd40",
        "mix_uniform": "72fbebb81de97119",
    },
    "fused_scan": {
        "RSSM.observe": "413a9c64c7ddeb0c",
        "RSSM.img_step": "4d7c2b4de5eaf615",
        "RSSM.posterior": "b93810392a5fcd37",
        "RSSM.sample": "6401bcaa270c3545",
        "RSSM._stats": "b0f6fd1f09139bf4",
        "RSSM.episode_start": "ef47eab3cb30bf73",
        "LayerNormGRUCell.forward": "e3df90fdd2c3c767",
        "one_hot_draw": "73e0ff08473b2055",
        "draw_index": "9aa2fce3b11c2d93",
        "upcast": "a4af19516ae1bd40",
        "mix_uniform": "72fbebb81de97119",
    },
    "fast_imagine": {
        "imagine": "38cee165f5e9c132",
        "RSSM.img_step": "4d7c2b4de5eaf615",
        "RSSM.prior": "0b078350f4e63381",
        "RSSM._stats": "b0f6fd1f09139bf4",
        "RSSM.sample": "6401bcaa270c3545",
        "RSSM.noise": "a721f47bd62a5ed1",
        "Actor.forward": "52cf07332cc55746",
        "one_hot_draw": "73e0ff08473b2055",
        "draw_index": "9aa2fce3b11c2d93",
    },
    "imagine_gathers": {
        "imagine": "38cee165f5e9c132",
        "RSSM.img_step": "4d7c2b4de5eaf615",
        "RSSM.prior": "0b078350f4e63381",
        "RSSM._stats": "b0f6fd1f09139bf4",
        "RSSM.sample": "6401bcaa270c3545",
        "RSSM.noise": "a721f47bd62a5ed1",
        "Actor.forward": "52cf07332cc55746",
        "one_hot_draw": "73e0ff08473b2055",
        "draw_index": "9aa2fce3b11c2d93",
        "one_hot": "b1c1b46ac80b3cb1",
        "Actor.probs": "8a0de8fad6b6dd26",
        "mix_uniform": "72fbebb81de97119",
    },
    "fused_epilogues": {
        "imagine": "38cee165f5e9c132",
        "RSSM.img_step": "4d7c2b4de5eaf615",
        "RSSM.prior": "0b078350f4e63381",
        "RSSM._stats": "b0f6fd1f09139bf4",
        "RSSM.sample": "6401bcaa270c3545",
        "RSSM.noise": "a721f47bd62a5ed1",
        "Actor.forward": "52cf07332cc55746",
        "one_hot_draw": "73e0ff08473b2055",
        "draw_index": "9aa2fce3b11c2d93",
        "one_hot": "b1c1b46ac80b3cb1",
        "LayerNormGRUCell.forward": "e3df90fdd2c3c767",
        "upcast": "a4af19516ae1bd40",
        "Actor.probs": "8a0de8fad6b6dd26",
        "mix_uniform": "72fbebb81de97119",
    },
    "fast_heads": {
        "imagined_heads": "b5139a202ca1f8ec",
        "imagine": "38cee165f5e9c132",
        "Actor.forward": "52cf07332cc55746",
        "Critic.forward": "e4c59f6ff1082350",
        "upcast": "a4af19516ae1bd40",
    },
}
PART_1_DIGEST = "7323accb45425176"
# pinned: end

SCRIPT = None  # the script `bind` was handed, whose Part 1 the digests are taken of
# what stepping a path aside sets
OFF = dict(
    fast_observe="off",
    observe_backward="autograd",
    fused_scan="off",
    fast_imagine="off",
    imagine_gathers="off",
    fused_epilogues="off",
    fast_heads="off",
)


def changed_names(script=None) -> dict[str, list[str]]:
    """Each path whose pinned Part 1 code differs in `script` (default: the bound one): the names that changed."""
    script = SCRIPT if script is None else script
    changed = {}
    for path, digests in PINNED.items():
        names = [name for name, digest in digests.items() if name_digest(script, name) != digest]
        if names:
            changed[path] = names
    return changed


def part_1_unchanged(script=None) -> bool:
    """Whether the script's Part 1 is the one the paths were pinned to, as a whole: its file's Part 1 and every
    pinned name (one replaced in memory included)."""
    script = SCRIPT if script is None else script
    source = part_1_source(script)
    return source is not None and code_digest(source) == PART_1_DIGEST and not changed_names(script)


def asks_for(args, path: str, device: torch.device) -> bool:
    """Whether the run's flags ask for `path` (the way `install` reads them)."""
    value = getattr(args, path)
    if path == "observe_backward":
        return value == "hand-written" and asks_for(args, "fast_observe", device)
    return value != "off" and wanted(args, path, device)


def step_aside_changed(args, device: torch.device) -> tuple:
    """(`args` with each path whose Part 1 code changed since it was pinned off, and one line naming those the run
    asks for, each with the names that changed, or no line)."""
    changed = changed_names()
    asked = [
        f"--{path.replace('_', '-')} ({', '.join(names)})"
        for path, names in changed.items()
        if asks_for(args, path, device)
    ]
    said = [
        f"speed: Part 1 changed where these paths are pinned to it, so Part 1 runs in their place: {'; '.join(asked)} "
        f"(once a path's copy carries the change: python dreamer_kernels.py pin PATH)"
    ]
    return dataclasses.replace(args, **{path: OFF[path] for path in changed}), said if asked else []


def pin(paths: list[str], kernels_file: str = __file__, script_file: str | None = None) -> list[str]:
    """Re-pin `paths` (all where empty) to the script in `script_file` (dreamer_atari.py beside this file where None),
    and Part 1 as a whole: the digests written into this file. Returns a line per path."""
    script_file = script_file or os.path.join(
        os.path.dirname(os.path.abspath(kernels_file)), "dreamer_atari.py"
    )
    unknown = sorted(set(paths) - set(PINNED))
    if unknown:
        raise ValueError(f"no path {', '.join(unknown)}; the paths are {', '.join(PINNED)}")
    if not os.path.isfile(script_file):
        raise ValueError(f"no script {script_file} to pin the paths to")
    spec = importlib.util.spec_from_file_location(Path(script_file).stem, script_file)
    script = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = script  # its dataclasses look themselves up there
    sys.path.insert(0, os.path.dirname(os.path.abspath(script_file)))  # its memory_utils.py
    spec.loader.exec_module(script)
    pinned = {
        path: {
            name: name_digest(script, name) if path in paths or not paths else digest
            for name, digest in names.items()
        }
        for path, names in PINNED.items()
    }
    lines = ["# pinned: start", "PINNED = {"]
    for path, names in pinned.items():
        lines += [f'    "{path}": {{'] + [f'        "{name}": "{digest}",' for name, digest in names.items()]
        lines.append("    },")
    lines += ["}", f'PART_1_DIGEST = "{code_digest(part_1_source(script))}"', "# pinned: end"]
    text = Path(kernels_file).read_text()
    start, end = text.index("# pinned: start"), text.index("# pinned: end") + len("# pinned: end")
    Path(kernels_file).write_text(text[:start] + "\n".join(lines) + text[end:])
    return [f"pinned {path}: {', '.join(pinned[path])}" for path in (paths or pinned)]


# --- The interface: what the script hands over, which paths it wants, installing and compiling them -------------------


def bind(script) -> None:
    """Hand over the script's Part 1 (`PART1`, read from `script`: a module, or anything with those attributes), which
    the faster equivalents compute and are checked against. A script without one of them raises KernelUnavailable."""
    missing = [name for name in PART1 if not hasattr(script, name)]
    if missing:
        raise KernelUnavailable(f"the script has no {', '.join(missing)}, which the kernels module computes")
    globals().update({name: getattr(script, name) for name in PART1}, SCRIPT=script)
    GRU_BACKWARDS.clear()
    GRU_BACKWARDS.update({LayerNormGRUCell: LayerNormGRUBackward, nn.GRUCell: TorchGRUBackward})


@dataclass(frozen=True)
class FastPath:
    """One faster equivalent: its flag, the Part 1 function it replaces, where `auto` turns it on, and the committed
    GPU results that showed it (installed, passing its checks, and timed where `saved_ms` is given)."""

    flag: str
    replaces: str
    default: str  # where it is on by default, in words
    # (card, commit, results file) of each GPU result that ran it
    shown: tuple[tuple[str, str, str], ...] = ()
    saved_ms: str = "not measured alone"


# The GPU result that the defaults on CUDA rest on: the 2026-11-27 H200 lease trained Pong with these paths (the code of
# commit c76c171, sm_90).
H200_2026_11_27 = ("NVIDIA H200 (sm_90)", "c76c171", "benchmark/results/2026-11-27-nvidia-h200.json")


# Each path, its flag and the GPU results that showed it; docs/dreamer_kernels.md's table is made from this one
# (`fast_paths_table`), and tests/test_dreamer_kernels_module.py holds each cited file to the card it names.
FAST_PATHS = (
    FastPath("--fast-observe", "RSSM.observe", "CUDA", (H200_2026_11_27,)),
    FastPath(
        "--observe-backward", "autograd through RSSM.observe", "with the fast observe", (H200_2026_11_27,)
    ),
    FastPath("--fast-imagine", "imagine", "CUDA", (H200_2026_11_27,)),
    FastPath("--imagine-gathers", "imagine's products with one-hot vectors", "CUDA where shown"),
    FastPath("--fast-heads", "imagined_heads", "CUDA where shown"),
    FastPath("--fused-scan", "the fast observe's steps", "CUDA where shown"),
    FastPath(
        "--fused-epilogues", "the gathered imagination step and the heads' LayerNorms", "CUDA where shown"
    ),
)


# Where `auto` turns a path on. On CUDA: the fast observe and the fast imagination everywhere (the H200 run of
# `FAST_PATHS` trained with them), each newer path on the compute capabilities of committed GPU results that showed it
# installed, passing its checks and making the update faster (none yet: a lease's results add them). On the CPU none:
# alone, no path saved 5 % of an update both at the Pong recipe and at the learning proof's size
# (benchmark/results/cpu_fast_paths/), and a path that saves less is not worth its copy of Part 1 there.
ON_CUDA = ("fast_observe", "fast_imagine")
SHOWN_ON: dict[str, tuple[tuple[int, int], ...]] = {
    "imagine_gathers": (),
    "fast_heads": (),
    "fused_scan": (),
    "fused_epilogues": (),
}
ON_THE_CPU: tuple[str, ...] = ()


# The CPU measurement the defaults there rest on (`ON_THE_CPU`): each path alone against the variant beneath it
# (benchmark/cpu_fast_paths.py), at the Pong recipe and at the learning proof's size
CPU_RESULTS = "benchmark/results/cpu_fast_paths/2026-12-02-intel-xeon.json"


def cpu_savings(root: str = os.path.dirname(os.path.abspath(__file__))) -> dict[str, str]:
    """Each path's share of the update saved on the CPU in `CPU_RESULTS` ("Pong recipe / proof size"), by its
    flag's name; empty where the file is not beside this module."""
    try:
        sizes = json.loads(Path(root, CPU_RESULTS).read_text())["sizes"]
    except OSError:
        return {}
    names = sizes["pong"]["saving"].keys() & sizes["proof"]["saving"].keys()
    return {
        name: " / ".join(f"{100 * sizes[size]['saving'][name]:+.1f} %" for size in ("pong", "proof"))
        for name in names
    }


def fast_paths_table() -> str:
    """The docs' table of fast paths, in markdown, from `FAST_PATHS` and `CPU_RESULTS`."""
    rows = [
        "| path (flag) | replaces | on by default | last shown on a GPU | ms saved (GPU) | update saved on a CPU "
        "(Pong recipe / proof size) |",
        "|---|---|---|---|---|---|",
    ]
    cpu = cpu_savings()
    for path in FAST_PATHS:
        shown = "; ".join(
            f"{card}, commit {commit}, [{file}](../{file})" for card, commit, file in path.shown
        )
        on_cpu = cpu.get(path.flag[2:].replace("-", "_"), "CUDA only")
        rows.append(
            f"| `{path.flag}` | {path.replaces} | {path.default} | {shown or 'never'} | {path.saved_ms} | {on_cpu} |"
        )
    return "\n".join(rows)


def wanted(args, name: str, device: torch.device) -> bool:
    """Whether the run asks for the path of the `auto`/`on`/`off` flag `name` (`on`, or `auto` where shown)."""
    value = getattr(args, name)
    if value != "auto":
        return value == "on"
    if device.type != "cuda":
        return name in ON_THE_CPU
    return name in ON_CUDA or torch.cuda.get_device_capability(device) in SHOWN_ON[name]


def triton_problem(device: torch.device) -> str | None:
    """Why Triton's kernels cannot run on `device` (a clause), or None: they need Triton, and NVIDIA's CUDA (or the
    interpreter on the CPU, as the tests run it)."""
    if device.type == "cuda" and torch.version.hip is not None:
        return "this is ROCm's torch, and the kernels are written for NVIDIA's CUDA"
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (7, 0):
        major, minor = torch.cuda.get_device_capability(device)
        return f"Triton compiles for compute capability 7.0 or newer, and this card is {major}.{minor}"
    try:
        import triton  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any failure to import is the same case
        return f"Triton does not import here ({type(exc).__name__})"
    return None


def install(agent, args) -> list[str]:
    """The faster equivalents the flags ask for, put in place of Part 1's functions on `agent` (its `observe`,
    `imagine`, `imagined_heads`), each checked before it trains (`check_fast_paths`).
    Returns the lines to say: each path that steps aside because the Part 1 code it is pinned to changed
    (`step_aside_changed`), each that does not apply here, and each that cannot run on this device
    (KernelUnavailable: it is left out, and Part 1's function, or the path beneath it, runs). A float64
    disagreement raises FastPathMismatch where Part 1 is unchanged as a whole (a copy edited by hand); where Part 1
    changed, the path that disagrees steps aside too, in one line, and Part 1 runs in its place."""
    args, said = step_aside_changed(args, agent.device)
    while True:  # each pass turns off a path that was on, or returns, or raises
        try:
            return said + install_paths(agent, args)
        except FastPathMismatch as exc:
            off = exc.off or OFF
            if part_1_unchanged() or off.items() <= vars(args).items():
                raise
            reset(agent)
            args = dataclasses.replace(args, **off)
            flags = ", ".join(
                f"--no-{flag}" if value is False else f"--{flag} {value}"
                for flag, value in ((flag.replace("_", "-"), value) for flag, value in off.items())
            )
            said.append(f"speed: {exc} Part 1 changed since the paths were pinned, so Part 1 runs ({flags}).")


def reset(agent) -> None:
    """Part 1's functions back in the places `install_paths` fills."""
    agent.observe, agent.imagine, agent.imagined_heads = (
        agent.world_model.rssm.observe,
        imagine,
        imagined_heads,
    )


def install_paths(agent, args) -> list[str]:
    """`install`'s paths, as the flags ask for them."""
    wm, device, said = agent.world_model, agent.device, []
    if wanted(args, "fast_observe", device) and (problem := fast_observe_problem(wm.rssm)):
        said.append(f"speed: the fast observe does not apply here ({problem}); RSSM.observe runs as written")
    elif wanted(args, "fast_observe", device):
        hand_written = args.observe_backward == "hand-written"
        if hand_written and (problem := hand_written_backward_problem(wm.rssm)):
            said.append(
                f"speed: the observe scan's hand-written backward does not apply ({problem}); autograd's runs"
            )
            hand_written = False
        agent.observe = FastObserve(wm.rssm, hand_written_backward=hand_written)
        if wanted(args, "fused_scan", device) and device.type not in FUSED_SCAN_DEVICES:
            said.append(f"speed: --fused-scan runs on CUDA, not on {device.type}; the fast observe runs")
        elif wanted(args, "fused_scan", device):
            agent.observe, line = fused_observe(wm.rssm, args, agent.observe)
            said += [line] if line else []
    if wanted(args, "fast_imagine", device):
        # the fused epilogues run on the gathers: asking for them asks for the gathers, unless those are off
        epilogues = wanted(args, "fused_epilogues", device)
        gathers = wanted(args, "imagine_gathers", device) or (epilogues and args.imagine_gathers == "auto")
        problem = gather_imagine_problem(agent) if gathers else None
        if problem:
            said.append(f"speed: imagination's products with one-hot latents stay products ({problem})")
        if epilogues and not gathers:
            said.append("speed: --fused-epilogues runs on the gathers, and --imagine-gathers is off")
        fused = gathers and not problem and epilogues
        if fused and device.type not in FUSED_SCAN_DEVICES:
            said.append(
                f"speed: --fused-epilogues runs on CUDA, not on {device.type}; gather_imagine_step runs"
            )
            fused = False
        if fused and (why := fused_epilogues_problem(args, device)):
            said.append(
                f"speed: --fused-epilogues does not apply ({why}); gather_imagine_step runs as written"
            )
            fused = False
        agent.imagine = FastImagine(gathers=gathers and not problem, fused=fused)
    if wanted(args, "fast_heads", device) and (problem := fast_heads_problem(agent, args)):
        said.append(
            f"speed: the heads on imagined states keep their own first layers ({problem}); imagined_heads runs"
        )
    elif wanted(args, "fast_heads", device):
        agent.imagined_heads = FastHeads(agent.imagine)
    check_fast_paths(agent, args, kernels=False)
    return said + check_kernels_run(agent, args)


def check_kernels_run(agent, args) -> list[str]:
    """At start-up, each Triton path installed on `agent`: its float64 check against the readable code (a
    disagreement raises FastPathMismatch: the run stops before training), then its float32 kernels, the run's own, at
    the run's own shapes against the path beneath it. One that cannot compile or launch here, or whose float32
    results disagree (KernelUnavailable), is left out with one line naming it, why, and its flag."""
    said = []
    if isinstance(agent.observe, FusedObserve):
        try:
            check_fused_scan(agent.world_model.rssm, agent.device)
            check_fused_scan_float32(agent.world_model.rssm, agent.device, args.batch_size)
        except (FastPathMismatch, torch.OutOfMemoryError):
            raise
        except Exception as exc:  # noqa: BLE001 - a kernel that cannot run here steps aside
            agent.observe = FastObserve(agent.world_model.rssm, hand_written_backward=True)
            said.append(step_aside("the fused observe scan", "--fused-scan off", "the fast observe", exc))
    fused_imagine = isinstance(agent.imagine, FastImagine) and agent.imagine.fused
    if fused_imagine:
        try:
            check_fused_epilogues(agent)
            if isinstance(agent.imagined_heads, FastHeads) and agent.imagined_heads.fused:
                check_fused_heads(agent)
            check_fused_epilogues_float32(agent, args.batch_size * args.sequence_length)
        except (FastPathMismatch, torch.OutOfMemoryError):
            raise
        except Exception as exc:  # noqa: BLE001 - as above
            agent.imagine = FastImagine(gathers=True, fused=False)
            if isinstance(agent.imagined_heads, FastHeads):
                agent.imagined_heads = FastHeads(agent.imagine)
            said.append(
                step_aside("the fused epilogues", "--fused-epilogues off", "gather_imagine_step", exc)
            )
    return said


def step_aside(path: str, flag: str, instead: str, exc: Exception) -> str:
    """The one line a path that cannot run here says."""
    why = str(exc) if isinstance(exc, KernelUnavailable) else f"{type(exc).__name__}: {exc}"
    why = why.splitlines()[0] if why else type(exc).__name__
    return f"speed: {path} cannot run on this device ({why}); {instead} runs instead ({flag} says so)"


def compile_paths(agent, compile_: Callable) -> None:
    """--compile: the fast paths' steps compiled with `compile_` (the script's `torch.compile` settings): one step of
    the fast observe and of its hand-written backward, one imagination step and the gathers' tables, each compiled
    once and reused at every step; the fused scan's steps are kernels already (the shared heads are never installed
    with --compile: `fast_heads_problem`)."""
    if isinstance(agent.observe, FastObserve) and not isinstance(agent.observe, FusedObserve):
        agent.observe.step = compile_(agent.observe.observe_step)
        agent.observe.reverse_step = compile_(ObserveBackwardThroughTime.reverse_step)
    if isinstance(agent.imagine, FastImagine):
        agent.imagine.step, agent.imagine.tables = compile_(agent.imagine.step), compile_(imagine_tables)


if __name__ == "__main__":
    words = sys.argv[1:]
    script_file = words[words.index("--script") + 1] if "--script" in words[:-1] else None
    if words[:1] != ["pin"] or ("--script" in words and script_file is None):
        print(
            "usage: python dreamer_kernels.py pin [--script FILE] [PATH ...]  (re-pins the paths to the Part 1 of "
            "FILE, dreamer_atari.py beside this file by default)",
            file=sys.stderr,
        )
        sys.exit(2)
    named = [word for word in words[1:] if word not in ("--script", script_file)]
    try:
        print("\n".join(pin(named, script_file=script_file)))
    except ValueError as exc:
        print(f"error: {exc}.", file=sys.stderr)
        sys.exit(2)
