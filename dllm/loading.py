"""`dllm.load`: a local Hugging Face directory, a shipped tiny model, or `random:<preset>` weights.

Checkpoints load from safetensors only (single file or sharded with its index), streamed tensor by tensor
through one name table per architecture (`WEIGHT_NAMES`); no remote code, no pickle.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .errors import DllmError
from .models import ARCHITECTURES, ARCHITECTURES_BY_NAME, PRESETS, DiffusionLM, ModelConfig

SHIPPED_DIR = Path(__file__).parent / "checkpoints"


def shipped_models() -> list[str]:
    return sorted(p.name for p in SHIPPED_DIR.glob("*") if (p / "config.json").exists())


def available_models() -> list[str]:
    return shipped_models() + [f"random:{name}" for name in PRESETS]


def load(name_or_path: str, device: str | torch.device = "cpu", dtype: torch.dtype | str | None = None,
         seed: int = 0):
    """Return `(model, tokenizer)` for a shipped name (`tiny-llada`), `random:<preset>`, or a local directory.

    dtype defaults to the checkpoint's own float type on GPU and float32 on CPU."""
    if isinstance(dtype, str):
        dtype = _parse_dtype(dtype)
    if name_or_path.startswith("random:"):
        return _load_random(name_or_path.removeprefix("random:"), device, dtype or torch.float32, seed)
    path = SHIPPED_DIR / name_or_path if (SHIPPED_DIR / name_or_path / "config.json").exists() else Path(name_or_path)
    if not path.is_dir():
        raise DllmError(f"unknown model {name_or_path!r}: give a local checkpoint directory or one of "
                        f"{', '.join(available_models())}")
    return load_dir(path, device, dtype)


def _parse_dtype(name: str) -> torch.dtype:
    table = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
             "float16": torch.float16, "fp16": torch.float16}
    if name not in table:
        raise DllmError(f"unknown dtype {name!r}; use one of {', '.join(table)}")
    return table[name]


def _load_random(preset: str, device, dtype: torch.dtype, seed: int):
    if preset not in PRESETS:
        raise DllmError(f"unknown random model {preset!r}; use one of "
                        f"{', '.join('random:' + p for p in PRESETS)}")
    from .tokenizer import build_char_tokenizer

    cfg = PRESETS[preset]
    model = build_model(cfg, device, dtype)
    init_random(model, seed)
    return model.eval(), build_char_tokenizer(cfg.arch)


