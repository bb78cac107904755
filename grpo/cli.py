"""The command line of train.py and eval.py, generated from their config dataclasses; presets and config files.

    python train.py --preset smoke --config run.yaml --learning-rate 1e-5
Precedence: field defaults < --preset < --config FILE (YAML or JSON, keys are the field names) < explicit flags.
A boolean field `x` gives `--x` and `--no-x`; an unknown setting fails with a message that names it.
`python -m grpo.cli > docs/cli.md` writes the flag reference, section by section.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import re
import shlex
import types
import typing
from pathlib import Path

import yaml

from data.calculator import SYSTEM_PROMPT as CALCULATOR_PROMPT
from data.prompts import TASK_SYSTEM_PROMPT
from data.reasoning_gym import is_source, task_name
from grpo.config import MAY_CHANGE_ON_RESUME, GRPOConfig, sections
from grpo.core.checkpoint import latest_checkpoint
from grpo.evaluation.evaluate import EvalConfig
from grpo.trl_api import recipe

logger = logging.getLogger("grpo")

PRESETS: dict[str, dict] = {
    # The whole loop on CPU in about a minute: a tiny random-init model learns to write the format tags
    # (single tokens of the tiny tokenizer) that the dense `tags` reward pays for; reward rises visibly.
    "smoke": dict(
        model="tiny", dataset="synthetic:256", output_dir="runs/smoke", overwrite=True, max_steps=30,
        prompts_per_step=4, num_generations=8, micro_batch_size=16, max_prompt_length=128, max_completion_length=24,
        learning_rate=3e-3, warmup_ratio=0.0, lr_scheduler_type="constant", max_grad_norm=1.0, beta=0.04,
        weight_decay=0.0, reward=["tags"], save_steps=15, eval_steps=30, eval_limit=16, eval_batch_size=16,
        log_completions_steps=5, logging_steps=5, device="cpu", precision="fp32",
    ),
    # GSM8K with the calculator tool (docs/tools.md): the system prompt says how to call it, the rewards pay for
    # the answer and for calls that worked. The model is the README's real run's; --model overrides it.
    "calculator": dict(
        model="Qwen/Qwen2.5-0.5B-Instruct", output_dir="runs/calculator", tools=["data.calculator:calculator"],
        system_prompt=CALCULATOR_PROMPT, reward=["correctness:2", "int", "strict_format", "tool_success"],
        max_completion_length=384,
    ),
    # A real skill on a small model, on a CPU: a reasoning-gym task (chain_sum here; name
    # another with --dataset reasoning-gym:NAME --task-settings ...) on SmolLM2-135M-Instruct, rewarded by the task's
    # verifier (full marks only). A short-answer prompt (not GSM8K's R1 layout), short completions held short by
    # DAPO's overlong penalty and its token-level loss, DAPO's dynamic sampling (every step trains on groups whose
    # answers differ), no KL, a constant learning rate (docs/tasks.md, "A recipe").
    "reasoning-gym-small": dict(
        model="smollm2-135m-instruct", dataset="reasoning-gym:chain_sum:2000",
        task_settings={"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2},
        system_prompt=TASK_SYSTEM_PROMPT, answer_extraction="tag-or-last-number", reward=["task_solved"],
        output_dir="runs/reasoning-gym-small", max_steps=60, prompts_per_step=4, num_generations=8,
        micro_batch_size=32, max_completion_length=64, overlong_buffer_len=16, temperature=1.0, loss_type="dapo",
        dynamic_sampling=True,
        beta=0.0, learning_rate=3e-5, lr_scheduler_type="constant", warmup_ratio=0.0, max_grad_norm=1.0,
        save_steps=0, log_completions_steps=10,
    ),
}


def _flag_type(annotation):
    """(python type, nargs) for a field annotation such as `float | None` (nargs None), `list[str]` ("*") or
    `tuple[float, float]` (2)."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        (inner,) = [a for a in typing.get_args(annotation) if a is not type(None)]
        return _flag_type(inner)
    if origin is list:
        return typing.get_args(annotation)[0], "*"
    if origin is tuple:
        return typing.get_args(annotation)[0], len(typing.get_args(annotation))
    return annotation, None


