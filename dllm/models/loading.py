"""`dllm.load`: a local Hugging Face directory, a shipped tiny model, or `random:<preset>` weights.

Checkpoints load from safetensors only (single file or sharded with its index), streamed part by part through
one name table per architecture (`WEIGHT_NAMES`, read in `checkpoint.py`); no remote code, no pickle. A model is
built on the meta device and each part gets memory, weights and (optionally) quantization in turn.
"""
from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import torch
from torch import nn

from ..core.checks import check_int, choose_from
from ..core.errors import DllmError
from . import ARCHITECTURES_BY_NAME, PRESETS, DiffusionLM, ModelConfig, architecture_of
from .checkpoint import checkpoint_fill, load_tokenizer, read_json
from .generation import GenerationConfig, read_generation_config
from .parallel import RankFailed, Ranks, ranks
from .quantize import check_quantization, check_saved_quantization, quantize_part, quantized_fill, saved_quantization
from .sharding import Shard, pieces, refusal, shard_model, take
from .threads import requested_threads, set_threads

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
         seed: int = 0, threads: int | None = None, quantize: str | None = None, quantize_head: bool = False,
         weights: bool = True, tensor_parallel: int = 1):
    """Return `(model, tokenizer)` for a shipped name (`tiny-llada`), `random:<preset>`, or a local directory.

    dtype defaults to the checkpoint's own float type on GPU and float32 on CPU (bfloat16 for int4 and fp8).
    `threads` sets torch's CPU thread count for the process (default: DLLM_THREADS, else OMP_NUM_THREADS, else
    one thread for a model under 10M parameters and the physical cores for a larger one; `model.threads` says
    which). quantize: a scheme of `dllm.models.quantize.SCHEMES` (int8, int8-dynamic, int4, fp8), applied to each
    layer as it loads; quantize_head quantizes the LM head too. A directory `save_pretrained` wrote from a
    quantized model loads quantized as it was saved.

    `tensor_parallel=N`: the model is split over N processes (`sharding`: heads, feed-forward columns, experts,
    vocabulary), this one rank 0, the others started for it (under `torchrun`, the processes it started, where this
    call returns on rank 0 only: the others follow rank 0 until it exits); on CUDA rank r on GPU r. Every sampler and
    cache decodes it as one process would. `weights=False` only checks that the model splits."""
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
    size = check_int("tensor_parallel", tensor_parallel, 1)
    if size > 1 and quantize is not None:
        raise DllmError("a tensor-parallel model is not quantized (its shards are plain tensors); drop --quantize "
                        "or --tensor-parallel")
    if size > 1 and weights:
        return _load_parallel(str(name_or_path), device, dtype, seed, requested, size)
    model, tokenizer = _load(str(name_or_path), device, dtype, seed, (quantize, quantize_head), weights)
    if size > 1:
        check_parallel(model.config, size)
    if weights:
        model.threads = set_threads(model, requested)
    return model, tokenizer


def check_parallel(cfg: ModelConfig, size: int) -> None:
    """Refuse (one line) a model that does not split over `size` ranks."""
    why = refusal(cfg, size)
    if why is not None:
        raise DllmError(f"{cfg.arch} cannot run on {size} tensor-parallel ranks: {why}; choose a tensor_parallel "
                        f"that divides it")


def _load_parallel(name: str, device: torch.device, dtype: torch.dtype | None, seed: int,
                   requested: tuple[int, str] | None, size: int):
    """Rank 0's `load` of a tensor-parallel model: the config checked on the meta device, the other ranks started
    (once per process) and loading their shards while this one loads its own."""
    cfg = _load(name, device, dtype, seed, (None, False), weights=False)[0].config
    check_parallel(cfg, size)
    group = ranks(size, device)
    key = group.build(_rank_shard, name, str(device), dtype, seed, requested, size)
    model, tokenizer = _load_rank(name, str(device), dtype, seed, requested, size)
    group.adopt(model, key)
    return model, tokenizer


def _rank_shard(*args):
    """Another rank's shard of rank 0's `load`."""
    return _load_rank(*args)[0]


def _load_rank(name: str, device: str, dtype: torch.dtype | None, seed: int, requested, size: int):
    """This rank's shard of a tensor-parallel `load` (and the tokenizer), once every rank has said it loaded."""
    group, failure = ranks(size, torch.device(device)), None
    try:
        model, tokenizer = _load(name, group.device, dtype, seed, (None, False), parallel=group)
        model.threads = set_threads(model, requested, size)
    except DllmError as error:
        failure = error
        if not group.leader:
            print(f"dllm: tensor-parallel rank {group.rank}: {error}", file=sys.stderr)
    try:
        group.agree(failure is None, "load its shard of the model")
    except RankFailed:
        if failure is not None and group.leader:
            raise failure from None
        raise
    return model, tokenizer


