"""One decoder for every supported family (Llama, Mistral, Qwen2/3, Gemma 2/3, Phi-3, and the
MoE ones through `moe.SparseMoE`) over the paged KV cache.

Families differ only through `ModelConfig`: qkv bias, per-head q/k norms, tied embeddings,
RoPE scaling and per-layer bases, sliding windows, soft-capping, Gemma's sandwich norms and
scaled embeddings. q/k/v and gate/up are fused into single matmuls; `checkpoint.py` maps the
Hugging Face tensors onto them. Every layer writes its new K/V into the cache first and then
attends from the cache, so a prefix-cache hit and a miss compute from identical inputs.
Past the last layer's K/V write only the rows whose output is wanted go on (`OutputRows`):
a 2,000-token prompt samples from one row, and the other 1,999 rows' attention, o-proj and
MLP in the last layer would be thrown away (llama.cpp skips the same rows).

`pack_weights()` (called by the loader) moves bf16 and fp32 CPU matmuls onto packed weights
with fused epilogues (`gemm`: our kernel's layout, or oneDNN's where it cannot be built) and
frees the unpacked matmul weights, so the model holds one copy; other dtypes and devices keep
their parameters and use `F.linear`.

LoRA adapters (`lora_layers`) add their low-rank products to the fused outputs of their rows;
an MLP whose gate/up an adapter in the step targets runs unfused that step.

A GGUF model served quantized (`kvgate.engine.loading.gguf.quantized`) gives whole modules their weights as
`quantized_linear.QuantizedLinear` handles instead, the same `gemm.LinearWeight` interface
over the file's blocks (qkv and o, gate_up and down), which `pack_weights` leaves as they are;
the embedding and the lm_head have their own (`embed_quantized`, `lm_head_quantized`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol, cast

import torch
import torch.nn.functional as F
from torch import nn

import kvgate.engine.cpu_ops as cpu_ops
import kvgate.engine.models.gemm as gemm
from kvgate.engine.attention.backend import TORCH_BACKEND, AttentionBackend
from kvgate.engine.attention.kv_cache import KVCache
from kvgate.engine.attention.metadata import AttentionMetadata, OutputRows
from kvgate.engine.models.lora_layers import LayerLoRA, StepLoRA
from kvgate.engine.models.model_config import ModelConfig
from kvgate.engine.models.moe import SparseMoE
from kvgate.engine.models.params import dense, new_param
from kvgate.engine.models.quantized_linear import QuantizedLinear
from kvgate.engine.models.rope import rope_inv_freq, rope_tables, rotate

__all__ = ["LlamaForCausalLM", "RMSNorm", "rope_inv_freq", "rotate"]


class LayerStack(Protocol):
    """Every layer of a decode step in one call (`kvgate.engine.models.decode_stack`)."""

    def serves(self, x: torch.Tensor) -> bool: ...

    def run(
        self,
        x: torch.Tensor,
        tables: list[tuple[torch.Tensor, torch.Tensor]],
        metadata: AttentionMetadata,
    ) -> torch.Tensor: ...


LayerStackBuilder = Callable[
    ["LlamaForCausalLM", list[KVCache], AttentionBackend], LayerStack | None
]


class RMSNorm(nn.Module):
    """transformers' RMSNorm: float32 statistics, ``x * rsqrt(mean(x^2) + eps)`` rounded once
    to the model dtype, then the weight in the model dtype. On CPU ``F.rms_norm`` is six
    separate ops with fresh temporaries; here rows go through one native call (`cpu_ops`), or
    where it does not apply a decode-sized batch (<= 64 rows) through torch's fused LayerNorm
    kernel over ``[x, -x]`` (mean 0, variance ``mean(x^2)``: its first half is the normalized
    ``x``), and larger ones through the formula with few temporaries. Gemma's
    ``(1 + weight)`` is folded into the stored weight at load time (`checkpoint.py`)."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        self.eps = eps
        self.weight = new_param(size, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and (out := cpu_ops.rms_norm(x, self.weight, self.eps)) is not None:
            return out
        size = x.shape[-1]
        if x.numel() <= 64 * size:
            both = torch.cat((x, -x), dim=-1)
            return F.layer_norm(both, (2 * size,), eps=self.eps)[..., :size] * self.weight
        xf = x.float()
        scale = xf.square().mean(-1, keepdim=True).add_(self.eps).rsqrt_()
        return (xf * scale).to(x.dtype).mul_(self.weight)  # xf may be x itself (fp32)


def _norm(config: ModelConfig, dtype: torch.dtype, device: torch.device | str) -> RMSNorm:
    return RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)


