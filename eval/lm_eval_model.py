"""The lm-evaluation-harness model `dllm`: any model, sampler and cache on lm-eval's generative and likelihood
tasks.

    python -m dllm.eval.lm_eval_model --model dllm --tasks gsm8k --batch_size 8 --model_args \\
        pretrained=/path/to/LLaDA-8B-Instruct,sampler=threshold,threshold=0.9,cache=dual,gen_length=256,device=cuda

The command line is lm-eval's own (`pip install 'dllm-fast[lm-eval]'`); lm-eval only finds models that are
imported, so this module registers `dllm` first. From Python: `import dllm.eval.lm_eval_model`, then
`lm_eval.simple_evaluate(model="dllm", model_args=...)`. The checkpoint is `pretrained=` (lm-eval's name for it)
or `model=`; sampler and cache parameters go in `--model_args` by name, and so do LLaDA's generation options
`cfg_scale` (also for likelihoods; `cfg` is LLaDA's `eval_llada.py` name for it), `logits_eos_inf`,
`confidence_eos_eot_inf`. Without a sampler the model's own decoding (`dllm generate --explain`).

- generate_until: the answer canvas is the request's `max_gen_toks` rounded up to whole blocks (else
  `gen_length`), the answer cut at `max_gen_toks` tokens and at the first `until` string; a context longer
  than the model's context leaves room for the canvas by losing its start (as lm-eval's HF models). Requests
  are decoded longest first in batches of `batch_size`.
- loglikelihood: the Monte Carlo ELBO of `dllm.engine.likelihood` with `mc_num` draws (default 128, LLaDA's
  setting; cost: `mc_num` rows per continuation, `mc_batch_size` per forward), `cfg_scale` guidance (default 0)
  and the greedy check (`greedy_check`, one forward per continuation token, guided as the score; off saves them
  and reports False). A Dream model is scored as Dream's harness scores it: BOS before the context, EOS after
  the continuation, Dream's estimator (`likelihood_convention=llada` or `dream` says otherwise).
- loglikelihood_rolling: the ELBO of each `max_length` window of the text with no context (a bound, per window).
- Under `accelerate launch` each process takes its share of the requests (lm-eval splits them by `rank`).
- A `device=cuda` (lm-eval's default) without a GPU falls back to the CPU with a one-line notice.
- `threads=N` sets the CPU thread count (`dllm.load`); per rank with `tensor_parallel=N`, which splits the model
  over N processes started for lm-eval's (likelihoods too: each forward's logits gathered from the ranks).
- Offline: the synthetic suite as lm-eval tasks ships in `lm_eval_tasks/` beside this file (`TASKS`):
  `--include_path TASKS --tasks dllm_synthetic,dllm_synthetic_mc --apply_chat_template`. A task whose dataset
  cannot be loaded (the Hub unreachable) stops with one `error:` line instead of lm-eval's traceback.
"""
from __future__ import annotations

import os
import sys
import traceback
import warnings
from pathlib import Path

import torch
from tqdm import tqdm

from dllm.core.errors import DllmError, one_line_notice

try:
    from lm_eval.api.model import LM
    from lm_eval.api.registry import register_model
except ImportError:  # optional extra: the class still answers plain request objects
    LM, register_model = object, None


def _device(device: str | None) -> str:
    if device and device.startswith("cuda") and not torch.cuda.is_available():
        print(f"note: device {device!r} asked for but no GPU is available; running on the CPU", file=sys.stderr)
        return "cpu"
    return device or "cpu"


def _flag(name: str, value) -> bool:
    """A --model_args switch: true/false, 1/0, yes/no, on/off."""
    text = str(value).lower()
    if text not in ("true", "1", "yes", "on", "false", "0", "no", "off"):
        raise DllmError(f"{name} must be true or false, got {value!r}")
    return text in ("true", "1", "yes", "on")


def _number(name: str, value, kind: type):
    """`value` (lm-eval passes --model_args as text) as an int or float, or a one-line error naming `name`."""
    try:
        return kind(value)
    except (TypeError, ValueError):
        raise DllmError(f"{name} must be a number, got {value!r}") from None


