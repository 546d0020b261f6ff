"""Shared fixtures: the shipped tiny model and tokenizer, small datasets written to tmp files."""

from __future__ import annotations

import json
import os
import random
import sys
import tempfile
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if os.environ.get("PYTEST_XDIST_WORKER"):
    # Under pytest-xdist (`make test` runs two workers on two cores) each worker and every subprocess it starts gets
    # one intra-op thread: two workers with two threads each oversubscribe the cores, and OpenMP's spin-waiting
    # then slows every tiny-model step several times over.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

# Probe verdicts (modules/adaptations/probe.py) shared by every test and subprocess of this run (both xdist workers
# see the same run id), measured afresh in each run, and never written to the user's own cache.
os.environ.setdefault("LIGHTALIGN_CACHE_DIR", os.path.join(
    tempfile.gettempdir(), f"lightalign-test-cache-{os.environ.get('PYTEST_XDIST_TESTRUNUID') or os.getpid()}"))

# Device-tuned constants (modules/training/device_tuning.py) take the table's values on any CPU and measure nothing:
# tests pin the code paths of those values (helpers/tuning.py set_tuned), and no test process pays the first-use
# micro-measurements. tests/training/test_device_tuning.py sets the measuring mode itself, with stand-in measurements.
os.environ.setdefault("LIGHTALIGN_TUNING", "table")

# Inductor's on-disk cache (torch.compile: the static backend's decode step) is not keyed on the kernels torch was
# restricted to: a kernel cached by a run on the machine's AVX-512 crashed (SIGSEGV) a run under
# ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 (make test-portable). Such a run gets a cache of its own.
_kernels = [os.environ.get(k) for k in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA")]
if any(_kernels):
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(
        tempfile.gettempdir(), f"torchinductor-{os.getuid()}-" + "-".join(k or "default" for k in _kernels).lower()))

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/: `from helpers import ...` in every folder
from helpers import console_script  # noqa: E402  (snapshots the environment above for the console-script tests)

REPO = Path(__file__).resolve().parent.parent
TINY = REPO / "assets" / "models" / "tiny"
DATA = REPO / "examples" / "data"


def pytest_configure(config):
    """Stop before collecting when ``import lightalign`` is not this checkout: the checkout's folder is not named
    ``lightalign``, so the import resolves to whatever copy is installed, and the suite would test that copy."""
    try:
        import lightalign
    except ImportError as error:
        raise pytest.UsageError(f"lightalign is not importable ({error}); run `pip install -e .` in {REPO}.") from None
    imported = Path(lightalign.__file__).resolve().parent  # symlinks resolved: a link to this checkout is this checkout
    if imported != REPO:
        raise pytest.UsageError(f"`import lightalign` resolves to {imported}, but these tests belong to the checkout "
                                f"{REPO}: run `pip install -e .` in {REPO} (or use the virtual environment made for "
                                "it), so that the suite tests this checkout's code.")


def pytest_collection_modifyitems(config, items):
    # Longest first: the multi-process tests (up to a minute each), then the other end-to-end runs, then the many
    # short ones. pyproject's addopts select xdist's work-stealing scheduler: each worker starts on one half of
    # this order and an idle worker takes the back half of the other's queue, so the run ends on short tests on
    # both workers. (The default `load` scheduler hands out consecutive chunks of a quarter of a worker's share:
    # every long test landed in the first worker's first chunk, which then ran them alone for 12 minutes.)
    items.sort(key=lambda item: ("multiprocess" not in item.keywords, "slow" not in item.keywords))  # stable
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def seeded():
    """Every test starts from the same RNG state (``random``, ``numpy`` when installed, ``torch``), whatever ran before
    it in its process: which tests share a pytest-xdist worker, and in which order, is the scheduler's choice."""
    random.seed(0)
    try:
        import numpy
    except ImportError:
        pass
    else:
        numpy.random.seed(0)
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def repo() -> Path:
    return REPO


@pytest.fixture(scope="session")
def tiny_dir() -> Path:
    return TINY


@pytest.fixture(scope="session")
def data_dir() -> Path:
    return DATA


@pytest.fixture(scope="session")
def tool_policy_dir(tmp_path_factory) -> Path:
    """The tiny model fitted to call a tool and sharpened to follow its path (tests/helpers/tool_policy.py), for the
    tests that run the console script (in-process tests script their tool calls instead: helpers/scripted_turns.py).
    Fitted once per test run, in this run's temp folder (never reused by a later run, whose code may differ): the
    pytest-xdist workers share the folder (the base temp folder's parent is common to them) and take turns under a
    file lock."""
    from filelock import FileLock

    from helpers.tool_policy import fit_tool_policy

    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base  # one run's folder either way
    with FileLock(str(shared / "tool_policy.lock")):
        return fit_tool_policy(TINY, shared / "tool_policy")


@pytest.fixture(scope="session")
def tokenizer():
    from lightalign.hub import load_tokenizer

    return load_tokenizer(str(TINY))


@pytest.fixture
def tiny_model():
    from lightalign.hub import load_causal_lm

    torch.manual_seed(0)
    return load_causal_lm(str(TINY), from_config=True).eval()


@pytest.fixture
def write_jsonl(tmp_path):
    """Write rows to a jsonl file in tmp_path and return its path."""

    def write(rows, name="data.jsonl") -> str:
        path = tmp_path / name
        with open(path, "w") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
        return str(path)

    return write


@pytest.fixture
def kwargs_spy(monkeypatch):
    """``spy(owner, name)``: ``owner.name`` still runs, and the returned dict holds the keyword arguments of its
    latest call (what a module handed a loss or a generation backend)."""

    def spy(owner, name: str) -> dict:
        seen, real = {}, getattr(owner, name)

        def wrapper(*args, **kwargs):
            seen.update(kwargs)
            return real(*args, **kwargs)

        monkeypatch.setattr(owner, name, wrapper)
        return seen

    return spy


@pytest.fixture
def quiet_trainer():
    """A CPU Trainer factory without logger, checkpoints, progress bar, summary or sanity check."""
    import lightning as L

    def make(**kw):
        kw.setdefault("max_steps", 2)
        return L.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0, **kw)

    return make


@pytest.fixture
def grpo_module(tiny_dir):
    """A GRPOModule factory on the tiny model: digit reward, groups of 4, 6-token completions."""
    from lightalign import GRPOModule
    from lightalign.rewards import digit_fraction_reward

    def make(**kw):
        kw.setdefault("reward_funcs", [digit_fraction_reward])
        kw.setdefault("num_generations", 4)
        kw.setdefault("max_completion_length", 6)
        kw.setdefault("learning_rate", 1e-3)
        return GRPOModule(str(tiny_dir), from_config=True, **kw)

    return make


@pytest.fixture
def prompt_data(tiny_dir, data_dir):
    """A PromptDataModule factory on the shipped arithmetic prompts."""
    from lightalign import PromptDataModule

    def make(**kw):
        return PromptDataModule(str(data_dir / "arithmetic_prompts.jsonl"), tokenizer=str(tiny_dir), max_prompt_length=16, **kw)

    return make


@pytest.fixture
def grad_capture():
    """A callback class recording every optimizer step's gradients (name -> tensor), before the step."""
    import lightning as L

    class GradCapture(L.Callback):
        def __init__(self):
            self.grads = []

        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            self.grads.append({n: p.grad.detach().clone() for n, p in pl_module.named_parameters()
                               if p.grad is not None})

    return GradCapture
