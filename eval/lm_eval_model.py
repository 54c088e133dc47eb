"""The lm-evaluation-harness model `dllm`: lm-eval's generate_until tasks with any model, sampler and cache.

    python -m dllm.eval.lm_eval_model --model dllm --tasks gsm8k --batch_size 8 --model_args \\
        model=/path/to/LLaDA-8B-Instruct,sampler=threshold,threshold=0.9,cache=dual,gen_length=256,device=cuda

The command line is lm-eval's own (`pip install 'dllm-fast[lm-eval]'`); lm-eval only finds models that are
imported, so this module registers `dllm` first. From Python: `import dllm.eval.lm_eval_model`, then
`lm_eval.simple_evaluate(model="dllm", model_args=...)`. Sampler and cache parameters go in `--model_args` by
name. The answer is generated over `gen_length` tokens and cut at the request's `until` strings; loglikelihood
requests are not supported.
"""
from __future__ import annotations

from tqdm import tqdm

from dllm.errors import DllmError

try:
    from lm_eval.api.model import LM
    from lm_eval.api.registry import register_model
except ImportError:  # optional extra: the class still answers plain request objects
    LM, register_model = object, None


class DllmLM(LM):
    """Answers `generate_until` requests (objects whose `.args` is `(context, {"until": [...], ...})`)."""

    def __init__(self, model: str = "tiny-llada", sampler: str = "low_confidence", cache: str = "none",
                 gen_length: int | None = None, block_length: int | None = None, steps: int | None = None,
                 seed: int = 0, device: str = "cpu", dtype: str | None = None, batch_size: int | str = 1,
                 max_batch_size: int | None = None, **params) -> None:  # lm-eval passes max_batch_size
        super().__init__()
        import dllm
        from dllm.engine import decoding_lengths, split_params

        if not str(batch_size).isdigit() or int(batch_size) < 1:
            raise DllmError(f"batch_size must be a positive integer, got {batch_size!r}")
        self.sampler, self.cache = split_params(sampler, cache, params)
        self.model, self.tokenizer = dllm.load(model, device=device, dtype=dtype)
        self.decoding = dict(**decoding_lengths(self.model, gen_length, block_length, steps), seed=seed)
        self.batch_size = int(batch_size)

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        import dllm

        answers = []
        for start in tqdm(range(0, len(requests), self.batch_size), disable=disable_tqdm, desc="dllm"):
            batch = requests[start:start + self.batch_size]
            out = dllm.generate(self.model, self.tokenizer, [r.args[0] for r in batch], self.sampler, self.cache,
                                chat=False, **self.decoding)  # lm-eval applies the chat template itself
            for request, text in zip(batch, out.texts):
                until = request.args[1].get("until") or []
                for stop in [until] if isinstance(until, str) else until:
                    text = text.split(stop)[0] if stop else text
                answers.append(text)
        return answers

    def loglikelihood(self, requests, disable_tqdm: bool = False):
        raise DllmError("the dllm model answers generate_until tasks only; choose a generative lm-eval task")

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
        raise DllmError("the dllm model answers generate_until tasks only; choose a generative lm-eval task")

    @property
    def tokenizer_name(self) -> str:
        return self.tokenizer.name_or_path.replace("/", "__")

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return self.tokenizer.apply_chat_template(chat_history, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)


if register_model is not None:
    register_model("dllm")(DllmLM)

if __name__ == "__main__":
    if register_model is None:
        raise SystemExit("lm-eval is not installed; pip install 'dllm-fast[lm-eval]'")
    from lm_eval.__main__ import cli_evaluate

    cli_evaluate()
