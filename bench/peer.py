"""The peer the GPU benchmarks measure against: Hugging Face transformers' GptOssForCausalLM at a
gptoss-jax preset's size, with random bf16 weights, on the GPU (on the CPU, a dry run of a script).
The benchmark scripts run it in a process of its own (`python -c`, from the checkout's root)."""

import sys

import torch

sys.path.insert(0, ".")


def build(preset: str):
    """(model, its transformers config, the device, a function that waits for the device)."""
    from transformers import GptOssConfig, GptOssForCausalLM

    from gptoss_jax import ModelConfig

    torch.manual_seed(0)
    cfg = GptOssConfig(**ModelConfig.preset(preset).to_hf_json(mxfp4=False))
    torch.set_default_dtype(torch.bfloat16)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    with torch.device(dev):
        model = GptOssForCausalLM(cfg)
    return model, cfg, dev, sync
