"""Loading a causal LM from a local directory, and the small seeded checkpoints the tests and scripts build.

There is no hub access on these machines, so ``make_checkpoint`` writes a real checkpoint (``save_pretrained``:
config.json and safetensors) from a plain transformers config and ``torch.manual_seed``; the servers then load
it exactly as they would load a downloaded one. Anyone can rebuild the same model: same config, same seed.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
VOCAB = 256  # the byte-level tokenizer's ids: one per byte

# Small enough for a 2-core CPU, big enough to have grouped KV heads, several layers and (hybrid) Mamba2 layers.
CHECKPOINTS = {
    "llama": dict(
        architecture="LlamaForCausalLM",
        config=dict(
            vocab_size=VOCAB,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=4,
            num_attention_heads=8,
            num_key_value_heads=4,
            max_position_embeddings=1024,
        ),
    ),
    "bamba": dict(
        architecture="BambaForCausalLM",
        config=dict(
            vocab_size=VOCAB,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            attn_layer_indices=[1, 3],
            mamba_n_heads=4,
            mamba_d_head=16,
            mamba_n_groups=2,
            mamba_d_state=16,
            mamba_d_conv=4,
            mamba_expand=1,
            max_position_embeddings=1024,
        ),
    ),
    # vLLM's hybrid family on its CPU build (vLLM 0.32 has no Bamba): Granite-4.0-H-like, Mamba2 and attention
    # layers, no experts. Head dim 64 and 32 Mamba head dim, as vLLM's CPU kernels need.
    "granite_hybrid": dict(
        architecture="GraniteMoeHybridForCausalLM",
        config=dict(
            vocab_size=VOCAB,
            hidden_size=256,
            intermediate_size=512,
            shared_intermediate_size=512,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            layer_types=["mamba", "attention", "mamba", "attention"],
            num_local_experts=0,
            num_experts_per_tok=0,
            mamba_n_heads=8,
            mamba_d_head=32,
            mamba_n_groups=2,
            mamba_d_state=16,
            mamba_d_conv=4,
            mamba_expand=1,
            position_embedding_type="rope",
            max_position_embeddings=8192,
            initializer_range=0.3,
        ),
    ),
    # DeepSeek-V2-style multi-head latent attention (MLA), dense layers only (first_k_dense_replace = every layer):
    # a latent KV cache of kv_lora_rank + qk_rope_head_dim per token, one "head"; 512 + 64, the one latent size
    # vLLM's CPU MLA kernel compiles for
    "deepseek_mla": dict(
        architecture="DeepseekV2ForCausalLM",
        config=dict(
            vocab_size=VOCAB,
            hidden_size=256,
            intermediate_size=512,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=4,
            kv_lora_rank=512,
            q_lora_rank=None,
            qk_nope_head_dim=64,
            qk_rope_head_dim=64,
            v_head_dim=64,
            first_k_dense_replace=4,
            n_routed_experts=1,
            num_experts_per_tok=1,
            moe_intermediate_size=64,
            max_position_embeddings=8192,
            initializer_range=0.3,
        ),
    ),
}


def make_checkpoint(
    kind: str, directory: str | Path, dtype: str = "float32", seed: int = 0, **overrides: object
) -> Path:
    """Write the ``kind`` checkpoint (a key of CHECKPOINTS), initialised from ``seed``, in ``dtype``; ``overrides``
    change its config (a model that differs from it, as a mismatched ctx/gen pair would)."""
    import transformers

    _quiet()
    spec = CHECKPOINTS[kind]
    architecture = getattr(transformers, spec["architecture"])
    fields = {**spec["config"], **overrides}
    config = architecture.config_class(**fields, eos_token_id=None, bos_token_id=None, pad_token_id=None)
    torch.manual_seed(seed)
    model = architecture(config).to(DTYPES[dtype]).eval()
    directory = Path(directory)
    model.save_pretrained(directory)
    return directory


def load_model(directory: str | Path, dtype: str) -> torch.nn.Module:
    """Any transformers causal LM saved in ``directory`` (safetensors), on the CPU, in eval mode."""
    from transformers import AutoModelForCausalLM

    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r}: one of {', '.join(DTYPES)}")
    _quiet()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return AutoModelForCausalLM.from_pretrained(str(directory), dtype=DTYPES[dtype]).eval()


def _quiet() -> None:
    """No progress bars or advice on stderr: a server's log is for what went wrong."""
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
