"""Shared fixtures. No test touches the network: HF_HUB_OFFLINE is forced before transformers loads."""

import contextlib
import ctypes
import fcntl
import gc
import os
import tempfile

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

# Under pytest-xdist (`pytest -n 2`), each worker gets its share of the cores, for torch here and for the programs
# the tests start: two workers with two threads each on two cores would oversubscribe every matmul.
if "PYTEST_XDIST_WORKER_COUNT" in os.environ:
    _threads = max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
    os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = str(_threads)
    torch.set_num_threads(_threads)

SHARED_GSM8K = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "gsm8k"


def release_memory() -> None:
    """Hand the heap's free pages back to the system (glibc's malloc_trim). A worker that ran the real model in its
    own process otherwise keeps GiBs it freed, which the other worker's subprocesses may need."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


@contextlib.contextmanager
def memory_heavy_section():
    """Work that holds many GiB (both trainers on the real model, a vLLM server and its trainers) runs while no other
    such work does, across the xdist workers of one run: two at once do not fit in this machine's memory (docs/log.md
    has the figures). The other worker goes on with what does not take this lock. Module fixtures that compute on the
    real model take it too: pytest sets them up before a test's own fixtures, so a test's lock would not cover them."""
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID", str(os.getpid()))
    with open(Path(tempfile.gettempdir()) / f"grpo-memory-heavy-{run}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            release_memory()


@pytest.fixture
def memory_heavy():
    with memory_heavy_section():
        yield


def pytest_collection_modifyitems(config, items):
    """The memory_heavy tests first, then the real model's module (whose module fixtures take the lock too), then
    the rest, each in its order. Under `--dist worksteal` (pyproject's addopts) the first worker starts with them
    and runs them one after the other while the other worker takes the rest; a worker steals from the end of the
    other's queue, so neither waits on the lock while the other holds it. The server test goes before the real
    model's: its memory is in the processes it starts, and a worker that ran the real model's tests keeps GiBs of
    its own (docs/log.md has the figures)."""
    def rank(item) -> int:
        if item.path.name == "test_real_model.py":
            return 1
        return 0 if "memory_heavy" in getattr(item, "fixturenames", ()) else 2

    items.sort(key=rank)  # stable: each group keeps its order


@pytest.fixture(scope="session")
def tokenizer():
    from grpo.tiny_model import build_tokenizer

    return build_tokenizer()


@pytest.fixture(scope="session")
def tiny_model_and_tokenizer(tokenizer):
    from grpo.tiny_model import build_tiny_model

    return build_tiny_model("tiny", seed=0, tokenizer=tokenizer)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    from grpo.tiny_model import save_tiny_model

    return save_tiny_model(tmp_path_factory.mktemp("tiny_model"), "tiny", seed=0)


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    yield


def gsm8k_dir() -> Path | None:
    return SHARED_GSM8K if (SHARED_GSM8K / "train.jsonl").exists() else None


@pytest.fixture(params=["auto", "plain"])
def both_kernels(request, monkeypatch):
    """Run a trainer test twice: with the kernels --kernels auto chooses, and with the plain path everywhere.

    Applied to whole modules with `pytestmark = pytest.mark.usefixtures("both_kernels")`; a test that chooses
    its kernels itself carries `@pytest.mark.own_kernels` and runs once. Subprocess runs keep their own flags.
    """
    if request.node.get_closest_marker("own_kernels"):
        if request.param == "plain":
            pytest.skip("this test chooses its kernels itself")
        return request.param
    if request.param == "plain":
        import dataclasses

        import grpo.core.setup

        real = grpo.core.setup.step_functions
        monkeypatch.setattr(grpo.core.setup, "step_functions",
                            lambda config, *args: real(dataclasses.replace(config, kernels="plain"), *args))
    return request.param


def batch_indices(trainer, step: int) -> list[int]:
    """The step's k * B prompt indices, as the trainer draws them (grpo.generation.rollout.step_prompts)."""
    from grpo.generation.rollout import step_prompts

    cfg = trainer.config
    return step_prompts(step, trainer.loop.prompts_per_generation, len(trainer.data.train_rows), cfg.seed, cfg.shuffle_dataset)


def record_updates(trainer) -> list:
    """Every grpo.core.update.UpdateResult the trainer makes from now on: its public `update` call, wrapped on this
    instance (the loop reaches it through train_on_rollout)."""
    records, update = [], trainer.update

    def recording(rollout):
        result = update(rollout)
        records.append(result)
        return result

    trainer.update = recording
    return records