def _optional(kind):
    def parse(text: str):
        return None if text.lower() in ("none", "null", "") else kind(text)

    parse.__name__ = kind.__name__
    return parse


def json_object(text: str) -> dict:
    """A flag's JSON object; argparse reports an error with the flag's name."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"not JSON ({error.msg}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object such as '{{\"key\": true}}', got {text!r}")
    return value


def build_parser(config_cls=GRPOConfig, description: str | None = None) -> argparse.ArgumentParser:
    """An argparse parser with one flag per config field (`--micro-batch-size` for `micro_batch_size`)."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                                     argument_default=argparse.SUPPRESS)
    # a value such as -1e3 is a number, not a flag (argparse's own pattern knows -1 and -.5 only)
    parser._negative_number_matcher = re.compile(r"^-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$|^-(inf|nan)$")
    if config_cls is GRPOConfig:
        parser.add_argument("--preset", choices=sorted(PRESETS),
                            help="a named set of settings (e.g. smoke: tiny model, CPU, ~1 min)")
    parser.add_argument("--config", help="a YAML or JSON file whose keys are the field names; flags override it")
    hints = typing.get_type_hints(config_cls)
    for title, fields in sections(config_cls):  # --help shows the config's sections, in its order
        group = parser.add_argument_group(title)
        for f in fields:
            _add_flag(group, f, hints)
    return parser


def _add_flag(parser, f: dataclasses.Field, hints: dict) -> None:
    """The flag of one config field: its type, choices, default and help from the field."""
    kind, nargs = _flag_type(hints[f.name])
    flag = "--" + f.name.replace("_", "-")
    # trl's spellings of the same setting, with dashes or underscores (--vllm-importance-sampling-mode)
    aliases = [f"--{spelling}" for alias in f.metadata.get("aliases", ())
               for spelling in dict.fromkeys((alias.replace("_", "-"), alias))]
    if aliases:
        parser = _Aliased(parser, f.name, aliases)
    default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
    help_text = f.metadata.get("help", "") + f" (default: {default!r})"
    if aliases:
        help_text += " [also " + ", ".join(a for a in aliases if "_" not in a) + "]"
    help_text = help_text.replace("%", "%%")
    if f.name == "resume":
        parser.add_argument(flag, nargs="?", const="", help=help_text)
    elif kind is bool:
        parser.add_argument(flag, action=argparse.BooleanOptionalAction, help=help_text)
    elif nargs == "*":
        # the flag alone: an empty list; given again, it adds to the list (--environment a:A --environment b:B)
        parser.add_argument(flag, nargs="*", action="extend", type=kind, help=help_text)
    elif nargs is not None:  # a fixed number of values: --reward-clip-range -1 1
        parser.add_argument(flag, nargs=nargs, type=kind, metavar=tuple(("MIN", "MAX") if nargs == 2 else ()) or None,
                            help=help_text)
    elif kind is dict:  # `none` clears it, as for the other optional flags
        parser.add_argument(flag, type=_optional(json_object), help=help_text)
    else:
        optional = type(None) in typing.get_args(hints[f.name])
        parser.add_argument(flag, type=_optional(kind) if optional else kind, choices=f.metadata.get("choices"),
                            help=help_text)


class _Aliased:
    """add_argument with more option strings (a field's trl spellings), stored under the field's name."""

    def __init__(self, parser, name: str, aliases: list[str]):
        self.parser, self.name, self.aliases = parser, name, aliases

    def add_argument(self, flag, **kwargs):
        return self.parser.add_argument(flag, *self.aliases, dest=self.name, **kwargs)


