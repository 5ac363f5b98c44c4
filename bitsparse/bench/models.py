"""Models the benchmarks train: a GPT in the style of Modded-NanoGPT, a residual MLP stack and
torchvision's ResNet-50 (for the ``vision`` and ``steps`` suites).

The first two are written in plain PyTorch, with the ReLU^2 MLP as ``fc(x).relu_().square()``, so
BitSparse sees them exactly as it would see a user's model. The GPT's loss is fused (see
``bitsparse.bench.cross_entropy``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from bitsparse.bench.cross_entropy import linear_cross_entropy


def rms_norm(x: torch.Tensor) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],))


class Rotary(nn.Module):
    def __init__(self, head_dim: int, base: float = 10000.0):
        super().__init__()
        inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2).float() / head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [batch, T, heads, head_dim]
        t = torch.arange(x.shape[1], device=x.device, dtype=torch.float32)
        freqs = torch.outer(t, self.inv_freq)
        cos, sin = freqs.cos()[None, :, None, :].to(x.dtype), freqs.sin()[None, :, None, :].to(x.dtype)
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos + x2 * sin, x2 * cos - x1 * sin), dim=-1)


class MLP(nn.Module):
    """The ReLU^2 feed-forward layer: ``proj(fc(x).relu_().square())``."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc = nn.Linear(dim, hidden)
        self.proj = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.fc(x).relu_().square())


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int, head_dim: int, qk_norm: bool):
        super().__init__()
        self.heads, self.head_dim, self.qk_norm = heads, head_dim, qk_norm
        # Separate projections, as in Modded-NanoGPT: attention saves v, and a view of a
        # fused qkv product would keep all three alive.
        self.q, self.k, self.v = (nn.Linear(dim, heads * head_dim, bias=False) for _ in range(3))
        self.out = nn.Linear(heads * head_dim, dim, bias=False)
        self.rotary = Rotary(head_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (proj(x).view(b, t, self.heads, self.head_dim) for proj in (self.q, self.k, self.v))
        if self.qk_norm:
            q, k = rms_norm(q), rms_norm(k)
        q, k = self.rotary(q), self.rotary(k)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, t, -1))


class Block(nn.Module):
    def __init__(self, config: "GPTConfig"):
        super().__init__()
        self.attn = Attention(config.dim, config.heads, config.head_dim, config.qk_norm)
        self.mlp = MLP(config.dim, config.hidden)
        self.checkpoint_mlp = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(rms_norm(x))
        if self.checkpoint_mlp:
            return x + checkpoint(self.mlp, rms_norm(x), use_reentrant=False)
        return x + self.mlp(rms_norm(x))


@dataclass
class GPTConfig:
    layers: int = 12
    dim: int = 768
    heads: int = 6
    head_dim: int = 128
    hidden: int = 3072
    vocab: int = 50304
    qk_norm: bool = False


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab, config.dim)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.layers))
        self.head = nn.Linear(config.dim, config.vocab, bias=False)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        hidden = rms_norm(x)
        return linear_cross_entropy(hidden.view(-1, hidden.shape[-1]), self.head.weight, targets.reshape(-1))

    def mlps(self) -> list[MLP]:
        return [block.mlp for block in self.blocks]

    def units(self) -> nn.ModuleList:
        """The repeated modules, which ``--compile-scope block`` compiles one by one."""
        return self.blocks

    def set_checkpointing(self, enabled: bool) -> None:
        for block in self.blocks:
            block.checkpoint_mlp = enabled


class MLPStack(nn.Module):
    """``layers`` residual layers ``x = x + W2 relu(W1 rmsnorm(x))^2``."""

    def __init__(self, dim: int = 4096, hidden: int = 21504, layers: int = 8):
        super().__init__()
        self.layers = nn.ModuleList(MLP(dim, hidden) for _ in range(layers))
        self.checkpointing = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for mlp in self.layers:
            h = rms_norm(x)
            x = x + (checkpoint(mlp, h, use_reentrant=False) if self.checkpointing else mlp(h))
        return x.float().square().mean()

    def mlps(self) -> list[MLP]:
        return [getattr(layer, "eager", layer) for layer in self.layers]

    def units(self) -> nn.ModuleList:
        """The repeated modules, which ``--compile-scope block`` compiles one by one."""
        return self.layers

    def set_checkpointing(self, enabled: bool) -> None:
        self.checkpointing = enabled


class ResNetStages(nn.Module):
    """torchvision's ResNet-50 whose four stages can each run under checkpointing (the
    counterpart of checkpointing each MLP of the GPT). Needs torchvision."""

    def __init__(self):
        super().__init__()
        import torchvision

        self.resnet = torchvision.models.resnet50()
        self.checkpointing = False

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        r = self.resnet
        x = r.maxpool(r.relu(r.bn1(r.conv1(images))))
        for stage in self.units():
            x = checkpoint(stage, x, use_reentrant=False) if self.checkpointing else stage(x)
        return r.fc(torch.flatten(r.avgpool(x), 1))

    def units(self) -> list[nn.Module]:
        return [self.resnet.layer1, self.resnet.layer2, self.resnet.layer3, self.resnet.layer4]

    def set_checkpointing(self, enabled: bool) -> None:
        self.checkpointing = enabled


@torch.no_grad()
def shift_to_sparsity(model: nn.Module, run_forward, zero_fraction: float, samples: int = 1 << 20) -> None:
    """Shift each MLP's up-projection bias so ``zero_fraction`` of its pre-activations are <= 0."""
    pre: dict[int, torch.Tensor] = {}
    hooks = [
        mlp.fc.register_forward_hook(lambda m, i, o, k=k: pre.__setitem__(k, o.flatten()))
        for k, mlp in enumerate(model.mlps())
    ]
    try:
        # One layer at a time, since each shift changes what the next layer sees.
        for k, mlp in enumerate(model.mlps()):
            run_forward()
            values = pre[k]
            sample = values[torch.randint(values.numel(), (min(samples, values.numel()),), device=values.device)]
            mlp.fc.bias -= torch.quantile(sample.float(), zero_fraction).to(mlp.fc.bias.dtype)
    finally:
        for hook in hooks:
            hook.remove()


def sparse_gpt_loss(length: int, zero_fraction: float = 0.9, device: str = "cuda") -> tuple[GPT, Callable]:
    """The benchmarks' 12-layer GPT (bf16, on ``device``, its MLPs shifted to ``zero_fraction``
    zeros), seeded, and a function computing its loss on ``length`` random tokens."""
    torch.manual_seed(0)
    config = GPTConfig()
    model = GPT(config).to(device, torch.bfloat16)
    tokens = torch.randint(config.vocab, (1, length), device=device)

    def loss_fn() -> torch.Tensor:
        return model(tokens, tokens)

    shift_to_sparsity(model, loss_fn, zero_fraction)
    return model, loss_fn
