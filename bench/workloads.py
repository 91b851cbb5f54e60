"""Reproducible benchmark workloads: lists of (prompt token ids, new tokens)."""

from __future__ import annotations

import json
import random

Workload = list[tuple[list[int], int]]


def mixed_64(vocab_size: int, count: int = 64) -> Workload:
    """64 requests (or the first `count`), prompts and outputs of 16-256 tokens (DESIGN.md's reference workload)."""
    lengths = random.Random(1234)
    sizes = []
    for _ in range(count):
        prompt_len = lengths.randint(16, 256)
        sizes.append((prompt_len, lengths.randint(16, 256)))
    ids = random.Random(5678)
    return [([ids.randrange(100, vocab_size) for _ in range(p)], n) for p, n in sizes]


def mixed_16(vocab_size: int) -> Workload:
    """mixed-64's first 16 requests (for models too large to batch 64 of on a small machine in good time)."""
    return mixed_64(vocab_size, 16)


def long_context(vocab_size: int) -> Workload:
    """8 prompts of 4096 tokens, 256 new tokens each: prefill and decode attention over long contexts."""
    rng = random.Random(4096)
    return [([rng.randrange(100, vocab_size) for _ in range(4096)], 256) for _ in range(8)]


def long_prompt(vocab_size: int, max_batch_tokens: int = 256) -> Workload:
    """8 prompts of 3-6x the token budget, short outputs: exercises chunked prefill."""
    rng = random.Random(42)
    return [([rng.randrange(100, vocab_size) for _ in range(rng.randint(3, 6) * max_batch_tokens)], 32) for _ in range(8)]


def shared_prefix(vocab_size: int) -> Workload:
    """64 requests sharing a 512-token system prompt, each with its own 32-token question."""
    rng = random.Random(7)
    system = [rng.randrange(100, vocab_size) for _ in range(512)]
    return [(system + [rng.randrange(100, vocab_size) for _ in range(32)], 64) for _ in range(64)]


def multi_prefix(vocab_size: int) -> Workload:
    """64 requests over 8 system prompts of 256 tokens, in shuffled order, each with a 32-token question and
    32 new tokens: with a cache too small for every prefix, the eviction policy decides the hit rate."""
    rng = random.Random(11)
    systems = [[rng.randrange(100, vocab_size) for _ in range(256)] for _ in range(8)]
    order = [i % 8 for i in range(64)]
    rng.shuffle(order)
    return [(systems[k] + [rng.randrange(100, vocab_size) for _ in range(32)], 32) for k in order]


def sharegpt_like(vocab_size: int) -> Workload:
    """64 requests with a chat-like length mix: log-normal prompts (median ~100) and outputs (median ~150)."""
    rng = random.Random(2024)
    out = []
    for _ in range(64):
        p = min(1024, max(4, int(rng.lognormvariate(4.6, 0.8))))
        n = min(512, max(4, int(rng.lognormvariate(5.0, 0.6))))
        out.append(([rng.randrange(100, vocab_size) for _ in range(p)], n))
    return out


def single_stream(vocab_size: int) -> Workload:
    """One request, a 16-token prompt and 128 new tokens: per-token latency with nothing to batch."""
    rng = random.Random(3)
    return [([rng.randrange(100, vocab_size) for _ in range(16)], 128)]


CHAT_QUESTIONS = (
    "Explain how a refrigerator works, step by step.",
    "Write a short story about a robot who learns to paint.",
    "What were the main causes of the French Revolution?",
    "How do I bake bread at home?",
)
CHAT_QUESTION = CHAT_QUESTIONS[0]


def chat(tokenizer, count: int) -> Workload:
    """`count` requests (at most four), real questions through the model's chat template, 128 new tokens each:
    a few streams on text. (single-stream's random prompt sends SmolLM2 into a loop of one sentence, which a
    draft model predicts better than text.)"""
    work = []
    for question in CHAT_QUESTIONS[:count]:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True, tokenize=True)
        ids = ids["input_ids"] if hasattr(ids, "keys") else ids  # (a BatchEncoding in newer transformers)
        work.append((list(ids), 128))
    return work


def single_chat(tokenizer) -> Workload:
    """One request, a real question through the model's chat template, 128 new tokens: one stream on text."""
    return chat(tokenizer, 1)


def chat_4(tokenizer) -> Workload:
    """Four chat requests at once, 128 new tokens each: a few streams, where speculation still runs."""
    return chat(tokenizer, 4)


