"""Architecture facts of a transformer model and what follows from them.

`ModelArch` is what the planner needs to know about a model: the shapes from its
Hugging Face `config.json` plus how its weights are stored. Parsing configs lives
in `inference.hf_config`; this module only holds the facts and the arithmetic.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

# Bytes per element of the dtypes vLLM accepts for weights and the KV cache.
DTYPE_BYTES: dict[str, float] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "fp8": 1,
    "int8": 1,
}


@dataclass(frozen=True)
class ModelArch:
    """Shapes of a decoder-only transformer and the storage of its weights."""

    model_type: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool
    max_position_embeddings: int
    weight_dtype: str = "float16"
    quantization: str | None = None  # "gptq", "awq", "fp8", … or None
    quant_bits: int | None = None
    quant_group_size: int | None = None
    attention_bias: bool = False  # Qwen2 has q/k/v biases

    # Parameter counts. A gated MLP (gate, up, down) is what Llama, Qwen2 and
    # Gemma2 use; norms are counted too although they are negligible.
    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def lm_head_params(self) -> int:
        return 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size

    @property
    def attention_params_per_layer(self) -> int:
        q = self.hidden_size * self.num_attention_heads * self.head_dim
        kv = 2 * self.hidden_size * self.num_kv_heads * self.head_dim
        o = self.num_attention_heads * self.head_dim * self.hidden_size
        bias = (self.num_attention_heads + 2 * self.num_kv_heads) * self.head_dim
        return q + kv + o + (bias if self.attention_bias else 0)

    @property
    def mlp_params_per_layer(self) -> int:
        return 3 * self.hidden_size * self.intermediate_size

    @property
    def linear_params(self) -> int:
        """Parameters in the transformer blocks' linear layers: what GPTQ/AWQ quantize."""
        return self.num_layers * (self.attention_params_per_layer + self.mlp_params_per_layer)

    @property
    def param_count(self) -> int:
        norms = (2 * self.num_layers + 1) * self.hidden_size
        return self.embedding_params + self.lm_head_params + self.linear_params + norms

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["param_count"] = self.param_count
        return data