class Attention(nn.Module):
    def __init__(
        self, config: ModelConfig, layer: int, dtype: torch.dtype, device: torch.device | str
    ):
        super().__init__()
        self.num_heads, self.num_kv_heads = config.num_heads, config.num_kv_heads
        self.head_dim = config.head_dim
        self.sizes = [config.q_size, config.kv_size, config.kv_size]
        self.scale = config.scale
        self.window = config.window(layer)
        self.softcap = config.attn_softcap
        self.qkv_weight: nn.Parameter | None = new_param(
            sum(self.sizes), config.hidden_size, dtype=dtype, device=device
        )
        self.qkv_bias = (
            new_param(sum(self.sizes), dtype=dtype, device=device)
            if config.attention_bias
            else None
        )
        self.o_weight: nn.Parameter | None = new_param(
            config.hidden_size, config.q_size, dtype=dtype, device=device
        )
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if config.qk_norm:  # per head, before RoPE (Qwen3, Gemma 3)
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps, dtype, device)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps, dtype, device)
        self.packed: dict[str, gemm.LinearWeight] = {}  # "qkv" and "o", or nothing

    def pack_weights(self) -> None:
        """Replace the weights by packed copies; the forward then reads only those."""
        if self.packed:  # quantized blocks from a GGUF file
            return
        self.packed = {
            "qkv": gemm.pack(dense(self.qkv_weight)),
            "o": gemm.pack(dense(self.o_weight)),
        }
        self.qkv_weight = self.o_weight = None

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: KVCache,
        metadata: AttentionMetadata,
        backend: AttentionBackend,
        lora: LayerLoRA | None = None,
        outputs: OutputRows | None = None,
    ) -> torch.Tensor:
        """``residual`` plus the attention output (the output alone when it is None), of
        ``outputs``' rows only where given (``residual`` then holds just those)."""
        tokens, q_size, kv_size = x.shape[0], self.sizes[0], self.sizes[1]
        packed = self.packed
        if packed:
            qkv = packed["qkv"].linear(x, self.qkv_bias)
        else:
            qkv = F.linear(x, dense(self.qkv_weight), self.qkv_bias)
        if lora is not None:
            lora.add(qkv, x, "qkv")
        heads = self.num_heads
        qk = qkv[:, : q_size + kv_size].view(tokens, heads + self.num_kv_heads, -1)
        if self.q_norm is not None and self.k_norm is not None:
            qk = torch.cat((self.q_norm(qk[:, :heads]), self.k_norm(qk[:, heads:])), dim=1)
        rotated = cpu_ops.rope(qk, heads, cos[:, 0], sin[:, 0])  # one call: q and k contiguous
        if rotated is None:
            qk = rotate(qk, cos, sin)  # q and k heads rotated together
            rotated = qk[:, :heads], qk[:, heads:]
        q, k = rotated
        v = qkv[:, q_size + kv_size :].view(tokens, self.num_kv_heads, self.head_dim)
        backend.write_kv(kv_cache, k, v, metadata.slot_mapping)
        if outputs is not None:
            q, metadata = q.index_select(0, outputs.rows), outputs.metadata
            lora = None if lora is None else lora.select(outputs.rows)
        out = q  # no row wanted (a prompt's chunk before its last): nothing to attend
        if q.shape[0]:
            out = backend.paged_attention(
                q.contiguous(),
                kv_cache,
                metadata,
                self.scale,
                window=self.window,
                softcap=self.softcap,
            )
        out = out.reshape(q.shape[0], q_size)
        if residual is None:
            y = packed["o"].linear(out) if packed else F.linear(out, dense(self.o_weight))
        elif packed:
            y = packed["o"].linear_add(out, residual)
        else:
            y = residual + F.linear(out, dense(self.o_weight))
        return y if lora is None else lora.add(y, out, "o")


