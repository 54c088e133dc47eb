import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"
sys.path.insert(0, str(ROOT))

torch.set_num_threads(1)  # tiny models: one thread is as fast, and never oversubscribes


# pc_sampler's token-frequency table for models decoded without their directory: tiny-dream's, whose ids (< 53) every
# tiny and random preset has
PC_TABLE = {"frequency_file": str(ROOT / "dllm" / "models" / "checkpoints" / "tiny-dream" / "token_frequency.json")}


def shared_path(*parts: str) -> Path:
    """A file under ../shared (tests only); skips the test when it is not there."""
    p = SHARED.joinpath(*parts)
    if not p.exists():
        pytest.skip(f"{p} not available")
    return p


def serve(*flags: str, env: dict | None = None, wait: float = 120) -> tuple[subprocess.Popen, str]:
    """`dllm serve` with `flags` on a free loopback port, once it answers /health: the process and its URL."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "dllm.cli", "serve", "--port", str(port), *flags],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + wait
    while True:
        assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read() if proc.poll() else "no start"
        try:
            urllib.request.urlopen(url + "/health", timeout=5)
            return proc, url
        except OSError:
            time.sleep(0.2)


def random_model(preset: str, seed: int = 0, std: float = 0.2):
    """A tiny random-weight model with logits sharp enough that argmax ties are rare."""
    from dllm.models import PRESETS
    from dllm.models.loading import build_model, init_random

    model = build_model(PRESETS[preset], "cpu", torch.float32)
    init_random(model, seed, std=std)
    return model.eval()


@pytest.fixture(scope="session")
def tiny_llada():
    """The shipped tiny-llada and its tokenizer, loaded once for the session (a test must not change its weights)."""
    import dllm
    return dllm.load("tiny-llada")


@pytest.fixture(scope="session")
def tiny_dream():
    """The shipped tiny-dream and its tokenizer, loaded once for the session (a test must not change its weights)."""
    import dllm
    return dllm.load("tiny-dream")


@pytest.fixture(scope="module", params=["llada-tiny", "dream-tiny", "tiny-llada", "tiny-dream"])
def any_model(request):
    """Random-weight tiny presets and the shipped tiny models, for tests that every combination runs."""
    if request.param.startswith("tiny-"):
        import dllm
        return dllm.load(request.param)[0]
    return random_model(request.param)


@pytest.fixture(autouse=True)
def _registries_restored():
    """Samplers and caches a test registers are gone after it, so no other test iterates over them."""
    from dllm import cache, samplers

    kept = dict(samplers.SAMPLERS.classes), dict(cache.CACHES.classes)
    yield
    samplers.SAMPLERS.classes, cache.CACHES.classes = dict(kept[0]), dict(kept[1])
