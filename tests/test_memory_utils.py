"""memory_utils: real measurements on this process, real torch optimizers; memory_analysis's CLI as a user runs it."""

import ast
import gc
import os
import pickle
import signal
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch

import memory_analysis as ma
import memory_utils as mu
from conftest import ROOT

CUDA = torch.cuda.is_available()


# --------------------------------------------------------------------------------------- host memory
def test_host_memory_psutil_and_proc_fallback_agree(monkeypatch):
    ballast = np.ones(64 * 1024 * 1024 // 8)  # 64 MB of touched pages, so both readings see real memory
    rss, uss = mu.process_rss_mb(), mu.process_uss_mb()
    assert rss > 64 and uss > 64 and uss <= rss + 1
    monkeypatch.setattr(mu, "psutil", None)
    rss_proc, uss_proc = mu.process_rss_mb(), mu.process_uss_mb()
    assert abs(rss_proc - rss) < 0.1 * rss + 8
    assert abs(uss_proc - uss) < 0.1 * uss + 8
    del ballast


def test_host_memory_without_psutil_or_proc(monkeypatch):
    monkeypatch.setattr(mu, "psutil", None)
    monkeypatch.setattr(mu, "_proc_status_kb", lambda *a, **k: None)
    with pytest.raises(RuntimeError, match="psutil"):
        mu.process_rss_mb()


@pytest.mark.skipif(CUDA, reason="checks the no-CUDA behaviour")
def test_gpu_stats_empty_without_cuda_and_report_keys():
    assert mu.gpu_memory_stats() == {}
    assert mu.gpu_memory_stats("cuda:0") == {}
    report = mu.memory_report({"total_steps": 10, "num_episodes": 1, "obs_bytes": 70560, "aux_bytes": 70})
    assert set(report) == set(mu.CPU_KEYS) | set(mu.BUFFER_KEYS.values())
    assert all(type(v) is float for v in report.values())
    assert report["buffer/replay/obs_bytes"] == 70560.0
    assert not any(k.startswith("debug/gpu/") for k in report)


def test_heap_in_use_follows_a_c_allocation_and_its_free():
    """glibc's live malloc'd bytes: an 8 MB numpy array (an mmapped block) and 2,000 blocks of 4 kB (in the heap)
    count while they live and stop counting when freed."""
    before = mu.heap_in_use_mb()
    big = np.ones(1_000_000)  # 8 MB
    small = [np.ones(512) for _ in range(2_000)]  # 2,000 x 4 kB
    during = mu.heap_in_use_mb()
    del big, small
    after = mu.heap_in_use_mb()
    assert during - before == pytest.approx(8.0 + 8.0, abs=1.0), (before, during)
    assert after - before == pytest.approx(0.0, abs=0.5), (before, after)


def test_memory_keys_are_the_documented_names():
    assert mu.CPU_KEYS == (
        "debug/cpu/rss_mb",
        "debug/cpu/uss_mb",
        "debug/cpu/anon_mb",
        "debug/cpu/heap_in_use_mb",
    )
    assert set(mu.GPU_KEYS) == {
        f"debug/gpu/{k}"
        for k in (
            "alloc_mb",
            "reserved_mb",
            "max_alloc_mb",
            "max_reserved_mb",
            "small_pool_active_mb",
            "large_pool_active_mb",
            "active_blocks",
            "num_alloc_retries",
            "num_ooms",
        )
    }
    assert set(mu.BUFFER_KEYS.values()) == {
        f"buffer/replay/{k}" for k in ("total_steps", "num_episodes", "obs_bytes", "aux_bytes")
    }


def test_memory_report_rejects_incomplete_buffer_stats():
    with pytest.raises(ValueError, match="obs_bytes"):
        mu.memory_report({"total_steps": 1, "num_episodes": 1, "aux_bytes": 0})


# --------------------------------------------------------------------------------------- leak detector
def _run_loop(steps_per_iter, iters, keep, buffer=None, buffer_capacity=None, pass_buffer_stats=True):
    """A tiny recurrent "collection" loop measured with real host memory. Returns the detector's verdict.

    With `keep`, it is the incident's bug: the recurrent state is computed with autograd on and never
    detached, so each step's graph (and the 1 MB tensors it saved) stays reachable from the next state.
    """
    detector = mu.LeakDetector(warmup_steps=0, window=iters, threshold_mb_per_1k=1.0)
    weight = torch.ones(1, requires_grad=True)
    hidden = torch.zeros(256 * 1024)
    for i in range(iters):
        noise = torch.randn(256 * 1024)  # 1 MB "observation"
        with torch.set_grad_enabled(keep):
            hidden = torch.tanh(weight * noise + hidden)
        if not keep:
            hidden = hidden.detach()
        stats = None
        if buffer is not None:
            buffer.append(np.ones(256 * 1024 // 8 * 2))  # 2 MB of "observations" per iteration
            while buffer_capacity is not None and len(buffer) > buffer_capacity:
                buffer.pop(0)
            nbytes = sum(a.nbytes for a in buffer)
            stats = {"total_steps": len(buffer), "num_episodes": 1, "obs_bytes": nbytes, "aux_bytes": 0}
        # memory_report collects garbage and trims the heap first: the figures are of live memory
        detector.observe(i * steps_per_iter, mu.memory_report(stats if pass_buffer_stats else None))
    assert (hidden.grad_fn is not None) == keep
    return detector.check()


def test_leak_detector_flags_a_recurrent_state_that_keeps_its_graph():
    verdict = _run_loop(steps_per_iter=100, iters=30, keep=True)
    assert verdict.leaking, verdict.diagnosis
    assert verdict.cause == "host_references"
    assert verdict.slopes[mu.HOST_UNEXPLAINED_MB] > 10  # ~20 MB per 1k steps kept (2 saved tensors per step)
    assert "references" in verdict.diagnosis


def test_leak_detector_passes_a_steady_loop():
    verdict = _run_loop(steps_per_iter=100, iters=30, keep=False)
    assert not verdict.leaking, verdict.diagnosis
    assert verdict.cause == "none"


def test_leak_detector_does_not_flag_a_buffer_filling_to_capacity():
    verdict = _run_loop(steps_per_iter=100, iters=30, keep=False, buffer=[], buffer_capacity=20)
    assert not verdict.leaking, verdict.diagnosis
    # the same loop judged without the buffer's bytes would be flagged: the subtraction is what saves it
    unexplained = _run_loop(
        steps_per_iter=100, iters=30, keep=False, buffer=[], buffer_capacity=None, pass_buffer_stats=False
    )
    assert unexplained.leaking and unexplained.cause == "host_references"


# The neighbour maps and reads every page of the same file, as a second torch process does with the libraries.
NEIGHBOUR = (
    "import mmap, sys\n"
    "f = open(sys.argv[1], 'rb')\n"
    "pages = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)\n"
    "sum(pages[i] for i in range(0, len(pages), mmap.PAGESIZE))\n"
    "print('ready', flush=True)\n"
    "sys.stdin.read()\n"
)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="USS and RssAnon as Linux reports them")
def test_a_neighbour_process_sharing_library_pages_starting_and_ending_is_not_a_leak(tmp_path):
    # A second run on the same machine (another seed, a test suite) maps the same torch libraries: while it
    # lives, their pages count as shared, so this process's USS drops; when it ends, USS jumps back up. A file of
    # this test's own stands in for the libraries, which any other torch process on the machine (a second test
    # worker) may already share and so hide the effect.
    import mmap

    library = tmp_path / "library.so"
    library.write_bytes(os.urandom(48 * 1024 * 1024))
    with open(library, "rb") as f:
        pages = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    sum(pages[i] for i in range(0, len(pages), mmap.PAGESIZE))  # resident, and this process's alone
    detector = mu.LeakDetector(warmup_steps=0, window=10, threshold_mb_per_1k=1.0)
    uss = []
    neighbour = subprocess.Popen(
        [sys.executable, "-c", NEIGHBOUR, str(library)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert neighbour.stdout.readline().strip() == "ready"
        for i in range(10):
            if i == 5:  # the neighbour ends halfway through the window
                neighbour.stdin.close()
                neighbour.wait(timeout=60)
            report = mu.memory_report()
            uss.append(report[mu.KEY_USS_MB])
            detector.observe(1000 * i, report)
    finally:
        neighbour.kill()
        pages.close()
    # the hazard is real: USS stepped up when the neighbour left, with nothing changed here
    assert min(uss[5:]) - max(uss[:5]) > 10, uss
    verdict = detector.check()
    assert not verdict.leaking, verdict.diagnosis
    assert abs(verdict.slopes[mu.HOST_UNEXPLAINED_MB]) < 1.0
    assert verdict.slopes[mu.KEY_USS_MB] > 1.0  # judged on USS, the same run would have been called a leak


def test_leak_detector_names_gpu_causes_from_the_pools_that_grow():
    graphs = mu.LeakDetector(warmup_steps=1000, window=10)
    frag = mu.LeakDetector(warmup_steps=0, window=10)
    for i in range(20):
        step = 500 * i
        graphs.observe(
            step,
            {
                mu.KEY_USS_MB: 500.0,
                mu.KEY_GPU_ALLOC_MB: 100 + 0.1 * step,
                mu.KEY_GPU_SMALL_POOL_ACTIVE_MB: 10 + 0.1 * step,
                mu.KEY_GPU_ACTIVE_BLOCKS: 8000 + 8 * step,
                mu.KEY_GPU_RESERVED_MB: 200 + 0.1 * step,
            },
        )
        frag.observe(
            step,
            {
                mu.KEY_USS_MB: 500.0,
                mu.KEY_GPU_ALLOC_MB: 100.0,
                mu.KEY_GPU_ACTIVE_BLOCKS: 900.0,
                mu.KEY_GPU_RESERVED_MB: 200 + 0.05 * step,
            },
        )
    g = graphs.check()
    assert g.leaking and g.cause == "graph_retention" and "no_grad" in g.diagnosis
    assert g.slopes[mu.KEY_GPU_SMALL_POOL_ACTIVE_MB] == pytest.approx(100.0)
    f = frag.check()
    assert f.leaking and f.cause == "fragmentation" and "expandable_segments" in f.diagnosis


def test_leak_detector_ignores_warmup_and_checks_arguments():
    detector = mu.LeakDetector(warmup_steps=10_000, window=5)
    for step in range(0, 10_000, 1000):
        detector.add("debug/cpu/uss_mb", step, float(step))
    assert detector.check().cause == "warming_up"
    for bad in (
        {"warmup_steps": -1},
        {"window": 1},
        {"threshold_mb_per_1k": 0},
        {"threshold_mb_per_1k": float("nan")},
    ):
        with pytest.raises(ValueError):
            mu.LeakDetector(**bad)
    with pytest.raises(ValueError, match="finite"):
        detector.add("x", 20_000, float("inf"))


def test_the_leak_detectors_own_memory_does_not_grow_while_its_window_fills():
    """The detector keeps each metric's window in one array made with its first sample, so what it holds does not
    grow while its window fills (96 memory reports: 24k env steps at a 250-step log interval), which a soak would
    read as the run's growth. From its 12th report (its first verdicts made) to its 200th, 14 metrics: about 18 kB
    more (numpy's own one-time allocations), against 145 kB with a deque of float pairs per metric (13 metrics)."""
    import tracemalloc

    detector = mu.LeakDetector(warmup_steps=0, window=96)
    rng = np.random.default_rng(0)
    keys = [*mu.CPU_KEYS, *mu.GPU_KEYS]

    def reports(steps):
        for step in steps:
            detector.observe(step, {key: 100.0 + rng.normal() for key in keys})
            assert not detector.check().leaking
        gc.collect()
        return tracemalloc.get_traced_memory()[0]

    tracemalloc.start()
    try:
        early = reports(range(0, 12 * 250, 250))
        full = reports(range(12 * 250, 200 * 250, 250))
    finally:
        tracemalloc.stop()
    assert len(detector.samples) == len(keys) + 1 == 14  # every key and host memory beyond the replay
    assert all(len(series) == 96 for series in detector.samples.values())
    assert full - early < 50_000, (early, full)


def test_robust_slope_shrugs_off_a_spike():
    steps = list(range(0, 10_000, 1000))
    values = [100.0] * 10
    values[4] = 5000.0
    assert mu.robust_slope(steps, values) == 0.0


# --------------------------------------------------------------------------------------- allocator
def test_configure_allocator_sets_defaults_torch_accepts(monkeypatch):
    for name in mu.ALLOC_ENV_VARS:
        monkeypatch.setenv(name, "x")
        monkeypatch.delenv(name)
    conf = mu.configure_allocator(verbose=False)
    assert conf == mu.DEFAULT_ALLOC_CONF == os.environ["PYTORCH_ALLOC_CONF"]
    assert "expandable_segments:True" in conf and "garbage_collection_threshold:0.7" in conf
    mu._validate_alloc_conf(mu.FALLBACK_ALLOC_CONF)  # torch's parser accepts the fallback too
    with pytest.raises(ValueError):
        mu._validate_alloc_conf("garbage_collection_threshold:1.5")  # and it really validates


@pytest.mark.parametrize("name", mu.ALLOC_ENV_VARS)
def test_configure_allocator_keeps_the_users_setting(monkeypatch, capsys, name):
    for other in mu.ALLOC_ENV_VARS:
        monkeypatch.delenv(other, raising=False)
    monkeypatch.setenv(name, "max_split_size_mb:256")
    assert mu.configure_allocator() == "max_split_size_mb:256"
    assert "your setting" in capsys.readouterr().out
    assert os.environ[name] == "max_split_size_mb:256"


# A fresh process writes 100 TensorBoard records of growing size (150-348 kB, like open-loop GIFs as a model
# trains) and prints how much resident anonymous memory the last 80 left behind, the writer flushed and the heap
# trimmed. Its arguments: whether to call one_malloc_arena() first, and the event folder.
WRITER_THREAD_PROBE = """
import sys
import memory_utils as mu
one = sys.argv[1] == "1"
if one:
    assert mu.one_malloc_arena()
import numpy as np
from tensorboard.compat.proto.summary_pb2 import Summary
from torch.utils.tensorboard import SummaryWriter

writer = SummaryWriter(sys.argv[2])
rng = np.random.default_rng(0)


def record(i):
    image = Summary.Image(height=1, width=1, colorspace=1, encoded_image_string=rng.bytes(150_000 + 2_000 * i))
    writer._get_file_writer().add_summary(Summary(value=[Summary.Value(tag="gif", image=image)]), i)


def anon_kb():
    writer.flush()
    mu.trim_host_memory()
    return 1024 * mu.process_anon_mb()


for i in range(20):
    record(i)
before = anon_kb()
for i in range(20, 100):
    record(i)
print(anon_kb() - before)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's arenas and RssAnon are Linux's")
def test_one_malloc_arena_returns_what_tensorboards_writer_thread_freed(tmp_path):
    def growth_kb(one_arena: bool) -> float:
        env = {key: value for key, value in os.environ.items() if key != "MALLOC_ARENA_MAX"}
        flag, events = ("1" if one_arena else "0"), str(tmp_path / str(one_arena))
        out = subprocess.run(
            [sys.executable, "-c", WRITER_THREAD_PROBE, flag, events],
            cwd=ROOT,
            env={**env, "PYTHONPATH": str(ROOT)},
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 0, out.stderr
        return float(out.stdout.split()[-1])

    # without it the writer thread's heap keeps the freed copies of the largest records (measured: 312 kB)
    assert growth_kb(one_arena=False) > 150
    assert growth_kb(one_arena=True) < 40  # with it the trim returns them (measured: 0)


def test_one_malloc_arena_keeps_the_users_setting(monkeypatch):
    monkeypatch.setenv("MALLOC_ARENA_MAX", "4")
    assert mu.one_malloc_arena() is False


# --------------------------------------------------------------------------------------- waiting for the GPU
class FakeGpu:
    """Free memory that becomes available after `frees_after` polls (never, when None)."""

    def __init__(self, frees_after):
        self.frees_after, self.polls, self.now, self.sleeps = frees_after, 0, 0.0, []

    def probe(self):
        self.polls += 1
        return 8000.0 if self.frees_after is not None and self.polls > self.frees_after else 100.0

    def sleep(self, seconds):
        self.sleeps.append(seconds)
        self.now += seconds

    def clock(self):
        return self.now


def test_wait_for_gpu_returns_when_memory_frees():
    gpu = FakeGpu(frees_after=3)
    assert mu.wait_for_gpu(4000, poll_s=5, timeout_s=60, probe=gpu.probe, sleep=gpu.sleep, clock=gpu.clock)
    assert gpu.polls == 4 and gpu.sleeps == [5, 5, 5]


def test_wait_for_gpu_times_out():
    gpu = FakeGpu(frees_after=None)
    assert not mu.wait_for_gpu(
        4000, poll_s=5, timeout_s=12, probe=gpu.probe, sleep=gpu.sleep, clock=gpu.clock
    )
    assert sum(gpu.sleeps) == 12 and gpu.polls == 4


@pytest.mark.parametrize(
    "kwargs,name",
    [({"min_free_mb": -1}, "min_free_mb"), ({"poll_s": 0}, "poll_s"), ({"timeout_s": -5}, "timeout_s")],
)
def test_wait_for_gpu_checks_arguments(kwargs, name):
    args = {"min_free_mb": 10, "poll_s": 1, "timeout_s": 1, "probe": lambda: 0.0, **kwargs}
    with pytest.raises(ValueError, match=name):
        mu.wait_for_gpu(**args)


@pytest.mark.skipif(CUDA, reason="checks the no-driver behaviour")
def test_wait_for_gpu_without_a_driver_or_probe():
    with pytest.raises(RuntimeError, match="reads free memory through NVML, and NVML does not start"):
        mu.wait_for_gpu(10, 1, 1)


# --------------------------------------------------------------------------------------- preallocation
def _model_and_batch(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Dropout(0.1), torch.nn.Linear(32, 4))
    batch = torch.randn(16, 8)
    return model, batch


def _train_step(model, optimizer, batch):
    optimizer.zero_grad(set_to_none=True)
    model(batch).square().mean().backward()
    optimizer.step()


@pytest.mark.parametrize("opt_cls", [torch.optim.Adam, torch.optim.AdamW])
def test_preallocation_changes_nothing_and_next_step_matches_a_fresh_optimizer(opt_cls):
    model, batch = _model_and_batch()
    fresh_model, _ = _model_and_batch()
    optimizer = opt_cls(model.parameters(), lr=1e-2)
    fresh_optimizer = opt_cls(fresh_model.parameters(), lr=1e-2)
    before = [p.detach().clone() for p in model.parameters()]
    worst_case = torch.randn(64, 8)

    torch.manual_seed(123)
    peak = mu.preallocate_optimizer_state(lambda: model(worst_case).square().mean().backward(), optimizer)
    rng_after = torch.get_rng_state()
    torch.manual_seed(123)
    assert torch.equal(rng_after, torch.get_rng_state())  # the RNG stream is untouched

    assert isinstance(peak, float) and peak >= 0
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert all(p.grad is None for p in model.parameters())
    for p in model.parameters():
        state = optimizer.state[p]
        assert state["exp_avg"].shape == p.shape and not state["exp_avg"].any()
        assert not state["exp_avg_sq"].any() and float(state["step"]) == 0

    for _ in range(3):  # the next real steps equal those of an optimizer that never preallocated
        torch.manual_seed(7)
        _train_step(model, optimizer, batch)
        torch.manual_seed(7)
        _train_step(fresh_model, fresh_optimizer, batch)
        assert all(torch.equal(a, b) for a, b in zip(model.parameters(), fresh_model.parameters()))


def test_preallocation_handles_several_optimizers_and_refuses_bad_input():
    a, b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    opt_a, opt_b = torch.optim.Adam(a.parameters()), torch.optim.Adam(b.parameters())
    x = torch.randn(2, 4)
    mu.preallocate_optimizer_state(lambda: b(a(x)).sum().backward(), [opt_a, opt_b])
    assert len(opt_a.state) == 2 and len(opt_b.state) == 2
    with pytest.raises(ValueError, match="no gradients"):  # a step_fn that never calls backward
        mu.preallocate_optimizer_state(lambda: None, opt_a)
    with pytest.raises(ValueError, match="optimizer"):
        mu.preallocate_optimizer_state(lambda: None, "adam")
    with pytest.raises(ValueError, match="step_fn"):
        mu.preallocate_optimizer_state(None, opt_a)


ALL_OPTIMIZERS = [
    c
    for c in vars(torch.optim).values()
    if isinstance(c, type) and issubclass(c, torch.optim.Optimizer) and c is not torch.optim.Optimizer
]
OPTIMIZER_KWARGS = {"SGD": {"lr": 0.01, "momentum": 0.9, "dampening": 0.5}, "Muon": {"lr": 0.02}}


def _batchnorm_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(), torch.nn.Linear(16, 4)
    )


@pytest.mark.parametrize("opt_cls", ALL_OPTIMIZERS, ids=lambda c: c.__name__)
def test_preallocation_leaves_every_optimizer_and_batchnorm_as_a_fresh_start(opt_cls):
    """Every optimizer in torch.optim, on a model with BatchNorm: after preallocation, three real steps give the
    same weights, running statistics and optimizer state as three steps of a twin that never preallocated."""
    name = opt_cls.__name__
    kwargs = OPTIMIZER_KWARGS.get(name, {})
    trainable = (
        (lambda m: [p for p in m.parameters() if p.ndim == 2])
        if name == "Muon"
        else (lambda m: list(m.parameters()))
    )
    model, twin = _batchnorm_model(), _batchnorm_model()
    optimizer, twin_optimizer = opt_cls(trainable(model), **kwargs), opt_cls(trainable(twin), **kwargs)
    x = torch.randn(32, 8, generator=torch.Generator().manual_seed(1))
    worst_case = lambda: model(3 * x).square().mean().backward()
    if name in ("LBFGS", "SparseAdam"):
        with pytest.raises(ValueError, match=f"cannot preallocate for {name}"):
            mu.preallocate_optimizer_state(worst_case, optimizer, modules=[model])
        return
    mu.preallocate_optimizer_state(worst_case, optimizer, modules=[model])
    # Adagrad's state exists from its construction; SGD with dampening drops its buffer (only "absent" is exact)
    assert optimizer.state or name == "SGD", "nothing was preallocated"
    for _ in range(3):
        for m, o in ((model, optimizer), (twin, twin_optimizer)):
            o.zero_grad()
            m(x).square().mean().backward()
            o.step()
    for a, b in zip(model.state_dict().values(), twin.state_dict().values()):
        assert torch.equal(a, b), "weights or running statistics differ from a fresh start"
    mine, theirs = optimizer.state_dict()["state"], twin_optimizer.state_dict()["state"]
    assert mine.keys() == theirs.keys()
    for index in mine:
        assert mine[index].keys() == theirs[index].keys()
        for key, value in mine[index].items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(theirs[index][key])), (name, key)


def test_preallocation_refuses_a_step_that_creates_no_state():
    model = torch.nn.Linear(4, 4)
    with pytest.raises(ValueError, match="nothing to preallocate"):
        mu.preallocate_optimizer_state(
            lambda: model(torch.ones(2, 4)).sum().backward(), torch.optim.SGD(model.parameters(), lr=0.1)
        )


# --------------------------------------------------------------------------------------- AMP
def test_amp_on_cpu_is_quiet_and_correct():
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning spam on CPU
        auto = mu.amp("auto", "cpu")
        assert auto.mode == "off" and not auto.enabled and not auto.scaler.is_enabled()
        bf16 = mu.amp("bf16", torch.device("cpu"))
        with bf16.autocast():
            out = torch.nn.Linear(4, 4)(torch.randn(2, 4))
        assert out.dtype == torch.bfloat16 and not bf16.scaler.is_enabled()
        loss = torch.ones(1, requires_grad=True).sum()
        assert auto.scaler.scale(loss) is loss  # disabled scaler passes straight through
    with pytest.raises(ValueError, match="fp16 needs a CUDA"):
        mu.amp("fp16", "cpu")
    with pytest.raises(ValueError, match="auto, off, fp16, bf16"):
        mu.amp("fp8", "cpu")


# --------------------------------------------------------------------------------------- what a run imports
def test_a_run_imports_memory_utils_without_the_offline_analysis():
    """A copied script needs only itself and memory_utils.py: importing memory_utils loads no memory_analysis, and
    neither training script imports it."""
    done = subprocess.run(
        [sys.executable, "-c", "import memory_utils, sys; assert 'memory_analysis' not in sys.modules"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    for script in ("dreamer_atari.py", "dqn_starcraft_split.py"):
        imported = set()
        for node in ast.walk(ast.parse((ROOT / script).read_text())):
            if isinstance(node, ast.Import):
                imported |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module:
                imported.add(node.module.split(".")[0])
        assert "memory_utils" in imported and "memory_analysis" not in imported, script


# --------------------------------------------------------------------------------------- CLI
def _cli(*args, **env):
    return subprocess.run(
        [sys.executable, str(ROOT / "memory_analysis.py"), *args],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        timeout=120,
    )


def test_cli_help_lists_the_commands():
    result = _cli("--help")
    assert result.returncode == 0
    for command in ("report", "allocator", "wait", "analyze"):
        assert command in result.stdout


@pytest.mark.parametrize(
    "args,needle",
    [
        (("wait", "--min-free", "abc", "--", "true"), "--min-free"),
        (("wait", "--min-free", "-5", "--allow-no-gpu", "--", "true"), "--min-free"),
        (("wait", "--min-free", "10", "--allow-no-gpu"), "command"),
        (
            ("wait", "--min-free", "10", "--fallback-env", "NOEQUALS", "--allow-no-gpu", "--", "true"),
            "NAME=VALUE",
        ),
        (("frobnicate",), "frobnicate"),
    ],
)
def test_cli_bad_arguments_exit_2_with_one_line(args, needle):
    result = _cli(*args)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0] and "Traceback" not in result.stderr


def test_memory_utils_run_as_a_command_names_the_command_line(tmp_path):
    """The command line moved to memory_analysis.py: `python memory_utils.py wait ... -- cmd` runs nothing and says
    where it is, with exit 2."""
    command = [
        sys.executable,
        str(ROOT / "memory_utils.py"),
        "wait",
        "--min-free",
        "2048",
        "--",
        "touch",
        "ran",
    ]
    for argv in (command, command[:2]):
        done = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=120)
        assert done.returncode == 2 and not (tmp_path / "ran").exists()
        assert done.stdout == "" and len(done.stderr.strip().splitlines()) == 1, done.stderr
        assert "memory_analysis.py" in done.stderr and "Traceback" not in done.stderr


@pytest.mark.skipif(CUDA, reason="checks the no-driver behaviour")
def test_cli_wait_without_a_driver_says_so():
    result = _cli("wait", "--min-free", "10", "--", "true")
    assert result.returncode == 2 and len(result.stderr.splitlines()) == 1, result.stderr
    assert "cannot read the GPU's free memory: NVML does not start" in result.stderr
    assert "--allow-no-gpu" in result.stderr and "Traceback" not in result.stderr
    assert _cli("wait", "--min-free", "10", "--allow-no-gpu", "--", "true").returncode == 0


class FakeNvml:
    """A stand-in for the pynvml module: GPUs 0..7 whose free memory reaches 8 GB after `frees_after` polls."""

    class NVMLError(Exception):
        pass

    def __init__(self, frees_after=0, driver=True):
        self.frees_after, self.driver, self.polls, self.running = frees_after, driver, 0, False
        self.handles = []

    def nvmlInit(self):
        if not self.driver:
            raise self.NVMLError("Driver Not Loaded")
        self.running = True

    def nvmlShutdown(self):
        self.running = False

    def nvmlDeviceGetHandleByIndex(self, index):
        self.handles.append(index)
        return f"GPU-fake-{index}"

    def nvmlDeviceGetHandleByUUID(self, uuid):
        self.handles.append(uuid)
        return uuid

    def nvmlDeviceGetUUID(self, handle):
        return handle

    def nvmlDeviceGetMemoryInfo(self, handle):
        assert self.running
        self.polls += 1
        free = 8000 if self.polls > self.frees_after else 100
        return type("Memory", (), {"free": free * 1024 * 1024})()


def test_cli_wait_reads_nvml_for_the_visible_gpu_and_never_touches_cuda(monkeypatch, tmp_path):
    """--gpu 1 with CUDA_VISIBLE_DEVICES=3,5 is physical GPU 5: NVML is asked about it, the command gets that card
    by UUID, and the waiting process never initialises CUDA (which would hold memory on the card it waits for)."""

    def no_cuda(*args, **kwargs):
        raise AssertionError("the waiting process touched CUDA")

    monkeypatch.setattr(torch.cuda, "mem_get_info", no_cuda)
    monkeypatch.setattr(torch.cuda, "_lazy_init", no_cuda)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    nvml, sleeps = FakeNvml(frees_after=2), []
    seen = tmp_path / "seen"
    command = [
        sys.executable,
        "-c",
        f"import os; open({str(seen)!r}, 'w').write(os.environ['CUDA_VISIBLE_DEVICES'])",
    ]
    code = ma.main(
        ["wait", "--min-free", "4000", "--sleep", "1", "--timeout", "60", "--gpu", "1", "--", *command],
        sleep=sleeps.append,
        nvml=nvml,
    )
    assert code == 0 and nvml.handles == [5] and nvml.polls == 3 and sleeps == [1, 1]
    assert seen.read_text() == "GPU-fake-5" and not nvml.running
    assert not torch.cuda.is_initialized()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-abc,GPU-def")
    assert ma.main(["wait", "--min-free", "10", "--gpu", "1", "--", "true"], nvml=FakeNvml()) == 0


def test_cli_wait_without_nvml_is_one_line_and_exit_2(capsys):
    assert ma.main(["wait", "--min-free", "10", "--", "true"], nvml=FakeNvml(driver=False)) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(
        "memory_analysis.py: error: cannot read the GPU's free memory: NVML does not start (Driver"
    )
    assert len(err.splitlines()) == 1
    assert (
        ma.main(["wait", "--min-free", "10", "--allow-no-gpu", "--", "true"], nvml=FakeNvml(driver=False))
        == 0
    )


def test_cli_wait_reports_a_signal_death_as_the_shell_does():
    command = [sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"]
    assert ma.main(["wait", "--min-free", "10", "--", *command], nvml=FakeNvml()) == 128 + signal.SIGKILL


def test_cli_wait_stopped_while_waiting_exits_quietly():
    def probe():
        os.kill(os.getpid(), signal.SIGTERM)  # arrives while the memory is still short
        return 0.0

    assert (
        ma.main(
            ["wait", "--min-free", "10", "--sleep", "1", "--timeout", "60", "--", "true"],
            probe=probe,
            sleep=lambda s: None,
        )
        == 128 + signal.SIGTERM
    )


def test_cli_wait_passes_a_group_signal_to_the_command_once(tmp_path):
    """`timeout`, `scancel` and `docker stop` signal the whole group: the command gets SIGTERM exactly once (wait
    passes it on; the command runs in its own group), ends its own way, and wait returns its status."""
    child = tmp_path / "child.py"
    child.write_text(
        "import signal, sys, time\n"
        "got = []\n"
        "signal.signal(signal.SIGTERM, lambda n, f: got.append(n))\n"
        "print('ready', flush=True)\n"
        "deadline = time.time() + 30\n"
        "while not got and time.time() < deadline:  # not signal.pause(): the signal may come before it\n"
        "    time.sleep(0.01)\n"
        "time.sleep(1)  # a second SIGTERM would arrive by now\n"
        "print('terms', len(got), flush=True)\n"
        "sys.exit(143)\n"
    )
    proc = subprocess.Popen(
        [
            sys.executable,
            str(ROOT / "memory_analysis.py"),
            "wait",
            "--min-free",
            "10",
            "--allow-no-gpu",
            "--",
            sys.executable,
            str(child),
        ],
        start_new_session=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        for line in proc.stdout:  # the command is up and has its handler
            if line.strip() == "ready":
                break
        os.killpg(proc.pid, signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 143, err
    assert out.splitlines() == ["terms 1"] and "Traceback" not in err


def test_cli_wait_runs_the_command_when_memory_frees(capfd):
    gpu = FakeGpu(frees_after=2)
    code = ma.main(
        ["wait", "--min-free", "4000", "--sleep", "1", "--timeout", "60", "--", "true"],
        probe=gpu.probe,
        sleep=gpu.sleep,
    )
    assert code == 0 and gpu.polls == 3
    assert "fallback" not in capfd.readouterr().out


def test_cli_wait_falls_back_on_timeout_and_passes_exit_status(capfd):
    gpu = FakeGpu(frees_after=None)
    command = [sys.executable, "-c", "import os, sys; sys.exit(int(os.environ['RL_BATCH_SIZE']))"]
    code = ma.main(
        [
            "wait",
            "--min-free",
            "4000",
            "--sleep",
            "1",
            "--timeout",
            "0",
            "--fallback-env",
            "RL_BATCH_SIZE=3",
            "--",
            *command,
        ],
        probe=gpu.probe,
        sleep=gpu.sleep,
    )
    assert code == 3  # the command saw the fallback environment, and its exit status came back
    assert "fallback environment RL_BATCH_SIZE=3" in capfd.readouterr().out


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="malloc_trim is glibc's")
def test_trim_returns_freed_heap_pages_so_uss_measures_live_memory():
    arrays = [np.ones(128) for _ in range(60_000)]  # ~60 MB in small heap blocks (1 KiB each, plus headers)
    pin = np.ones(128)  # allocated last: it pins the top of the heap, so free() alone cannot give pages back
    baseline = mu.process_uss_mb()
    del arrays
    gc.collect()
    cached = mu.process_uss_mb()  # freed, but glibc still holds the pages
    assert mu.trim_host_memory()
    live = mu.process_uss_mb()
    assert cached - live > 30, (baseline, cached, live)
    del pin


def test_cli_wait_small_mistakes_are_one_line(tmp_path):
    script = tmp_path / "train.sh"
    script.write_text("echo hi\n")  # not executable
    result = _cli("wait", "--min-free", "10", "--allow-no-gpu", "--", str(script))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip().endswith(f"command is not executable: {script}")
    # --fallback-env takes one NAME=VALUE per flag, so the command after it needs no `--`
    code = ma.main(
        [
            "wait",
            "--min-free",
            "4000",
            "--timeout",
            "0",
            "--fallback-env",
            "RL_BATCH_SIZE=3",
            sys.executable,
            "-c",
            "import os, sys; sys.exit(int(os.environ['RL_BATCH_SIZE']))",
        ],
        probe=lambda: 0.0,
        sleep=lambda s: None,
    )
    assert code == 3


def test_cli_analyze_to_an_unwritable_folder_is_one_line(tmp_path):
    snapshots = tmp_path / "memory_snapshots"
    snapshots.mkdir()
    for step in (1000, 2000):
        with open(snapshots / f"snapshot_step_{step}.pickle", "wb") as f:
            pickle.dump({"segments": [], "device_traces": []}, f)
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    result = _cli("analyze", "--snapshots-dir", str(snapshots), "--out-dir", str(blocker / "report"))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert (
        "cannot write the report to --out-dir" in result.stderr
        and len(result.stderr.strip().splitlines()) == 1
    )


@pytest.mark.parametrize(
    "call, name",
    [
        (
            lambda: mu.memory_report(
                buffer_stats={"obs_bytes": None, "aux_bytes": 1, "total_steps": 1, "num_episodes": 1}
            ),
            "obs_bytes",
        ),
        (lambda: mu.amp("auto", "banana"), "device"),
        (lambda: mu.MemorySnapshots(None, 5), "run_dir"),
        (lambda: mu.MemorySnapshots("runs/x", every=True), "every"),
        (lambda: mu.LeakDetector(warmup_steps=True), "warmup_steps"),
    ],
)
def test_public_functions_refuse_bad_arguments_with_a_value_error_naming_them(call, name):
    with pytest.raises(ValueError, match=name):
        call()


def test_numpy_numbers_are_steps_and_values_too():
    detector = mu.LeakDetector(warmup_steps=0, window=5, min_samples=3)
    for step in np.arange(0, 5000, 1000):
        detector.observe(step, {mu.KEY_USS_MB: np.float32(100.0)})
    assert not detector.check().leaking


class _Cycle:
    def __init__(self):
        self.me = self


def test_the_loops_collections_walk_only_what_the_loop_made_and_everything_goes_back_after():
    """`collect_only_the_loops_garbage`: what lives when the loop starts is out of the collector's sight, what the
    loop makes is collected as ever (a cycle the loop drops is freed), and at the end, also when the loop raises,
    everything goes back to the collector."""
    before = _Cycle()
    try:
        with pytest.raises(KeyboardInterrupt), mu.collect_only_the_loops_garbage():
            assert gc.get_freeze_count() > 0
            assert id(before) not in {id(obj) for obj in gc.get_objects()}  # a collection does not walk it
            made = _Cycle()
            assert id(made) in {id(obj) for obj in gc.get_objects()}
            made_id, made = id(made), None
            gc.collect()
            assert made_id not in {id(obj) for obj in gc.get_objects()}  # the loop's cycle was freed
            raise KeyboardInterrupt
        assert gc.get_freeze_count() == 0 and id(before) in {id(obj) for obj in gc.get_objects()}
    finally:
        gc.collect()
        gc.freeze()  # the state this module's fixture left
