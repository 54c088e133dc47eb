"""The playground page of `dllm serve` in headless Chromium (selenium; Debian's `chromium` and `chromium-driver`):
`Playground` drives the page (tests/test_playground.py), and run as a script it serves a model on loopback, decodes a
prompt on the page with each step shown for a while and saves a screenshot mid-decode (README's docs/playground.png):

    python scripts/playground_screenshot.py --model tiny-llada --sampler wino --prompt "sort: 09,04,07,01" \\
        --field gen_length=32 --field block_length=16 --field threshold=0.2 --field remask_threshold=0.9999 \\
        -o docs/playground.png"""
from __future__ import annotations

import argparse
import shutil
import time

BROWSERS = ("chromium", "chromium-browser", "google-chrome")


def missing_browser() -> str | None:
    """Why no headless Chromium can run here (None: one can)."""
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed (pip install selenium)"
    if shutil.which("chromedriver") is None or not any(shutil.which(b) for b in BROWSERS):
        return "no chromium and chromedriver here (apt-get install chromium chromium-driver)"
    return None


class Playground:
    """The page at `url` in a headless Chromium of its own (a context manager)."""

    def __init__(self, url: str, width: int = 1200, height: int = 760):
        from selenium import webdriver
        from selenium.webdriver.chrome.options import Options
        from selenium.webdriver.chrome.service import Service

        options = Options()
        for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", f"--window-size={width},{height}"):
            options.add_argument(arg)
        self.driver = webdriver.Chrome(options=options, service=Service(shutil.which("chromedriver")))
        self.driver.get(url)
        self.wait(lambda: self.driver.execute_script("return document.body.dataset.ready === '1'"), 60)

    def __enter__(self) -> Playground:
        return self

    def __exit__(self, *exc) -> None:
        self.driver.quit()

    def wait(self, condition, timeout: float = 120) -> None:
        from selenium.webdriver.support.ui import WebDriverWait

        WebDriverWait(self.driver, timeout, poll_frequency=0.02).until(lambda _: condition())

    def element(self, id_or_name: str):
        from selenium.webdriver.common.by import By

        found = self.driver.find_elements(By.ID, id_or_name) or \
            self.driver.find_elements(By.CSS_SELECTOR, f'[data-name="{id_or_name}"]')
        if not found:
            raise KeyError(f"the page has no field {id_or_name!r}")
        return found[0]

    def send(self, prompt: str, sampler: str | None = None, cache: str | None = None, delay_ms: int = 0,
             **fields) -> None:
        """Fill the form (a sampler or cache chosen first brings its parameters' fields) and press Decode."""
        from selenium.webdriver.support.ui import Select

        for name, value in (("sampler", sampler), ("cache", cache)):
            if value is not None:
                Select(self.element(name)).select_by_value(value)
        for name, value in {"prompt": prompt, "delay": delay_ms, **fields}.items():
            field = self.element(name)
            field.clear()
            field.send_keys(str(value))
        self.element("send").click()

    def finished(self) -> dict:
        """After `send`: waits for the answer or the error; the page's text, error, numbers and the canvas states."""
        script = "return document.getElementById('numbers').dataset.done === '1' || " \
                 "document.getElementById('error').textContent !== ''"
        self.wait(lambda: self.driver.execute_script(script))
        self.wait(lambda: self.element("send").is_enabled())
        return {"answer": self.element("answer").text, "error": self.element("error").text,
                "numbers": self.element("numbers").text,
                "states": self.driver.execute_script("return window.dllmStates")}

    def screenshot_at(self, shown: int, path: str) -> None:
        """A screenshot once the canvas shows its `shown`-th step."""
        self.wait(lambda: int(self.driver.execute_script(
            "return document.getElementById('canvas').dataset.shown || 0")) >= shown)
        self.driver.save_screenshot(path)


def main() -> None:
    import dllm
    from dllm.serve import EngineClient, EngineSpec, LocalServer
    from dllm.serve.requests import served_defaults

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny-llada")
    ap.add_argument("--sampler", default=None)
    ap.add_argument("--prompt", default="reverse: abc12")
    ap.add_argument("--field", action="append", default=[], metavar="NAME=VALUE", help="a form field (repeat)")
    ap.add_argument("--delay-ms", type=int, default=400, help="each step shown this long")
    ap.add_argument("--at-step", type=int, default=3, help="the screenshot once this step is shown")
    ap.add_argument("-o", "--output", default="playground.png")
    args = ap.parse_args()
    why = missing_browser()
    if why:
        raise SystemExit(f"error: {why}")
    flags = {"sampler": None, "cache": None, "sampler_args": {}, "cache_args": {}, "gen_length": None,
             "block_length": None, "steps": None, "seed": 0}
    defaults = served_defaults(dllm.load(args.model, weights=False)[0], flags)
    with LocalServer(EngineClient.spawn(EngineSpec(args.model), defaults)) as local, \
            Playground(local.url + "/") as page:
        page.send(args.prompt, args.sampler, delay_ms=args.delay_ms, **dict(f.split("=", 1) for f in args.field))
        page.screenshot_at(args.at_step, args.output)
        time.sleep(0.1)
        print(page.finished()["numbers"])
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