class MLP(nn.Module):
    def __init__(
        self, config: ModelConfig, size: int, dtype: torch.dtype, device: torch.device | str
    ):
        super().__init__()
        hidden = config.hidden_size
        self.gelu = config.hidden_act == "gelu_pytorch_tanh"  # GeGLU (Gemma), else SwiGLU
        self.gate_up_weight: nn.Parameter | None = new_param(
            2 * size, hidden, dtype=dtype, device=device
        )
        self.down_weight: nn.Parameter | None = new_param(hidden, size, dtype=dtype, device=device)
        self.packed: dict[str, gemm.LinearWeight] = {}  # "gate_up" and "down", or nothing

    def pack_weights(self) -> None:
        """Replace the weights by packed copies; the forward then reads only those."""
        if self.packed:  # quantized blocks from a GGUF file
            return
        # Gate and up as one pair: act(gate) * up runs in the matmul's epilogue.
        self.packed = {
            "gate_up": gemm.pack(dense(self.gate_up_weight), gated=True),
            "down": gemm.pack(dense(self.down_weight)),
        }
        self.gate_up_weight = self.down_weight = None

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, lora: LayerLoRA | None = None
    ) -> torch.Tensor:
        """``residual`` plus the gated MLP of ``x`` (the MLP alone when it is None)."""
        packed = self.packed
        if not packed or (lora is not None and lora.touches("gate_up", "down")):
            return self._unfused(x, residual, lora)
        hidden = packed["gate_up"].linear_gated(x, "gelu" if self.gelu else "silu")
        if residual is None:
            return packed["down"].linear(hidden)
        return packed["down"].linear_add(hidden, residual)

    def _unfused(
        self, x: torch.Tensor, residual: torch.Tensor | None, lora: LayerLoRA | None
    ) -> torch.Tensor:
        """Gate and up as one output (each adapter's delta added before the activation)."""
        packed = self.packed
        if packed:
            gate_up = packed["gate_up"].linear(x)
        else:
            gate_up = F.linear(x, dense(self.gate_up_weight))
        if lora is not None:
            lora.add(gate_up, x, "gate_up")
        gate, up = gate_up.chunk(2, dim=-1)
        gate = F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)
        hidden = gate * up
        if packed:
            out = packed["down"].linear(hidden)
        else:
            out = F.linear(hidden, dense(self.down_weight))
        if lora is not None:
            lora.add(out, hidden, "down")
        return out if residual is None else residual + out


