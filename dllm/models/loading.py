"""`dllm.load`: a local Hugging Face directory, a shipped tiny model, or `random:<preset>` weights.

Checkpoints load from safetensors only (single file or sharded with its index), streamed tensor by tensor
through one name table per architecture (`WEIGHT_NAMES`); no remote code, no pickle.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from ..core.checks import choose_from
from ..core.errors import DllmError
from . import ARCHITECTURES_BY_NAME, PRESETS, DiffusionLM, ModelConfig, architecture_of
from .generation import GenerationConfig, read_generation_config
from .quantize import (FORMAT, check_quantization, check_saved_quantization, flatten_state, quantize_part,
                       quantized_fill, saved_quantization, torchao)
from .threads import requested_threads, set_threads
from .transformer import shard_rows

SHIPPED_DIR = Path(__file__).parent / "checkpoints"


def shipped_models() -> list[str]:
    return sorted(p.name for p in SHIPPED_DIR.glob("*") if (p / "config.json").exists())


def available_models() -> list[str]:
    return shipped_models() + [f"random:{name}" for name in PRESETS]


def model_families() -> dict[str, str]:
    """Every model `load` knows by name, with its architecture (a key of `ARCHITECTURES_BY_NAME`)."""
    arch_names = {module: name for name, module in ARCHITECTURES_BY_NAME.items()}
    shipped = {name: arch_names[read_config(SHIPPED_DIR / name)[1]] for name in shipped_models()}
    return {**shipped, **{f"random:{name}": cfg.arch for name, cfg in PRESETS.items()}}


def describe_models() -> list[dict[str, str]]:
    """`dllm list models`: each name and architecture, with what a shipped model was trained on."""
    out = [{"name": name, "family": family} for name, family in model_families().items()]
    for entry in out:
        if entry["name"] in shipped_models():
            file = SHIPPED_DIR / entry["name"] / "generation_config.json"
            arch = ARCHITECTURES_BY_NAME[entry["family"]]
            trained_on = read_generation_config(read_json(file, "fix it"), arch, file).get("trained_on")
            entry.update({"doc": f"trained on {trained_on}"} if trained_on else {})
    return out


def load(name_or_path: str, device: str | torch.device = "cpu", dtype: torch.dtype | str | None = None,
         seed: int = 0, threads: int | None = None, quantize: str | None = None, quantize_head: bool = False):
    """Return `(model, tokenizer)` for a shipped name (`tiny-llada`), `random:<preset>`, or a local directory.

    dtype defaults to the checkpoint's own float type on GPU and float32 on CPU (bfloat16 for int4 and fp8).
    `threads` sets torch's CPU thread count for the process (default: DLLM_THREADS, else OMP_NUM_THREADS, else
    one thread for a model under 10M parameters and the physical cores for a larger one; `model.threads` says
    which). quantize: a scheme of `dllm.models.quantize.SCHEMES` (int8, int8-dynamic, int4, fp8), applied to each
    layer as it loads; quantize_head quantizes the LM head too. A directory `save_pretrained` wrote from a
    quantized model loads quantized as it was saved."""
    if not isinstance(name_or_path, (str, Path)) or not str(name_or_path):
        raise DllmError(f"model must be a name or a directory, got {name_or_path!r}; e.g. load(\"tiny-llada\")")
    requested = requested_threads(threads)
    device = parse_device(device)
    dtype = parse_dtype(dtype) if dtype is not None else None
    if not isinstance(quantize_head, bool):
        raise DllmError(f"quantize_head must be true or false, got {quantize_head!r}")
    if quantize is not None:
        dtype = check_quantization(quantize, device, dtype)
    elif quantize_head:
        raise DllmError("quantize_head quantizes the head with the rest: add quantize=SCHEME (--quantize int8)")
    model, tokenizer = _load(str(name_or_path), device, dtype, seed, (quantize, quantize_head))
    model.threads = set_threads(model, requested)
    return model, tokenizer


def _load(name_or_path: str, device: torch.device, dtype: torch.dtype | None, seed: int,
          quantization: tuple[str | None, bool]):
    if name_or_path.startswith("random:"):
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
            raise DllmError(f"seed (of the random weights) must be an integer in 0..2^63-1, got {seed!r}")
        return _load_random(name_or_path.removeprefix("random:"), device, dtype or torch.float32, seed, quantization)
    if name_or_path in shipped_models():  # a bare name; anything with a slash is a path, even `./tiny-llada`
        return load_dir(SHIPPED_DIR / name_or_path, device, dtype, quantization)
    path = Path(name_or_path).expanduser()
    if path.is_file():
        raise DllmError(f"{name_or_path} is a file; give the checkpoint directory that holds it ({path.parent})")
    if not path.is_dir() and ("/" in name_or_path or name_or_path.startswith((".", "~"))):
        raise DllmError(f"no such directory {name_or_path}; give a local checkpoint directory (nothing is "
                        f"downloaded) or a model name from `dllm list models`")
    if not path.is_dir():
        raise DllmError(f"unknown model {name_or_path!r}; {choose_from(name_or_path, available_models())} "
                        f"(or give a local checkpoint directory)")
    return load_dir(path, device, dtype, quantization)


def parse_device(device) -> torch.device:
    """A usable torch device, or a one-line error naming the fix (e.g. `cuda` on a machine without a GPU)."""
    if not isinstance(device, (str, torch.device)):
        raise DllmError(f"device must be a string such as 'cpu' or 'cuda', got {device!r}")
    try:
        device = torch.device(device)
    except RuntimeError:
        raise DllmError(f"unknown device {device!r}; use cpu, cuda or cuda:N") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise DllmError("CUDA is not available on this machine (no GPU or a CPU-only torch); use --device cpu")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise DllmError(f"there is no {device}: this machine has {torch.cuda.device_count()} GPU(s)")
    elif device.type == "mps" and not torch.backends.mps.is_available():
        raise DllmError("MPS is not available on this machine; use --device cpu")
    elif device.type not in ("cpu", "cuda", "mps"):
        raise DllmError(f"device {str(device)!r} is not supported; use cpu, cuda or cuda:N")
    return device


DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


def parse_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """A floating-point torch dtype from its name or itself."""
    if isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype.removeprefix("torch.") in DTYPES:
        return DTYPES[dtype.removeprefix("torch.")]
    raise DllmError(f"unsupported dtype {dtype!r}; use one of float32, bfloat16, float16")


def _load_random(preset: str, device, dtype: torch.dtype, seed: int, quantization=(None, False)):
    if preset not in PRESETS:
        raise DllmError(f"unknown random model 'random:{preset}'; {choose_from(preset, list(PRESETS), 'random:')}")
    from .tokenizer import build_char_tokenizer

    cfg = PRESETS[preset]
    _check_head(cfg, *quantization)
    model = materialize(meta_model(cfg, dtype), device, random_fill(device, seed), *quantization)
    return model.eval(), build_char_tokenizer(ARCHITECTURES_BY_NAME[cfg.arch].TOKENIZER_STYLE)


def meta_model(cfg: ModelConfig, dtype: torch.dtype) -> DiffusionLM:
    """A model (its architecture's `MODEL_CLASS`, else `DiffusionLM`) in `dtype` on the meta device: shapes only,
    no memory."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            return getattr(ARCHITECTURES_BY_NAME[cfg.arch], "MODEL_CLASS", DiffusionLM)(cfg)
    finally:
        torch.set_default_dtype(previous)


def model_parts(model: DiffusionLM) -> list[tuple[str, nn.Module]]:
    """The model's parts in parameter order, each with the prefix of its parameter names: each child module (the
    embedding, the final norm, ...) and each layer on its own; the head not when it is tied (it is the
    embedding)."""
    parts = []
    for name, child in model.named_children():
        if name == "layers":
            parts += [(f"layers.{i}", layer) for i, layer in enumerate(child)]
        elif not (name == "lm_head" and model.config.tied_head):
            parts.append((name, child))
    return parts


def materialize(model: DiffusionLM, device, fill=None, quantize: str | None = None,
                quantize_head: bool = False) -> DiffusionLM:
    """Give a meta model memory on `device` one part at a time (`model_parts`): `fill(prefix, part)` writes the
    part's weights (a checkpoint's or random ones; None leaves them uninitialised), then with `quantize` its linear
    layers are quantized before the next part exists, so the full-precision model is never in memory at once."""
    for prefix, part in model_parts(model):
        part.to_empty(device=device)
        if fill is not None:
            fill(prefix, part)
        if quantize and (prefix.startswith("layers.") or (prefix == "lm_head" and quantize_head)):
            quantize_part(part, quantize)
    for name, buffer in model.named_buffers(recurse=False):  # computed by init_buffers on their device
        setattr(model, name, torch.empty_like(buffer, device=device))
    model.init_buffers()
    if quantize:
        model.quantization = {"scheme": quantize, "head": quantize_head}
    return model


def build_model(cfg: ModelConfig, device, dtype: torch.dtype) -> DiffusionLM:
    """A model on `device` in `dtype` with uninitialised weights (no random init of weights that a checkpoint or
    `init_random` overwrites)."""
    return materialize(meta_model(cfg, dtype), device)


def random_fill(device, seed: int, std: float = 0.02):
    """A `fill` of random weights: N(0, std), norms 1, biases 0, drawn in parameter order from one generator (so
    a model filled part by part gets the weights `init_random` gives it whole)."""
    gen = torch.Generator(device=device).manual_seed(seed)

    @torch.no_grad()
    def fill(prefix: str, part: nn.Module) -> None:
        for name, p in part.named_parameters(prefix=prefix):
            if name.endswith(("norm.weight", "scale")):  # norms, and DiffusionGemma's router and layer scales
                p.fill_(1.0)
            elif name.endswith("bias"):
                p.zero_()
            else:
                p.normal_(0.0, std, generator=gen)

    return fill


def init_random(model: DiffusionLM, seed: int, std: float = 0.02) -> None:
    fill = random_fill(model.device, seed, std)
    for prefix, part in model_parts(model):
        fill(prefix, part)


def _check_head(cfg: ModelConfig, quantize: str | None, quantize_head: bool) -> None:
    if quantize_head and cfg.tied_head:
        raise DllmError("this model's head is its embedding (tied), which stays in the model dtype; drop "
                        "--quantize-head")


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


def read_config(path: Path) -> tuple[dict, object]:
    """config.json without its null fields (null means unset in Hugging Face configs: our defaults apply) and
    the architecture module it names."""
    cfg_file = path / "config.json"
    if not cfg_file.exists():
        raise DllmError(f"{path} has no config.json; point at a Hugging Face model directory")
    hf = {key: value for key, value in read_json(cfg_file, "re-download the checkpoint").items() if value is not None}
    arch = architecture_of(hf)
    if arch is None:
        supported = ", ".join(dict.fromkeys(a.MODEL_TYPE for a in ARCHITECTURES_BY_NAME.values()))
        raise DllmError(f"unknown model_type {hf.get('model_type')!r} in {cfg_file}; supported: {supported} "
                        f"(LLaDA, Dream, SDAR, LLaDA2, LLaDA-MoE, Fast-dLLM v2, Nemotron-Labs-Diffusion and DiffusionGemma "
                        f"checkpoints)")
    return hf, arch


DLM_PAD = "<|dlm_pad|>"  # apple/DiffuCoder's padding after the answer (a Dream-layout checkpoint)


def load_dir(path: Path, device="cpu", dtype: torch.dtype | None = None, quantization=(None, False)):
    hf, arch = read_config(path)
    saved = saved_quantization(hf, path)
    if saved is not None:  # a checkpoint save_pretrained wrote from a quantized model: loads as it was saved
        dtype = check_saved_quantization(path, saved, torch.device(device), dtype, *quantization)
    tokenizer = load_tokenizer(path, arch)
    eot = tokenizer.convert_tokens_to_ids(arch.END_OF_TURN) if arch.END_OF_TURN in tokenizer.get_vocab() else None
    if "mask_token_id" not in hf and tokenizer.mask_token_id is not None:  # LLaDA2 names it in the tokenizer only
        hf = {**hf, "mask_token_id": tokenizer.mask_token_id}
    try:
        cfg = arch.config_from_hf(hf, end_of_turn_id=eot)
    except (KeyError, ValueError, TypeError) as e:
        problem = f"missing field {e}" if isinstance(e, KeyError) else e if isinstance(e, ValueError) else \
            f"a field has the wrong type ({e})"
        raise DllmError(f"{path / 'config.json'}: {problem}") from None
    generation, file = GenerationConfig(), path / "generation_config.json"
    if file.exists():
        hf_generation = read_json(file, "fix or delete it")
        generation = read_generation_config(hf_generation, arch, file)
        if hf_generation.get("mask_token_id") not in (None, cfg.mask_id):
            raise DllmError(f"{file} says mask_token_id {hf_generation['mask_token_id']}, config.json "
                            f"{cfg.mask_id}; make them agree")
    padding = tokenizer.get_vocab().get(DLM_PAD)  # DiffuCoder fills the canvas after its answer with this token
    stops = {*generation.stop_ids, *([] if padding is None else [padding])} - set(cfg.stop_ids)
    if stops:  # an answer ends there too
        cfg = dataclasses.replace(cfg, stop_ids=tuple(sorted({*cfg.stop_ids, *(i for i in stops
                                                                              if i < cfg.vocab_size)})))
    _check_head(cfg, *quantization)
    if dtype is None:
        dtype = torch.float32 if torch.device(device).type == "cpu" else _checkpoint_dtype(hf, path)
    model = meta_model(cfg, dtype)
    if saved is not None:
        materialize(model, device, quantized_fill(model, path, device))
        model.quantization = {"scheme": saved["scheme"], "head": saved["quantize_head"]}
    else:
        skipped = getattr(arch, "SKIPPED_WEIGHTS", ())
        materialize(model, device, checkpoint_fill(model, path, arch.WEIGHT_NAMES, device, skipped), *quantization)
    model.generation_defaults = generation
    return model.eval(), tokenizer


def _checkpoint_dtype(hf: dict, path: Path) -> torch.dtype:
    """The float type config.json names (`dtype` since transformers 4.56, `torch_dtype` before), else bf16."""
    name = hf.get("dtype") or hf.get("torch_dtype") or "bfloat16"
    try:
        return parse_dtype(name)
    except DllmError:
        raise DllmError(f"{path / 'config.json'} names dtype {name!r}; pass --dtype float32, bfloat16 or "
                        f"float16") from None


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


def _target(model: DiffusionLM, params: dict, ours: str) -> torch.Tensor:
    """Our tensor for a name-table entry: a parameter, one expert of a stacked one (`name@e`), or the rows of a
    fused one (`name:shard`)."""
    name, _, shard = ours.partition(":")
    name, _, expert = name.partition("@")
    t = params[name][int(expert)] if expert else params[name]
    return t[shard_rows(model.config, shard, t.shape[0])] if shard else t


FLOAT_WEIGHTS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _part_of(ours: str) -> str:
    """The `model_parts` prefix a name-table target belongs to (`layers.3`, `embed`, ...)."""
    top, _, rest = _parameter(ours).partition(".")
    return f"{top}.{rest.partition('.')[0]}" if top == "layers" else top


def checkpoint_fill(model: DiffusionLM, path: Path, table: dict[str, str], device, skipped: tuple[str, ...] = ()):
    """A `fill` that streams each part's tensors from the safetensors files, checked first, strictly: no missing
    or extra names (but those starting with a `skipped` prefix and not in the table), and every parameter of ours
    written (the model's memory is uninitialised until then). A part opens (memory-maps) the files it reads and
    closes them, so the checkpoint's pages never all count as ours."""
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

    @torch.no_grad()
    def fill(prefix: str, part: nn.Module) -> None:
        part_params = dict(part.named_parameters(prefix=prefix))
        for f, tensor_names in by_part.get(prefix, {}).items():
            try:
                with safe_open(str(f), framework="pt", device=str(device)) as handle:
                    tensors = {name: handle.get_tensor(name) for name in tensor_names}
            except Exception as e:
                raise DllmError(f"{f} is corrupt ({type(e).__name__}: {_first_line(e)}); "
                                f"re-download the checkpoint") from None
            for name, t in tensors.items():
                p = _target(model, part_params, names[name])
                if t.dtype not in FLOAT_WEIGHTS:
                    raise DllmError(f"{f.name}: {name} is {t.dtype}; dllm loads float32, bfloat16 or float16 "
                                    f"weights (dequantize the checkpoint first)")
                if t.shape != p.shape:
                    raise DllmError(f"{f.name}: {name} has shape {tuple(t.shape)}, config.json implies "
                                    f"{tuple(p.shape)}; the config and weights do not belong together")
                p.copy_(t)

    return fill


def load_weights(model: DiffusionLM, path: Path, table: dict[str, str], skipped: tuple[str, ...] = ()) -> None:
    """Stream every tensor from the safetensors files into `model` (which has memory), strictly."""
    fill = checkpoint_fill(model, path, table, model.device, skipped)
    for prefix, part in model_parts(model):
        fill(prefix, part)


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