def build_model(cfg: ModelConfig, device, dtype: torch.dtype) -> DiffusionLM:
    """Allocate a model directly on `device` in `dtype` (no full fp32 copy of a large model)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = DiffusionLM(cfg)
    finally:
        torch.set_default_dtype(previous)
    model.inv_freq = model.inv_freq.float()
    return model


@torch.no_grad()
def init_random(model: DiffusionLM, seed: int, std: float = 0.02) -> None:
    gen = torch.Generator(device=model.device).manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        elif name.endswith("bias"):
            p.zero_()
        else:
            p.normal_(0.0, std, generator=gen)


def read_config(path: Path) -> tuple[dict, object]:
    cfg_file = path / "config.json"
    if not cfg_file.exists():
        raise DllmError(f"{path} has no config.json; point at a Hugging Face model directory")
    try:
        hf = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise DllmError(f"{cfg_file} is not valid JSON ({e}); re-download the checkpoint") from None
    model_type = hf.get("model_type")
    if model_type not in ARCHITECTURES:
        raise DllmError(f"unknown model_type {model_type!r} in {cfg_file}; supported: "
                        f"{', '.join(ARCHITECTURES)} (LLaDA and Dream checkpoints)")
    return hf, ARCHITECTURES[model_type]


def load_dir(path: Path, device="cpu", dtype: torch.dtype | None = None):
    hf, arch = read_config(path)
    tokenizer = load_tokenizer(path, arch)
    eot = tokenizer.convert_tokens_to_ids(arch.END_OF_TURN) if arch.END_OF_TURN in tokenizer.get_vocab() else None
    try:
        cfg = arch.config_from_hf(hf, end_of_turn_id=eot)
    except (KeyError, ValueError) as e:
        raise DllmError(f"{path / 'config.json'}: {e if isinstance(e, ValueError) else f'missing field {e}'}") from None
    if dtype is None:
        dtype = torch.float32 if torch.device(device).type == "cpu" else _parse_dtype(hf.get("torch_dtype", "bfloat16"))
    model = build_model(cfg, device, dtype)
    load_weights(model, path, arch.WEIGHT_NAMES)
    return model.eval(), tokenizer


def load_tokenizer(path: Path, arch):
    from transformers import AutoTokenizer
    from transformers.utils import logging

    verbosity = logging.get_verbosity()
    logging.set_verbosity_error()  # AutoTokenizer warns that it does not know our model types; it needs not
    try:
        tok = AutoTokenizer.from_pretrained(str(path), trust_remote_code=False)
    except Exception as e:  # Dream ships a remote-code tokenizer class; its vocab files are plain Qwen2
        if arch.MODEL_TYPE != "Dream":
            raise DllmError(f"cannot load the tokenizer in {path}: {e}") from None
        from transformers import Qwen2Tokenizer

        tok = Qwen2Tokenizer.from_pretrained(str(path))
    finally:
        logging.set_verbosity(verbosity)
    tok.padding_side = "left"
    return tok


def weight_names(table: dict[str, str], n_layers: int) -> dict[str, str]:
    """Expand a `{i}` name table to every layer: checkpoint name -> our parameter name."""
    out = {}
    for ckpt, ours in table.items():
        layers = range(n_layers) if "{i}" in ckpt else [None]
        for i in layers:
            out[ckpt.format(i=i)] = ours.format(i=i)
    return out


def _shard_files(path: Path) -> dict[str, Path]:
    """Map each checkpoint tensor name to the safetensors file holding it."""
    single, index = path / "model.safetensors", path / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise DllmError(f"{index} is corrupt ({e}); re-download the checkpoint") from None
        files = {name: path / f for name, f in weight_map.items()}
        missing = sorted({str(f.name) for f in files.values() if not f.exists()})
        if missing:
            raise DllmError(f"{path} is missing shard files {', '.join(missing)} named in its index; download them")
        return files
    if single.exists():
        try:
            with safe_open(str(single), framework="pt") as f:
                return {name: single for name in f.keys()}
        except Exception as e:
            raise DllmError(f"{single} is corrupt ({type(e).__name__}: {e}); re-download the checkpoint") from None
    if list(path.glob("*.bin")) or list(path.glob("*.pt")):
        raise DllmError(f"{path} has only pickle weights (*.bin/*.pt); convert them to safetensors")
    raise DllmError(f"{path} has no model.safetensors or model.safetensors.index.json; download the weights")


@torch.no_grad()
def load_weights(model: DiffusionLM, path: Path, table: dict[str, str]) -> None:
    """Stream every tensor from the safetensors files into `model`, strictly (no missing or extra names)."""
    names = weight_names(table, model.config.n_layers)
    params = dict(model.named_parameters())
    names = {ckpt: ours for ckpt, ours in names.items() if ours in params}  # e.g. bias rows of a bias-free model
    files = _shard_files(path)
    missing = sorted(set(names) - set(files))
    unexpected = sorted(set(files) - set(names))
    if missing or unexpected:
        detail = (f"missing {len(missing)} tensors (first: {missing[0]})" if missing else "") + \
                 (("; " if missing else "") + f"unexpected {len(unexpected)} (first: {unexpected[0]})" if unexpected else "")
        raise DllmError(f"{path} does not match config.json: {detail}; is this the right checkpoint?")
    by_file: dict[Path, list[str]] = {}
    for name, f in files.items():
        by_file.setdefault(f, []).append(name)
    for f, tensor_names in by_file.items():
        try:
            with safe_open(str(f), framework="pt", device=str(model.device)) as handle:
                for name in tensor_names:
                    t = handle.get_tensor(name)
                    p = params[names[name]]
                    if t.shape != p.shape:
                        raise DllmError(f"{f.name}: {name} has shape {tuple(t.shape)}, config.json implies "
                                        f"{tuple(p.shape)}; the config and weights do not belong together")
                    p.copy_(t)
        except DllmError:
            raise
        except Exception as e:
            raise DllmError(f"{f} is corrupt ({type(e).__name__}: {e}); re-download the checkpoint") from None


def save_pretrained(model: DiffusionLM, tokenizer, path: str | Path) -> None:
    """Write `model` as a Hugging Face directory with the official names of its architecture."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    arch = ARCHITECTURES_BY_NAME[model.config.arch]
    params = dict(model.named_parameters())
    ours_to_ckpt = {ours: ckpt for ckpt, ours in weight_names(arch.WEIGHT_NAMES, model.config.n_layers).items()}
    save_file({ours_to_ckpt[n]: p.detach().contiguous().cpu() for n, p in params.items()},
              str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(arch.hf_config(model.config), indent=2) + "\n")
    if tokenizer is not None:
        from .tokenizer import save_tokenizer

        save_tokenizer(tokenizer, path)
