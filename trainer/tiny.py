"""Tiny random causal LMs of every family contract.families supports (Llama, Qwen2, Qwen3,
Mistral, Gemma, Gemma-2, Gemma-3, Phi-3, OLMo, OLMo-2, Granite, Cohere, StarCoder2,
GLM, GLM-4, Helium, SmolLM3, Phi, GPT-NeoX, OLMo-3, Cohere-2, EXAONE-4, Ministral, Arcee, Apertus,
Hunyuan, ERNIE-4.5, VaultGemma, Persimmon, GPT-J, GPT-Neo, CodeGen, GPTBigCode (StarCoder-1,
SantaCoder), Seed-OSS, StableLM, Nemotron) with a locally trained BPE tokenizer.

Used by tests, the demo run and benchmarks: no hub exists, so everything is saved to a local
directory and loaded back with `from_pretrained`. `python -m trainer.tiny --family llama --out DIR`.
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

import torch

FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "gemma", "gemma2", "phi3", "olmo2", "granite",
            "cohere", "gemma3_text", "starcoder2", "glm", "helium", "smollm3", "olmo",
            "phi", "gpt_neox", "olmo3", "cohere2", "glm4", "exaone4", "ministral", "arcee",
            "apertus", "hunyuan_v1_dense", "ernie4_5", "vaultgemma", "persimmon", "gptj",
            "gpt_neo", "codegen", "gpt_bigcode", "seed_oss", "stablelm",
            "nemotron")

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
SPECIAL_TOKENS = ["<|pad|>", "<|bos|>", "<|eos|>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>"]

_WORDS = (
    "the a an of to in is was for on that with as by at from it this be are or which "
    "model train loss data adapter rank learning rate batch step job task token gradient "
    "cat dog house tree river mountain city blue red green small large quick slow happy "
    "one two three four five six seven eight nine ten answer question please thanks yes no"
).split()


def synthetic_corpus(n_lines: int = 400, seed: int = 0) -> list[str]:
    """Deterministic word-salad lines (enough to train a small BPE vocabulary)."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(_WORDS) for _ in range(rng.randint(4, 16))) for _ in range(n_lines)]


