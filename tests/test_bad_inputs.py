"""Bad inputs a new user gives (issue #66), each ending in one `error:` line that names it, nothing lost:

- a refused run leaves the earlier run in its output folder byte for byte: every refusal of set-up, injected in turn,
  and the two found outside (a causal-LM folder as a reward model; --max-staleness with a colocated vLLM engine);
- config files, presets and the Python API read through one typed reader (grpo/config_types.py);
- a plug-in fails the same way at the probe and at step N, and one without a signal is refused or skipped;
- a resumed run refuses a change to what defines it; length messages name their flags;
- eval.py refuses a flag that does nothing, and evaluates a trained run as it was trained.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import shutil
import sys
import typing
from pathlib import Path

import pytest
import yaml

import eval as eval_cli
import train as train_cli
from grpo import cli
from grpo.config import MAY_CHANGE_ON_RESUME, GRPOConfig
from grpo.config_types import ConfigTypeError, read_value
from grpo.algorithm.advantages import resolve_estimator
from grpo.algorithm.loss import resolve_objective
from grpo.core import setup
from grpo.core.setup import engine_settings
from grpo.evaluation.evaluate import EvalConfig
from grpo.core.metrics import read_jsonl
from grpo.core.trainer import Trainer
from grpo.tiny_model import save_tiny_model

ROOT = Path(__file__).resolve().parent.parent
SMOKE = ["--preset", "smoke", "--eval-steps", "0", "--log-completions-steps", "0"]


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file under `folder`, by relative path, with its bytes."""
    return {str(path.relative_to(folder)): path.read_bytes() for path in sorted(folder.rglob("*")) if path.is_file()}


@pytest.fixture(scope="module")
def earlier_run(tmp_path_factory) -> Path:
    """A finished two-step smoke run with two checkpoints, its metrics and samples: what a refused run must keep."""
    folder = tmp_path_factory.mktemp("earlier") / "run"
    assert train_cli.main([*SMOKE, "--max-steps", "2", "--save-steps", "1", "--log-completions-steps", "1",
                           "--output-dir", str(folder)]) == 0
    assert len(snapshot(folder)) > 12
    return folder


@pytest.fixture
def run(earlier_run, tmp_path) -> tuple[Path, dict[str, bytes]]:
    """A copy of the earlier run in this test's folder, and its bytes."""
    folder = tmp_path / "run"
    shutil.copytree(earlier_run, folder)
    return folder, snapshot(folder)


def one_error_line(capsys) -> str:
    """The one `error:` line a refusal prints (its continuation lines indented), with no traceback."""
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, err
    return err[err.index("error:"):]


# ============================================================================= nothing deleted before every check

def test_a_causal_lm_folder_as_reward_model_is_refused_and_the_earlier_run_kept(run, tmp_path, capsys):
    folder, before = run
    policy = save_tiny_model(tmp_path / "not-a-reward-model", "tiny", seed=0)
    code = train_cli.main([*SMOKE, "--max-steps", "1", "--output-dir", str(folder), "--overwrite",
                           "--reward", "tags", str(policy)])
    assert code == 1
    assert "not a sequence-classification model" in one_error_line(capsys)
    assert snapshot(folder) == before


def test_a_colocated_vllm_engine_with_max_staleness_is_refused_and_the_earlier_run_kept(run, capsys):
    folder, before = run
    code = train_cli.main([*SMOKE, "--max-steps", "1", "--output-dir", str(folder), "--overwrite", "--max-staleness",
                           "1", "--use-vllm"])
    assert code == 1
    assert "--max-staleness with --generation-backend vllm needs generation processes" in one_error_line(capsys)
    assert snapshot(folder) == before


