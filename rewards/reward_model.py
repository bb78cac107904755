"""A reward model as a reward function: a sequence-classification model's score of prompt + completion.

    r_i = RM(text(prompt_i + completion_i))[0]        the score head's one logit at the last non-pad token

trl 1.16's semantics (GRPOTrainer/RLOOTrainer: `reward_funcs` given as a model id, a folder or a PreTrainedModel,
`reward_processing_classes`, `_calculate_rewards`):
- loaded with AutoModelForSequenceClassification.from_pretrained(id, num_labels=1); named after the id's last path
  component (`org/my-rm` -> `my-rm`); its tokenizer is AutoTokenizer.from_pretrained(id) unless one is given;
- a tokenizer without a pad token pads with its EOS token, and the model's config.pad_token_id is set to the
  tokenizer's: the model reads its score at the last token that is not padding;
- chat prompts: the text is the reward tokenizer's chat template over prompt + completion messages
  (trl.data_utils.apply_chat_template({"messages": p + c}, tokenizer, **chat_template_kwargs)["text"], which is
  `tokenizer.apply_chat_template(p + c, tools=None, tokenize=False, **chat_template_kwargs)`); plain-string
  prompts: the text is prompt + completion, concatenated;
- tokenized with padding=True, padding_side="right", add_special_tokens=False (the template wrote any special
  tokens); scored as `logits[:, 0]` under torch.inference_mode.
Beyond trl: the model loads lazily (at `load(device)`, which the trainer calls once the run's device is known, or at
the first call, on the CPU), so checking a configuration never loads one; safetensors only; remote code only when
asked; scored `batch_size` texts at a time; fp32 unless `dtype` says otherwise (trl under transformers 5 loads the
checkpoint's own dtype); a checkpoint without a trained one-label score head is refused, not scored by a random head.

This is the one reward that holds a model (rewards are otherwise plain functions over text, docs/style.md): a class
only so that the model loads once and lives on the run's device.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch

from rewards.scoring import RewardSpec

DEFAULT_BATCH_SIZE = 16  # texts per forward pass: a memory bound; the scores do not depend on it


def is_conversational(prompt) -> bool:
    """trl.data_utils.is_conversational for one prompt: a list of messages with roles."""
    return isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], dict) and "role" in prompt[0]


def is_local_path(source: str) -> bool:
    """A folder on this machine, not a hub id: it exists, or it is written as a path (./x, /x, ~/x)."""
    return Path(source).expanduser().exists() or source.startswith((".", "/", "~"))


def check_model_folder(source: str, where: str) -> None:
    """A local reward model folder exists and holds config.json; ValueError naming `where` otherwise."""
    path = Path(source).expanduser()
    if not path.is_dir():
        raise ValueError(f"{where}: no such folder {path}")
    if not (path / "config.json").is_file():
        raise ValueError(f"{where}: the folder {path} has no config.json, so it is not a model folder "
                         "(save_pretrained's); a reward model is a sequence-classification model with one label")


class RewardModel:
    """A sequence-classification reward model with a reward function's signature: `fn(prompts, completions,
    **columns) -> list[float]`, one score per completion (trl 1.16's reward model, see the module docstring).

    model: a local folder or hub id (loaded on `load`), or a built PreTrainedModel with one label.
    tokenizer: trl's reward_processing_classes entry; None: AutoTokenizer.from_pretrained of the model's id.
    batch_size: texts per forward pass. chat_template_kwargs: the template's extra arguments (trl's
    args.chat_template_kwargs). trust_remote_code: run the checkpoint's own code (off unless asked).
    dtype: the weights' dtype when loading from a folder or id ("auto": the checkpoint's). name: the reward's
    name; default the id's last path component, as trl.
    """

    def __init__(self, model, tokenizer=None, *, batch_size: int = DEFAULT_BATCH_SIZE,
                 chat_template_kwargs: dict | None = None, trust_remote_code: bool = False,
                 dtype: torch.dtype | str = torch.float32, name: str | None = None):
        if batch_size < 1:
            raise ValueError(f"reward model batch_size must be >= 1, got {batch_size}")
        if isinstance(model, str):
            if not model.strip("/"):
                raise ValueError("a reward model needs a folder or hub id, got an empty name")
            if is_local_path(model):
                check_model_folder(model, f"reward model {model!r}")
            model_id = model
        elif isinstance(model, torch.nn.Module) and hasattr(model, "config"):
            model_id = getattr(model.config, "_name_or_path", "") or type(model).__name__
            check_sequence_classifier(model, model_id)
        else:
            raise TypeError(f"a reward model is a folder, a hub id or a PreTrainedModel, got {type(model).__name__}")
        self.source = model  # what was given: the id/folder, or the model
        self.model = None if isinstance(model, str) else model  # the loaded model, once `load` ran
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.trust_remote_code = trust_remote_code
        self.dtype = dtype
        self.name = name or model_id.rstrip("/").split("/")[-1]  # trl: get_config_model_id(config).split("/")[-1]
        self.__name__ = self.name  # what rewards.registry names a callable by
        self.device = None  # set by `load`

    def __repr__(self) -> str:
        source = self.source if isinstance(self.source, str) else type(self.source).__name__
        return f"RewardModel({source!r}, device={self.device})"

    def with_tokenizer(self, tokenizer) -> RewardModel:
        """A copy of this reward model that scores with `tokenizer` (a reward_processing_classes entry)."""
        if self.device is not None:
            raise ValueError(f"reward model {self.name!r} is loaded already: give its tokenizer before it loads")
        other = copy.copy(self)
        other.tokenizer = tokenizer
        return other

    # ------------------------------------------------------------------ loading
    def load(self, device: torch.device | str = "cpu") -> RewardModel:
        """Load the model and tokenizer (once), check them, and put the model on `device` in eval mode."""
        if self.model is None:
            self.model = self._from_pretrained()
        check_sequence_classifier(self.model, self.name)
        if self.tokenizer is None:
            self.tokenizer = self._load_tokenizer()
        if len(self.tokenizer) <= 1:  # transformers builds an empty tokenizer from a folder without tokenizer files
            raise ValueError(f"reward model {self.name!r}: its tokenizer has {len(self.tokenizer)} token(s); save the "
                             "model's tokenizer in its folder, or pass one (trl's reward_processing_classes)")
        if self.tokenizer.pad_token_id is None:  # trl: pad with EOS
            self.tokenizer.pad_token = self.tokenizer.eos_token
        # the score is read at the last token that is not padding: the model must know which id pads (trl)
        self.model.config.get_text_config().pad_token_id = self.tokenizer.pad_token_id
        self.device = torch.device(device)
        self.model.to(self.device).eval()
        return self

    def _from_pretrained(self):
        from transformers import AutoModelForSequenceClassification

        source = str(Path(self.source).expanduser()) if is_local_path(self.source) else self.source
        try:  # ignore_mismatched_sizes: a wrong head is reported below with the model's name, not as a size error
            model, info = AutoModelForSequenceClassification.from_pretrained(
                source, num_labels=1, dtype=self.dtype, trust_remote_code=self.trust_remote_code,
                use_safetensors=True, ignore_mismatched_sizes=True, output_loading_info=True)
        except (OSError, ValueError) as error:  # unreachable id, broken folder, pickled weights, unknown architecture
            reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            raise ValueError(f"reward model {self.source!r}: could not be loaded as a sequence-classification model "
                             f"({reason})") from None
        untrained = sorted(info["missing_keys"]) + sorted(entry[0] if isinstance(entry, tuple) else entry
                                                             for entry in info["mismatched_keys"])
        if untrained:  # e.g. a causal LM's folder: from_pretrained would add a randomly initialised score head
            architectures = getattr(model.config, "architectures", None) or ["?"]
            raise ValueError(f"reward model {self.source!r}: not a sequence-classification model with one label (its "
                             f"checkpoint is a {', '.join(architectures)}; weights missing or of another shape: "
                             f"{', '.join(untrained)}), so its scores would come from a randomly initialised head")
        return model

    def _load_tokenizer(self):
        from transformers import AutoTokenizer

        model_id = getattr(self.model.config, "_name_or_path", "")
        if not model_id:
            raise ValueError(f"reward model {self.name!r}: built in memory, so its tokenizer cannot be found; give one "
                             "(RewardModel(model, tokenizer) or the Trainer's reward_processing_classes)")
        try:
            return AutoTokenizer.from_pretrained(model_id, trust_remote_code=self.trust_remote_code)
        except (OSError, ValueError) as error:
            raise ValueError(f"reward model {self.name!r}: its tokenizer could not be loaded from {model_id} "
                             f"({str(error).strip().splitlines()[0] if str(error).strip() else error})") from None

    # ------------------------------------------------------------------ scoring
    def texts(self, prompts: list, completions: list) -> list[str]:
        """What the reward model reads: the chat template over prompt + completion messages, or prompt + completion."""
        if not is_conversational(prompts[0]):
            return [prompt + completion for prompt, completion in zip(prompts, completions, strict=True)]
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(f"reward model {self.name!r}: the prompts are chat messages but its tokenizer has no chat "
                             "template to write them as text; give a tokenizer with one (reward_processing_classes)")
        return [self.tokenizer.apply_chat_template(prompt + completion, tools=None, tokenize=False,
                                                   **self.chat_template_kwargs)
                for prompt, completion in zip(prompts, completions, strict=True)]

    def __call__(self, prompts: list, completions: list, **columns) -> list[float]:
        if self.device is None:
            self.load()
        texts = self.texts(prompts, completions)
        scores = []
        for start in range(0, len(texts), self.batch_size):
            batch = self.tokenizer(text=texts[start : start + self.batch_size], return_tensors="pt", padding=True,
                                   padding_side="right", add_special_tokens=False).to(self.device)  # (b, L) each
            with torch.inference_mode():
                logits = self.model(**batch).logits  # (b, 1)
            scores += logits[:, 0].float().tolist()  # note: a CPU-GPU sync point
        return scores


def check_sequence_classifier(model, name: str) -> None:
    """A sequence-classification model with one label (trl supports only these); ValueError naming it otherwise."""
    kind = type(model).__name__
    if not kind.endswith("ForSequenceClassification"):
        raise ValueError(f"reward model {name!r}: a {kind}, not a sequence-classification model (trl's reward models "
                         "are AutoModelForSequenceClassification with num_labels=1)")
    if model.config.num_labels != 1:
        raise ValueError(f"reward model {name!r}: its score head has {model.config.num_labels} labels; a reward model "
                         "has one (num_labels=1)")


def with_processing_classes(specs: list, processing_classes) -> list:
    """trl's reward_processing_classes: one tokenizer, or a list aligned with the reward functions (None entries:
    the model's own tokenizer); entries for reward functions that are not models are ignored."""
    if processing_classes is None:
        return specs
    if not isinstance(processing_classes, list):
        processing_classes = [processing_classes]
    if len(processing_classes) != len(specs):
        raise ValueError(f"The number of reward processing classes ({len(processing_classes)}) must match the number "
                         f"of reward functions ({len(specs)}).")
    return [RewardSpec(spec.name, spec.fn.with_tokenizer(tokenizer), spec.weight)
            if isinstance(spec.fn, RewardModel) and tokenizer is not None else spec
            for spec, tokenizer in zip(specs, processing_classes, strict=True)]


def load_reward_models(specs: list, device: torch.device) -> None:
    """Put every reward model among `specs` on the run's `device`, loading it first if it is not yet."""
    for spec in specs:
        if isinstance(spec.fn, RewardModel):
            spec.fn.load(device)


__all__ = ["RewardModel", "check_model_folder", "is_conversational", "load_reward_models", "with_processing_classes"]
