"""A HF ``tokenizer.json`` rebuilt from a GGUF file's byte-level BPE metadata (llama.cpp ``tokenizer.ggml.*``)."""

from __future__ import annotations

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from elastiserve.platforms import ConfigError

CONTROL_TOKEN_TYPE = 3  # llama.cpp LLAMA_TOKEN_TYPE_CONTROL
USER_DEFINED_TOKEN_TYPE = 4

# llama.cpp's pre-tokenizer names whose split we reproduce: "smollm" splits digits one by one before GPT-2's
# byte-level regex (the same as SmolLM2's published tokenizer.json: Digits(individual) + ByteLevel).
_DIGIT_SPLIT_PRE = ("smollm",)
_PLAIN_GPT2_PRE = ("gpt-2", "default")


def build_byte_level_bpe(metadata: dict) -> Tokenizer:
    """metadata: ``tokenizer.ggml.*`` keys with python values (tokens: list[str], merges: list[str], ...)."""
    kind = metadata.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ConfigError(f"only byte-level BPE (gpt2) GGUF tokenizers are supported, got {kind!r}")
    pre = metadata.get("tokenizer.ggml.pre", "default")
    if pre not in _DIGIT_SPLIT_PRE + _PLAIN_GPT2_PRE:
        raise ConfigError(f"GGUF pre-tokenizer {pre!r} is not supported (known: {_DIGIT_SPLIT_PRE + _PLAIN_GPT2_PRE})")
    tokens: list[str] = metadata["tokenizer.ggml.tokens"]
    vocab = {token: index for index, token in enumerate(tokens)}
    merges = [tuple(merge.split(" ", 1)) for merge in metadata["tokenizer.ggml.merges"]]
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _DIGIT_SPLIT_PRE:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    else:
        tokenizer.pre_tokenizer = byte_level
    tokenizer.decoder = decoders.ByteLevel()
    token_types = metadata.get("tokenizer.ggml.token_type") or []
    # Control tokens (<|im_start|>, ...) must match whole in text and be skippable when decoding.
    special = [tokens[i] for i, kind in enumerate(token_types) if kind == CONTROL_TOKEN_TYPE]
    user = [tokens[i] for i, kind in enumerate(token_types) if kind == USER_DEFINED_TOKEN_TYPE]
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])
    if tokenizer.get_vocab_size() != len(tokens):
        raise ConfigError(f"rebuilt tokenizer has {tokenizer.get_vocab_size()} tokens, the GGUF lists {len(tokens)}")
    return tokenizer


def tokenizer_config_from_gguf(metadata: dict) -> dict:
    """The tokenizer_config.json fields our Tokenizer and transformers read (special tokens, chat template)."""
    tokens = metadata["tokenizer.ggml.tokens"]

    def token(key: str) -> str | None:
        index = metadata.get(f"tokenizer.ggml.{key}")
        return tokens[index] if index is not None else None

    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token("bos_token_id"),
        "eos_token": token("eos_token_id"),
        "unk_token": token("unknown_token_id"),
        "pad_token": token("padding_token_id"),
        "add_bos_token": bool(metadata.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(metadata.get("tokenizer.ggml.add_eos_token", False)),
        "chat_template": metadata.get("tokenizer.chat_template"),
        "model_max_length": int(metadata.get("context_length", 8192)),
        "clean_up_tokenization_spaces": False,
    }