def train_tokenizer(vocab_size: int = 384, seed: int = 0, chat_template: bool = True):  # noqa: ANN201
    """A byte-level BPE tokenizer trained on the synthetic corpus, as a PreTrainedTokenizerFast."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(synthetic_corpus(seed=seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|eos|>", pad_token="<|pad|>",
    )
    if chat_template:
        fast.chat_template = CHAT_TEMPLATE
    return fast


def tiny_config(family: str, vocab_size: int, hidden: int = 64, layers: int = 2):  # noqa: ANN201, C901 (a table: one branch per family)
    """A transformers config of the family, small enough for CPU tests, keeping what makes the
    family itself: Gemma's tied and scaled embeddings; Gemma-2's soft-caps (final logit cap 3.0,
    with weights drawn wide enough that raw logits reach past it, so the cap changes the loss)
    and its alternating sliding-window layers; Mistral's sliding window (both windows 16,
    shorter than the test sequences); Qwen3's q/k norms; Phi-3's fused qkv_proj and gate_up_proj;
    the others' own norms, partial or missing rotary, biases, multipliers and logit scales (see
    each branch)."""
    from transformers import (
        ApertusConfig,
        ArceeConfig,
        CodeGenConfig,
        Cohere2Config,
        CohereConfig,
        Ernie4_5Config,
        Exaone4Config,
        Gemma2Config,
        Gemma3TextConfig,
        GemmaConfig,
        Glm4Config,
        GlmConfig,
        GPTBigCodeConfig,
        GPTJConfig,
        GPTNeoConfig,
        GPTNeoXConfig,
        GraniteConfig,
        HeliumConfig,
        HunYuanDenseV1Config,
        LlamaConfig,
        MinistralConfig,
        MistralConfig,
        NemotronConfig,
        Olmo2Config,
        Olmo3Config,
        OlmoConfig,
        PersimmonConfig,
        Phi3Config,
        PhiConfig,
        Qwen2Config,
        Qwen3Config,
        SeedOssConfig,
        SmolLM3Config,
        StableLmConfig,
        Starcoder2Config,
        VaultGemmaConfig,
    )

    heads = 4
    common = dict(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=2,
        max_position_embeddings=512, tie_word_embeddings=False,
    )
    if family == "llama":
        return LlamaConfig(**common)
    if family == "qwen2":
        return Qwen2Config(**common)
    if family == "qwen3":  # its default head_dim (128) is not hidden / heads
        return Qwen3Config(**common, head_dim=hidden // heads)
    if family == "mistral":
        return MistralConfig(**common, sliding_window=16)
    # Gemma's defaults are the 2B/7B shapes (head_dim 256, tied embeddings): keep the tying,
    # shrink the head to the tiny width
    gemma = {**common, "tie_word_embeddings": True, "head_dim": hidden // heads}
    # windowed layers between global ones (Gemma-2/3, OLMo-3, Cohere-2, EXAONE-4, ...)
    alternating = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
    if family == "gemma":
        return GemmaConfig(**gemma)
    if family == "gemma2":
        return Gemma2Config(
            **gemma, query_pre_attn_scalar=hidden // heads, final_logit_softcapping=3.0,
            attn_logit_softcapping=50.0, sliding_window=16, initializer_range=0.2,
            layer_types=alternating,
        )
    # most configs' default special-token ids lie outside a tiny vocabulary (make_tiny_model sets
    # the tokenizer's): these are its pad, bos and eos
    ids = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
    if family == "phi3":
        # original_max_position_embeddings matches so no long-rope scaling applies
        return Phi3Config(**common, **ids, original_max_position_embeddings=512, sliding_window=None)
    if family == "gemma3_text":
        # Gemma-3: q/k norms, local layers with their own rope base (rope_parameters per layer
        # type), one global layer in two here (the 5:1 pattern needs 6 layers)
        return Gemma3TextConfig(
            **gemma, **ids, query_pre_attn_scalar=hidden // heads, sliding_window=16,
            layer_types=alternating,
        )
    if family == "olmo2":  # q/k norms over the whole projection, norms after attention and MLP
        return Olmo2Config(**common, **ids)
    if family == "olmo":  # parameter-free LayerNorm, q/k/v clipped (OLMo-1.7's clip_qkv)
        return OlmoConfig(**common, **ids, clip_qkv=8.0)
    if family == "granite":
        # Granite-3's multipliers: embeddings x12, residual branches x0.22, attention scale,
        # logits divided by logits_scaling (weights drawn wide enough that the division changes
        # the loss); tied embeddings
        return GraniteConfig(
            **{**common, "tie_word_embeddings": True}, **ids, embedding_multiplier=12.0,
            residual_multiplier=0.22, attention_multiplier=1.0 / (hidden // heads),
            logits_scaling=8.0, initializer_range=0.1,
        )
    if family == "cohere":
        # Cohere: parallel attention and MLP off one LayerNorm, interleaved rotary, q/k norms
        # (Command-R+), tied embeddings, logits multiplied by logit_scale (weights wide enough
        # that it changes the loss)
        return CohereConfig(**{**common, "tie_word_embeddings": True}, **ids, use_qk_norm=True,
                            logit_scale=0.25, initializer_range=0.2)
    if family == "starcoder2":
        # StarCoder2: LayerNorm, biases everywhere, a plain GELU MLP (c_fc / c_proj), a
        # sliding window shorter than the test sequences (weights drawn wide enough that it
        # changes the loss), tied embeddings
        return Starcoder2Config(**{**common, "tie_word_embeddings": True}, **ids, use_bias=True,
                                sliding_window=16, initializer_range=0.1)
    if family == "glm":
        # GLM-4: fused gate_up_proj, q/k/v biases, half of each head rotated (interleaved)
        return GlmConfig(**common, **ids, head_dim=hidden // heads, attention_bias=True)
    if family == "helium":
        return HeliumConfig(**common, **ids, head_dim=hidden // heads)
    if family == "smollm3":
        # SmolLM3: every few layers without rotary (NoPE; here the second), tied embeddings
        return SmolLM3Config(**{**common, "tie_word_embeddings": True}, **ids,
                             no_rope_layers=[1 if i % 2 == 0 else 0 for i in range(layers)])
    if family == "phi":
        # Phi-2: LayerNorm, one parallel block, half of each head rotated, q/k/v/dense/fc1/fc2
        # with biases, an LM head with a bias
        return PhiConfig(**common, **ids)
    if family == "gpt_neox":
        # Pythia: fused query_key_value, a quarter of each head rotated, parallel residual (no
        # grouped-query heads)
        return GPTNeoXConfig(
            vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden,
            num_hidden_layers=layers, num_attention_heads=heads, max_position_embeddings=512,
            tie_word_embeddings=False, **ids,
        )
    # sliding-window models: windows of 16 (shorter than the test sequences) and weights drawn
    # wide enough (initializer_range 0.1 or more) that the window changes the loss
    if family == "olmo3":  # OLMo-2's norms, sliding-window layers between global ones
        return Olmo3Config(**common, **ids, sliding_window=16, layer_types=alternating,
                           initializer_range=0.1)
    if family == "cohere2":
        # Command-R7B: Cohere's block and logit scale (wide weights, see cohere), sliding-window
        # layers with rotary between global layers without it
        return Cohere2Config(**{**common, "tie_word_embeddings": True}, **ids, logit_scale=0.25,
                             initializer_range=0.2, sliding_window=16, layer_types=alternating)
    if family == "glm4":  # GLM's fused gate_up_proj and partial rotary, norms after each block
        return Glm4Config(**common, **ids, head_dim=hidden // heads, attention_bias=True)
    if family == "exaone4":  # q/k norms, norms after each block, sliding and global layers
        return Exaone4Config(**common, **ids, sliding_window=16, layer_types=alternating,
                             initializer_range=0.1)
    if family == "ministral":  # Ministral-8B: interleaved sliding-window and global layers
        return MinistralConfig(**common, **ids, head_dim=hidden // heads, sliding_window=16,
                               layer_types=alternating, initializer_range=0.1)
    if family == "arcee":  # AFM: ReLU^2 MLP without a gate
        return ArceeConfig(**common, **ids, head_dim=hidden // heads)
    if family == "apertus":
        # xIELU MLP without a gate, q/k norms, llama3 rope scaling (its positions as the 8B's)
        return ApertusConfig(**{**common, "max_position_embeddings": 65536}, **ids,
                             head_dim=hidden // heads)
    if family == "hunyuan_v1_dense":  # q/k norms
        return HunYuanDenseV1Config(**common, **ids, head_dim=hidden // heads)
    if family == "ernie4_5":  # interleaved rotary, tied embeddings
        return Ernie4_5Config(**{**common, "tie_word_embeddings": True}, **ids,
                              head_dim=hidden // heads)
    if family == "vaultgemma":
        # Gemma-2's soft-caps (its checkpoints' 30 / 50) and alternating windows, no post-norms
        return VaultGemmaConfig(**gemma, **ids, query_pre_attn_scalar=hidden // heads,
                                sliding_window=16, layer_types=alternating,
                                initializer_range=0.1)
    if family == "seed_oss":
        # Seed-OSS: q/k/v biases (no output bias), its checkpoints' attention and residual
        # dropout 0.1 (the engine turns them off)
        return SeedOssConfig(**common, **ids, head_dim=hidden // heads, attention_bias=True,
                             attention_dropout=0.1, residual_dropout=0.1)
    if family == "stablelm":
        # StableLM-2-12B's block: LayerNorm, q/k/v biases, per-head q/k LayerNorms, a quarter of
        # each head rotated, parallel attention and MLP
        return StableLmConfig(**common, **ids, use_qkv_bias=True, qk_layernorm=True,
                              use_parallel_residual=True)
    if family == "nemotron":
        # Nemotron-4 / Minitron: LayerNorm with a zero-centred weight (1 + w), half of each head
        # rotated, a squared-ReLU MLP without a gate
        return NemotronConfig(**common, **ids, head_dim=hidden // heads)
    if family == "persimmon":
        # fused query_key_value, per-head q/k LayerNorms, half of each head rotated, ReLU^2
        return PersimmonConfig(**{k: v for k, v in common.items() if k != "num_key_value_heads"},
                               **ids, qk_layernorm=True)
    # the GPT-2-era configs: no grouped-query heads, their own size names
    gpt2_era = dict(vocab_size=vocab_size, n_embd=hidden, n_layer=layers, n_head=heads,
                    n_inner=2 * hidden, n_positions=512, tie_word_embeddings=False, **ids)
    if family == "gptj":  # one parallel block, a quarter of each head rotated (interleaved)
        return GPTJConfig(**gpt2_era, rotary_dim=(hidden // heads) // 4)
    if family == "codegen":  # GPT-J's block with q/k/v fused into qkv_proj
        return CodeGenConfig(**gpt2_era, n_ctx=512, rotary_dim=(hidden // heads) // 4)
    if family == "gpt_bigcode":
        # StarCoder-1 / SantaCoder: multi-query attention (one key/value head) fused into
        # c_attn, learned absolute positions, c_proj in both attention and MLP, dropouts 0.1
        return GPTBigCodeConfig(**gpt2_era, multi_query=True, attn_pdrop=0.1, resid_pdrop=0.1,
                                embd_pdrop=0.1)
    if family == "gpt_neo":
        # learned absolute positions, global and local (windowed) attention layers, no 1/sqrt(d)
        # attention scaling, tied embeddings
        return GPTNeoConfig(vocab_size=vocab_size, hidden_size=hidden, num_layers=layers,
                            num_heads=heads, intermediate_size=2 * hidden,
                            max_position_embeddings=512, window_size=16,
                            attention_types=[[["global", "local"], layers // 2]],
                            initializer_range=0.1, **ids)
    raise ValueError(f"unknown family {family!r}; expected one of {FAMILIES}")


def make_tiny_model(
    family: str, out_dir: str | Path, seed: int = 0, hidden: int = 64, layers: int = 2,
    chat_template: bool = True,
) -> Path:
    """Save a random tiny model of `family` plus its tokenizer to `out_dir`; returns the path."""
    from transformers import AutoModelForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(seed=seed, chat_template=chat_template)
    cfg = tiny_config(family, len(tokenizer), hidden=hidden, layers=layers)
    cfg.bos_token_id = tokenizer.bos_token_id
    cfg.eos_token_id = tokenizer.eos_token_id
    cfg.pad_token_id = tokenizer.pad_token_id
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--family", choices=FAMILIES, default="llama")
    parser.add_argument("--out", required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    args = parser.parse_args(argv)
    path = make_tiny_model(args.family, args.out, args.seed, args.hidden, args.layers)
    print(f"saved tiny {args.family} model to {path}")


if __name__ == "__main__":
    main()