class DecoderLayer(nn.Module):
    def __init__(
        self, config: ModelConfig, layer: int, dtype: torch.dtype, device: torch.device | str
    ):
        super().__init__()
        self.input_norm = _norm(config, dtype, device)
        self.attn = Attention(config, layer, dtype, device)
        self.post_attention_norm = _norm(config, dtype, device)  # before the MLP
        # Gemma: norms on the attention and MLP outputs too, before their residual adds.
        self.attn_out_norm = _norm(config, dtype, device) if config.sandwich_norms else None
        self.mlp_out_norm = _norm(config, dtype, device) if config.sandwich_norms else None
        if config.is_moe_layer(layer):
            self.mlp: SparseMoE | MLP = SparseMoE(config, dtype, device)
        else:
            self.mlp = MLP(config, config.intermediate_size, dtype, device)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: KVCache,
        metadata: AttentionMetadata,
        backend: AttentionBackend,
        lora: LayerLoRA | None = None,
        outputs: OutputRows | None = None,
    ) -> torch.Tensor:
        """The layer's output: of every row, or of ``outputs``' rows only where given (all rows'
        K/V are written either way)."""
        normed, residual, mlp_lora = self.input_norm(x), x, lora
        if outputs is not None:
            residual = x.index_select(0, outputs.rows)
            mlp_lora = None if lora is None else lora.select(outputs.rows)
        attend = (cos, sin, kv_cache, metadata, backend, lora, outputs)
        attn_out_norm, mlp_out_norm = self.attn_out_norm, self.mlp_out_norm
        if attn_out_norm is None or mlp_out_norm is None:
            x = self.attn(normed, residual, *attend)
            return self._mlp(self.post_attention_norm(x), x, mlp_lora)
        x = residual + attn_out_norm(self.attn(normed, None, *attend))
        out: torch.Tensor = x + mlp_out_norm(self._mlp(self.post_attention_norm(x), None, mlp_lora))
        return out

    def _mlp(
        self, x: torch.Tensor, residual: torch.Tensor | None, lora: LayerLoRA | None
    ) -> torch.Tensor:
        out: torch.Tensor = (
            self.mlp(x, residual)
            if lora is None or isinstance(self.mlp, SparseMoE)  # adapters never target experts
            else self.mlp(x, residual, lora)
        )
        return out


