"""Faster fp32 linear layers on CPU: each `nn.Linear.forward` through a packed copy of its weight.

`PanelLinear` packs the weight into panels of 16 output features (C++ `pack_panels` / `panel_linear`,
`kernels/cpu/linear.h`): a register-tiled kernel that reads each weight once per step and reuses it across
up to six rows at a time. Over SmolLM2's decoder linears on this project's 2-core machine it ran 1.2–2.1x
faster than oneDNN's prepacked matmul from 1 to 64 rows and 1.15–1.25x at 128–256 (the same process; table in
docs/performance-notes.md), and faster than the plain-weight kernel it replaced at one or two rows. The packed copies
sit on transparent huge pages where the OS offers them (`pack_panels`). Where the C++ kernels cannot be
built, oneDNN's prepacked matmul is used instead. Either differs from `F.linear` by float rounding only. Under an
engine a panel copy that holds its weight exactly (fp32; bf16 or fp16 as they are) holds it instead of the model
(`release`); a rounded one (int8, bf16 from fp32) and oneDNN's sit beside it.
"""

from __future__ import annotations

import collections
import ctypes
import functools
import mmap
import re

import torch
import torch.nn.functional as F
from torch import nn

from jitney.kernels import native


def available() -> bool:
    return native.available() or (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


class PackedLinears:
    """While entered, every fp32 CPU `nn.Linear` of `model` computes through a packed weight, except those in
    `skip` (computed by someone else, e.g. `cpu_layers.FusedLayers`).

    `widen` (`EngineConfig.batch_invariant`): bf16 and fp16 linears too, through `PanelLinear` over an fp32 copy of
    their weights, rows cast to fp32 and the outputs back. torch's bf16 matmul sums a row's products in an order that
    depends on the number of rows (a row's output differed by up to 4e-3 alone vs in a batch); the panel kernel
    sums every row the same way.

    `quantized` (`EngineConfig.weights`: "int8", "w8a8" or "bf16"): the fp32 linears through int8 (bf16) copies of
    their weights (`PanelLinear(quantized=...)`).

    `compute="bf16"` (`EngineConfig.compute`): every linear but the LM head (fp32, bf16 and fp16 ones) computes in
    bf16 (`PanelLinear(compute="bf16")`; a half-precision one's rows cast to fp32 and its outputs back); the head
    as without.

    `release`: a packed copy that holds its weight exactly (`PanelLinear.exact`) holds it instead of the model, until
    exit puts the weight back (`release`, `restore`); a weight another module shares stays. `store`
    (`stored.PackedStore`): packed copies mapped from files an earlier start wrote, else kept there to be written."""

    def __init__(self, model: nn.Module, skip: set[nn.Module] | frozenset = frozenset(), widen: bool = False,
                 quantized: str | None = None, compute: str = "fp32", release: bool = False, store=None):
        self.model = model
        self.store = store
        self.skip = skip
        self.widen = widen
        self.quantized = quantized
        self.compute = compute
        self.release = release
        self.patched: list[nn.Linear] = []
        self.released: list[tuple[nn.Linear, PanelLinear, list[torch.Tensor] | None]] = []
        self.tensors: list[torch.Tensor] = []
        """The packed copies it made (`core.memory`)."""

    def __enter__(self) -> "PackedLinears":
        try:
            return self._enter()
        except BaseException:  # (what it packed and released so far put back)
            self.__exit__(None, None, None)
            raise

    def _enter(self) -> "PackedLinears":
        kinds = (torch.float32, torch.bfloat16, torch.float16) if self.widen or self.compute == "bf16" else (torch.float32,)
        head = self.model.get_output_embeddings() if hasattr(self.model, "get_output_embeddings") else None
        keep = shared(self.model)
        for module in self.model.modules():
            w = module.weight if isinstance(module, nn.Linear) else None
            if w is None or w.dtype not in kinds or w.device.type != "cpu" or module in self.skip:
                continue
            bias = None if module.bias is None else module.bias.detach().float()
            if self.compute == "bf16" and module is not head:
                linear = PanelLinear([w.detach()], bias, compute="bf16", store=self.store)
            elif w.dtype not in (torch.float32,) + ((torch.bfloat16, torch.float16) if self.widen else ()):
                continue  # (a half-precision head under bf16 compute: torch's, as without)
            elif w.dtype == torch.float32 and self.quantized:
                linear = PanelLinear([w.detach()], module.bias, quantized=self.quantized, store=self.store)
            elif w.dtype == torch.float32:
                linear = packed_linear([w.detach()], module.bias, self.store)
            else:
                linear = PanelLinear([w.detach().float()], bias, store=self.store)
            module.forward = linear if w.dtype == torch.float32 else _widened(linear)
            self.tensors += linear.tensors
            self.patched.append(module)
            if self.release and (weights := release([module], linear, keep)):
                self.released += kept_if_mapped([(module, linear, weights)])
                del weights  # (freed before the trim, unless kept)
                trim()
        return self

    def __exit__(self, *exc_info) -> None:
        self.tensors = []
        for module, linear, weights in self.released:
            restore([module], linear, weights)
        for module in self.patched:
            del module.forward  # back to nn.Linear.forward
        self.patched, self.released = [], []


COMPUTE = ("fp32", "bf16")
"""What a linear layer's rows may compute in (`EngineConfig.compute`)."""

ACTIVATIONS = {"silu": 0, "gelu_tanh": 1}
"""A gated MLP's activations the kernels compute, by the codes of `Activation` in `kernels/cpu/linear.h`."""


class PanelLinear:
    """`x @ W.T + bias` for fp32 CPU rows, W the row blocks `weights` stacked (one linear over q, k and v
    projections), through one packed copy (`packed`, made here; the weights themselves are not kept).

    `gated`: `weights` are a gated MLP's gate and up projections ([I, K] each, I a multiple of 16, `bias` theirs
    stacked) and the layer computes act(x @ gate.T) * (x @ up.T) [.., I] in one pass (`pack_panels_gated`), act
    the `activation` named (one of `ACTIVATIONS`: SiLU, or GeLU's tanh approximation).
    `quantized`: the packed copy holds each output feature's weights rounded to int8 on its own scale (its largest
    magnitude / 127; `int8_weights`), a quarter of the bytes. "int8": rows and sums stay fp32. "w8a8": the rows
    are rounded to int8 too, each block of 32 inputs on its own scale (`int8_activations`), their products summed
    exactly in int32 a block at a time (AVX-512 VNNI), the blocks' sums in fp32; input widths a multiple of 32.
    int8 not with `gated`. "bf16": each weight rounded to bfloat16 (to nearest, ties to even), half the bytes,
    widened back to fp32 as the kernel loads it: the same sums as fp32 over the rounded weights (`rounded`).
    `compute="bf16"` (`EngineConfig.compute`): the weights rounded to bf16 as "bf16" rounds them, and each row too
    as it enters, their products summed in fp32 on the CPU's matrix units (AMX tiles, else AVX512-BF16, else
    plain C++: `vnni_panels` in `kernels/cpu/bf16.h`); fp32 outputs. Where the input width is not a multiple of 32, rows
    stay fp32 over the bf16 weights. Not with int8 weights.
    `store` (`stored.PackedStore`): the packed copy mapped from its file where an earlier start wrote one, else packed
    and kept there to be written."""

    def __init__(self, weights: list[torch.Tensor], bias: torch.Tensor | None, gated: bool = False,
                 quantized: str | None = None, activation: str = "silu", compute: str = "fp32", store=None):
        if quantized not in (None, "int8", "w8a8", "bf16"):
            raise ValueError(f"PanelLinear: quantized is None, 'int8', 'w8a8' or 'bf16', not {quantized!r}")
        if compute not in COMPUTE:
            raise ValueError(f"PanelLinear: compute is one of {COMPUTE}, not {compute!r}")
        if compute == "bf16" and quantized in ("int8", "w8a8"):
            raise ValueError("PanelLinear: bf16 compute is over bf16 weights, not int8 ones")
        if gated and quantized in ("int8", "w8a8"):
            raise ValueError("PanelLinear: int8 weights are not packed gated (stack gate and up instead)")
        if activation not in ACTIVATIONS:
            raise ValueError(f"PanelLinear: activation is one of {sorted(ACTIVATIONS)}, not {activation!r}")
        kernels = native.load()
        self.gated = gated
        self.act = ACTIVATIONS[activation]
        self.dtype = weights[0].dtype
        """The weights' own type (`weight()` gives them back in it)."""
        narrowed = (quantized == "bf16" or compute == "bf16") and self.dtype != torch.bfloat16
        self.exact = quantized not in ("int8", "w8a8") and not narrowed
        """Whether the packed copy holds the weights themselves (relaid, or widened to fp32), so that `weight()` gives
        them back bit for bit."""
        originals = weights  # (what its copy is named by in `store`: the draft's and the screen's derive from it)
        if quantized == "bf16" or compute == "bf16":
            weights = [w.detach().to(torch.bfloat16) for w in weights]
        self.compute = "bf16" if compute == "bf16" and weights[0].shape[1] % 32 == 0 else "fp32"
        """What the rows compute in."""

        def pack() -> torch.Tensor:
            if quantized in ("int8", "w8a8"):
                return pack_int8(weights, activations=quantized == "w8a8")
            packed = kernels.pack_panels_gated(*weights) if gated else kernels.pack_panels(weights)
            return kernels.vnni_panels(packed) if self.compute == "bf16" else packed  # (in place)

        self.store = store
        self.key = None if store is None else store.key("panels", originals, gated=gated, quantized=quantized,
                                                        compute=self.compute)
        """Its packed copy's name in `store` (`stored.PackedStore`), where it has one."""
        self.packed = pack() if store is None else store.fetch(self.key, pack)
        self.width = sum(w.shape[0] for w in weights)  # the kernel's outputs before gating
        self.out_features = self.width // 2 if gated else self.width
        if bias is not None and gated:  # in the panels' order: gate's 16 features, then up's 16, ...
            bias = torch.stack(bias.detach().view(2, -1, 16).unbind(0), 1).reshape(-1)
        self.bias = None if bias is None else bias.detach().contiguous()
        self._kernel = kernels.panel_linear

    @property
    def tensors(self) -> list[torch.Tensor]:
        """What it holds (`core.memory`)."""
        return [self.packed] + ([] if self.bias is None else [self.bias])

    def weight(self) -> torch.Tensor:
        """The weights it packed, stacked [N, K] in their own type (a new tensor), where it holds them `exact`ly:
        `pack_panels`' panels are [P, K, 16] (`vnni_panels`' [P, K / 2, 16, 2] the same pairs side by side), a gated
        MLP's gate and up panels in turns."""
        if not self.exact:
            raise ValueError("PanelLinear.weight: its packed copy holds rounded weights, not the weights themselves")
        p = self.packed
        if p.dim() == 4:  # (vnni_panels)
            p = p.permute(0, 1, 3, 2).reshape(p.shape[0], -1, 16)
        k = p.shape[1]
        if self.gated:  # [I / 16, gate | up, K, 16] -> gate's rows, then up's
            w = p.view(-1, 2, k, 16).permute(1, 0, 3, 2).reshape(-1, k)
        else:
            w = p.permute(0, 2, 1).reshape(-1, k)[: self.width]
        return w.to(self.dtype) if w.dtype != self.dtype else w.contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        if not flat.is_contiguous():
            flat = flat.contiguous()
        return self._kernel(flat, self.packed, self.width, self.bias, self.gated, self.act).view(*x.shape[:-1],
                                                                                                 self.out_features)


def shared(model: nn.Module) -> set[int]:
    """Ids of the parameters of `model` that more than one module holds (a tied LM head and embedding)."""
    counts = collections.Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
    return {i for i, n in counts.items() if n > 1}


def release(linears: list[nn.Linear], packed, keep: set[int]) -> list[torch.Tensor]:
    """Give the weights of `linears` (which `packed` computes as one) up to `packed`, where it holds them `exact`ly
    and none is in `keep` (ids, `shared`): each becomes an empty tensor, so that a forward still reading it fails
    loudly rather than silently, until `restore` puts it back. The weights as they were (`kept_if_mapped` decides
    which to hold on to); none where it gave nothing up."""
    if not isinstance(packed, PanelLinear) or not packed.exact or any(id(m.weight) in keep for m in linears):
        return []
    weights = [m.weight.data for m in linears]
    for m in linears:
        m.weight.data = m.weight.data.new_empty(0)
    return weights


def kept_if_mapped(released: list[tuple]) -> list[tuple]:
    """`released`, tuples whose last item is the weights `release` gave up, with those weights kept where every one
    lies in a file's mapping (`page_out`: they cost no memory while an engine runs, and `restore` puts the very
    tensors back instead of unpacking the packed copy into fresh pages), else None (theirs to free now)."""
    flags = iter(page_out([w for *_, weights in released for w in weights]))
    return [(*head, weights if all([next(flags) for _ in weights]) else None) for *head, weights in released]


@functools.cache
def _malloc_trim():
    try:
        return ctypes.CDLL(None).malloc_trim  # (glibc's)
    except (OSError, AttributeError):
        return None


def trim() -> None:
    """Hand the pages of freed memory back to the OS, where the C library keeps them (glibc: a weight smaller than its
    mmap threshold lives on the heap, and freeing it leaves its pages resident: 1.1B shape, bf16, entering an engine
    held ~0.4 GiB more without this)."""
    if (malloc_trim := _malloc_trim()) is not None:
        malloc_trim(0)


MADV_PAGEOUT = 21  # (Linux 5.4 on)
_FILE_MAPPING = re.compile(r"^([0-9a-f]+)-([0-9a-f]+) \S+ \S+ \S+ [1-9][0-9]* +/", re.MULTILINE)


def page_out(weights: list[torch.Tensor]) -> list[bool]:
    """Drop from this process's memory the pages of `weights` that lie in a file's mapping; whether each does. A
    checkpoint's weights are mapped from its safetensors file (transformers' loading), and a weight given up
    (`release`) frees none of it while any tensor of that file lives (the embedding): the pages its packing read
    stayed resident, the model's size over its packed copies (SmolLM2 in fp32: 513 MiB). `MADV_PAGEOUT` loses
    nothing: a page read again comes back from the file. The pages leave the OS's file cache too, so a later start
    that packs from the checkpoint again reads it from the disk (one that maps its packed copies, `packed_cache`,
    reads none of it). All False where the OS has no /proc; where it has no such advice, the pages stay."""
    if not weights:
        return []
    try:
        with open("/proc/self/maps") as maps:  # (the ranges mapped from a file: those of a non-zero inode)
            files = [(int(low, 16), int(high, 16)) for low, high in _FILE_MAPPING.findall(maps.read())]
    except OSError:
        return [False] * len(weights)
    page, inside = mmap.PAGESIZE, []
    for w in weights:
        address, size = w.data_ptr(), w.nbytes
        inside.append(any(low <= address and address + size <= high for low, high in files))
        start, end = -(-address // page) * page, (address + size) // page * page  # (whole pages inside it only)
        if inside[-1] and end > start:
            _madvise()(ctypes.c_void_p(start), ctypes.c_size_t(end - start), MADV_PAGEOUT)
    return inside


@functools.cache
def _madvise():
    libc = ctypes.CDLL(None)  # (its result is not read: where the advice is refused, the pages stay)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc.madvise


def released(m: nn.Linear) -> bool:
    """Whether `release` gave the weight of `m` up."""
    return m.weight.numel() == 0 < m.in_features * m.out_features


def restore(linears: list[nn.Linear], packed: PanelLinear, weights: list[torch.Tensor] | None = None) -> None:
    """Each of `linears` its weight again: `weights`, those `release` took, where they were kept (`kept_if_mapped`),
    else unpacked from `packed` (in its own type; a tensor of its own). `packed` gives its packed copy up (so that
    putting a model back holds one layer twice at most, not the whole model)."""
    if weights is not None:
        packed.packed = None
        for m, w in zip(linears, weights):
            m.weight.data = w
        return
    stacked = packed.weight()
    packed.packed = None
    blocks = stacked.split([m.out_features for m in linears])
    for m, w in zip(linears, blocks):
        m.weight.data = w.to(m.weight.dtype, copy=len(linears) > 1)  # (a block of several: not a view of them all)


def int8_copy(linears: list[nn.Linear], packed) -> torch.Tensor:
    """`pack_int8` of the weights of `linears` stacked (the speculative draft's), from `packed` where `release` gave
    them up to it: straight from its bf16 panels (C++ `int8_from_panels`: one pass, nothing unpacked), else from the
    weights it unpacks; mapped from `packed`'s store where an earlier start wrote it."""
    store = getattr(packed, "store", None)
    if store is not None:
        return store.fetch(store.derived(packed.key, "int8"), lambda: _int8_copy(linears, packed))
    return _int8_copy(linears, packed)


def _int8_copy(linears: list[nn.Linear], packed) -> torch.Tensor:
    if not any(released(m) for m in linears):
        return pack_int8([m.weight.detach() for m in linears])
    if packed.packed.dtype == torch.bfloat16:
        return native.load().int8_from_panels(packed.packed, packed.width, packed.gated)
    return pack_int8([packed.weight()])


def int8_weights(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`weight` [N, K] (fp32, bf16 or fp16: computed in fp32) rounded to int8 [N, K], each output feature on its own
    scale (its largest magnitude / 127; 1 for an all-zero one; to nearest even), and those scales [N] fp32 (C++,
    `int8_rows`: one pass, no widened copy)."""
    return native.load().int8_rows(weight.detach())


def pack_int8(weights: list[torch.Tensor], activations: bool = False) -> torch.Tensor:
    """The row blocks `weights` stacked and rounded (`int8_weights`), packed for `panel_linear`; `activations`:
    for int8 activations too (`pack_panels_w8a8`; the input width a multiple of 32)."""
    rounded = [int8_weights(w) for w in weights]
    pack = native.load().pack_panels_w8a8 if activations else native.load().pack_panels_int8
    return pack([q for q, _ in rounded], torch.cat([s for _, s in rounded]))


def head_screen(weight: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """What `FusedDecoder.screen` (C++, `HeadScreen`) takes for an fp32, bf16 or fp16 LM head of `weight` [V, K]
    (K a multiple of 32): the weights themselves (contiguous), rounded to int8 (`int8_weights`) and packed for int8 rows too,
    their scales [V], each scale times the feature's sum of int8 magnitudes [V], and the same per block of 32
    inputs, [K / 32, V] and [V, K / 32]."""
    weight = weight.detach().contiguous()
    q, scale = int8_weights(weight)
    magnitudes = torch.cat([q[start : start + 4096].abs().float().view(-1, q.shape[1] // 32, 32).sum(-1)
                            for start in range(0, q.shape[0], 4096)])  # (a few features at a time; exact in fp32)
    blocks = magnitudes * scale[:, None]
    return (weight, native.load().pack_panels_w8a8([q], scale), scale, (magnitudes.sum(1) * scale).contiguous(),
            blocks.t().contiguous(), blocks)


def int8_activations(x: torch.Tensor) -> torch.Tensor:
    """Rows `x` [..., K] as a "w8a8" `PanelLinear` computes with them: each block of 32 inputs rounded to int8 on
    its own scale (its largest magnitude / 127), scaled back (a new tensor)."""
    blocks = x.reshape(*x.shape[:-1], -1, 32)
    scale = blocks.abs().amax(-1, keepdim=True) / 127
    inverse = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
    return ((blocks * inverse).round().clamp(-127, 127) * scale).reshape(x.shape)


def int8_rounded(weight: torch.Tensor) -> torch.Tensor:
    """`weight` as an int8 `PanelLinear` computes with it: rounded (`int8_weights`) and scaled back."""
    q, scale = int8_weights(weight)
    return q.float() * scale[:, None]


def rounded(weight: torch.Tensor, weights: str) -> torch.Tensor:
    """`weight` (fp32) as a `PanelLinear(quantized=weights)` computes with it, in fp32."""
    return weight.to(torch.bfloat16).float() if weights == "bf16" else int8_rounded(weight)


class QuantizedReference:
    """While entered, every fp32 `nn.Linear` of `model` computes through `F.linear` with its weight as the
    `weights` path ("int8", "w8a8" or "bf16") rounds it (`rounded`; "w8a8": its input rounded too,
    `int8_activations`): torch's reference for `EngineConfig.weights` (the start-up check's, the tests').
    `compute="bf16"`: every one but the LM head with its weight and its input rounded to bf16 (`PanelLinear`'s
    bf16 compute; `weights` None or "bf16"). Forwards are patched, not weights (a tied embedding shares the LM
    head's weight)."""

    def __init__(self, model: nn.Module, weights: str | None, compute: str = "fp32"):
        self.model = model
        self.weights = weights
        self.compute = compute
        self.patched: list[nn.Linear] = []

    def __enter__(self) -> "QuantizedReference":
        head = self.model.get_output_embeddings() if hasattr(self.model, "get_output_embeddings") else None
        for m in self.model.modules():
            if isinstance(m, nn.Linear) and m.weight.dtype == torch.float32:  # (what `PackedLinears` packs)
                bf16 = self.compute == "bf16" and m is not head
                weights = "bf16" if bf16 else self.weights
                if weights is None:
                    continue
                linear = functools.partial(F.linear, weight=rounded(m.weight.detach(), weights), bias=m.bias)
                if self.weights == "w8a8":
                    m.forward = lambda x, f=linear: f(int8_activations(x))
                elif bf16 and m.in_features % 32 == 0:  # (else fp32 rows, as `PanelLinear`)
                    m.forward = lambda x, f=linear: f(x.to(torch.bfloat16).float())
                else:
                    m.forward = linear
                self.patched.append(m)
        return self

    def __exit__(self, *exc_info) -> None:
        for m in self.patched:
            del m.forward
        self.patched = []


def _widened(linear: PanelLinear):
    def forward(x: torch.Tensor) -> torch.Tensor:
        return linear(x.float()).to(x.dtype)

    return forward


def packed_linear(weights: list[torch.Tensor], bias: torch.Tensor | None, store=None):
    """A `PanelLinear` where the C++ kernels build (kept in `store`), else oneDNN's matmul over a stacked copy
    packed here."""
    if native.available():
        return PanelLinear(weights, bias, store=store)
    packed = torch.ops.mkldnn._reorder_linear_weight(torch.cat(weights) if len(weights) > 1 else weights[0], None)
    out_features = sum(w.shape[0] for w in weights)

    def forward(x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        if not flat.is_contiguous():
            flat = flat.contiguous()
        y = torch.ops.mkldnn._linear_pointwise(flat, packed, bias, "none", [], "")
        return y.view(*x.shape[:-1], out_features)

    forward.tensors = [packed]  # (as `PanelLinear.tensors`)
    return forward