class DllmLM(LM):
    """Answers lm-eval requests (objects whose `.args` is `(context, {"until": [...], ...})` for generation,
    `(context, continuation)` for likelihoods, `(text,)` for rolling likelihoods)."""

    def __init__(self, model: str | None = None, sampler: str | None = None, cache: str | None = None,
                 gen_length: int | None = None, block_length: int | None = None, steps: int | None = None,
                 seed: int = 0, device: str | None = None, dtype: str | None = None, batch_size: int | str = 1,
                 max_batch_size: int | None = None, mc_num: int = 128, mc_batch_size: int = 32,
                 cfg_scale: float | None = None, cfg: float | None = None, logits_eos_inf: bool = False,
                 confidence_eos_eot_inf: bool = False, greedy_check: bool = True, threads: int | str | None = None,
                 likelihood_convention: str | None = None, pretrained: str | None = None, quantize: str | None = None,
                 quantize_head: bool = False, tensor_parallel: int | str = 1,
                 **params) -> None:  # lm-eval passes max_batch_size
        super().__init__()
        from accelerate import PartialState

        import dllm
        from dllm import cache as caches
        from dllm import samplers
        from dllm.core.checks import check_int
        from dllm.engine.guidance import Guidance
        from dllm.engine.likelihood import CONVENTIONS, convention_of
        from dllm.engine.options import settle

        if not str(batch_size).isdigit() or int(batch_size) < 1:
            raise DllmError(f"batch_size must be a positive integer, got {batch_size!r}")
        if model is not None and pretrained is not None and model != pretrained:
            raise DllmError(f"pretrained={pretrained} and model={model} name two checkpoints; give one")
        if cfg_scale is not None and cfg is not None and float(cfg_scale) != float(cfg):
            raise DllmError(f"cfg_scale={cfg_scale} and cfg={cfg} (LLaDA's name for it) disagree; give one")
        scale = next((v for v in (cfg_scale, cfg) if v is not None), 0.0)
        guidance = Guidance(_number("cfg_scale" if cfg is None else "cfg", scale, float),
                            _flag("logits_eos_inf", logits_eos_inf),
                            _flag("confidence_eos_eot_inf", confidence_eos_eot_inf))
        if likelihood_convention not in (None, *CONVENTIONS):
            raise DllmError(f"likelihood_convention must be one of {', '.join(CONVENTIONS)}, got "
                            f"{likelihood_convention!r}")
        if gen_length == "auto":
            raise DllmError("gen_length=auto grows each answer while decoding, and this adapter sizes each canvas from "
                            "lm-eval's max_gen_toks; give gen_length=N (gen_length auto: dllm eval, dllm generate)")
        if sampler is not None:  # checked before the weights load (without one: the model's, see below)
            samplers.SAMPLERS.get(sampler)
        if cache is not None:
            caches.CACHES.get(cache)
        device = _device(device)
        tensor_parallel = _number("tensor_parallel", tensor_parallel, int)
        if tensor_parallel > 1 and int(os.environ.get("WORLD_SIZE", "1")) > 1:
            raise DllmError("tensor_parallel=N starts the model's ranks itself, and accelerate launch runs the "
                            "adapter data-parallel; run lm-eval as one plain process")
        state = PartialState(cpu=device == "cpu")
        self._rank, self._world_size = state.process_index, state.num_processes
        if device == "cuda" and self._world_size > 1:
            device = f"cuda:{state.local_process_index}"
        self.model, self.tokenizer = dllm.load(pretrained or model or "tiny-llada", device=device, dtype=dtype,
                                               threads=None if threads is None else _number("threads", threads, int),
                                               quantize=quantize, quantize_head=_flag("quantize_head", quantize_head),
                                               tensor_parallel=tensor_parallel)
        self._device = self.model.device
        if self._world_size > 1:
            from accelerate import Accelerator

            self.accelerator = Accelerator(cpu=self._device.type == "cpu")  # lm-eval gathers through it
        settings = settle(self.model, sampler, cache, params, gen_length=gen_length, block_length=block_length,
                          steps=steps, **guidance.config())
        self.sampler, self.cache = settings.sampler, settings.cache
        self.decoding = dict(**settings.lengths, seed=seed, **guidance.config())
        self.batch_size = int(batch_size)
        self.convention = likelihood_convention or convention_of(self.model)
        self.likelihood = dict(mc_num=check_int("mc_num", _number("mc_num", mc_num, int), 1),
                               batch_size=check_int("mc_batch_size", _number("mc_batch_size", mc_batch_size, int), 1),
                               cfg_scale=guidance.cfg_scale, seed=seed, convention=self.convention,
                               bos_id=self.tokenizer.bos_token_id)
        self.greedy_check = _flag("greedy_check", greedy_check)

    def _canvas(self, max_gen_toks: int | None) -> dict:
        """Decoding lengths for an answer of at most `max_gen_toks` tokens: whole blocks, the same steps per token."""
        from dllm.engine.options import lengths_for_answer

        lengths = {k: self.decoding[k] for k in ("gen_length", "block_length", "steps")}
        return {**self.decoding, **lengths_for_answer(lengths, max_gen_toks)}

    def _log_share(self, kind: str, requests) -> None:
        if self._world_size > 1:
            # one write, so that the processes' lines never interleave
            sys.stderr.write(f"dllm: process {self._rank} of {self._world_size} answers {len(requests)} {kind} "
                             f"requests\n")
            sys.stderr.flush()

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        import dllm
        from dllm.engine.text import answer_text, encode_prompts

        self._log_share("generate_until", requests)

        answers: list[str | None] = [None] * len(requests)
        groups: dict[int | None, list[int]] = {}
        for i, request in enumerate(requests):
            groups.setdefault(request.args[1].get("max_gen_toks"), []).append(i)
        bar = tqdm(total=len(requests), disable=disable_tqdm, desc="dllm")
        for max_gen_toks, members in groups.items():
            members.sort(key=lambda i: -len(requests[i].args[0]))  # similar lengths batch together
            if max_gen_toks is not None and (isinstance(max_gen_toks, bool) or not isinstance(max_gen_toks, int)
                                             or max_gen_toks < 1):
                raise DllmError(f"max_gen_toks must be a positive integer, got {max_gen_toks!r}")
            decoding = self._canvas(max_gen_toks)
            room = self.model.config.max_length - decoding["gen_length"]
            if room < 1:
                raise DllmError(f"an answer canvas of {decoding['gen_length']} tokens leaves no room for a context in "
                                f"the model's {self.model.config.max_length}; lower gen_length or max_gen_toks")
            for start in range(0, len(members), self.batch_size):
                batch = members[start:start + self.batch_size]
                contexts = encode_prompts(self.tokenizer, [requests[i].args[0] for i in batch], chat=False)
                out = dllm.generate(self.model, self.tokenizer, [ids[-room:] for ids in contexts], self.sampler,
                                    self.cache, chat=False, **decoding)  # lm-eval applies the chat template itself
                for i, ids in zip(batch, out.token_ids):
                    ids = ids[:int(max_gen_toks)] if max_gen_toks else ids
                    text = answer_text(self.tokenizer, ids)
                    until = requests[i].args[1].get("until") or []
                    for stop in [until] if isinstance(until, str) else until:
                        text = text.split(stop)[0] if stop else text
                    answers[i] = text
                bar.update(len(batch))
        bar.close()
        return answers

    def _encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """Token ids of the context and of the continuation as lm-eval's `TemplateLM._encode_pair` (and LLaDA's and
        Dream's harnesses) split them: the context's trailing spaces move to the continuation, then the whole
        text's ids are split after the context's; unless the context's ids without those spaces are not a
        prefix of the whole text's while the context's own ids are (a special token that includes the
        spaces, as a chat header's), where they stay. The context is cut from the left to fit the model (a
        block-causal one keeps two blocks of room: the greedy check decodes whole blocks)."""
        from dllm.engine.text import encode_text

        def ids(text: str) -> list[int]:
            return encode_text(self.tokenizer, text, "a request")

        whole, stripped = ids(context + continuation), ids(context.rstrip())
        prefix = stripped
        if whole[:len(stripped)] != stripped and whole[:len(own := ids(context))] == own:
            prefix = own
        cfg = self.model.config
        room = cfg.max_length - 2 * (cfg.block_size or 0) - (len(whole) - len(prefix)) \
            - 2 * (self.convention == "dream")  # Dream's BOS and EOS
        return prefix[max(0, len(prefix) - room):], whole[len(prefix):]

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        from dllm.engine.likelihood import elbo, is_greedy

        self._log_share("loglikelihood", requests)
        results = []
        for request in tqdm(requests, disable=disable_tqdm, desc="dllm loglikelihood"):
            prefix, target = self._encode_pair(*request.args)
            score = elbo(self.model, prefix, target, **self.likelihood)
            if self.convention == "dream" and self.tokenizer.bos_token_id is not None:
                prefix = [self.tokenizer.bos_token_id, *prefix]  # the greedy check sees the context as scored
            greedy = self.greedy_check and bool(prefix) and is_greedy(self.model, prefix, target,
                                                                      self.likelihood["cfg_scale"])
            results.append((score, greedy))
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        from dllm.engine.likelihood import elbo
        from dllm.engine.text import encode_text

        window = self.model.config.max_length
        results = []
        for request in tqdm(requests, disable=disable_tqdm, desc="dllm loglikelihood_rolling"):
            ids = encode_text(self.tokenizer, request.args[0], "a request")
            results.append(sum(elbo(self.model, [], ids[i:i + window], **{**self.likelihood, "convention": "llada"})
                               for i in range(0, len(ids), window)))
        return results

    def all_gather(self, tensor):
        """lm-eval's collectives across `accelerate launch` processes (no-ops for one process)."""
        return self.accelerator.gather(tensor) if self._world_size > 1 else tensor

    def gather_object(self, obj, dst: int = 0):
        if self._world_size == 1:
            return [obj]
        result = [None] * self._world_size if self._rank == dst else None
        torch.distributed.gather_object(obj=obj, object_gather_list=result, dst=dst)
        return result

    def barrier(self) -> None:
        if self._world_size > 1:
            self.accelerator.wait_for_everyone()

    @property
    def tokenizer_name(self) -> str:
        return self.tokenizer.name_or_path.replace("/", "__")

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return self.tokenizer.apply_chat_template(chat_history, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)


