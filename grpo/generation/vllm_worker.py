"""The trainer's hook inside a vLLM engine's worker (`worker_extension_cls`): reload every weight from the policy,
and tell a trainer what model a server serves (`grpo_model_info`).

vLLM imports this module in its worker, which may be a process of its own (generation ranks, a server), so it
imports only what that process needs (grpo.generation.vllm_transfer holds what the server's engine shares). The
names are the Hugging Face checkpoint's (`model.layers.0.self_attn.q_proj.weight`); the engine's `load_weights`
maps them onto its own fused parameters (`qkv_proj`, `gate_up_proj`) with the model's own mapping, as when it reads
a checkpoint. The reload goes through vLLM's layerwise reload, which redoes what the engine did to its weights
after loading them (a CPU engine repacks its linear layers for its kernels, so a plain `load_weights` into a
running engine fails there).
"""

from __future__ import annotations


class WeightLoader:
    """Mixed into vLLM's worker class: `self.model_runner` holds the engine's model."""

    def grpo_reload_weights(self, weights) -> list[str]:
        """Reload from (name, tensor) pairs (an iterator given in this process: an engine in the trainer's own).
        Returns the engine's parameters that no weight reached (the caller stops the run on any)."""
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

        from grpo.generation.vllm_transfer import reprocess_tied_layers

        model = self.model_runner.get_model()
        expected = {name for name, _ in model.named_parameters()}
        with set_current_vllm_config(self.vllm_config):
            initialize_layerwise_reload(model)
            loaded = set(model.load_weights(weights) or ())
            finalize_layerwise_reload(model, self.vllm_config.model_config)
            reprocess_tied_layers(model, loaded)
        return sorted(expected - loaded)

    def grpo_model_info(self) -> dict:
        """What a trainer checks before it pushes weights to a server (grpo.generation.vllm_server): the served
        model's architectures and shape, and this worker's GPU (None on a CPU), which NCCL cannot share with the
        trainer."""
        config = self.model_runner.model_config
        text = config.hf_text_config
        import torch

        gpu = None
        if torch.cuda.is_available():
            gpu = str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)
        return {"architectures": list(getattr(config.hf_config, "architectures", None) or []),
                "vocab_size": int(text.vocab_size), "hidden_size": int(text.hidden_size),
                "num_hidden_layers": int(text.num_hidden_layers), "gpu": gpu}

    def grpo_reload_weights_files(self, paths: list[str]) -> list[str]:
        """Reload from safetensors files (an engine in a process of its own: the files lie in shared memory)."""
        from safetensors import safe_open

        def weights():
            for path in paths:
                with safe_open(path, framework="pt") as file:
                    for name in file.keys():
                        yield name, file.get_tensor(name)

        return self.grpo_reload_weights(weights())
