"""Quantized weights through torchao (`pip install 'dllm-fast[quant]'`), applied layer by layer while a model loads.

Schemes (`SCHEMES`) map to torchao 0.18 configs; what each quantizes:
- every `nn.Linear` of the attention and feed-forward layers (fused q|k|v and gate|up, shared experts), per
  output channel (int8, fp8) or per group of input columns (int4);
- the stacked routed experts of MoE layers (3D `[E, out, in]` parameters): per expert and output row to int8 with
  torchao's `Int8Tensor` under every scheme, weight-only. torchao has no grouped int8/int4 GEMM for them, so the
  layer dequantizes its stacks to the model dtype for `F.grouped_mm` each forward (one layer's experts at a time);
- not the MoE router (its scores choose the experts; it runs in fp32 as the reference does), the norms, the
  embedding, nor the LM head unless `quantize_head` (the head of an 8B model is 1 GB in bf16).
torchao is imported on first use only, never by `import dllm`.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors import safe_open
from torch import Tensor, nn

from ..core.errors import DllmError

SCHEMES = ("int8", "int8-dynamic", "int4", "fp8")  # README "Quantized weights" says what each one is
INT4_GROUPS = (128, 64, 32)  # the group sizes both int4 kernels take, largest first
FORMAT = "dllm-torchao"  # config.json `quantization_config.quant_method` of a checkpoint `save_pretrained` wrote


def is_quantized(t: Tensor) -> bool:
    """A torchao weight (a tensor subclass) rather than a plain tensor or parameter."""
    return type(t) not in (Tensor, nn.Parameter)


def dense(t: Tensor) -> Tensor:
    """`t` in its high-precision dtype: a quantized stack of experts dequantized, a plain tensor as it is."""
    return t.dequantize() if is_quantized(t) else t


def torchao():
    """The torchao module, imported quietly (it logs a warning per CUDA extension a CPU build cannot load)."""
    quiet = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [log.level for log in quiet]
    for log in quiet:
        log.setLevel(logging.ERROR)
    try:
        import torchao
        import torchao.prototype.safetensors.safetensors_support  # noqa: F401  (pulls in the mx formats: warns)
    except ImportError:
        raise DllmError("quantization needs torchao: pip install 'dllm-fast[quant]' (from a checkout: pip install -e "
                        "'.[quant]')") from None
    finally:
        for log, level in zip(quiet, levels):
            log.setLevel(level)
    return torchao


def check_quantization(scheme: str, device: torch.device, dtype: torch.dtype | None) -> torch.dtype | None:
    """Refuse a scheme this machine cannot run, before any work; returns the dtype to load in (int4 and fp8 need
    bfloat16 and get it when none is asked for)."""
    if scheme not in SCHEMES:
        raise DllmError(f"unknown quantization {scheme!r}; use one of {', '.join(SCHEMES)}")
    if device.type not in ("cpu", "cuda"):
        raise DllmError(f"quantized weights run on cpu or cuda, not {device.type}; drop --quantize")
    torchao()
    works = "int8, int8-dynamic" + (", int4" if cpu_int4_kernel() or device.type == "cuda" else "")
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    if scheme == "fp8" and (capability or (0, 0)) < (8, 9):
        where = "on a CPU" if capability is None else \
            f"{torch.cuda.get_device_name(device)} is {capability[0]}.{capability[1]}:"
        raise DllmError(f"fp8 needs a CUDA GPU of compute capability 8.9+ (Ada, Hopper); {where} use {works}")
    if scheme == "int4" and capability is not None and capability < (8, 0):
        raise DllmError(f"int4 on a GPU needs compute capability 8.0+ (tinygemm's kernel); "
                        f"{torch.cuda.get_device_name(device)} is {capability[0]}.{capability[1]}: use int8, int8-dynamic")
    if scheme == "int4" and device.type == "cpu" and not cpu_int4_kernel():
        raise DllmError(f"int4 on a CPU needs torch's CPU int4 kernel (aten._weight_int4pack_mm_for_cpu), which this "
                        f"torch {torch.__version__} lacks; use {works}")
    if scheme in ("int4", "fp8"):
        if dtype not in (None, torch.bfloat16):
            why = "torch's CPU int4 kernel is some 60x slower in float32 than float32 weights" \
                if device.type == "cpu" else "its kernels take bfloat16 activations"
            raise DllmError(f"{scheme} runs in bfloat16 ({why}); drop --dtype, or use --quantize int8")
        return torch.bfloat16
    return dtype


def cpu_int4_kernel() -> bool:
    return hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")


def _config(scheme: str, linear: nn.Linear):
    """torchao's config for one linear layer, or None to keep it (int4: no group size divides its width)."""
    from torchao.quantization import (Float8DynamicActivationFloat8WeightConfig, Int4WeightOnlyConfig,
                                      Int8DynamicActivationInt8WeightConfig, Int8WeightOnlyConfig, PerRow)

    if scheme == "int8":
        return Int8WeightOnlyConfig(set_inductor_config=False)
    if scheme == "int8-dynamic":
        return Int8DynamicActivationInt8WeightConfig(set_inductor_config=False)
    if scheme == "fp8":
        return Float8DynamicActivationFloat8WeightConfig(granularity=PerRow(), set_inductor_config=False)
    group = next((g for g in INT4_GROUPS if linear.in_features % g == 0), None)
    if group is None:
        return None
    if linear.weight.device.type == "cpu":
        from torchao.prototype.quantization.int4 import PrototypeInt4WeightOnlyConfig

        return PrototypeInt4WeightOnlyConfig(group_size=group, set_inductor_config=False)
    return Int4WeightOnlyConfig(group_size=group, int4_packing_format="tile_packed_to_4d", set_inductor_config=False)


