"""Engine configuration: one validated msgspec Struct whose field names follow the seed engine."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

PositiveInt = Annotated[int, Meta(ge=1)]


class EngineConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How the engine batches, caches and schedules.

    Every value is validated when the config is built (directly or with `EngineConfig.from_dict`); a bad
    value raises `ValueError` naming the field, an unknown field raises `TypeError` / `ValueError` naming it.
    """

    block_size: Annotated[int, Meta(ge=4)] = 16
    """Tokens per KV-cache block."""
    num_blocks: PositiveInt | None = None
    """Blocks in the KV cache; `None` solves for it from free memory under `max_memory_percent` (on CPU, and at most
    `cpu_kv_cache_space`)."""
    commit_cache: bool | None = None
    """On a Linux CPU, write every page of the KV cache once when the engine is built, so that no step waits on the
    first write into a fresh page (on huge pages the kernel may compact memory to find one: ~1.2 s of a 15.4 s
    mixed-64 run on the 2-core machine), and a cache larger than the memory available is refused at start-up
    (`ValueError`) rather than killed mid-serving. Costs start-up time (0.4-2.7 GB of cache a second there).
    `None`: on when `num_blocks` is given; a cache sized from free memory is committed as its blocks are
    first written (committing most of the RAM up front could take tens of seconds)."""
    max_batch_tokens: PositiveInt = 256
    """Query tokens in one forward pass (prompts longer than what is left are chunked; a chunk's tokens count
    with their attention's work, `chunk_context_cost`)."""
    chunk_context_cost: Annotated[float, Meta(ge=0.0)] | None = None
    """What a prompt chunk's attention adds to its count against `max_batch_tokens`: each of its query tokens
    counts 1 + c x this, c the positions it attends to, so that a step carrying a chunk late in a long prompt
    costs about what one early in it does, and the decodes beside it wait no longer (decode rows count 1).
    `None`: the model's own, computed when the engine is built (`assembly.chunk_context_cost`: attention's
    multiply-adds per position over a token's in the linear layers, over attention's pace against theirs as
    measured on this project's CPU kernels, `assembly.ATTENTION_PACE`; SmolLM2 1 / 1,536, so a token at 4,096
    positions counts 3.7); 0: tokens only. On other hardware, set it from the steps' own times."""
    max_batch_cache_blocks: PositiveInt | None = None
    """The cache budget: KV blocks read in one forward pass (`None`: the whole cache). It bounds the
    attention's gather buffers."""
    max_memory_percent: Annotated[float, Meta(gt=0.0, le=1.0)] = 0.9
    """Share of free device memory (CPU: available RAM) the cache sizing may use."""
    max_requests_per_batch: PositiveInt = 64
    """Requests in one forward pass (bounds the logits tensor)."""
    scheduler: str = "fifo"
    """Name of a registered scheduler plugin."""
    safety_margin: Annotated[float, Meta(ge=0.0, lt=1.0)] | None = None
    """Share of blocks kept free before a new prefill may start; `None` takes the scheduler's default."""
    allow_block_sharing: bool = True
    """Prefix caching, where every layer is full attention."""
    cpu_kv_cache_space: Annotated[float, Meta(gt=0.0)] | None = 4.0
    """GiB the KV cache may take on CPU when `num_blocks` is not given (besides `max_memory_percent` of the available
    RAM): a cache a machine's other programs can live beside, where 90% of the RAM would reserve tens of GB for a
    small model. SmolLM2 holds ~93,000 fp32 tokens in 4 GiB, a 7B model with 8 KV heads ~16,000 (a bf16 cache
    twice that). `None`: no cap (what the memory allows). vLLM's CPU backend reserves 4 GiB by default too."""
    cpu_offload_space: Annotated[float, Meta(ge=0.0)] = 0.0
    """GiB of host memory for swapped-out requests (0 disables it)."""
    q_padding_interval_size: Annotated[int, Meta(ge=0)] = 0
    """Decode steps run at padded shapes (what CUDA graphs replay): rows padded to a multiple of this.
    0: 8 with CUDA graphs, no padded steps without. Set off CUDA, decode steps run padded but eagerly."""
    kv_padding_interval_size: Annotated[int, Meta(ge=0)] = 0
    """Padded decode steps: block tables padded to a multiple of this many tokens (0: 256 with CUDA graphs)."""
    use_cuda_graph: bool | None = None
    """Capture padded decode steps as CUDA graphs and replay them. `None`: on where the model is on CUDA and
    the attention backend has static steps; `True` elsewhere is an error."""
    use_async_batching: bool | None = None
    """Prepare and launch the next decode step before the current one's tokens are handed out (two input
    buffer pairs, copy and compute streams on CUDA). `None`: on with CUDA graphs; it works anywhere."""
    eviction: str = "mru"
    """Name of the eviction policy for cached prefix blocks."""
    offload_backend: str = "cpu"
    """Name of the offload backend for requests swapped out under memory pressure."""
    attention_backend: str | None = None
    """Name of a registered attention backend; `None` chooses by device."""
    pack_cpu_weights: bool | None = None
    """On CPU, run fp32 linear layers through packed weights (`kernels/cpu_linear.py`: jitney's C++ kernel, or
    oneDNN where it cannot be built; faster). While the engine runs, a packed copy that holds its weight exactly holds
    it instead of the model (the model's tensor is empty until the engine exits; a rounded copy, int8 or bf16 from
    fp32, sits beside it). `None`: on where available."""
    fuse_cpu_layers: bool | None = None
    """On CPU, run Llama-like fp32 decoder layers (Llama, Mistral, Qwen2, Qwen3, Phi3, Gemma 1-3, OLMo2, Granite,
    SmolLM3) as a dozen calls each: C++ RMSNorm, rotary and the MLP's activation, one linear each over the q/k/v and
    the gate/up weights stacked (`kernels/cpu_layers.py`), and every step in one C++ call. A bf16 or fp16 model whose
    every layer is one of these computes there over its own weights, its rows fp32 or bf16 (`compute`), an fp32 KV
    cache unless `kv_cache_dtype`, where the default attention backend serves (`core/assembly.half_fused`). `None`: on where the
    weights are packed and the C++ kernels build."""

    packed_cache: bool = False
    """On CPU, keep the packed copies of the weights (every packing above, and the speculative draft's) on disk, in
    `$JITNEY_HOME/packed` (else `~/.cache/jitney/packed`), each file named by the weights' bytes and the packing, and
    map them on a later start of the same weights instead of packing again: a second start in seconds where fresh
    memory is slow to touch (docs/benchmarks.md, "A second start"). The first start writes them on a thread of its
    own once the engine has started, and its exit waits for them (about the packed bytes again on disk; not where that
    would leave less than 1 GiB free). The directory keeps within 32 GiB (`$JITNEY_PACKED_GIB`): the files used
    longest ago are removed to make room for new ones. On ext4 since Linux 6.16 the page cache maps them as huge pages, and decode
    steps read them as fast; on a file system that keeps small pages, ~13% slower (docs/performance-notes.md).
    Delete the directory to take the disk space back."""

    lm_head_screen: bool = True
    """On the CPU's one-call decoder, a step whose rows are all greedy takes each row's token through the LM head's
    screen: int8 logits with proven bounds, fp32 logits only where those leave a doubt (`HeadScreen` in
    `kernels/cpu/head_screen.h`). The tokens are the plain head's argmax bit for bit; off, every logit is computed
    (to measure what it gains: bench mode `jitney-noscreen`). Only for an fp32 head (or its `weights="bf16"`
    copy), or a bf16 / fp16 model's, without bias, soft-capping or divisor, on a CPU with AVX-512 VNNI; costs the
    head's int8 copy (SmolLM2: +36 MB)."""

    batch_invariant: bool = False
    """Every request's logits bit-identical whatever else is batched with it and however its prompt is chunked
    (what `SamplingParams.seed` promises), for every attention backend and dtype on CPU. Without it that holds
    only on the paths that are invariant anyway: fp32 through jitney's C++ kernels (the default `cpu` backend, and
    bf16 / fp16 models on the one-call decoder) and Triton; the `torch` backend and other bf16 / fp16 models differ
    by float rounding (~1e-7 fp32, ~4e-3 bf16), enough
    to change a token now and then. On, the `torch` backend attends one query row at a time
    (`TorchPagedAttention(rowwise=True)`) and bf16 / fp16 linear layers compute through jitney's fp32 kernel over
    an fp32 copy of their weights (twice the bf16 weights' memory). Costs: docs/reliability.md. Needs a CPU model,
    the C++ kernels, and an attention backend that declares `batch_invariant`; otherwise a `ValueError` at start-up."""

    weights: Literal["int8", "w8a8", "bf16"] | None = None
    """`None`: the model's weights as loaded. `"int8"`: on CPU, every fp32 linear layer (the LM head included)
    computes through a copy of its weights rounded to int8, each output feature on its own scale (its largest
    magnitude / 127), with fp32 rows and fp32 sums (`kernels/cpu_linear.PanelLinear(quantized="int8")`): a quarter of the
    bytes a step reads, so steps of a few rows, bound by reading the weights, run faster (SmolLM2 on the 2-core
    machine: docs/benchmarks.md); steps of many rows compute as much as in fp32. Tokens are not fp32's: greedy text
    parts from fp32's at near-ties (perplexity and agreement in docs/benchmarks.md); deterministic and batch-invariant like fp32. Needs an fp32 model on the
    CPU and jitney's C++ kernels (a `ValueError` at start-up otherwise); the engine's model keeps its own weights,
    the int8 copies live while the engine runs. Speculation is off by default (the draft would be the model itself).
    `"w8a8"`: the same int8 weights, and each linear's input rounded to int8 too, in blocks of 32 inputs each on
    its own scale; products summed exactly in int32 (AVX-512 VNNI), blocks in fp32. Steps of many rows compute
    faster; the rounding of the activations costs more quality than int8's (docs/benchmarks.md). Needs every
    linear's input width to be a multiple of 32. `"bf16"`: every fp32 linear through a copy of its weights rounded
    to bfloat16 (half the bytes; rows and sums fp32, so tokens are `generate`'s over the rounded weights, and
    fp32's exactly for a checkpoint published in bf16); speculation stays on (its draft is int8)."""

    compute: Literal["fp32", "bf16"] | None = None
    """What the CPU's linear layers compute in. `"fp32"`: fp32 rows times fp32 weights (or a bf16 / fp16 model's own
    weights, widened exactly). `"bf16"`: every linear layer but the LM head rounds its weights and its rows to
    bfloat16 (to nearest even) and sums their products in fp32, on the CPU's matrix units where it has them (AMX
    tiles, else AVX512-BF16; plain C++ elsewhere, slowly): the layers' outputs, the residual stream, attention and
    the KV cache stay fp32, as does the head (so the LM head's screen still serves). Which unit runs is chosen at
    start-up from what the CPU reports and the OS allows, and logged. Tokens are not fp32's: they part from them at
    near-ties (perplexity and agreement in docs/benchmarks.md); a row's outputs do not depend on its batch. Layers
    whose input width is not a multiple of 32 keep fp32 rows. Needs the model on CPU and jitney's C++ kernels, not
    int8 `weights`; a `ValueError` at start-up otherwise. `None`: "bf16" for a bf16 model on the one-call decoder where
    the CPU has AMX or AVX512-BF16 (its rows rounded to its own precision: about twice fp32's rate on many rows), else
    "fp32" (an fp16 model too: its weights would lose three bits); resolved when the engine is built
    (`assembly.default_compute`), so `engine.config.compute` says which."""

    kv_cache_dtype: Literal["bf16", "int8"] | None = None
    """`None`: the KV cache holds keys and values as the model computes them (fp32 for an fp32 model, and for a bf16
    or fp16 model on the one-call decoder). `"bf16"`: rounded to bfloat16 as they are written (to nearest even): half
    the bytes, so twice the tokens in the same memory and half of what a decode step's attention reads. Queries,
    scores and sums stay fp32 (the `cpu` attention backend widens each key and value exactly as it reads it), so a
    row's output is fp32 attention over the rounded keys and values: tokens are not fp32's, they part from them at
    near-ties (perplexity, agreement and speed in docs/benchmarks.md); deterministic and batch-invariant like fp32.
    `"int8"`: each position's key (value) of each KV head as int8 codes with one fp32 scale (its largest magnitude
    over 127, `kernels/base.quantize_kv`): 68 bytes a row of 64 dims against bf16's 128, fp32's 256; the kernels
    multiply each code by its row's scale as they read it. Quality measured, not assumed (docs/benchmarks.md).
    Needs an attention backend that reads such a cache (`AttentionBackend.cache_dtypes`: the `cpu` backend, the
    default for fp32 models on CPU where jitney's C++ kernels build) or, for bf16, a model that computes in bf16;
    otherwise a `ValueError` at start-up."""

    check_model: bool = True
    """When the engine is entered, run a few positions through the model's own attention and through the path
    that will serve it, and refuse the model (`selfcheck.UnfaithfulModel`, naming the class and the reason)
    if they differ: an architecture jitney cannot run faithfully fails there, never with wrong tokens. Costs
    a few short forward passes at start-up; False skips it."""

    speculative_tokens: Annotated[int, Meta(ge=0)] | None = None
    """Speculative decoding in the CPU's one-call decode steps (`kernels/cpu_layers.FusedDecoder.speculate`):
    an int8 copy of the model proposes this many tokens after each greedy decode, and one pass of the model
    checks them all; a request gets the model's own tokens up to the first it disagrees with, the same tokens
    as without. Where the one-call decoder runs (fused fp32 Llama-like models on CPU, every layer full attention)
    and decode steps are not padded. `None`: 8 (`engine.DRAFT_TOKENS`), or 0 with async batching (speculative
    steps are not chained) or int8 `weights` (the draft would be the model itself), or where the draft, the whole KV
    cache and 1 GiB would not fit in the memory available once the weights are packed (a warning says so); 0: off.
    Costs an int8 copy of the weights (a quarter of fp32's size, half of bf16's; none with int8 `weights`)."""
    speculative_max_rows: PositiveInt = 16
    """Speculate only in steps of at most this many rows, proposals included (with more requests decoding,
    fewer proposals each, and none below two each): a step of a few rows is bound by reading the weights,
    which extra rows share; at more, the extra rows cost their own compute. With SmolLM2 on a 2-core CPU, up
    to five requests speculate: four chat streams of 128 tokens ran 1.79-1.88 s against 2.27-2.49 s at 8
    (where none did), five 1.91-1.98 against 2.23-2.31; 24 was no better than 16."""
    lookup_tokens: Annotated[int, Meta(ge=0)] | None = None
    """Prompt-lookup speculation (`core/lookup`) in the one-call decode steps the draft does not take (more rows
    than `speculative_max_rows`): a greedy request whose last three (else two) tokens occurred before in its
    prompt or output proposes up to this many of the tokens that followed them there, and the pass that computes
    its next token checks them; it keeps them up to the first the model disagrees with, so its tokens are the
    same as without. Costs no model pass: a wrong guess costs its row in that pass. Only in steps where every
    request decodes one greedy sample and none is offloaded, within `max_batch_tokens`. Where the one-call
    decoder runs, as `speculative_tokens`; `None`: 4 (0 with async batching); 0: off."""

    def __post_init__(self) -> None:
        # msgspec checks constraints only when converting; building the Struct directly does not, so check
        # each field against its annotated type here and name the field in the error.
        for field in msgspec.structs.fields(self):
            value = getattr(self, field.name)
            try:
                msgspec.convert(value, field.type, strict=True)
            except msgspec.ValidationError as exc:
                raise ValueError(f"EngineConfig.{field.name}: {exc} (got {value!r})") from None

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "EngineConfig":
        """Build a config from plain data (a parsed JSON/TOML file, CLI flags); unknown keys are errors."""
        try:
            return msgspec.convert(data, cls)
        except msgspec.ValidationError as exc:
            raise ValueError(f"EngineConfig: {exc}") from None