# Set-up's refusals. The census: every product function that holds a `raise` and that Trainer.__init__ calls before it
# replaces the old run (setup.replace_old_run), over configurations that reach the optional parts (LoRA, a reward
# model, tools, evaluation, environments). Each is made to refuse (an exception injected as it is entered, at every
# call), and the earlier run must come out byte for byte. The census is pinned below by name: a refusal added to
# set-up changes it, and the test then fails until the list names it (and so checks it too).
REFUSING_SET_UP = sorted("""
data.gsm8k:read_rows data.gsm8k:validate_rows data.synthetic:make_synthetic_problems data.tasks:load_task_rows
grpo.algorithm.advantages:check_advantages grpo.algorithm.advantages:check_estimator
grpo.algorithm.advantages:group_advantages grpo.algorithm.advantages:resolve_estimator
grpo.algorithm.logprobs:check_plain_output_head grpo.algorithm.loss:LossOptions.__post_init__
grpo.algorithm.loss:check_objective grpo.algorithm.loss:resolve_objective
grpo.algorithm.sampler:SamplingParams.__post_init__
grpo.config:ConfigMixin.raise_problems grpo.config_types:check_value grpo.config_types:read_value
grpo.kernels:select_kernels grpo.parallel.distributed:init_world grpo.parallel.distributed:resolve_mode
grpo.parallel.distributed:wrap_model grpo.multiturn.environments:Environments.from_factory
grpo.multiturn.environments:Environments.reward_functions
grpo.multiturn.environments:Environments.reward_functions.<locals>.owned_by grpo.multiturn.environments:load_environments
grpo.evaluation.evaluate:make_scorer grpo.lora:_peft grpo.lora:add_lora grpo.generation.prompts:encode_prompts
grpo.core.setup:find_resume_checkpoint grpo.core.setup:load_policy grpo.core.setup:models grpo.core.setup:old_run_files
grpo.core.setup:reward_specs
grpo.core.setup:task_rows grpo.core.setup:vllm_engine grpo.models:eos_token_ids
grpo.models:load_model grpo.models:load_tokenizer grpo.models:make_optimizer grpo.models:resolve_device
grpo.errors:guarded grpo.errors:guarded.<locals>.call
grpo.tiny_model:build_tiny_model rewards.registry:_parse_spec rewards.registry:_split_weight
rewards.registry:load_function rewards.registry:parse_reward_specs rewards.reward_model:RewardModel.__init__
rewards.reward_model:RewardModel._from_pretrained rewards.reward_model:RewardModel._load_tokenizer
rewards.reward_model:RewardModel.load rewards.reward_model:check_model_folder
rewards.reward_model:check_sequence_classifier rewards.reward_model:with_processing_classes
rewards.sandbox:check_isolation rewards.scoring:check_reward_columns rewards.shaping:overlong_penalty
""".split())


