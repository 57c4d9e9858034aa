"""Any Hugging Face ``transformers`` causal LM, built from a configuration (nothing is
downloaded), trained on byte-level text or on token files. Needs ``pip install
elastic-dp[hf]`` (transformers).

    HF_MODEL=llama elastic-dp train jobs.hf_causal_lm --workers 2 --steps 100
    HF_MODEL=gpt2 HF_CONFIG='{"n_layer": 4}' elastic-dp train jobs.hf_causal_lm …
    HF_MODEL=path/to/config.json HF_TOKENS=s3://bucket/corpus?… elastic-dp train jobs.hf_causal_lm …

``HF_MODEL`` is a model type the library ships a configuration class for (``llama``,
``gpt2``, ``mistral``, ``qwen2``, …; small defaults below) or a local ``config.json`` (or
its directory); ``HF_CONFIG`` is JSON that overrides fields of it. Every dropout
probability is set to 0 unless ``HF_CONFIG`` sets it: randomness inside a step would make
the run depend on which worker trained which sample. The data: ``HF_TOKENS``, token files
(``elastic-dp tokenize``; the model's vocabulary must cover their ids), or else the Python
standard library's source as bytes (vocabulary 256), as ``jobs.gpt``. Batches are dicts
(``input_ids``, ``labels``) and the loss is the model's own.

From Python, ``make_task(model, overrides, tokens=..., context=...)`` builds the same Task
(docs/jobs.md).
"""

from __future__ import annotations

import functools
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

from elastic_dp import Task, TaskError, TrainConfig
from jobs import gpt

SMALL = {
    "llama": {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4,
              "num_key_value_heads": 2, "max_position_embeddings": 256},
    "gpt2": {"n_embd": 128, "n_layer": 4, "n_head": 4, "n_positions": 256},
}
"""Small defaults for model types run without a local config (any field can be overridden)."""


def model_config(model: str, overrides: dict[str, Any] | None = None, vocab_size: int | None = None):
    """A ``transformers`` config: of model type ``model`` (the library's defaults, then
    ``SMALL``'s) or read from a local ``config.json``; then ``overrides``; dropouts 0."""
    try:
        from transformers import AutoConfig
    except ImportError:
        raise TaskError("jobs.hf_causal_lm needs transformers: pip install 'elastic-dp[hf]'") from None
    overrides = dict(overrides or {})
    path = Path(model)
    if path.suffix == ".json" or path.is_dir():
        if not path.exists():
            raise TaskError(f"HF_MODEL={model}: no such config file or directory")
        config = AutoConfig.from_pretrained(str(path))
    else:
        try:
            config = AutoConfig.for_model(model, **SMALL.get(model, {}))
        except ValueError:
            raise TaskError(f"HF_MODEL={model} is neither a model type transformers knows (llama, gpt2, …) nor "
                            "a local config.json") from None
    if vocab_size is not None and "vocab_size" not in overrides:
        overrides["vocab_size"] = vocab_size
    for key in config.to_dict():
        if ("dropout" in key or key.endswith("pdrop")) and key not in overrides \
                and isinstance(getattr(config, key), float):
            overrides[key] = 0.0
    for key, value in overrides.items():
        setattr(config, key, value)
    return config


def build_model(model: str, overrides: dict[str, Any], vocab_size: int | None) -> nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(model_config(model, overrides, vocab_size))


class CausalWindows(Dataset):
    """Windows of ``context`` tokens as the dict a causal LM takes: ``input_ids`` and
    ``labels`` (the same ids: the model shifts them)."""

    def __init__(self, base: Dataset) -> None:
        self.base = base

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        x, _ = self.base[i]
        return {"input_ids": x, "labels": x}


def build_dataset(tokens: str | None, context: int) -> CausalWindows:
    if tokens:
        from elastic_dp.tokens import TokenWindows

        return CausalWindows(TokenWindows(tokens, context))
    return CausalWindows(gpt.ByteWindows(gpt.corpus(), context))


def build_eval_dataset(context: int) -> CausalWindows:
    """Held out: the standard library's source after the training corpus (as ``jobs.gpt``)."""
    return CausalWindows(gpt.build_eval_dataset(context))


def loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return model(**batch).loss


def build_optimizer(model: nn.Module, lr: float) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)


def make_task(model: str = "llama", overrides: dict[str, Any] | None = None, *, tokens: str | None = None,
              context: int = 64, lr: float = 1e-3, defaults: TrainConfig | None = None) -> Task:
    """The Task of a ``transformers`` causal LM (``model``: a model type or a local
    config.json; ``overrides``: its fields) on ``tokens`` (token files) or the standard
    library's bytes (vocabulary 256 unless ``overrides`` says otherwise)."""
    overrides = dict(overrides or {})
    vocab = None if tokens else 256
    model_config(model, overrides, vocab)  # a bad model or override is refused here, not in every worker
    return Task(model=functools.partial(build_model, model, overrides, vocab),
                dataset=functools.partial(build_dataset, tokens, context),
                eval_dataset=None if tokens else functools.partial(build_eval_dataset, context),
                loss=loss, optimizer=functools.partial(build_optimizer, lr=lr),
                tokens_per_sample=context,
                defaults=defaults or TrainConfig(steps=100, global_batch=16, micro_batch=8, warmup_steps=10,
                                                 lr_schedule="cosine", clip_grad_norm=1.0))


def _from_environment() -> Task:
    try:
        overrides = json.loads(os.environ.get("HF_CONFIG", "{}"))
    except ValueError as exc:
        raise TaskError(f"HF_CONFIG is not JSON: {exc}") from None
    return make_task(os.environ.get("HF_MODEL", "llama"), overrides, tokens=os.environ.get("HF_TOKENS") or None)


TASK = _from_environment()


if __name__ == "__main__":
    from elastic_dp.cli import main

    sys.exit(main(["train", "jobs.hf_causal_lm", *sys.argv[1:]]))
