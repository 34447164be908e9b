"""Pins the tokenizer rebuilt from the SmolLM2 GGUF metadata.

- Encoding equals transformers' tokenizer built from the same GGUF on a varied sample (digits, code, whitespace
  runs, accents, CJK, emoji, special tokens); decode(encode(text)) == text.
- The chat template renders exactly what transformers' apply_chat_template renders.
- The incremental detokenizer's deltas concatenate to the full decode, also when one character spans tokens.
- Stop strings found incrementally stop where a search of the full decode does.
"""

from __future__ import annotations

import random

import pytest
import transformers

from elastiserve.engine.loader import smollm2_dir, smollm2_gguf_path
from elastiserve.engine.tokenizer import ChatTemplateError, StopStringMatcher, Tokenizer

pytestmark = [pytest.mark.cpu]

SAMPLE = [
    "The capital of France is",
    " leading space and  double  spaces,\ttabs\nand\n\nnewlines   ",
    "Numbers: 12345, 3.14159, 2024-11-30, 1e-5, $1,000,000 and 0x1F",
    "def f(x):\n    return {'a': [x ** 2 for x in range(10)]}  # code",
    "Ünïcödé àccents — “quotes” … naïve café",
    "日本語のテキストと中文字符，한국어 텍스트",
    "emoji 🙂👍🏽🇫🇷 and symbols ∑∫√≠ ©®™",
    "<|im_start|>user\nHello!<|im_end|>\n<|im_start|>assistant\n",
    "I'm sure they're done; we'll see what's left.",
    "",
]

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You answer in one word."},
        {"role": "user", "content": "Capital of Japan?"},
        {"role": "assistant", "content": "Tokyo"},
        {"role": "user", "content": "And of Italy? 🇮🇹"},
    ],
]


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_dir(smollm2_dir())


@pytest.fixture(scope="module")
def reference():
    gguf = smollm2_gguf_path()
    return transformers.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)


@pytest.mark.parametrize("text", SAMPLE)
def test_encode_matches_transformers_and_round_trips(tokenizer, reference, text):
    ids = tokenizer.encode(text)
    assert ids == reference.encode(text, add_special_tokens=True)
    assert tokenizer.decode(ids, skip_special_tokens=False) == text


def test_special_tokens(tokenizer):
    assert tokenizer.vocab_size == 49152
    assert tokenizer.encode("<|im_start|>") == [1] and tokenizer.bos_token_id == 1
    assert tokenizer.eos_token_ids == (2,)  # <|im_end|>, what the instruct model ends a turn with
    assert tokenizer.decode([1, 4093, 2]) == "user"  # special tokens skipped by default
    assert tokenizer.encode("12") == [33, 34]  # SmolLM2 splits digits one by one


@pytest.mark.parametrize("conversation", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(tokenizer, reference, conversation, add_generation_prompt):
    ours = tokenizer.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt)
    expected = reference.apply_chat_template(conversation, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert ours == expected
    assert ours.endswith("<|im_start|>assistant\n") == add_generation_prompt


def test_chat_template_default_system_prompt(tokenizer):
    text = tokenizer.apply_chat_template(CONVERSATIONS[0])
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")


def test_missing_chat_template_raises(tokenizer):
    bare = Tokenizer(tokenizer.backend, {"eos_token": "<|im_end|>"})
    with pytest.raises(ChatTemplateError):
        bare.apply_chat_template(CONVERSATIONS[0])


@pytest.mark.parametrize("text", [SAMPLE[4], SAMPLE[5], SAMPLE[6], "a🙂b\U0001f3fd日x"])
def test_incremental_detokenizer_equals_full_decode(tokenizer, text):
    prompt = tokenizer.encode("Say it: ")
    output = tokenizer.encode(text)
    detok = tokenizer.detokenizer(prompt)
    deltas = [detok.add([token]) for token in output]
    assert "\ufffd" not in "".join(deltas)  # no half characters were ever streamed
    assert "".join(deltas) + detok.flush() == tokenizer.decode(output) == text
    multi_byte_split = any(
        "\ufffd" in tokenizer.decode([token]) for token in output
    )  # the sample really has a character spread over tokens (else the test would not exercise the hold-back)
    assert multi_byte_split or text == SAMPLE[4]


def test_incremental_detokenizer_in_chunks_and_special_tokens(tokenizer):
    output = tokenizer.encode("Paris 🇫🇷 est la capitale.<|im_end|>")
    detok = tokenizer.detokenizer()
    chunks = [output[i : i + 3] for i in range(0, len(output), 3)]
    text = "".join(detok.add(chunk) for chunk in chunks) + detok.flush()
    assert text == tokenizer.decode(output) == "Paris 🇫🇷 est la capitale."


def naive_stop_cut(tokenizer, output_ids, stops):
    """What the engine did before: decode the whole output each step and search all of it."""
    text = tokenizer.decode(output_ids)
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return (min(hits), text[: min(hits)]) if hits else (None, None)


@pytest.mark.parametrize("seed", range(12))
def test_stop_string_matcher_equals_the_full_decode_search(tokenizer, seed):
    """Token by token, the incremental matcher stops at the same step and cuts the same text as searching the full
    decode, for stop strings taken from the text itself (so they do occur, often across token boundaries, including
    multi-byte characters)."""
    rng = random.Random(seed)
    text = rng.choice([t for t in SAMPLE if len(t) > 8]) * 3
    ids = tokenizer.encode(text, add_special_tokens=False)
    full = tokenizer.decode(ids)
    start = rng.randrange(len(full) // 3, len(full) - 4)
    stops = [full[start : start + rng.randint(1, 6)], "\x00never"]
    matcher = StopStringMatcher(tokenizer, stops)
    for n in range(1, len(ids) + 1):
        want_cut, want_text = naive_stop_cut(tokenizer, ids[:n], stops)
        stopped = matcher.add(ids[:n])
        if want_cut is not None or stopped:
            assert stopped and want_cut is not None and matcher.text == want_text, (n, stops)
            break
    else:
        pytest.fail(f"no stop found for {stops!r}")


def test_released_text_is_not_searched_for_stop_strings(tokenizer):
    """Below ``min_tokens`` the engine releases the output without a stop search (``StopStringMatcher.release``):
    a stop string inside it does not stop the request later, one after it does, and the text is whole."""
    ids = tokenizer.encode("one two three. one two three. four", add_special_tokens=False)
    full = tokenizer.decode(ids)
    first_dot = next(k for k in range(1, len(ids) + 1) if "." in tokenizer.decode(ids[:k]))
    matcher = StopStringMatcher(tokenizer, ["."])
    matcher.release(ids[:first_dot])
    stopped_at = next(k for k in range(first_dot + 1, len(ids) + 1) if matcher.add(ids[:k]))
    second_dot = full.index(".", full.index(".") + 1)
    assert "." in tokenizer.decode(ids[first_dot:stopped_at]) and matcher.text == full[:second_dot]
    with pytest.raises(RuntimeError, match="release after add"):
        held = StopStringMatcher(tokenizer, [". f"])
        held.add(ids[:first_dot])  # the "." is held back as a possible start of ". f"
        held.release(ids[: first_dot + 1])