def _load(name_or_path: str, device: torch.device, dtype: torch.dtype | None, seed: int,
          quantization: tuple[str | None, bool], weights: bool = True, parallel: Ranks | None = None):
    """`load`'s model; `parallel`: this rank's shard of it."""
    if name_or_path.startswith("random:"):
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
            raise DllmError(f"seed (of the random weights) must be an integer in 0..2^63-1, got {seed!r}")
        return _load_random(name_or_path.removeprefix("random:"), device, dtype or torch.float32, seed, quantization,
                            weights, parallel)
    if name_or_path in shipped_models():  # a bare name; anything with a slash is a path, even `./tiny-llada`
        return load_dir(SHIPPED_DIR / name_or_path, device, dtype, quantization, weights, parallel)
    path = Path(name_or_path).expanduser()
    if path.is_file():
        raise DllmError(f"{name_or_path} is a file; give the checkpoint directory that holds it ({path.parent})")
    if not path.is_dir() and ("/" in name_or_path or name_or_path.startswith((".", "~"))):
        raise DllmError(f"no such directory {name_or_path}; give a local checkpoint directory (nothing is "
                        f"downloaded) or a model name from `dllm list models`")
    if not path.is_dir():
        raise DllmError(f"unknown model {name_or_path!r}; {choose_from(name_or_path, available_models())} "
                        f"(or give a local checkpoint directory)")
    return load_dir(path, device, dtype, quantization, weights, parallel)


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


def _load_random(preset: str, device, dtype: torch.dtype, seed: int, quantization=(None, False), weights=True,
                 parallel: Ranks | None = None):
    if preset not in PRESETS:
        raise DllmError(f"unknown random model 'random:{preset}'; {choose_from(preset, list(PRESETS), 'random:')}")
    from .tokenizer import build_char_tokenizer

    cfg = PRESETS[preset]
    _check_head(cfg, *quantization)
    model = meta_model(cfg, dtype, parallel)
    if weights:
        fill = random_fill(device, seed)
        if parallel is not None:  # each part drawn whole, as one process draws it, and this rank's pieces kept
            fill = whole_parts_fill(meta_model(cfg, dtype), fill, model.tp, device)
        materialize(model, device, fill, *quantization)
    return model.eval(), build_char_tokenizer(ARCHITECTURES_BY_NAME[cfg.arch].TOKENIZER_STYLE)


def meta_model(cfg: ModelConfig, dtype: torch.dtype, parallel: Ranks | None = None) -> DiffusionLM:
    """A model (its architecture's `MODEL_CLASS`, else `DiffusionLM`) in `dtype` on the meta device: shapes only,
    no memory; `parallel`: this rank's shard of it (`sharding.shard_model`)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            model = getattr(ARCHITECTURES_BY_NAME[cfg.arch], "MODEL_CLASS", DiffusionLM)(cfg)
            return model if parallel is None else shard_model(model, Shard.of(parallel, cfg.vocab_size))
    finally:
        torch.set_default_dtype(previous)


def whole_parts_fill(whole: DiffusionLM, fill, shard: Shard, device):
    """A shard's `fill` from `fill` of the whole model `whole` (on the meta device): each part is made whole on
    `device`, filled, and its pieces (`sharding.pieces`) copied into the shard's part; one whole part at a time."""
    parts = dict(model_parts(whole))

    @torch.no_grad()
    def fill_shard(prefix: str, part: nn.Module) -> None:
        full = parts[prefix].to_empty(device=device)
        fill(prefix, full)
        copy_pieces(prefix, full, part, whole.config, shard)
        full.to_empty(device="meta")

    return fill_shard


@torch.no_grad()
def copy_pieces(prefix: str, full: nn.Module, part: nn.Module, cfg: ModelConfig, shard: Shard) -> None:
    """Copy into a shard's `part` its pieces of the whole model's `full` part (both named from `prefix`)."""
    whole = dict(full.named_parameters(prefix=prefix))
    for name, p in part.named_parameters(prefix=prefix):
        p.copy_(take(whole[name], pieces(cfg, shard, name)))


def parallel_copy(build, tensor_parallel: int):
    """A tensor-parallel model on the CPU whose every rank builds the whole model by `build()` (a picklable callable,
    e.g. a module-level function building a random model) and keeps its shard: for tests and small models, each rank
    holding a whole copy while it builds. Returns rank 0's shard."""
    size = check_int("tensor_parallel", tensor_parallel, 2)
    group = ranks(size, torch.device("cpu"))
    key = group.build(_copy_shard, build, size)
    model = _copy_shard(build, size)
    group.adopt(model, key)
    return model