class LlamaForCausalLM(nn.Module):
    """`forward` returns final hidden states [T, hidden]; `compute_logits` projects chosen rows."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        self.config = config
        self.embed_weight: nn.Parameter | None = new_param(
            config.vocab_size, config.hidden_size, dtype=dtype, device=device
        )
        # A ModuleList (registered as submodules), typed as the layers it holds.
        self.layers = cast(
            "Sequence[DecoderLayer]",
            nn.ModuleList(DecoderLayer(config, i, dtype, device) for i in range(config.num_layers)),
        )
        self.norm = _norm(config, dtype, device)
        self.lm_head_weight: nn.Parameter | None = (
            None
            if config.tie_word_embeddings
            else new_param(config.vocab_size, config.hidden_size, dtype=dtype, device=device)
        )
        # Table 0: the global RoPE; table 1 (Gemma 3): the sliding layers' own base.
        thetas = [None] if config.local_rope_theta is None else [None, config.local_rope_theta]
        for index, theta in enumerate(thetas):
            cos, sin = rope_tables(config, config.max_model_len, theta)
            self.register_buffer(f"rope_cos_{index}", cos.to(device, dtype), persistent=False)
            self.register_buffer(f"rope_sin_{index}", sin.to(device, dtype), persistent=False)
        self.num_rope_tables = len(thetas)
        self.layer_rope = [
            1 if len(thetas) > 1 and config.window(i) is not None else 0
            for i in range(config.num_layers)
        ]
        self.lm_head_packed: gemm.LinearWeight | None = None
        self.embed_quantized: QuantizedLinear | None = None  # then embed_weight is None
        self.lm_head_quantized: QuantizedLinear | None = None
        # The decode layers as one native call, built for the caches and backend it serves
        # (by the model runner at start; None where it cannot serve this model).
        self._decode_stack: tuple[list[KVCache], AttentionBackend, LayerStack | None]
        self._decode_stack = ([], TORCH_BACKEND, None)
        # What builds it (`kvgate.engine.models.decode_stack.build`, set by `registry.build_model`):
        # the stack reads this module's layers, so this module does not import it.
        self.build_layer_stack: LayerStackBuilder | None = None

    def pack_weights(self) -> None:
        """Prepack the matmul weights where that helps (bf16 and fp32 on CPU), after loading.

        The unpacked matmul weights are freed (an untied lm_head's too), so the parameters
        left are the embedding and the norms. A tied lm_head is the embedding: in our
        kernel's layout the lookup reads that copy (`NativeLinear.rows`) and the embedding
        is freed as well; oneDNN's layout cannot be read so, and keeps it."""
        if not gemm.packs(self.norm.weight):
            return
        for layer in self.layers:
            layer.attn.pack_weights()
            layer.mlp.pack_weights()
        if self.lm_head_quantized is not None:
            return
        self.lm_head_packed = gemm.pack(self._lm_head_weight())
        self.lm_head_weight = None
        if self.config.tie_word_embeddings and isinstance(self.lm_head_packed, gemm.NativeLinear):
            self.embed_weight = None  # looked up in the packed copy

    def _lm_head_weight(self) -> torch.Tensor:
        return dense(self.embed_weight if self.config.tie_word_embeddings else self.lm_head_weight)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        metadata: AttentionMetadata,
        backend: AttentionBackend,
        lora: StepLoRA | None = None,
        outputs: OutputRows | None = None,
    ) -> torch.Tensor:
        """Final hidden states, of ``outputs``' rows only where given (the last layer computes
        no other past its K/V); ``lora`` adds the adapters of the rows that have one."""
        tables = [
            (
                getattr(self, f"rope_cos_{i}")[positions].unsqueeze(1),
                getattr(self, f"rope_sin_{i}")[positions].unsqueeze(1),
            )
            for i in range(self.num_rope_tables)
        ]
        if self.embed_quantized is not None:
            x = self.embed_quantized.embedding(input_ids, self.norm.weight.dtype)
        elif self.embed_weight is None:  # a tied table, held once in the lm_head's layout
            assert isinstance(self.lm_head_packed, gemm.NativeLinear)
            x = self.lm_head_packed.rows(input_ids)
        else:
            x = F.embedding(input_ids, self.embed_weight)
        if self.config.embed_scale is not None:  # rounded to the model dtype, as transformers does
            x = x * torch.tensor(self.config.embed_scale, dtype=x.dtype)
        if lora is None and outputs is None and metadata.max_query_len == 1:  # decodes alone
            stack = self.decode_stack_for(kv_caches, backend)
            if stack is not None and stack.serves(x):
                x = stack.run(x, tables, metadata)
                hidden: torch.Tensor = self.norm(x)
                return hidden
        last = len(self.layers) - 1
        for i, (layer, kv_cache, rope) in enumerate(
            zip(self.layers, kv_caches, self.layer_rope, strict=True)
        ):
            layer_lora = None if lora is None else lora.layer(i)
            layer_outputs = outputs if i == last else None
            x = layer(x, *tables[rope], kv_cache, metadata, backend, layer_lora, layer_outputs)
        hidden = self.norm(x)
        return hidden

    def decode_stack_for(
        self, kv_caches: list[KVCache], backend: AttentionBackend
    ) -> LayerStack | None:
        """The decode stack over these caches and backend, built once (None: the layers serve)."""
        caches, built_for, stack = self._decode_stack
        if caches is not kv_caches or built_for is not backend:
            build = self.build_layer_stack
            stack = None if build is None else build(self, kv_caches, backend)
            self._decode_stack = (kv_caches, backend, stack)
        return stack

    def compute_logits(self, hidden: torch.Tensor, raw: bool = False) -> torch.Tensor:
        """fp32 logits of ``hidden``'s rows, soft-capped where the model caps them. ``raw``:
        as the lm_head gives them (the model dtype, no fp32 copy) and never capped, for a
        plain argmax (where the model soft-caps, ``raw`` is refused: tanh may tie the top)."""
        if raw and self.config.final_softcap is not None:
            raise ValueError("raw logits of a soft-capped model would not give its argmax")
        if self.lm_head_quantized is not None:
            logits = self.lm_head_quantized.linear(hidden, float_out=True)
        elif self.lm_head_packed is not None:
            logits = self.lm_head_packed.linear(hidden)
        else:
            logits = F.linear(hidden, self._lm_head_weight())
        if raw:
            return logits
        logits = logits.float()
        cap = self.config.final_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap
