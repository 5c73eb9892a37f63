"""A GPT-style decoder with document-masked causal attention, and per-rank step timing, for train_throughput.

The model takes one packed micro-batch (a flat row of tokens) with its `cu_seqlens`: each segment
attends only within itself, causally, as variable-length kernels do. On CPU every segment is one
`scaled_dot_product_attention(is_causal=True)` call; on CUDA `torch.nn.attention.varlen.varlen_attn`
runs the whole row in one kernel when it loads, else the per-segment path. Position ids restart at
every segment (rotary embeddings). Only lengths matter for compute, so tokens and labels are random.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["PRESETS", "Decoder", "ModelConfig", "RankTimer"]


@dataclass(frozen=True)
class ModelConfig:
    """Shape of the decoder: layers, width (model dim), heads, MLP ratio, vocabulary."""

    layers: int
    width: int
    heads: int
    mlp_ratio: int = 4
    vocab: int = 512

    def describe(self) -> str:
        c = self
        return f"{c.layers} layers, width {c.width}, {c.heads} heads, mlp {c.mlp_ratio}x, vocab {c.vocab}"


PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(layers=1, width=64, heads=2),  # tests and --quick
    "cpu": ModelConfig(layers=2, width=64, heads=2, mlp_ratio=8),  # the default CPU run (~10 min on 2 cores)
    "gpu": ModelConfig(layers=8, width=1024, heads=16),  # --device cuda: a ~100M-parameter model
    # --device cuda: a 7B-class layer (width 4096, 32 heads of 128), two deep. Attention and linear FLOPs per token
    # both scale with depth, so their ratio, which sets how much balancing can gain, is a 7B model's.
    "gpu-7b-layer": ModelConfig(layers=2, width=4096, heads=32),
}


def _rope_tables(pos: torch.Tensor, head_dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin (T, 1, head_dim / 2) of the rotary embedding at positions pos (T,): once per row, not per layer."""
    d = head_dim // 2
    inv = 1.0 / (10000.0 ** (torch.arange(d, device=pos.device, dtype=torch.float32) / d))
    ang = pos.to(torch.float32)[:, None] * inv[None, :]
    return ang.cos()[:, None, :].to(dtype), ang.sin()[:, None, :].to(dtype)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding of x (T, H, D) with the row's tables."""
    d = x.shape[-1] // 2
    x1, x2 = x[..., :d], x[..., d:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


@dataclass(frozen=True)
class _Row:
    """What every layer needs of one packed row, made once per micro-batch: one host-to-device copy of
    cu_seqlens (a copy per layer would stall the GPU each time), its longest segment, the rotary tables."""

    cu: Sequence[int]
    cu_t: torch.Tensor | None  # on the device, for the varlen kernel
    longest: int
    cos: torch.Tensor
    sin: torch.Tensor


def _varlen() -> Callable[..., torch.Tensor] | None:
    """torch's causal variable-length attention, or None where this torch has none.

    torch 2.10 takes `is_causal=True`; later releases `window_size=(-1, 0)` (left unbounded, right 0).
    """
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    if "window_size" in inspect.signature(varlen_attn).parameters:
        return functools.partial(varlen_attn, window_size=(-1, 0))
    return functools.partial(varlen_attn, is_causal=True)


class _Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.ln1 = nn.LayerNorm(cfg.width)
        self.qkv = nn.Linear(cfg.width, 3 * cfg.width, bias=False)
        self.proj = nn.Linear(cfg.width, cfg.width, bias=False)
        self.ln2 = nn.LayerNorm(cfg.width)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.width, cfg.mlp_ratio * cfg.width, bias=False),
            nn.GELU(),
            nn.Linear(cfg.mlp_ratio * cfg.width, cfg.width, bias=False),
        )

    def forward(self, x: torch.Tensor, row: _Row, varlen: Callable[..., torch.Tensor] | None) -> torch.Tensor:
        t, w = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(t, 3, self.heads, w // self.heads).unbind(1)
        q, k = _rope(q, row.cos, row.sin), _rope(k, row.cos, row.sin)
        if varlen is not None:
            q, k, v = (z.contiguous() for z in (q, k, v))
            att = varlen(q, k, v, row.cu_t, row.cu_t, row.longest, row.longest)
        else:  # one causal SDPA call per segment on (1, H, L, D) slices: 4-D, or SDPA takes its O(L^2)-memory math path
            qh, kh, vh = (z.transpose(0, 1).unsqueeze(0) for z in (q, k, v))
            outs = [
                F.scaled_dot_product_attention(qh[:, :, a:b], kh[:, :, a:b], vh[:, :, a:b], is_causal=True)
                for a, b in itertools.pairwise(row.cu)
            ]
            att = (outs[0] if len(outs) == 1 else torch.cat(outs, 2))[0].transpose(0, 1)
        x = x + self.proj(att.reshape(t, w))
        return x + self.mlp(self.ln2(x))


class Decoder(nn.Module):
    """Embedding, `layers` pre-LN blocks, tied LM head; forward returns the mean next-token loss of a row."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        if cfg.width % cfg.heads or (cfg.width // cfg.heads) % 2:
            raise ValueError(f"width {cfg.width} must split into {cfg.heads} heads of an even size")
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab, cfg.width)
        self.blocks = nn.ModuleList(_Block(cfg) for _ in range(cfg.layers))
        self.ln = nn.LayerNorm(cfg.width)
        self.varlen: Callable[..., torch.Tensor] | None = None

    def forward(self, ids: torch.Tensor, labels: torch.Tensor, pos: torch.Tensor, cu: Sequence[int]) -> torch.Tensor:
        x = self.embed(ids)
        cos, sin = _rope_tables(pos, self.cfg.width // self.cfg.heads, x.dtype)
        cu_t = torch.tensor(cu, dtype=torch.int32, device=x.device) if self.varlen is not None else None
        row = _Row(cu, cu_t, int(np.diff(cu).max()), cos, sin)
        for blk in self.blocks:
            x = blk(x, row, self.varlen)
        logits = self.ln(x) @ self.embed.weight.T
        return F.cross_entropy(logits.float(), labels)


class RankTimer:
    """Times forward + backward of one rank's micro-batches (gradient accumulation), one rank at a time.

    `lengths` of a micro-batch are its segments' token counts: the row is their concatenation, with
    cu_seqlens at their boundaries and positions restarting at each. Returns seconds per micro-batch.
    """

    def __init__(self, cfg: ModelConfig, device: str = "cpu", seed: int = 0) -> None:
        torch.manual_seed(seed)
        self.device = torch.device(device)
        self.dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        self.model = Decoder(cfg).to(self.device, self.dtype)
        self.attention = "sdpa-per-segment"  # what warm_up found to run: "varlen" where torch's kernel loads
        self.varlen_error: str | None = None
        if self.device.type == "cuda":
            self.model.varlen = _varlen()
            self.attention = "varlen" if self.model.varlen is not None else self.attention
        self.gen = torch.Generator().manual_seed(seed)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def micro_batch(self, lengths: Sequence[int]) -> float:
        """Seconds of forward + backward over one packed row of segments of these lengths."""
        lens = np.asarray(lengths, dtype=np.int64)
        lens = lens[lens > 0]
        if len(lens) == 0:
            return 0.0
        total = int(lens.sum())
        cu = np.concatenate([[0], np.cumsum(lens)]).tolist()
        pos = torch.from_numpy(np.arange(total) - np.repeat(np.asarray(cu[:-1]), lens)).to(self.device)
        ids = torch.randint(0, self.model.cfg.vocab, (total,), generator=self.gen).to(self.device)
        labels = torch.randint(0, self.model.cfg.vocab, (total,), generator=self.gen).to(self.device)
        self._sync()
        t0 = time.perf_counter()
        loss = self.model(ids, labels, pos, cu)
        loss.backward()
        self._sync()
        return time.perf_counter() - t0

    def rank(self, micro_batches: Sequence[Sequence[int]]) -> list[float]:
        """Seconds of each micro-batch of one rank's step (gradients accumulate, then are dropped)."""
        out = [self.micro_batch(mb) for mb in micro_batches]
        self.model.zero_grad(set_to_none=True)
        return out

    def warm_up(self, seq_len: int) -> None:
        """One throwaway row (a full sequence and a few short segments): allocator and kernels warm.

        Where the varlen kernel fails here (an unsupported GPU or dtype), the run falls back to one SDPA call
        per segment and says so in `attention` and `varlen_error` rather than stopping.
        """
        try:
            self.rank([[seq_len], [seq_len // 4] * 4])
        except RuntimeError as e:
            if self.model.varlen is None:
                raise
            self.model.varlen, self.attention, self.varlen_error = None, "sdpa-per-segment", repr(e)[:500]
            self.model.zero_grad(set_to_none=True)
            self.rank([[seq_len], [seq_len // 4] * 4])

    def flops_ratio(self, seq_len: int) -> float:
        """Attention FLOPs per token of a full causal sequence of seq_len over linear FLOPs per token (analytic)."""
        c = self.model.cfg
        linear = 2 * c.layers * (4 + 2 * c.mlp_ratio) * c.width**2 + 2 * c.width * c.vocab
        attention = 2 * c.layers * seq_len * c.width  # QK^T and AV over L/2 keys on average
        return attention / linear if linear else math.inf
