"""Each vocabulary token's bytes, as the detokenizer would emit them (None for special tokens, which guided output
never contains).

Byte-level BPE vocabularies (GPT-2's scheme, SmolLM2's, Llama 3's, Qwen's) spell each byte as one printable
character; inverting that table gives the exact bytes, including tokens that are only part of a UTF-8 character.
SentencePiece vocabularies spell a space as U+2581 and bytes as ``<0xAB>``.
"""

from __future__ import annotations

import json
from typing import Any


def _byte_level_table() -> dict[str, int]:
    """GPT-2's byte -> printable character mapping, inverted."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = list(printable)
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


def _is_byte_level(backend: Any) -> bool:
    if type(getattr(backend, "decoder", None)).__name__ == "ByteLevel":
        return True
    try:  # a Sequence decoder: look inside it
        decoder = json.loads(backend.to_str()).get("decoder") or {}
    except (AttributeError, ValueError):
        return False
    kinds = {decoder.get("type")} | {d.get("type") for d in decoder.get("decoders", []) or []}
    return "ByteLevel" in kinds


def _special_ids(backend: Any) -> set[int]:
    decoder = getattr(backend, "get_added_tokens_decoder", None)
    if decoder is None:
        return set()
    return {i for i, token in decoder().items() if getattr(token, "special", False)}


def vocabulary_bytes(tokenizer: Any, vocab_size: int) -> list[bytes | None]:
    """``vocab_size`` entries (ids past the tokenizer's vocabulary are None). ``tokenizer`` is the engine's
    ``Tokenizer`` (an HF ``tokenizers`` backend) or anything with a ``token_bytes()`` list."""
    own = getattr(tokenizer, "token_bytes", None)
    if own is not None:
        table = list(own())
        return (table + [None] * vocab_size)[:vocab_size]
    backend = tokenizer.backend
    special = _special_ids(backend)
    byte_level = _is_byte_level(backend)
    inverse = _byte_level_table() if byte_level else {}
    out: list[bytes | None] = [None] * vocab_size
    for token_id in range(min(vocab_size, backend.get_vocab_size(with_added_tokens=True))):
        if token_id in special:
            continue
        piece = backend.id_to_token(token_id)
        if piece is None:
            continue
        if byte_level and all(ch in inverse for ch in piece):
            out[token_id] = bytes(inverse[ch] for ch in piece)
        elif len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            out[token_id] = bytes([int(piece[3:5], 16)])
        else:
            out[token_id] = piece.replace("\u2581", " ").encode()
    return out