if register_model is not None:
    register_model("dllm")(DllmLM)

TASKS = Path(__file__).resolve().parent / "lm_eval_tasks"  # the packaged tasks, for --include_path


def _from_datasets(error: BaseException) -> bool:
    """The error came from `datasets` loading a task's data: the Hub unreachable, an unknown dataset, a missing
    file (all OSErrors)."""
    frames = traceback.extract_tb(error.__traceback__)
    return isinstance(error, OSError) and any(f"{os.sep}datasets{os.sep}" in frame.filename for frame in frames)


if __name__ == "__main__":
    if register_model is None:
        raise SystemExit("lm-eval is not installed; pip install 'dllm-fast[lm-eval]'")
    from lm_eval.__main__ import cli_evaluate

    warnings.formatwarning = one_line_notice
    try:
        cli_evaluate()
    except DllmError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    except OSError as e:
        if not _from_datasets(e):
            raise
        print(f"error: lm-eval could not load a task's dataset ({str(e).strip().splitlines()[0]}); without the Hub, "
              f"run tasks with local data, e.g. the packaged ones: --include_path {TASKS} --tasks "
              f"dllm_synthetic,dllm_synthetic_mc --apply_chat_template (HF_DATASETS_OFFLINE=1 skips the download "
              f"retries)", file=sys.stderr)
        raise SystemExit(2) from None