class _YAMLLoader(yaml.SafeLoader):
    """PyYAML's safe loader read with YAML 1.2's core schema, as trl recipes are written: true / false are the only
    booleans (not yes, on, y), numbers are written as YAML 1.2 writes them (5e-6 and 1e3 are floats; 0x1F and 0o17
    ints; no 1_000, 0b1 or base 60), and a key given twice in one mapping is refused, not silently the last."""

    def construct_mapping(self, node, deep=False):
        keys = [self.construct_object(key, deep=deep) for key, _ in node.value]
        twice = sorted({str(key) for key in keys if keys.count(key) > 1})
        if twice:
            raise yaml.constructor.ConstructorError(None, None, f"{', '.join(twice)} given twice", node.start_mark)
        return super().construct_mapping(node, deep)


_CORE_SCHEMA = {  # YAML 1.2's core schema: tag -> (pattern, first characters)
    "tag:yaml.org,2002:bool": (r"^(true|True|TRUE|false|False|FALSE)$", "tTfF"),
    "tag:yaml.org,2002:int": (r"^[-+]?[0-9]+$|^0o[0-7]+$|^0x[0-9a-fA-F]+$", "-+0123456789"),
    "tag:yaml.org,2002:float": (r"^[-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)([eE][-+]?[0-9]+)?$|^[-+]?\.(inf|Inf|INF)$"
                                r"|^\.(nan|NaN|NAN)$", "-+0123456789."),
}
_YAMLLoader.yaml_implicit_resolvers = {
    first: [(tag, pattern) for tag, pattern in resolvers if tag not in _CORE_SCHEMA]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}
for _tag, (_pattern, _first) in _CORE_SCHEMA.items():
    _YAMLLoader.add_implicit_resolver(_tag, re.compile(_pattern), list(_first))
_YAMLLoader.add_constructor("tag:yaml.org,2002:bool", lambda loader, node: node.value.lower() == "true")


def _core_int(loader, node) -> int:
    """A YAML 1.2 core-schema integer: decimal, or 0x hexadecimal, or 0o octal."""
    base = {"0x": 16, "0o": 8}.get(node.value[:2], 10)
    return int(node.value if base == 10 else node.value[2:], base)


_YAMLLoader.add_constructor("tag:yaml.org,2002:int", _core_int)


def _no_key_twice(pairs: list) -> dict:
    """A JSON object whose keys are each given once (json's object_pairs_hook)."""
    keys = [key for key, _ in pairs]
    twice = sorted({key for key in keys if keys.count(key) > 1})
    if twice:
        raise ValueError(f"{', '.join(twice)} given twice")
    return dict(pairs)


def load_config_file(path: str, config_cls=None) -> dict:
    """The settings of a YAML or JSON file (keys are the field names; dashes are read as underscores), each read as
    its field's type when `config_cls` is given (grpo.config_types): a wrong key or value, or a key given twice, is
    refused, naming the file, the setting and the type. A trl / open-r1 recipe (its model, data, reward and trl
    GRPOConfig keys) is read by grpo.trl_api.recipe, which says what it maps and what it leaves."""
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"--config {path}: no such file")
    text, is_yaml = file.read_text(), file.suffix.lower() in (".yaml", ".yml")
    try:
        values = yaml.load(text, Loader=_YAMLLoader) if is_yaml else json.loads(text, object_pairs_hook=_no_key_twice)
    except (yaml.YAMLError, ValueError) as error:
        raise ValueError(f"--config {path}: not valid {'YAML' if is_yaml else 'JSON'} "
                         f"({str(error).splitlines()[0]})") from None
    values = {} if values is None else values
    if not isinstance(values, dict):
        raise ValueError(f"--config {path}: expected a mapping of field names to values")
    named = [str(key).replace("-", "_") for key in values]
    twice = sorted({name for name in named if named.count(name) > 1})  # max-steps and max_steps
    if twice:
        raise ValueError(f"--config {path}: {', '.join(twice)} given twice (once with dashes)")
    values = dict(zip(named, values.values()))
    if config_cls is GRPOConfig and recipe.is_recipe(values):  # a trl / open-r1 recipe (docs/trl.md)
        values, mapped, left = recipe.recipe_settings(values, where=f"--config {path}")
        logger.info("--config %s is a trl recipe; read as:\n  %s", path, "\n  ".join(mapped))
        if left:
            logger.warning("--config %s: settings without effect here:\n  %s", path, "\n  ".join(left))
    return values if config_cls is None else config_cls.read(values, where=f"--config {path}")