def _copy_shard(build, size: int) -> DiffusionLM:
    whole = build()
    check_parallel(whole.config, size)
    group = ranks(size, torch.device("cpu"))
    model = meta_model(whole.config, whole.dtype, group)
    parts = dict(model_parts(whole))
    materialize(model, "cpu", lambda prefix, part: copy_pieces(prefix, parts[prefix], part, whole.config, model.tp))
    model.generation_defaults = whole.generation_defaults
    return model.eval()


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


INTEGER_KEYS = {  # config.json keys our architectures read as integers (the names of every family's config)
    "vocab_size", "embedding_size", "hidden_size", "d_model", "intermediate_size", "mlp_hidden_size",
    "moe_intermediate_size", "shared_expert_intermediate_size", "expert_intermediate_size", "dense_intermediate_size",
    "num_hidden_layers", "n_layers", "num_attention_heads", "n_heads", "num_key_value_heads", "n_kv_heads", "head_dim",
    "max_position_embeddings", "max_sequence_length", "num_experts", "num_experts_per_tok", "num_shared_experts",
    "n_group", "topk_group", "first_k_dense_replace", "decoder_sparse_step", "sliding_window", "rotary_dim",
    "canvas_length", "mask_token_id", "pad_token_id", "delete_token_id", "split_token_id", "image_token_id"}
NUMBER_KEYS = {"rms_norm_eps", "rope_theta", "mlp_ratio", "partial_rotary_factor", "routed_scaling_factor"}


def check_config_types(hf: dict, cfg_file: Path) -> None:
    """A number-valued key of config.json (or of its text_config) that holds something else, named as the file
    names it."""
    for fields in (hf, hf.get("text_config") if isinstance(hf.get("text_config"), dict) else {}):
        for key, value in fields.items():
            if value is None or (key not in INTEGER_KEYS and key not in NUMBER_KEYS):
                continue
            kind = "an integer" if key in INTEGER_KEYS else "a number"
            if isinstance(value, bool) or not isinstance(value, int if key in INTEGER_KEYS else (int, float)):
                raise DllmError(f"{cfg_file}: {key} must be {kind}, got {value!r}; fix the file")


def read_config(path: Path) -> tuple[dict, object]:
    """config.json without its null fields (null means unset in Hugging Face configs: our defaults apply) and
    the architecture module it names."""
    cfg_file = path / "config.json"
    if not cfg_file.exists():
        raise DllmError(f"{path} has no config.json; point at a Hugging Face model directory")
    hf = {key: value for key, value in read_json(cfg_file, "re-download the checkpoint").items() if value is not None}
    check_config_types(hf, cfg_file)
    arch = architecture_of(hf)
    if arch is None:
        supported = ", ".join(dict.fromkeys(a.MODEL_TYPE for a in ARCHITECTURES_BY_NAME.values()))
        raise DllmError(f"unknown model_type {hf.get('model_type')!r} in {cfg_file}; supported: {supported} "
                        f"(LLaDA, Dream, SDAR, LLaDA2, LLaDA-MoE, Fast-dLLM v2, Nemotron-Labs-Diffusion and DiffusionGemma "
                        f"checkpoints)")
    return hf, arch


DLM_PAD = "<|dlm_pad|>"  # apple/DiffuCoder's padding after the answer (a Dream-layout checkpoint)


def load_dir(path: Path, device="cpu", dtype: torch.dtype | None = None, quantization=(None, False), weights=True,
             parallel: Ranks | None = None):
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
    if parallel is not None and saved is not None:
        raise DllmError(f"{path} holds a quantized model, which is not split over tensor-parallel ranks; load the "
                        f"unquantized checkpoint")
    model = meta_model(cfg, dtype, parallel)
    if weights and saved is not None:
        materialize(model, device, quantized_fill(model, path, device))
        model.quantization = {"scheme": saved["scheme"], "head": saved["quantize_head"]}
    elif weights:
        skipped = getattr(arch, "SKIPPED_WEIGHTS", ())
        whole = None if parallel is None else meta_model(cfg, dtype)
        materialize(model, device, checkpoint_fill(model, path, arch.WEIGHT_NAMES, device, skipped, whole),
                    *quantization)
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


def load_weights(model: DiffusionLM, path: Path, table: dict[str, str], skipped: tuple[str, ...] = ()) -> None:
    """Stream every tensor from the safetensors files into `model` (which has memory), strictly."""
    fill = checkpoint_fill(model, path, table, model.device, skipped)
    for prefix, part in model_parts(model):
        fill(prefix, part)