JSON_TASKS = (
    ("Describe a product for an online shop.", {
        "type": "object", "additionalProperties": False, "required": ["name", "price", "tags", "in_stock"],
        "properties": {"name": {"type": "string", "maxLength": 40}, "price": {"type": "number", "minimum": 0},
                       "tags": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 4},
                       "in_stock": {"type": "boolean"}}}),
    ("Describe a person in a novel.", {
        "type": "object", "additionalProperties": False, "required": ["name", "age", "city", "hobbies"],
        "properties": {"name": {"type": "string", "maxLength": 40}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
                       "city": {"type": "string", "maxLength": 30},
                       "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 3}}}),
    ("Give tomorrow's weather report for a city.", {
        "type": "object", "additionalProperties": False, "required": ["city", "summary", "high_c", "low_c", "wind"],
        "properties": {"city": {"type": "string", "maxLength": 30}, "summary": {"enum": ["sunny", "cloudy", "rain", "snow"]},
                       "high_c": {"type": "integer"}, "low_c": {"type": "integer"},
                       "wind": {"type": "object", "additionalProperties": False, "required": ["speed_kmh", "direction"],
                                "properties": {"speed_kmh": {"type": "integer", "minimum": 0},
                                               "direction": {"enum": ["N", "E", "S", "W"]}}}}}),
    ("List the steps of a simple recipe.", {
        "type": "object", "additionalProperties": False, "required": ["title", "steps"],
        "properties": {"title": {"type": "string", "maxLength": 40},
                       "steps": {"type": "array", "items": {"type": "string", "maxLength": 60}, "minItems": 2,
                                 "maxItems": 5}}}),
)
"""json-16's tasks and the JSON schema each one's reply is held to."""


def json_schemas(count: int) -> list[dict]:
    """The schema of each of json-16's first `count` requests (`JSON_TASKS` in turn)."""
    return [JSON_TASKS[i % len(JSON_TASKS)][1] for i in range(count)]


def json_16(tokenizer) -> Workload:
    """16 chat requests asking for a JSON reply to a schema given in the prompt (`JSON_TASKS` in turn), up to 256
    new tokens: the structured-output workload (`jitney bench --modes jitney,jitney-json`: the same prompts free
    and held to their schemas)."""
    work = []
    for i, schema in enumerate(json_schemas(16)):
        task = JSON_TASKS[i % len(JSON_TASKS)][0]
        text = f"{task} Reply with one JSON object only, following this schema: {json.dumps(schema)} (#{i + 1})"
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
        work.append((list(ids["input_ids"] if hasattr(ids, "keys") else ids), 256))
    return work


# (single-chat, chat-4 and json-16 take the tokenizer, the others the vocabulary size)
TAKES_TOKENIZER = ("single-chat", "chat-4", "json-16")
WORKLOADS = {
    "single-stream": single_stream, "single-chat": single_chat, "chat-4": chat_4, "json-16": json_16,
    "mixed-64": mixed_64, "mixed-16": mixed_16, "long-context": long_context, "long-prompt": long_prompt,
    "shared-prefix": shared_prefix, "multi-prefix": multi_prefix, "sharegpt-like": sharegpt_like,
}


def decoding(vocab_size: int, long: bool = False) -> tuple[Workload, list[float]]:
    """Four requests decoding 256 tokens each from 64-token prompts, all at 0 s; `long`: a 4096-token prompt
    (one new token, so that every token gap measured is the four's) arrives at 1 s, while they decode. With
    (arrivals), the inter-token latency a long prompt costs running decodes: chunked prefill should bound it."""
    rng = random.Random(64)
    work = [([rng.randrange(100, vocab_size) for _ in range(64)], 256) for _ in range(4)]
    if long:
        work.append(([rng.randrange(100, vocab_size) for _ in range(4096)], 1))
    return work, [0.0] * 4 + ([1.0] if long else [])


ARRIVING = {"decode-4": decoding, "decode-4+long": lambda vocab: decoding(vocab, long=True)}
"""Workloads whose requests arrive at given seconds (jitney's modes only)."""


MODEL_SHAPES = {
    "tinyllama-1.1b-random": ("LlamaConfig", "LlamaForCausalLM", dict(
        hidden_size=2048, num_hidden_layers=22, num_attention_heads=32, num_key_value_heads=4, intermediate_size=5632,
        vocab_size=32000, max_position_embeddings=2048)),
    "qwen3-0.6b-random": ("Qwen3Config", "Qwen3ForCausalLM", dict(
        hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
        intermediate_size=3072, vocab_size=151936, tie_word_embeddings=True, max_position_embeddings=40960)),
    "gemma3-270m-random": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        hidden_size=640, num_hidden_layers=18, num_attention_heads=4, num_key_value_heads=1, head_dim=256,
        intermediate_size=2048, vocab_size=262144, query_pre_attn_scalar=256, sliding_window=512,
        max_position_embeddings=32768)),
    "llama3.2-3b-random": ("LlamaConfig", "LlamaForCausalLM", dict(
        hidden_size=3072, num_hidden_layers=28, num_attention_heads=24, num_key_value_heads=8, head_dim=128,
        intermediate_size=8192, vocab_size=128256, tie_word_embeddings=True, rope_theta=500000.0,
        max_position_embeddings=131072)),
    "mistral-7b-random": ("MistralConfig", "MistralForCausalLM", dict(
        hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
        intermediate_size=14336, vocab_size=32768, rope_theta=1000000.0, sliding_window=None,
        max_position_embeddings=32768)),
}
"""Models benchmarked by their shape (random weights; `jitney bench --model NAME`): TinyLlama-1.1B's, Qwen3-0.6B's,
Gemma-3-270M's, Llama-3.2-3B's and Mistral-7B-v0.3's (config class, model class, config fields)."""


def shaped_model(name: str, dtype=None):
    """A model of the shape `MODEL_SHAPES[name]`, random weights (seeded), no tokenizer; built directly in `dtype`
    (a torch dtype; default fp32), so a bf16 3B model never holds an fp32 copy (12.8 GB) on the way."""
    import torch
    import transformers

    config_class, model_class, shape = MODEL_SHAPES[name]
    torch.manual_seed(0)
    config = getattr(transformers, config_class)(**shape, bos_token_id=None, eos_token_id=None, pad_token_id=0)
    return getattr(transformers, model_class)._from_config(config, dtype=dtype or torch.float32).eval()