def settings_from_args(argv=None, config_cls=GRPOConfig, description: str | None = None) -> dict:
    """The settings a command line gives, field name -> value, not yet checked: --preset < --config FILE < explicit
    flags (a field's default is not among them)."""
    args = vars(build_parser(config_cls, description).parse_args(argv))
    values = dict(PRESETS[args.pop("preset")]) if "preset" in args else {}
    preset = dict(values)
    if "config" in args:
        values.update(load_config_file(args.pop("config"), config_cls))
    values.update(args)
    if "task_settings" in preset and values["task_settings"] is preset["task_settings"] \
            and task_name(values.get("dataset")) != task_name(preset.get("dataset")):
        values.pop("task_settings")  # a preset's task settings are its task's, not another's
    return values


def make_config(values: dict, config_cls=GRPOConfig, given=None):
    """The validated config of `values` (settings_from_args'); its `given` names the settings the user gave (default:
    every key of `values`), so that eval.py can refuse a given one that does nothing."""
    config = config_cls.from_dict(values, where="settings")
    if getattr(config, "resume", None) == "":  # `--resume` without a folder: this run's own output folder
        config.resume = config.output_dir
    config.given = frozenset(values if given is None else given)
    return config.validate()


def config_from_args(argv=None, config_cls=GRPOConfig, description: str | None = None) -> GRPOConfig:
    """Parse flags into a validated config: defaults < --preset < --config FILE < explicit flags."""
    return make_config(settings_from_args(argv, config_cls, description), config_cls)


TASK_BOUND = ("split", "task_settings", "task_seed", "trust_task_verifier", "reward", "scorer")  # the run's task's


def run_settings(values: dict) -> tuple[dict, dict, Path | None]:
    """eval.py on a trained run: (`values` with every evaluation setting they do not give taken from the run's
    run_config.json, what was taken: setting -> value, the run_config.json read or None). `values["model"]` may name
    a run folder (its newest complete checkpoint is evaluated) or a checkpoint folder; anything else is no run. The
    settings taken are EvalConfig's fields with a `from_run` (the training setting of that name, or the first of
    several that is set); with another dataset than the run's, the run's task's own settings (TASK_BOUND) are not."""
    model = values.get("model")
    folder = Path(str(model)).expanduser() if model else None
    if folder is None or not folder.is_dir():
        return values, {}, None
    checkpoint = latest_checkpoint(folder)  # the folder itself when it is a checkpoint
    if checkpoint is None and ((folder / "run_config.json").is_file() or (folder / "checkpoints").is_dir()):
        raise ValueError(f"--model {model}: a run folder that holds no complete checkpoint (looked for "
                         f"{folder / 'checkpoints'}/step-*/COMPLETE): the run saved none yet")
    record_file = None if checkpoint is None else checkpoint / "run_config.json"
    if record_file is None or not record_file.is_file():
        return values, {}, None
    run = json.loads(record_file.read_text())
    values, taken, unrecorded = dict(values, model=str(checkpoint)), {}, []
    other_task = "dataset" in values and _dataset(values["dataset"]) != _dataset(run.get("dataset"))
    for f in dataclasses.fields(EvalConfig):
        sources = f.metadata.get("from_run")
        sources = (sources,) if isinstance(sources, str) else sources or ()
        if f.name in values or (other_task and f.name in TASK_BOUND):
            continue
        if sources and not any(name in run for name in sources):
            unrecorded.append(f.name)
        found = [run[name] for name in sources if run.get(name) is not None]
        if found and found[0] != f.default and not (f.default_factory is not dataclasses.MISSING
                                                      and found[0] == f.default_factory()):
            values[f.name] = taken[f.name] = found[0]
    if unrecorded:
        logger.warning("%s does not record %s (an older run_config.json): eval.py's defaults stand for them",
                       record_file, ", ".join(unrecorded))
    return values, taken, record_file


