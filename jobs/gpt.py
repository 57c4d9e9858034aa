"""A small GPT trained on text that every machine has: the Python standard library's source.

Byte-level (vocabulary of 256), no tokenizer to download, no dropout (randomness inside a
step would have to depend on seed, step and sample only; the job does without it).

    elastic-dp train jobs.gpt --workers 2 --steps 150 --out runs/gpt
    python -m jobs.gpt --workers 2 --steps 150         # the form a Ray job entrypoint uses
    GPT_TOKENS=DIR_OR_URI elastic-dp train jobs.gpt …   # on token files (elastic-dp tokenize)
    elastic-dp train jobs.gpt --eval-every 50 …         # held-out loss on the next 100 kB of source
"""

from __future__ import annotations

import math
import os
import sys
import sysconfig
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from elastic_dp import Task, TrainConfig

CONTEXT = 64
CORPUS_BYTES = 2_000_000


def corpus(max_bytes: int = CORPUS_BYTES) -> bytes:
    """The first ``max_bytes`` of the standard library's top-level .py files, in name order."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    chunks, size = [], 0
    for path in sorted(stdlib.glob("*.py")):
        data = path.read_bytes()
        chunks.append(data)
        size += len(data)
        if size >= max_bytes:
            break
    return b"".join(chunks)[:max_bytes]


class ByteWindows(Dataset):
    """Non-overlapping windows of ``context + 1`` bytes: input and next-byte target."""

    def __init__(self, data: bytes, context: int = CONTEXT) -> None:
        self.tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
        self.context = context

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.context

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        w = self.tokens[i * self.context: i * self.context + self.context + 1]
        return w[:-1], w[1:]


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        att = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int = 256, context: int = CONTEXT, dim: int = 128, layers: int = 4,
                 heads: int = 4) -> None:
        super().__init__()
        self.context = context
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.zeros(context, dim))
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.tok.weight  # tied input and output embeddings
        for name, p in self.named_parameters():
            if name.endswith("proj.weight") or name.endswith("mlp.2.weight"):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * layers))
            elif p.dim() == 2:
                nn.init.normal_(p, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos[: idx.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def build_model() -> GPT:
    return GPT()


def init_module(model: GPT, name: str, module: nn.Module) -> None:
    """``--init units`` (the default at ``--zero 3``): ``module``'s own parameters drawn
    from the distributions ``GPT()`` draws them from (the values differ: each unit has its
    own seed)."""
    if module is model:
        nn.init.zeros_(model.pos)
        return
    module.reset_parameters()  # the biases and the layer norms, as GPT() leaves them
    if isinstance(module, (nn.Linear, nn.Embedding)):
        scaled = name.endswith(("proj", "mlp.2"))
        nn.init.normal_(module.weight, std=0.02 / math.sqrt(2 * len(model.blocks)) if scaled else 0.02)


TOKENS_ENV = "GPT_TOKENS"
"""Set to a directory or URI of byte-level token files (``elastic-dp tokenize``) to train on
them instead of the standard library's source; the workers must see it too (a Ray job:
``--runtime-env-json '{"env_vars": {"GPT_TOKENS": "..."}}'``)."""


def build_dataset() -> Dataset:
    uri = os.environ.get(TOKENS_ENV)
    if uri:
        from elastic_dp.tokens import TokenWindows

        return TokenWindows(uri, CONTEXT)
    return ByteWindows(corpus())


EVAL_BYTES = 100_000


def build_eval_dataset(context: int = CONTEXT) -> ByteWindows:
    """Held out: the 100,000 bytes of the standard library's source after the training
    corpus (``--eval-every K`` evaluates on them)."""
    return ByteWindows(corpus(CORPUS_BYTES + EVAL_BYTES)[CORPUS_BYTES:], context)


def loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    logits = model(x)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))


def build_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                              {"params": no_decay, "weight_decay": 0.0}], lr=3e-3, betas=(0.9, 0.95))


@torch.no_grad()
def generate(model: nn.Module, prompt: bytes = b"def ", length: int = 160, seed: int = 0) -> str:
    """Sample ``length`` bytes after ``prompt`` (temperature 0.8, fixed seed)."""
    model.eval()
    device = next(model.parameters()).device
    gen = torch.Generator(device="cpu").manual_seed(seed)
    idx = torch.tensor([list(prompt)], dtype=torch.long, device=device)
    for _ in range(length):
        logits = model(idx[:, -model.context:])[0, -1].float().cpu() / 0.8
        nxt = torch.multinomial(torch.softmax(logits, -1), 1, generator=gen)
        idx = torch.cat([idx, nxt.to(device).view(1, 1)], dim=1)
    return bytes(idx[0].tolist()).decode("utf-8", errors="replace")


def training_flops_per_sample(model: GPT, context: int = CONTEXT) -> float:
    """Forward and backward FLOPs of one window: 6 x parameters per token (the tied
    embedding counted once, as the output matmul), plus attention's 12 x layers x dim x
    context per token (PaLM, appendix B)."""
    params = sum(p.numel() for p in model.parameters())
    dim, layers = model.tok.embedding_dim, len(model.blocks)
    return context * (6 * params + 12 * layers * dim * context)


TASK = Task(model=build_model, dataset=build_dataset, loss=loss, optimizer=build_optimizer, init_module=init_module,
            eval_dataset=build_eval_dataset,
            sample=generate, tokens_per_sample=CONTEXT, flops_per_sample=training_flops_per_sample(GPT()),
            defaults=TrainConfig(steps=150, global_batch=32, micro_batch=16, warmup_steps=10,
                                 clip_grad_norm=1.0))


if __name__ == "__main__":
    from elastic_dp.cli import main

    sys.exit(main(["train", "jobs.gpt", *sys.argv[1:]]))