def _raising_functions() -> set[tuple[str, int]]:
    """(file, first line) of every product function whose body holds a `raise`."""
    found = set()
    for package in ("grpo", "rewards", "data"):
        for path in (ROOT / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and any(
                        isinstance(inner, ast.Raise) for inner in ast.walk(node)):  # a decorated code's first line
                    found.add((str(path), min([node.lineno] + [d.lineno for d in node.decorator_list])))  # is its @'s
    return found


def _module_of(filename: str) -> str:
    return ".".join(Path(filename).relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")


def _set_up(config: GRPOConfig, target=None, at_call: int = 1) -> dict:
    """Build the trainer; with `target` (a code object) an exception is raised as it is entered for the `at_call`-th
    time (CPython stops profiling once a profile function raises: one fault per run). Returns {code object: [the
    call number of the first call from each place that calls it]} of the product functions with a `raise` that ran
    before the old run was replaced."""
    raising, calls, sites, stop, live = _raising_functions(), {}, {}, setup.replace_old_run.__code__, [True]
    resolve_estimator.cache_clear()  # so that a plug-in's loading runs here, not in an earlier test
    resolve_objective.cache_clear()

    def profile(frame, event, arg):
        if event != "call" or not live[0]:
            return
        code = frame.f_code
        if code is stop:
            live[0] = False
        elif (code.co_filename, code.co_firstlineno) in raising:
            calls[code] = calls.get(code, 0) + 1
            sites.setdefault(code, {}).setdefault((frame.f_back.f_code, frame.f_back.f_lineno), calls[code])
            if code is target and calls[code] == at_call:
                raise ValueError(f"a refusal injected into {code.co_qualname}")

    sys.setprofile(profile)
    try:
        trainer = Trainer(config)
    finally:
        sys.setprofile(None)
    trainer.close()
    return {code: sorted(first.values()) for code, first in sites.items()}


def _set_up_configurations(folder: Path, rm_folder: Path) -> list[GRPOConfig]:
    base = dict(model="tiny", dataset="synthetic:32", prompts_per_step=2, num_generations=2, micro_batch_size=4,
                max_prompt_length=96, max_completion_length=8, device="cpu", precision="fp32", max_steps=1,
                eval_steps=1, eval_limit=2, output_dir=str(folder), overwrite=True)
    return [
        GRPOConfig(**base, reward=["tags", str(rm_folder)], tools=["data.calculator:calculator"], use_peft=True,
                   overlong_buffer_len=2, kernels="auto"),
        GRPOConfig(**base, environment=["tests.test_environments:Tally"], kernels="plain"),
    ]


@pytest.mark.slow
def test_every_refusal_of_set_up_leaves_the_earlier_run_byte_for_byte(run, tmp_path):
    pytest.importorskip("peft")
    from tests.test_reward_model import build_reward_model
    from grpo.tiny_model import build_tokenizer

    folder, before = run
    rm_folder = tmp_path / "rm"
    tokenizer = build_tokenizer()
    build_reward_model(tokenizer).save_pretrained(rm_folder, safe_serialization=True)
    tokenizer.save_pretrained(rm_folder)
    pristine = tmp_path / "pristine"
    shutil.copytree(folder, pristine)
    census, recovered = {}, []
    for config in _set_up_configurations(folder, rm_folder):
        targets = _set_up(dataclasses.replace(config))  # a run that replaces the old one: put it back
        shutil.rmtree(folder)
        shutil.copytree(pristine, folder)
        for code, first_calls in targets.items():
            name = f"{_module_of(code.co_filename)}:{code.co_qualname}"
            if name in census:
                continue
            census[name] = code
            for call in first_calls:  # a fault at each place that calls it during set-up
                try:
                    _set_up(dataclasses.replace(config), target=code, at_call=call)
                except Exception:  # noqa: BLE001 - the injected refusal, or what the code made of it
                    assert snapshot(folder) == before, f"a refusal in {name} (call {call}) changed the earlier run"
                else:  # a caller recovered from it (a fallback): the run replaced the old one, as a good run does
                    recovered.append((name, call))
                    shutil.rmtree(folder)
                    shutil.copytree(pristine, folder)
    assert sorted(census) == REFUSING_SET_UP, (
        "set-up's refusals changed: added " + str(sorted(set(census) - set(REFUSING_SET_UP))) + ", gone "
        + str(sorted(set(REFUSING_SET_UP) - set(census))) + " (check that each refuses before the old run is "
        "replaced, then update REFUSING_SET_UP)")
    assert len(recovered) < len(census) // 4, recovered  # a few callers recover (the config's checks collect them)


# ============================================================================= the typed reader

def _valid_value(annotation, field: dataclasses.Field):
    """A value of the field's type other than its default (a choice when it has choices)."""
    choices = field.metadata.get("choices")
    if choices:
        return next((choice for choice in choices if choice != field.default), choices[0])
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, type(int | None)):
        return _valid_value(next(arg for arg in args if arg is not type(None)), field)
    if origin is list:
        return [_valid_value(args[0], field)]
    if origin is tuple:
        return tuple(float(index) for index in range(len(args)))
    return {bool: not field.default if isinstance(field.default, bool) else True, int: 3, float: 0.25,
            str: "text", dict: {"key": 1}}[annotation]


def _typed_fields(config_cls=GRPOConfig):
    hints = typing.get_type_hints(config_cls)
    return [(f, hints[f.name]) for f in dataclasses.fields(config_cls)]


def test_every_field_type_of_the_config_reads_back_through_yaml_json_and_python(tmp_path):
    kinds = set()
    values = {}
    for field, annotation in _typed_fields():
        values[field.name] = _valid_value(annotation, field)
        origin = typing.get_origin(annotation)
        inner = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
        kinds.add("optional" if type(None) in typing.get_args(annotation) else "required")
        kinds.add("choices" if field.metadata.get("choices") else (
            (typing.get_origin(inner[0]) or inner[0]) if inner and origin is not list and origin is not tuple
            else origin or annotation))
    assert {"optional", "required", "choices", bool, int, float, str, list, tuple, dict} <= kinds, kinds
    plain = {key: list(value) if isinstance(value, tuple) else value for key, value in values.items()}
    (tmp_path / "all.yaml").write_text(yaml.safe_dump(plain))
    (tmp_path / "all.json").write_text(json.dumps(plain))
    for name in ("all.yaml", "all.json"):
        assert cli.load_config_file(str(tmp_path / name), GRPOConfig) == values
    config = GRPOConfig(**plain)
    from grpo.config_types import type_problems

    assert type_problems(config) == [] and dataclasses.asdict(config) == values


@pytest.mark.parametrize("suffix", [".yaml", ".json"])
def test_strings_for_numbers_and_bools_are_refused_naming_the_field_and_type(tmp_path, suffix):
    for field, annotation in _typed_fields():
        sample = _valid_value(annotation, field)
        if isinstance(sample, bool) or (isinstance(sample, (int, float)) and not field.metadata.get("choices")):
            text = str(sample).lower()
            file = tmp_path / f"{field.name}{suffix}"
            file.write_text(f"{field.name}: '{text}'\n" if suffix == ".yaml" else json.dumps({field.name: text}))
            expected = "true or false" if isinstance(sample, bool) else "a whole number" if isinstance(sample, int) \
                else "a number"
            with pytest.raises(ConfigTypeError, match=rf"--config {file}: {field.name} must be {expected}.*got the "
                                                      rf"string '{text}' \(write {text} without quotes\)"):
                cli.load_config_file(str(file), GRPOConfig)
            with pytest.raises(ValueError, match=rf"{field.name} must be {expected}"):
                GRPOConfig(**{field.name: text}).validate()


@pytest.mark.parametrize("annotation, value, expected", [
    (bool, True, True), (int, 7, 7), (int, 1e3, 1000), (float, 2, 2.0), (float | None, None, None),
    (list[str], ("a", "b"), ["a", "b"]), (tuple[float, float], [1, 2.5], (1.0, 2.5)), (dict, {"a": 1}, {"a": 1}),
    (typing.Literal["x", "y"], "y", "y"),
])
def test_read_value_accepts_its_type(annotation, value, expected):
    assert read_value(annotation, value) == expected and type(read_value(annotation, value)) is type(expected)


@pytest.mark.parametrize("annotation, value", [
    (bool, "false"), (bool, 0), (bool, 1), (int, True), (int, "2"), (int, 2.5), (float, "0.2"), (float, False),
    (str, 3), (list[str], "tags"), (list[str], [1]), (tuple[float, float], 1), (tuple[float, float], [1.0]),
    (dict, [1]), (dict, {1: 2}), (float | None, "none"), (typing.Literal["x", "y"], "z"),
])
def test_read_value_refuses_another_type(annotation, value):
    with pytest.raises(TypeError):
        read_value(annotation, value)


@pytest.mark.parametrize("text, problem", [
    ('{"epsilon": "0.2"}', "epsilon must be a number, got the string '0.2'"),
    ('{"kl_in_reward": "false"}', "kl_in_reward must be true or false or null, got the string 'false'"),
    ('{"reward_clip_range": 1}', "reward_clip_range must be a list of 2 items"),
    ('{"advantage_estimator": 3}', "advantage_estimator must be a string, got the number 3"),
    ('{"num_generations": "2"}', "num_generations must be a whole number, got the string '2'"),
    ('{"epsilonn": 0.2}', "unknown setting.s. epsilonn .did you mean epsilon.."),
])
def test_the_config_files_found_outside_end_in_one_error_line(tmp_path, capsys, text, problem):
    file = tmp_path / "bad.json"
    file.write_text(text)
    assert train_cli.main([*SMOKE, "--config", str(file), "--output-dir", str(tmp_path / "run")]) == 2
    line = one_error_line(capsys)
    assert line.startswith(f"error: --config {file}: ") and problem.split(" got")[0].split(".")[0] in line
    import re

    assert re.search(problem, line), line
    assert not (tmp_path / "run").exists()


def test_yaml_numbers_are_yaml_1_2s(tmp_path):
    file = tmp_path / "run.yaml"
    file.write_text("learning_rate: 5e-6\nbeta: 1e-2\nreward_clip_range: [-1, 1e3]\nwarmup_ratio: .5\n")
    assert cli.load_config_file(str(file), GRPOConfig) == dict(learning_rate=5e-6, beta=0.01,
                                                               reward_clip_range=(-1.0, 1000.0), warmup_ratio=0.5)
    assert cli.config_from_args(["--reward-clip-range", "-1e3", "1e3"]).reward_clip_range == (-1000.0, 1000.0)


def test_every_preset_reads_through_the_typed_reader():
    for name, preset in cli.PRESETS.items():
        assert GRPOConfig.read(preset, where=f"--preset {name}").keys() == preset.keys()


# ============================================================================= plug-ins

NAN_ESTIMATOR = '''
import torch

def no_signal(batch):
    return torch.full_like(batch.rewards, float("nan"))
'''
LATE_ESTIMATOR = '''
import os

import torch

def later(batch):
    if batch.rewards.shape[0] > 2 * batch.group_size:  # a step's batch (the start-of-run probe's has two groups)
        calls = int(os.environ.get("PLUG_IN_CALLS", "0")) + 1
        os.environ["PLUG_IN_CALLS"] = str(calls)
        if calls > int(os.environ["PLUG_IN_GOOD_CALLS"]):
            {failure}
    return batch.rewards - batch.rewards.nanmean()
'''


def test_an_estimator_without_a_signal_is_refused_at_the_probe(tmp_path, capsys):
    plug_in = tmp_path / "plug.py"
    plug_in.write_text(NAN_ESTIMATOR)
    assert train_cli.main([*SMOKE, "--advantage-estimator", f"{plug_in}:no_signal",
                           "--output-dir", str(tmp_path / "run")]) == 2
    line = one_error_line(capsys)
    assert f"advantage_estimator '{plug_in}:no_signal' ({plug_in}) returned no finite advantage" in line
    assert "start-of-run probe" in line


def test_a_step_without_a_signal_is_skipped_and_counted(tmp_path, monkeypatch, capsys, caplog):
    plug_in = tmp_path / "plug.py"
    plug_in.write_text(LATE_ESTIMATOR.format(failure='return torch.full_like(batch.rewards, float("nan"))'))
    monkeypatch.setenv("PLUG_IN_GOOD_CALLS", "1")  # step 1
    monkeypatch.delenv("PLUG_IN_CALLS", raising=False)
    folder = tmp_path / "run"
    code = train_cli.main([*SMOKE, "--max-steps", "5", "--max-bad-steps", "3", "--save-steps", "1",
                           "--advantage-estimator", f"{plug_in}:later", "--output-dir", str(folder)])
    assert code == 1
    line = one_error_line(capsys)
    assert "3 consecutive updates were skipped" in line and "step-000003" in line and "--resume" in line
    assert caplog.text.count("returned no finite advantage") == 3
    logged = read_jsonl(folder / "metrics.jsonl")
    assert [row["step"] for row in logged] == [1, 2, 3]


@pytest.mark.parametrize("failure, said", [
    ('raise RuntimeError("the plug-in broke")', "raised RuntimeError at {file}:11: the plug-in broke"),
    ("return batch.rewards[:1]", "returned (1,); expected a tensor of shape"),
])
def test_a_plug_in_that_fails_at_step_n_names_itself_its_file_and_the_step(tmp_path, monkeypatch, capsys, failure,
                                                                           said):
    plug_in = tmp_path / "plug.py"
    plug_in.write_text(LATE_ESTIMATOR.format(failure=failure))
    monkeypatch.setenv("PLUG_IN_GOOD_CALLS", "2")  # steps 1 and 2
    monkeypatch.delenv("PLUG_IN_CALLS", raising=False)
    folder = tmp_path / "run"
    argv = [*SMOKE, "--max-steps", "4", "--save-steps", "1", "--advantage-estimator", f"{plug_in}:later",
            "--output-dir", str(folder)]
    assert train_cli.main(argv) == 1
    line = one_error_line(capsys)
    assert line.startswith(f"error: step 3: advantage_estimator '{plug_in}:later' ")
    assert said.format(file=plug_in) in line
    assert f"The last good checkpoint is {folder / 'checkpoints' / 'step-000002'}." in line
    assert "Once fixed, resume with: python train.py" in line and f"--resume {folder}" in line
    assert sorted(path.name for path in (folder / "checkpoints").iterdir()) == ["step-000001", "step-000002"]
    assert (folder / "checkpoints" / "step-000002" / "COMPLETE").is_file()
    assert len(read_jsonl(folder / "metrics.jsonl")) == 2
    monkeypatch.setenv("PLUG_IN_GOOD_CALLS", "100")  # fixed: the printed command goes on from step 2
    assert train_cli.main([*argv, "--resume", str(folder)]) == 0
    assert [row["step"] for row in read_jsonl(folder / "metrics.jsonl")] == [1, 2, 3, 4]


OBJECTIVE = '''import os


def objective(x):
    probe = tuple(x.logps.shape) == (4, 5)  # the start-of-run probe's micro-batch
    calls = int(os.environ.get("OBJECTIVE_CALLS", "0")) + (0 if probe else 1)
    os.environ["OBJECTIVE_CALLS"] = str(calls)
    if calls > int(os.environ["OBJECTIVE_GOOD_CALLS"]) or probe and os.environ.get("OBJECTIVE_PROBE_FAILS"):
        raise KeyError("no such term")
    return -x.advantages * x.logps
'''


@pytest.mark.parametrize("good_calls, where", [(9, "probe"), (0, "step")])
def test_a_loss_plug_in_that_raises_names_itself_at_the_probe_and_at_a_step(tmp_path, capsys, monkeypatch, good_calls,
                                                                            where):
    plug_in = tmp_path / "objective.py"
    plug_in.write_text(OBJECTIVE)
    monkeypatch.setenv("OBJECTIVE_GOOD_CALLS", str(good_calls))
    monkeypatch.delenv("OBJECTIVE_CALLS", raising=False)
    if where == "probe":
        monkeypatch.setenv("OBJECTIVE_PROBE_FAILS", "1")
    code = train_cli.main([*SMOKE, "--loss-type", f"{plug_in}:objective", "--output-dir", str(tmp_path / "run")])
    line = one_error_line(capsys)
    said = f"loss_type '{plug_in}:objective' raised KeyError at {plug_in}:9: 'no such term'"
    if where == "probe":
        assert code == 2 and line.startswith("error: invalid configuration:") and said in line
        assert "(on the start-of-run probe micro-batch of 4 rows x 5 tokens)" in line
    else:
        assert code == 1 and line.startswith(f"error: step 1: {said}")
        assert "The last good checkpoint is none (none was saved yet)." in line


# ============================================================================= resume, lengths

def test_resuming_with_another_algorithm_is_refused_listing_each_change(run, capsys):
    folder, before = run
    argv = [*SMOKE, "--max-steps", "3", "--output-dir", str(folder), "--resume"]
    assert train_cli.main([*argv, "--advantage-estimator", "rloo", "--reward", "tags:2", "--num-generations", "4"]) == 1
    line = one_error_line(capsys)
    for change in ("advantage_estimator: 'grpo' -> 'rloo'", "loss_type: 'grpo' -> 'rloo'",
                   "kl_in_reward: False -> True", "num_generations: 8 -> 4", "reward: ['tags'] -> ['tags:2']",
                   "reward functions (name, weight): [('tags', 1.0)] -> [('tags', 2.0)]",
                   "--resume-with-changed-settings"):
        assert change in line, line
    assert snapshot(folder) == before
    # settings that may change on resume change freely; the rest with the explicit flag, recorded in run_config.json
    assert train_cli.main([*argv, "--logging-steps", "2", "--kernels", "plain"]) == 0
    assert train_cli.main([*SMOKE, "--max-steps", "4", "--output-dir", str(folder), "--resume", "--epsilon", "0.3",
                           "--resume-with-changed-settings"]) == 0
    record = json.loads((folder / "run_config.json").read_text())
    assert record["epsilon"] == 0.3
    assert record["changed_on_resume"] == [{"at_step": 3, "changes": ["epsilon: 0.2 -> 0.3"]}]


def test_the_settings_that_may_change_on_resume_are_fields_and_listed_in_the_docs():
    names = {field.name for field in dataclasses.fields(GRPOConfig)}
    assert MAY_CHANGE_ON_RESUME <= names
    reference = cli.cli_reference()
    assert all(f"`--{name.replace('_', '-')}`" in reference.split("may change on --resume")[-1]
               for name in MAY_CHANGE_ON_RESUME)


def test_a_length_check_names_every_term_with_its_flag():
    config = GRPOConfig(max_prompt_length=256, max_completion_length=8, eval_max_completion_length=64,
                        vllm_max_model_length=300, use_vllm=True)
    with pytest.raises(ValueError, match=r"--vllm-max-model-length 300 is below the longest request, "
                                         r"--max-prompt-length 256 \+ --eval-max-completion-length 64 = 320"):
        config.validate()
    settings = engine_settings(GRPOConfig(max_prompt_length=256, max_completion_length=80, num_generations=4), "fp32")
    assert settings.max_model_length == 336
    assert settings.max_model_length_from == "the longest request, --max-prompt-length 256 + --max-completion-length " \
                                             "80 = 336"
    assert settings.group_tokens_from == "--max-prompt-length 256 + --num-generations 4 x --max-completion-length " \
                                         "80 = 576 tokens"


# ============================================================================= eval.py

def test_eval_refuses_a_flag_that_does_nothing_naming_what_would_read_it(tmp_path, capsys):
    folder = tmp_path / "rm"
    argv = ["--model", "tiny", "--dataset", "synthetic:4", "--output-dir", str(tmp_path / "eval")]
    for extra, said in [(["--reward", str(folder)], "--reward does nothing here: the rewards scorer (--scorer "
                                                    "rewards) reads it; this evaluation scores with --scorer auto, "
                                                    "which on gsm8k rows is gsm8k"),
                        (["--temperature", "0.5"], "--temperature does nothing here: --num-samples > 1 reads it"),
                        (["--answer-extraction", "tag-or-last-line"], "--answer-extraction does nothing here: a "
                                                                      "reasoning-gym dataset reads it")]:
        assert eval_cli.main([*argv, *extra]) == 1
        assert said in one_error_line(capsys)
    assert not (tmp_path / "eval").exists()


def test_eval_config_shares_the_training_fields():
    training = {field.name: field for field in dataclasses.fields(GRPOConfig)}
    hints, training_hints = typing.get_type_hints(EvalConfig), typing.get_type_hints(GRPOConfig)
    shared = [field for field in dataclasses.fields(EvalConfig) if field.name in training]
    assert len(shared) >= 20
    for field in shared:
        assert hints[field.name] == training_hints[field.name], field.name
        if field.metadata["help"] == training[field.name].metadata["help"]:
            assert field.metadata.get("choices") == training[field.name].metadata.get("choices")
    sources = [field.metadata.get("from_run") for field in dataclasses.fields(EvalConfig)]
    for source in sources:
        for name in (source,) if isinstance(source, str) else source or ():
            assert name in training, name


@pytest.mark.slow
def test_eval_evaluates_a_trained_run_as_it_was_trained(tmp_path, capsys):
    pytest.importorskip("reasoning_gym")
    folder = tmp_path / "run"
    task = ["--dataset", "reasoning-gym:gcd:64", "--task-settings", '{"min_value": 1, "max_value": 60}']
    assert train_cli.main(["--model", "tiny", *task, "--answer-extraction", "tag-or-last-number",
                           "--max-completion-length", "12", "--max-prompt-length", "160", "--prompts-per-step", "2",
                           "--num-generations", "2", "--micro-batch-size", "4", "--max-steps", "1", "--device", "cpu",
                           "--reward", "task_score", "--output-dir", str(folder)]) == 0
    capsys.readouterr()
    out = tmp_path / "eval"
    assert eval_cli.main(["--model", str(folder), *task, "--limit", "6", "--output-dir", str(out / "a")]) == 0
    said = capsys.readouterr().out
    checkpoint = folder / "checkpoints" / "step-000001"
    assert f"evaluating {checkpoint} as it was trained: settings from {checkpoint / 'run_config.json'}" in said
    for taken in ("answer_extraction='tag-or-last-number'", "max_completion_length=12", "max_prompt_length=160",
                  "reward=['task_score']", "system_prompt="):
        assert taken in said, said
    # the same as giving the run's settings by hand
    assert eval_cli.main(["--model", str(checkpoint), *task, "--limit", "6", "--answer-extraction",
                          "tag-or-last-number", "--max-completion-length", "12", "--max-prompt-length", "160",
                          "--reward", "task_score", "--output-dir", str(out / "b")]) == 0
    (first,), (second,) = ([json.loads(path.read_text()) for path in (out / side).glob("*.summary.json")]
                           for side in "ab")
    assert {k: v for k, v in first.items() if k != "model"} == {k: v for k, v in second.items() if k != "model"}
    samples = [json.loads(line) for line in next((out / "a").glob("*.samples.jsonl")).read_text().splitlines()]
    assert max(sample["length"] for sample in samples) <= 12
    # a flag given on the command line wins over the run's
    assert eval_cli.main(["--model", str(folder), *task, "--limit", "2", "--max-completion-length", "5",
                          "--output-dir", str(out / "c")]) == 0
    assert "max_completion_length=" not in capsys.readouterr().out
    samples = [json.loads(line) for line in next((out / "c").glob("*.samples.jsonl")).read_text().splitlines()]
    assert max(sample["length"] for sample in samples) <= 5


def test_run_settings_leave_another_tasks_settings_out(tmp_path):
    checkpoint = tmp_path / "run" / "checkpoints" / "step-000001"
    checkpoint.mkdir(parents=True)
    (checkpoint / "COMPLETE").write_text("")
    (checkpoint / "trainer_state.pt").write_text("")
    record = {**GRPOConfig(dataset="reasoning-gym:gcd", task_settings={"max_value": 9}, eval_split="validation",
                           answer_extraction="tag-or-last-line", eval_max_completion_length=33).to_dict()}
    (checkpoint / "run_config.json").write_text(json.dumps(record))
    values, taken, _ = cli.run_settings({"model": str(tmp_path / "run")})
    assert values["model"] == str(checkpoint)
    assert taken["task_settings"] == {"max_value": 9} and taken["split"] == "validation"
    assert taken["max_completion_length"] == 33 and taken["answer_extraction"] == "tag-or-last-line"
    values, taken, _ = cli.run_settings({"model": str(checkpoint), "dataset": "synthetic:8"})
    assert "task_settings" not in taken and "split" not in taken and "answer_extraction" in taken
    assert cli.run_settings({"model": "tiny"}) == ({"model": "tiny"}, {}, None)



# ============================================================================= found by an attack on the above

def test_resuming_another_folders_checkpoint_into_a_folder_with_a_run_needs_overwrite(run, tmp_path, capsys):
    folder, before = run
    other = tmp_path / "other"
    shutil.copytree(folder, other)
    argv = [*SMOKE, "--no-overwrite", "--max-steps", "3", "--resume", str(other), "--output-dir", str(folder)]
    assert train_cli.main(argv) == 1
    assert "holds another run" in one_error_line(capsys) and snapshot(folder) == before
    assert train_cli.main([*argv, "--overwrite"]) == 0  # replaced: the resumed run's three steps, nothing else
    assert [row["step"] for row in read_jsonl(folder / "metrics.jsonl")] == [3]


@pytest.mark.parametrize("device", ["meta", "tpu", "CPU", "cuda:x"])
def test_a_device_that_is_none_is_refused_in_one_line(tmp_path, capsys, device):
    assert train_cli.main([*SMOKE, "--device", device, "--output-dir", str(tmp_path / "run")]) == 2
    assert "device must be auto, cpu, cuda or cuda:N" in one_error_line(capsys)


def test_a_failure_before_the_first_checkpoint_says_how_to_run_again(tmp_path, monkeypatch, capsys):
    plug_in = tmp_path / "plug.py"
    plug_in.write_text(LATE_ESTIMATOR.format(failure='raise RuntimeError("broke")'))
    monkeypatch.setenv("PLUG_IN_GOOD_CALLS", "1")
    monkeypatch.delenv("PLUG_IN_CALLS", raising=False)
    folder = tmp_path / "run"
    argv = [*SMOKE, "--no-overwrite", "--max-steps", "3", "--save-steps", "0", "--advantage-estimator",
            f"{plug_in}:later", "--output-dir", str(folder)]
    assert train_cli.main(argv) == 1
    line = one_error_line(capsys)
    assert "none (none was saved yet)" in line and "run it again (no checkpoint was saved yet) with: python " \
                                                   "train.py" in line
    command = line.split("with: python train.py ", 1)[1].split()
    assert command[-1] == "--overwrite" and "--resume" not in command
    monkeypatch.setenv("PLUG_IN_GOOD_CALLS", "100")
    monkeypatch.delenv("PLUG_IN_CALLS", raising=False)
    assert train_cli.main(command) == 0


SCORER = '''
import os


def scorer(completion, row):
    calls = int(os.environ.get("SCORER_CALLS", "0")) + 1
    os.environ["SCORER_CALLS"] = str(calls)
    return {"length": "long"} if calls > int(os.environ["SCORER_GOOD_CALLS"]) else {"length": len(completion)}
'''


def test_an_eval_scorer_that_returns_a_wrong_type_at_a_step_names_itself_and_that_step(tmp_path, monkeypatch,
                                                                                         capsys):
    plug_in = tmp_path / "scorer.py"
    plug_in.write_text(SCORER)
    monkeypatch.setenv("SCORER_GOOD_CALLS", "2")  # step 1's evaluation of 2 problems
    monkeypatch.delenv("SCORER_CALLS", raising=False)
    folder = tmp_path / "run"
    assert train_cli.main([*SMOKE, "--max-steps", "3", "--save-steps", "1", "--eval-steps", "1", "--eval-limit", "2",
                           "--eval-scorer", f"{plug_in}:scorer", "--output-dir", str(folder)]) == 1
    line = one_error_line(capsys)
    assert line.startswith(f"error: step 2's evaluation: eval scorer '{plug_in}:scorer' ({plug_in}) returned "
                           "{'length': 'long'}, expected a dict of names to numbers")
    assert f"The last good checkpoint is {folder / 'checkpoints' / 'step-000001'}." in line


def test_a_reward_that_calls_sys_exit_is_one_error_line(tmp_path, capsys):
    plug_in = tmp_path / "rewards.py"
    plug_in.write_text("import sys\n\n\ndef leaving(prompts, completions, **columns):\n    sys.exit(3)\n")
    assert train_cli.main([*SMOKE, "--reward", f"{plug_in}:leaving", "--output-dir", str(tmp_path / "run")]) == 1
    assert "step 1: reward 'leaving' raised SystemExit on row 0: 3" in one_error_line(capsys)


def test_a_checkpoint_that_does_not_record_a_setting_is_resumed_with_a_warning(run, caplog):
    folder, _ = run
    for record_file in folder.rglob("run_config.json"):
        record = json.loads(record_file.read_text())
        del record["beta"], record["loss_type"]
        record_file.write_text(json.dumps(record))
    assert train_cli.main([*SMOKE, "--max-steps", "3", "--output-dir", str(folder), "--resume", "--beta", "0.3"]) == 0
    assert "does not record beta, loss_type" in caplog.text


def test_an_evaluation_budget_of_zero_is_refused_and_an_eval_limit_of_zero_is_every_row(tmp_path, capsys):
    assert train_cli.main([*SMOKE, "--eval-max-completion-length", "0", "--output-dir", str(tmp_path / "a")]) == 2
    assert "eval_max_completion_length must be >= 1" in one_error_line(capsys)
    folder = tmp_path / "b"
    assert train_cli.main([*SMOKE, "--max-steps", "1", "--dataset", "synthetic:24", "--eval-steps", "1",
                           "--eval-limit", "0", "--output-dir", str(folder)]) == 0
    assert json.loads((folder / "eval" / "step-000001.json").read_text())["num_samples"] > 0


def test_eval_on_a_run_folder_without_a_checkpoint_says_so(tmp_path, capsys):
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / "run_config.json").write_text(json.dumps(GRPOConfig().to_dict()))
    assert eval_cli.main(["--model", str(folder), "--output-dir", str(tmp_path / "eval")]) == 2
    assert "a run folder that holds no complete checkpoint" in one_error_line(capsys)


@pytest.mark.parametrize("text, problem", [
    ("use_peft: yes\n", "use_peft must be true or false, got the string 'yes'"),
    ("max_steps: 1_6\n", "max_steps must be a whole number, got the string '1_6'"),
    ("max_steps: 3\nmax_steps: 4\n", "max_steps given twice"),
    ("max-steps: 3\nmax_steps: 4\n", "max_steps given twice"),
])
def test_yaml_is_read_with_the_core_schema_and_a_key_twice_is_refused(tmp_path, text, problem):
    file = tmp_path / "RUN.YAML"
    file.write_text(text)
    with pytest.raises(ValueError, match=problem):
        cli.load_config_file(str(file), GRPOConfig)
    (tmp_path / "run.json").write_text('{"beta": 0.1, "beta": 0.2}')
    with pytest.raises(ValueError, match="beta given twice"):
        cli.load_config_file(str(tmp_path / "run.json"), GRPOConfig)
    (tmp_path / "ok.yaml").write_text("max_steps: 0x10\nuse_peft: True\n")
    assert cli.load_config_file(str(tmp_path / "ok.yaml"), GRPOConfig) == dict(max_steps=16, use_peft=True)