def _dataset(dataset: str | None) -> str | None:
    """A dataset as run_settings compares them: a reasoning-gym task by its name, a local path normalised."""
    name = task_name(dataset)
    return os.path.normpath(name) if name and not is_source(name) and ":" not in name else name


def resume_command(argv: list[str], output_dir: str, torchrun: bool = False, start_over: bool = False) -> str:
    """The command that continues a run of train.py: its own flags, with `--resume OUTPUT_DIR` in place of any
    --resume they held (the run folder's newest complete checkpoint is where it goes on). `start_over`: the run saved
    no checkpoint yet, so the command runs it again from the start, with --overwrite (the folder holds its logs)."""
    flags, rest = [], list(argv)
    while rest:
        flag = rest.pop(0)
        if flag == "--resume" and rest and not rest[0].startswith("-"):
            rest.pop(0)  # its folder
        elif flag != "--resume" and not flag.startswith("--resume="):
            flags.append(flag)
    program = "torchrun [the same torchrun options] train.py" if torchrun else "python train.py"
    ending = ["--overwrite"] if start_over else ["--resume", str(output_dir)]
    return f"{program} {shlex.join([*(flag for flag in flags if flag != '--overwrite'), *ending])}"


def cli_reference() -> str:
    """docs/cli.md: every flag of train.py with its default and help, in the config's order (`python -m grpo.cli`)."""

    def table(config_cls) -> list[str]:
        lines = []
        for title, fields in sections(config_cls):
            lines += [f"### {title}", "", "| flag | default | meaning |", "|---|---|---|"]
            for f in fields:
                default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
                shown = "(the data's, data/prompts.py)" if f.name == "system_prompt" else repr(default)
                help_text = f.metadata.get("help", "").replace("|", "\\|")
                lines.append(f"| `--{f.name.replace('_', '-')}` | `{shown}` | {help_text} |")
            lines.append("")
        return lines

    def flags(preset: dict) -> str:
        prompts = {CALCULATOR_PROMPT: "(data.calculator.SYSTEM_PROMPT)",
                   TASK_SYSTEM_PROMPT: "(data.prompts.TASK_SYSTEM_PROMPT)"}
        shown = {k: prompts.get(v, v) if k == "system_prompt" else v for k, v in preset.items()}

        def flag(key, value):
            name = "--" + key.replace("_", "-")
            if isinstance(value, bool):  # a switch: --x or --no-x
                return name if value else f"--no-{name[2:]}"
            if isinstance(value, list):
                return f"{name} {' '.join(value)}"
            shown = json.dumps(value) if isinstance(value, dict) else value
            return f"{name} {shown}"
        return " ".join(flag(k, v) for k, v in shown.items())
    return "\n".join([
        "# Command-line reference",
        "",
        "Generated from `grpo/config.py` by `python -m grpo.cli > docs/cli.md` (tests/test_docs.py keeps it",
        "current). `python train.py --help` prints the same list. Flags can also come from `--config FILE` (YAML or",
        "JSON, keys are the field names); precedence: defaults < `--preset` < `--config` < flags. A boolean flag `--x`",
        "has its `--no-x`. Batch sizes count prompts and completions, not trl's per-device completions (README).",
        "",
        *[f"`--preset {name}` sets: `{flags(preset)}`.\n" for name, preset in PRESETS.items()],
        "",
        "## train.py",
        "",
        *table(GRPOConfig),
        "### settings that may change on --resume",
        "",
        "A resumed run goes on as it started: a change to any other setting is refused, listing each change old -> "
        "new, unless `--resume-with-changed-settings` (then each change is logged and kept in run_config.json's "
        "`changed_on_resume`). These may change on --resume: "
        + ", ".join(f"`--{name.replace('_', '-')}`" for name in sorted(MAY_CHANGE_ON_RESUME)) + ".",
        "",
        "## eval.py",
        "",
        *table(EvalConfig),
    ])


if __name__ == "__main__":
    print(cli_reference())
