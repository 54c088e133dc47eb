"""A checkpoint directory's files: JSON read with one-line errors, the tokenizer, the name table from checkpoint
names to our parameters (vLLM's `load_weights` idea: one table per architecture), the safetensors shards streamed
part by part, and writing a model back under the official names (`save_pretrained`)."""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from ..core.errors import DllmError
from . import ARCHITECTURES_BY_NAME, DiffusionLM
from .quantize import FORMAT, flatten_state, torchao
from .sharding import SKIP, local_config, local_target, pieces
from .transformer import shard_rows


def read_json(file: Path, fix: str) -> dict:
    """A JSON object from `file`, or a one-line error that ends with `fix`."""
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise DllmError(f"{file} is not valid JSON ({e}); {fix}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise DllmError(f"cannot read {file} ({type(e).__name__}: {_first_line(e)}); {fix}") from None
    if not isinstance(data, dict):
        raise DllmError(f"{file} holds a JSON {type(data).__name__}, not an object; {fix}")
    return data


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tiktoken.model")  # any one of them


def load_tokenizer(path: Path, arch):
    from transformers import AutoTokenizer
    from transformers.utils import logging

    if not any((path / f).exists() for f in TOKENIZER_FILES):
        raise DllmError(f"{path} has no tokenizer files (one of {', '.join(TOKENIZER_FILES)}); copy them from the "
                        f"original checkpoint")
    verbosity = logging.get_verbosity()
    logging.set_verbosity_error()  # AutoTokenizer warns that it does not know our model types; it needs not
    try:
        tok = AutoTokenizer.from_pretrained(str(path), trust_remote_code=False)
    except Exception as e:  # Dream ships a remote-code tokenizer class; its vocab files are plain Qwen2
        if arch.MODEL_TYPE != "Dream":
            raise DllmError(f"cannot load the tokenizer in {path} ({type(e).__name__}: {_first_line(e)}); "
                            f"check its tokenizer files") from None
        from transformers import Qwen2Tokenizer

        try:
            tok = Qwen2Tokenizer.from_pretrained(str(path))
        except Exception as e:
            raise DllmError(f"cannot load the tokenizer in {path} ({type(e).__name__}: {_first_line(e)}); "
                            f"check its tokenizer files") from None
    finally:
        logging.set_verbosity(verbosity)
    tok.padding_side = "left"
    return tok


def _first_line(error: Exception) -> str:
    return (str(error).strip().splitlines() or [""])[0]


def weight_names(table: dict[str, str], n_layers: int, n_experts: int = 0) -> dict[str, str]:
    """Expand a name table to every layer `{i}` and expert `{e}`: checkpoint name -> our parameter name.
    Entries for parameters a layer lacks (an expert of a dense layer) are dropped by `load_weights`."""
    out = {}
    for ckpt, ours in table.items():
        for i in range(n_layers) if "{i}" in ckpt else [None]:
            for e in range(n_experts) if "{e}" in ckpt else [None]:
                out[ckpt.format(i=i, e=e)] = ours.format(i=i, e=e)
    return out


def table_names(model: DiffusionLM, table: dict[str, str]) -> dict[str, str]:
    """`weight_names` of `model`'s size, keeping only entries for parameters it has (e.g. no qkv bias)."""
    cfg, params = model.config, dict(model.named_parameters())
    names = weight_names(table, cfg.n_layers, cfg.moe.n_experts if cfg.moe else 0)
    return {ckpt: ours for ckpt, ours in names.items() if _parameter(ours) in params}


def _parameter(ours: str) -> str:
    """The parameter of a name-table target `name[@expert][:shard]`."""
    return ours.partition(":")[0].partition("@")[0]


def _shard_files(path: Path) -> dict[str, Path]:
    """Map each checkpoint tensor name to the safetensors file holding it (a single file wins over an index, as
    in transformers)."""
    single, index = path / "model.safetensors", path / "model.safetensors.index.json"
    if single.exists():
        try:
            with safe_open(str(single), framework="pt") as f:
                return {name: single for name in f.keys()}
        except Exception as e:
            raise DllmError(f"{single} is corrupt ({type(e).__name__}: {_first_line(e)}); "
                            f"re-download the checkpoint") from None
    if index.exists():
        weight_map = read_json(index, "re-download the checkpoint").get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
            raise DllmError(f"{index} is corrupt (no weight_map of tensor name -> file); re-download the checkpoint")
        files = {name: path / f for name, f in weight_map.items()}
        missing = sorted({str(f.name) for f in files.values() if not f.is_file()})
        if missing:
            raise DllmError(f"{path} is missing shard files {', '.join(missing)} named in its index; download them")
        return files
    if any(next(path.glob(pattern), None) for pattern in ("*.bin", "*.pt", "*.pth", "*.ckpt")):
        raise DllmError(f"{path} has only pickle weights (*.bin/*.pt/*.pth/*.ckpt); convert them to safetensors")
    raise DllmError(f"{path} has no model.safetensors or model.safetensors.index.json; download the weights")


def _target(model: DiffusionLM, params: dict, ours: str, cfg=None) -> torch.Tensor:
    """Our tensor for a name-table entry: a parameter, one expert of a stacked one (`name@e`), or the rows of a
    fused one (`name:shard`, by `cfg`'s sizes: a tensor-parallel shard's `local_config`; default the model's)."""
    name, _, shard = ours.partition(":")
    name, _, expert = name.partition("@")
    t = params[name][int(expert)] if expert else params[name]
    return t[shard_rows(cfg or model.config, shard, t.shape[0])] if shard else t


FLOAT_WEIGHTS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _part_of(ours: str) -> str:
    """The `model_parts` prefix a name-table target belongs to (`layers.3`, `embed`, ...)."""
    top, _, rest = _parameter(ours).partition(".")
    return f"{top}.{rest.partition('.')[0]}" if top == "layers" else top


def checkpoint_fill(model: DiffusionLM, path: Path, table: dict[str, str], device, skipped: tuple[str, ...] = (),
                    whole: DiffusionLM | None = None):
    """A `fill` that streams each part's tensors from the safetensors files, checked first, strictly: no missing
    or extra names (but those starting with a `skipped` prefix and not in the table), and every parameter of ours
    written (the model's memory is uninitialised until then). A part opens (memory-maps) the files it reads and
    closes them, so the checkpoint's pages never all count as ours. `model` a tensor-parallel shard: `whole` is the
    whole model on the meta device, and each tensor's piece (`sharding.pieces`) is read alone."""
    params = dict(model.named_parameters())
    names = table_names(model, table)
    unfilled = set(params) - {_parameter(ours) for ours in names.values()}
    if unfilled:
        raise DllmError(f"the {model.config.arch} name table fills no {sorted(unfilled)[0]}; this is a bug in dllm")
    files = _shard_files(path)
    missing = sorted(set(names) - set(files))
    tied = {ckpt for ckpt, ours in table.items() if ours == "lm_head.weight" and model.config.tied_head}
    unexpected = sorted(name for name in set(files) - set(names) - tied  # a tied checkpoint may still hold its head
                        if not name.startswith(skipped))
    if missing or unexpected:
        detail = (f"missing {len(missing)} tensors (first: {missing[0]})" if missing else "") + \
                 (("; " if missing else "") + f"unexpected {len(unexpected)} (first: {unexpected[0]})" if unexpected else "")
        raise DllmError(f"{path} does not match config.json: {detail}; is this the right checkpoint?")
    by_part: dict[str, dict[Path, list[str]]] = {}
    for name, ours in names.items():
        by_part.setdefault(_part_of(ours), {}).setdefault(files[name], []).append(name)

    shard = model.tp
    local = None if shard is None else local_config(model.config, shard.size)
    whole_params = None if whole is None else dict(whole.named_parameters())

    def read(handle, f: Path, name: str) -> torch.Tensor | None:
        """The tensor `name` (a shard's piece of it; None: none on this rank)."""
        if shard is None:
            return handle.get_tensor(name)
        piece = pieces(model.config, shard, names[name])
        if piece == SKIP:
            return None
        stored = handle.get_slice(name)
        expected = tuple(_target(whole, whole_params, names[name]).shape)
        if tuple(stored.get_shape()) != expected:
            raise DllmError(f"{f.name}: {name} has shape {tuple(stored.get_shape())}, config.json "
                            f"implies {expected}; the config and weights do not belong together")
        if piece is None:
            return stored[:]
        dim, ranges = piece
        return torch.cat([stored[a:b] if dim == 0 else stored[:, a:b] for a, b in ranges], dim)

    @torch.no_grad()
    def fill(prefix: str, part: nn.Module) -> None:
        part_params = dict(part.named_parameters(prefix=prefix))
        for f, tensor_names in by_part.get(prefix, {}).items():
            try:
                with safe_open(str(f), framework="pt", device=str(device)) as handle:
                    tensors = {name: read(handle, f, name) for name in tensor_names}
            except DllmError:
                raise
            except Exception as e:
                raise DllmError(f"{f} is corrupt ({type(e).__name__}: {_first_line(e)}); "
                                f"re-download the checkpoint") from None
            for name, t in tensors.items():
                if t is None:
                    continue
                p = (_target(model, part_params, names[name]) if shard is None else
                     _target(model, part_params, local_target(model.config, shard, names[name]), local))
                if t.dtype not in FLOAT_WEIGHTS:
                    raise DllmError(f"{f.name}: {name} is {t.dtype}; dllm loads float32, bfloat16 or float16 "
                                    f"weights (dequantize the checkpoint first)")
                if t.shape != p.shape:
                    raise DllmError(f"{f.name}: {name} has shape {tuple(t.shape)}, config.json implies "
                                    f"{tuple(p.shape)}; the config and weights do not belong together")
                p.copy_(t)

    return fill


def checkpoint_state(model: DiffusionLM) -> dict[str, torch.Tensor]:
    """The model's tensors under the official checkpoint names of its architecture (fused ones split)."""
    arch = ARCHITECTURES_BY_NAME[model.config.arch]
    params = dict(model.named_parameters())
    return {ckpt: _target(model, params, ours).detach().contiguous().cpu()
            for ckpt, ours in table_names(model, arch.WEIGHT_NAMES).items()}


def save_pretrained(model: DiffusionLM, tokenizer, path: str | Path) -> None:
    """Write `model` as a Hugging Face directory with the official names of its architecture; a quantized model
    in torchao's safetensors format under our parameter names, with a `quantization_config` naming the scheme, so
    that `load` reads it back quantized (quantize once, load many times)."""
    path = Path(path)
    arch = ARCHITECTURES_BY_NAME[model.config.arch]
    config = arch.hf_config(model.config)
    if model.quantization:
        tensors, metadata = flatten_state(model)  # refuses what torchao cannot save, before anything is written
        config["quantization_config"] = {"quant_method": FORMAT, "scheme": model.quantization["scheme"],
                                         "quantize_head": model.quantization["head"],
                                         "dtype": str(model.dtype).removeprefix("torch."),
                                         "torchao_version": torchao().__version__}
    else:
        tensors, metadata = checkpoint_state(model), {}
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"), metadata={**metadata, "format": "pt"})
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path / "model.safetensors", 0o666 & ~umask)  # safetensors writes 0600; the other files get the umask's
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    generation = model.generation_defaults
    config = {**{generation.keys.get(name, name): value for name, value in generation.values.items()},
              **{generation.keys[f"sampler.{name}"]: value for name, value in generation.sampler_args.items()},
              **generation.family}
    if config:
        (path / "generation_config.json").write_text(json.dumps(config, indent=2) + "\n")
    if tokenizer is not None:
        from .tokenizer import save_tokenizer

        save_tokenizer(tokenizer, path)