@torch.no_grad()
def quantize_part(part: nn.Module, scheme: str) -> None:
    """Quantize the linear layers and expert stacks of `part` (a transformer layer, or the head) in place."""
    quantize_ = torchao().quantization.quantize_
    from torchao.quantization import Int8Tensor, PerRow

    for name, module in list(part.named_modules()):
        if isinstance(module, nn.Linear) and not name.endswith("router"):
            config = _config(scheme, module)
            if config is not None:
                quantize_(module, config)
        for attr, p in list(module.named_parameters(recurse=False)):
            if p.dim() == 3:  # a stack of routed experts [E, out, in]
                setattr(module, attr, nn.Parameter(Int8Tensor.from_hp(p.detach(), PerRow()), requires_grad=False))


def tensor_bytes(t: Tensor) -> int:
    """Bytes `t` holds: a torchao tensor's data and scales summed."""
    if not is_quantized(t):
        return t.numel() * t.element_size()
    names, _ = t.__tensor_flatten__()
    return sum(tensor_bytes(getattr(t, name)) for name in names if getattr(t, name) is not None)


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters and buffers, quantized ones as stored (a tied head counted once)."""
    tensors = {id(t): t for t in (*model.parameters(), *model.buffers())}
    return sum(tensor_bytes(t) for t in tensors.values())


def check_savable(scheme: str, device) -> None:
    """Refuse, before any work, to save what torchao's safetensors format cannot hold."""
    if scheme == "int4" and torch.device(device).type == "cpu":
        raise DllmError("int4 weights quantized on a CPU cannot be saved (torchao's safetensors format has no CPU int4 "
                        "layout); save int8 or int8-dynamic, or quantize int4 on a GPU (--device cuda)")


def flatten_state(model: nn.Module) -> tuple[dict[str, Tensor], dict[str, str]]:
    """The model's state as plain tensors and torchao's JSON metadata (torchao's safetensors format, our parameter
    names; a tied head saved once)."""
    from torchao.prototype.safetensors.safetensors_support import flatten_tensor_state_dict

    check_savable(model.quantization["scheme"], model.device)
    state = {name: t.detach() for name, t in model.state_dict(keep_vars=True).items()}
    if model.config.tied_head:
        state.pop("lm_head.weight")
    tensors, metadata = flatten_tensor_state_dict(state)
    return {name: t.contiguous().cpu() for name, t in tensors.items()}, metadata


def unflatten_tensor(name: str, metadata: dict[str, str], read) -> Tensor:
    """Tensor `name` of a checkpoint in torchao's safetensors format: a plain one read as it is, a quantized one
    rebuilt from its parts (`read(stored_name)` reads one stored tensor)."""
    from torchao.prototype.safetensors.safetensors_support import unflatten_tensor_state_dict

    described = json.loads(metadata[name])
    if described.get("_type") == Tensor.__name__:
        return read(name)
    module, _, attr = name.rpartition(".")
    parts = {f"{module}._{attr}_{part}": read(f"{module}._{attr}_{part}") for part in described["_tensor_data_names"]}
    rebuilt, _ = unflatten_tensor_state_dict(parts, {name: metadata[name], "tensor_names": json.dumps([name])})
    return rebuilt[name]


