"""The structure a reader relies on (issue #62): layers that import downwards only, the core loop in one folder,
a set-up that builds what each part reads so that nothing below it reads GRPOConfig, a Trainer.__init__ of a screen.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import sys
from pathlib import Path

import pytest

from grpo.config import GRPOConfig
from grpo.core.trainer import Trainer

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
import reader_path  # noqa: E402

# Set-up: the modules that read GRPOConfig. Every other product module is below set-up and never reads it: the
# update, the rollout, the generation backends, the metrics, the checkpoints, the kernels, the algorithm, ...
SET_UP = {
    "grpo.config": "the settings and their checks",
    "grpo.config_types": "the typed reader of every setting (GRPOConfig.validate calls it)",
    "grpo.cli": "the command line, presets and config files",
    "grpo.core.setup": "the set-up steps and the option objects each part reads",
    "grpo.core.trainer": "Trainer.__init__, which calls the set-up steps",
    "grpo.trl_api.config": "trl's GRPOConfig, turned into our settings",
    "grpo.trl_api.trainer": "trl's GRPOTrainer: our GRPOConfig from trl's, then a Trainer",
}


def _graph():
    modules = reader_path.product_modules()
    return {name: reader_path.imports_of(path, name, modules) for name, path in modules.items()}


def test_every_import_runs_down_the_layers_and_none_forms_a_cycle():
    graph = _graph()
    assert reader_path.layer_violations(graph) == []
    assert reader_path.cycles(graph) == []
    assert not [name for name in graph if name.startswith("grpo") and reader_path.part_of(name) is None]
    # the check finds what it is for: an import from a lower layer up, and one between two folders of a layer
    planted = {"grpo.config": {"grpo.core.update"}, "grpo.parallel.distributed": {"grpo.kernels.batching"},
               "grpo.core.update": set(), "grpo.kernels.batching": set(), "rewards.scoring": {"grpo.config"}}
    assert len(reader_path.layer_violations(planted)) == 3


def test_config_imports_no_loop_module_and_no_two_folders_import_each_other():
    graph = _graph()
    assert {target for target in graph["grpo.config"] if target.startswith("grpo.")} <= {
        "grpo.algorithm.advantages", "grpo.algorithm.loss", "grpo.algorithm.off_policy", "grpo.algorithm.sampler",
        "grpo.algorithm.logprobs", "grpo.config_types", "grpo.errors", "grpo.algorithm.step"}
    folders = {}
    for module, targets in graph.items():
        for target in targets:
            source, goal = reader_path.part_of(module), reader_path.part_of(target)
            if source and goal and source != goal:
                folders.setdefault(source, set()).add(goal)
    both_ways = sorted((a, b) for a, goals in folders.items() for b in goals if a in folders.get(b, ()) and a < b)
    assert both_ways == []


def test_the_core_loop_has_a_folder_of_its_own_and_each_feature_one():
    core = sorted(path.name for path in (ROOT / "grpo" / "core").glob("*.py") if path.name != "__init__.py")
    assert len(core) <= 14, core
    assert set(core) <= {"trainer.py", "setup.py", "update.py", "metrics.py", "checkpoint.py", "run_state.py",
                         "disk_full.py"}, core
    for folder, modules in {"generation": ["rollout", "vllm", "async_rollouts", "dynamic_sampling", "prompts"],
                            "multiturn": ["tools", "environments"], "evaluation": ["evaluate", "pass_at_k", "answers"],
                            "parallel": ["distributed", "threads"]}.items():
        assert all((ROOT / "grpo" / folder / f"{name}.py").is_file() for name in modules), folder
    assert not (ROOT / "grpo" / "loop").exists()


def test_trainer_init_reads_as_a_few_named_steps_in_one_screen():
    source = inspect.getsource(Trainer.__init__)
    body = ast.parse(source.strip().replace("\n    ", "\n")).body[0].body
    lines = [line for line in source.splitlines() if line.strip()]
    assert len(lines) <= 40, len(lines)
    calls = {node.func.attr for node in ast.walk(ast.Module(body=body, type_ignores=[]))
             if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
             and isinstance(node.func.value, ast.Name) and node.func.value.id == "setup"}
    assert {"checked_config", "processes", "rewards", "run_folder", "run_data", "models", "step_functions",
            "optimisation", "replace_old_run"} <= calls


def test_no_module_below_set_up_imports_grpo_config_s_class():
    for name, path in reader_path.product_modules().items():
        if name in SET_UP or name in ("train", "eval"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "grpo.config":
                assert "GRPOConfig" not in [alias.name for alias in node.names], name


class _Watched(GRPOConfig):
    """A GRPOConfig that records, for every read of a setting, the module and function that read it."""

    def __getattribute__(self, name):
        if name in _SETTINGS:
            frame = sys._getframe(1)
            _READS.add((frame.f_globals.get("__name__", "?"), frame.f_code.co_qualname))
        return object.__getattribute__(self, name)


_SETTINGS = {f.name for f in dataclasses.fields(GRPOConfig)} | {
    name for name, value in vars(GRPOConfig).items() if isinstance(value, property)}
_READS: set[tuple[str, str]] = set()


@pytest.mark.slow
@pytest.mark.parametrize("settings", [
    dict(kernels="plain"),
    dict(kernels="auto", use_peft=True, tools=["data.calculator:calculator"], eval_steps=1, save_steps=1,
         num_iterations=2, dynamic_sampling=True, max_staleness=0),
], ids=["plain", "auto-lora-tools-eval-async"])
def test_nothing_below_set_up_reads_the_config(tmp_path, settings):
    if settings.get("use_peft"):
        pytest.importorskip("peft")
    config = _Watched(model="tiny", dataset="synthetic:32", prompts_per_step=2, num_generations=4, micro_batch_size=4,
                      max_prompt_length=192, max_completion_length=8, reward=["tags", "xmlcount"], device="cpu",
                      precision="fp32", max_steps=2, eval_limit=2, log_completions_steps=1, beta=0.04,
                      output_dir=str(tmp_path / "run"), **settings)
    _READS.clear()
    trainer = Trainer(config)
    during_set_up = {module for module, _ in _READS if module.split(".")[0] in ("grpo", "rewards", "data")}
    assert during_set_up <= set(SET_UP), f"below set-up, {sorted(during_set_up - set(SET_UP))} read GRPOConfig"
    assert {function for module, function in _READS if module == "grpo.core.trainer"} <= {"Trainer.__init__"}
    _READS.clear()
    trainer.train()  # two steps, evaluation, checkpoints, the logs
    trainer.close()
    assert not [read for read in _READS if read[0].split(".")[0] in ("grpo", "rewards", "data", "train")], _READS
    assert (tmp_path / "run" / "checkpoints" / "step-000002").is_dir()


def test_product_and_bench_lines_fit_120_characters_and_have_no_unused_names():
    """The line budgets count lines of at most 120 characters: ruff (pyproject's [tool.ruff]) enforces it."""
    ruff = pytest.importorskip("ruff")
    import subprocess

    assert ruff  # the package ships the binary that `python -m ruff` runs
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", str(root)],
                          capture_output=True, text=True, cwd=root, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