def saved_quantization(hf: dict, path: Path) -> dict | None:
    """config.json's `quantization_config` when `save_pretrained` wrote it (None without one); other formats are
    refused by name."""
    saved = hf.get("quantization_config")
    if saved is None:
        return None
    method = saved.get("quant_method") if isinstance(saved, dict) else None
    if method != FORMAT:
        raise DllmError(f"{path} is quantized by {method or 'an unknown method'} (config.json quantization_config); "
                        f"dllm loads only checkpoints it quantized itself ({FORMAT}): load the original "
                        f"bf16 checkpoint with --quantize")
    if saved.get("scheme") not in SCHEMES or not isinstance(saved.get("quantize_head"), bool) or \
            saved.get("dtype") not in ("float32", "bfloat16", "float16"):
        raise DllmError(f"{path / 'config.json'}: quantization_config needs a scheme ({', '.join(SCHEMES)}), "
                        f"quantize_head (true or false) and dtype (float32, bfloat16 or float16); save the model again")
    return saved


def check_saved_quantization(path: Path, saved: dict, device: torch.device, dtype: torch.dtype | None,
                              quantize: str | None, quantize_head: bool) -> torch.dtype:
    """The dtype a quantized checkpoint loads in (the one it was saved in), or a one-line error."""
    scheme = saved["scheme"]
    if (quantize is not None and quantize != scheme) or quantize_head > saved["quantize_head"]:
        asked = f"--quantize {quantize}" + (" --quantize-head" if quantize_head else "")
        raise DllmError(f"{path} holds {scheme} weights" + (" (head included)" if saved["quantize_head"] else "") +
                        f" and loads as saved; drop {asked}, or quantize the original checkpoint")
    if scheme == "int4" and device.type != "cuda":
        raise DllmError(f"{path} holds int4 weights in torchao's GPU layout; load it with --device cuda, or "
                        f"quantize the original checkpoint on this CPU (--quantize int4)")
    check_quantization(scheme, device, None)
    stored = getattr(torch, saved["dtype"])
    if dtype is not None and dtype != stored:
        raise DllmError(f"{path} was quantized in {str(stored).removeprefix('torch.')} and loads in it; drop "
                        f"--dtype, or quantize the original checkpoint in {str(dtype).removeprefix('torch.')}")
    return stored


def quantized_fill(model: nn.Module, path: Path, device):
    """A `fill` that reads each part's tensors from a checkpoint `save_pretrained` wrote from a quantized model
    (torchao's safetensors format under our parameter names), quantized ones rebuilt as torchao tensors; the file
    is opened per part, as `checkpoint.checkpoint_fill` does."""
    file = path / "model.safetensors"
    if not file.is_file():
        raise DllmError(f"{path} has no model.safetensors; save the quantized model again")
    try:
        with safe_open(str(file), framework="pt") as handle:
            metadata = handle.metadata() or {}
        stored = set(json.loads(metadata["tensor_names"]))
    except Exception as e:
        first = str(e).strip().partition("\n")[0]
        raise DllmError(f"{file} is corrupt ({type(e).__name__}: {first}); save the quantized model again") from None
    expected = {name for name, _ in model.named_parameters()}
    if stored != expected:
        odd = sorted(stored ^ expected)[0]
        raise DllmError(f"{file} does not match config.json ({odd} is {'extra' if odd in stored else 'missing'}); "
                        f"save the quantized model again")

    @torch.no_grad()
    def fill(prefix: str, part: nn.Module) -> None:
        with safe_open(str(file), framework="pt", device=str(device)) as handle:
            for name, p in list(part.named_parameters(prefix=prefix)):
                t = unflatten_tensor(name, metadata, handle.get_tensor)
                if is_quantized(t):
                    owner, _, attr = name.removeprefix(prefix).lstrip(".").rpartition(".")
                    setattr(part.get_submodule(owner), attr, nn.Parameter(t, requires_grad=False))
                else:
                    p.copy_(t)

    return fill
