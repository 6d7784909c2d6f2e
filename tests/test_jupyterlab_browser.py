"""The tour notebook in a real browser: JupyterLab on loopback, headless Chromium, run all.

On demand only (`pytest -m browser tests/test_jupyterlab_browser.py`): it needs `chromium`
on PATH (Debian: `apt-get install chromium`), JupyterLab and websocket-client (both in the
`notebooks` extra), and takes a minute or two. Without Chromium it skips.

What it does:
1. copies notebooks/ to a scratch folder (JupyterLab autosaves the notebooks it opens: the
   committed ones must stay without outputs), with links to the project's packages and data;
2. serves JupyterLab there on 127.0.0.1 with a random token, the app exposed to the page
   (`LabApp.expose_app_in_browser`) so that its commands can be called;
3. starts headless Chromium with a fresh profile and drives it over the DevTools protocol
   (a websocket, no browser download): opens 01_tour.ipynb, runs
   `notebook:run-all-cells`, waits until every code cell has run and the kernel is idle;
4. asserts from the notebook model that no cell errored and that the figures and tables
   are there, scrolls the first figure into view and takes a screenshot
   (MOE_SANDBOX_SCREENSHOT=path keeps it: notebooks/figures/jupyterlab_tour.png was made so).
"""
from __future__ import annotations

import base64
import json
import os
import pathlib
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

pytestmark = pytest.mark.browser

REPO = pathlib.Path(__file__).resolve().parents[1]
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                  "--no-first-run", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--hide-scrollbars",
                  "--window-size=1400,1000"]
NOTEBOOK = "notebooks/01_tour.ipynb"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_for(what, fn, timeout, interval=0.5):
    end = time.monotonic() + timeout
    last = None
    while time.monotonic() < end:
        try:
            last = fn()
            if last:
                return last
        except Exception as e:  # not up yet
            last = e
        time.sleep(interval)
    raise TimeoutError(f"{what}: not ready after {timeout} s (last: {last!r})")


class DevTools:
    """The few DevTools-protocol calls this test needs, over one page's websocket."""

    def __init__(self, ws_url):
        import websocket

        self.ws = websocket.create_connection(ws_url, timeout=60, suppress_origin=True)
        self.next_id = 0

    def call(self, method, **params):
        self.next_id += 1
        self.ws.send(json.dumps({"id": self.next_id, "method": method, "params": params}))
        while True:
            msg = json.loads(self.ws.recv())
            if msg.get("id") == self.next_id:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg.get("result", {})

    def js(self, expression):
        """Evaluate `expression` in the page (promises awaited) and return its JSON value."""
        res = self.call("Runtime.evaluate", expression=expression, returnByValue=True,
                        awaitPromise=True)
        if "exceptionDetails" in res:
            raise RuntimeError(f"page JS failed: {res['exceptionDetails']}")
        return res.get("result", {}).get("value")

    def close(self):
        self.ws.close()


# the state of the open notebook, read from its model (cells outside the viewport may not be
# in the DOM: JupyterLab renders notebooks lazily)
NOTEBOOK_JS = """
(() => {
  const app = window.jupyterapp;
  if (!app) return null;
  for (const w of app.shell.widgets('main')) {
    if (w.context && w.context.path.endsWith('01_tour.ipynb')) return w;
  }
  return null;
})()
"""
STATE_JS = """
(() => {
  const w = NOTEBOOK;
  if (!w || !w.content || !w.content.model || !w.sessionContext) return null;
  const kernel = w.sessionContext.session && w.sessionContext.session.kernel;
  const cells = [];
  for (const c of w.content.model.cells) {
    if (c.type !== 'code') continue;
    const outs = c.outputs.toJSON();
    cells.push({count: c.executionCount,
                errors: outs.filter(o => o.output_type === 'error')
                            .map(o => o.ename + ': ' + o.evalue),
                images: outs.filter(o => o.data && o.data['image/png']).length,
                markdown: outs.filter(o => o.data && o.data['text/markdown']).length});
  }
  return {kernel: kernel ? kernel.status : 'none', cells: cells};
})()
""".replace("NOTEBOOK", NOTEBOOK_JS.strip())
# make the notebook the current widget (headless windows have no focus of their own), then
# run every cell through the command a user's "Run > Run All Cells" calls
RUN_ALL_JS = """
(() => {
  const app = window.jupyterapp;
  const w = NOTEBOOK;
  app.shell.activateById(w.id);
  app.shell.collapseLeft();
  app.commands.execute('notebook:run-all-cells');   // not awaited: it resolves when done
  return app.shell.currentWidget === w;
})()
""".replace("NOTEBOOK", NOTEBOOK_JS.strip())


@pytest.mark.skipif(CHROMIUM is None, reason="needs chromium on PATH (apt-get install chromium)")
def test_tour_runs_in_jupyterlab(tmp_path):
    pytest.importorskip("jupyterlab")
    pytest.importorskip("websocket")
    root = tmp_path / "lab"
    root.mkdir()
    shutil.copytree(REPO / "notebooks", root / "notebooks",
                    ignore=shutil.ignore_patterns("figures", "__pycache__", ".ipynb_checkpoints"))
    for name in ("reference", "sandbox", "cuda_kernels", "data", "benchmarks"):
        (root / name).symlink_to(REPO / name)

    port, token = _free_port(), secrets.token_hex(16)
    env = dict(os.environ, MOE_SANDBOX_NOTEBOOK_MODE="cpu", MOE_SANDBOX_REPO=str(root),
               JUPYTER_CONFIG_DIR=str(tmp_path / "cfg"),
               JUPYTER_RUNTIME_DIR=str(tmp_path / "runtime"))
    env.pop("MOE_SANDBOX_FIGURES", None)
    # a fresh settings folder: no "get notified about news?" prompt over the screenshot
    settings = tmp_path / "lab-settings"
    news = settings / "@jupyterlab" / "apputils-extension" / "notification.jupyterlab-settings"
    news.parent.mkdir(parents=True)
    news.write_text(json.dumps({"fetchNews": "false"}))
    env.update(JUPYTERLAB_SETTINGS_DIR=str(settings),
               JUPYTERLAB_WORKSPACES_DIR=str(tmp_path / "lab-workspaces"))
    server_log = open(tmp_path / "jupyterlab.log", "w")
    server = subprocess.Popen(
        [sys.executable, "-m", "jupyterlab", "--no-browser", "--ip=127.0.0.1", f"--port={port}",
         f"--ServerApp.root_dir={root}", f"--IdentityProvider.token={token}",
         "--LabApp.expose_app_in_browser=True", "--ServerApp.allow_root=True"],
        stdout=server_log, stderr=subprocess.STDOUT, env=env)
    profile = tmp_path / "chromium-profile"
    browser = None
    tools = None
    try:
        base = f"http://127.0.0.1:{port}"
        _wait_for("jupyter server", lambda: urllib.request.urlopen(
            f"{base}/api/status?token={token}", timeout=5).status == 200, timeout=120)

        browser = subprocess.Popen([CHROMIUM, *CHROMIUM_FLAGS, f"--user-data-dir={profile}",
                                    "--remote-debugging-port=0", "about:blank"],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        devtools_port = _wait_for("chromium DevTools port", lambda: (
            (profile / "DevToolsActivePort").read_text().split()[0]), timeout=60)
        pages = _wait_for("a chromium page", lambda: [
            t for t in json.load(urllib.request.urlopen(
                f"http://127.0.0.1:{devtools_port}/json/list", timeout=5))
            if t.get("type") == "page"], timeout=30)
        tools = DevTools(pages[0]["webSocketDebuggerUrl"])
        tools.call("Page.enable")
        tools.call("Emulation.setFocusEmulationEnabled", enabled=True)
        tools.call("Page.navigate", url=f"{base}/lab/tree/{NOTEBOOK}?reset&token={token}")

        try:
            _wait_for("the notebook and its kernel", lambda: (tools.js(STATE_JS) or {}).get(
                "kernel") == "idle", timeout=180)
            assert tools.js(RUN_ALL_JS), "the tour notebook did not become the current widget"

            def finished():
                s = tools.js(STATE_JS)
                done = s and s["kernel"] == "idle" and all(c["count"] for c in s["cells"])
                return s if done or (s and any(c["errors"] for c in s["cells"])) else None

            state = _wait_for("run all cells", finished, timeout=900, interval=2)
        except TimeoutError as e:     # say what the page shows, and keep a picture of it
            shot = tools.call("Page.captureScreenshot", format="png")["data"]
            (tmp_path / "timeout.png").write_bytes(base64.b64decode(shot))
            page = tools.js("({title: document.title, app: !!window.jupyterapp, "
                            "widget: String(window.jupyterapp && window.jupyterapp.shell."
                            "currentWidget && window.jupyterapp.shell.currentWidget.title.label)})")
            raise AssertionError(f"{e}; page {page}; state {tools.js(STATE_JS)}; screenshot "
                                 f"{tmp_path / 'timeout.png'}; server log "
                                 f"{tmp_path / 'jupyterlab.log'}") from e
        errors = [e for c in state["cells"] for e in c["errors"]]
        assert not errors, f"cells failed in JupyterLab: {errors}"
        assert sum(c["images"] for c in state["cells"]) >= 3, f"figures missing: {state}"
        assert sum(c["markdown"] for c in state["cells"]) >= 2, f"tables missing: {state}"

        # the first figure into view (the DOM holds it now: it was rendered), then a picture
        _wait_for("a rendered figure", lambda: tools.js(
            "document.querySelectorAll('.jp-RenderedImage img').length") > 0, timeout=60)
        tools.js("document.querySelector('.jp-RenderedImage img')"
                 ".scrollIntoView({block: 'center'})")
        time.sleep(1.0)
        shot = base64.b64decode(tools.call("Page.captureScreenshot", format="png")["data"])
        out = tmp_path / "jupyterlab_tour.png"
        out.write_bytes(shot)
        assert shot[:8] == b"\x89PNG\r\n\x1a\n" and len(shot) > 20_000, "screenshot looks empty"
        keep = os.environ.get("MOE_SANDBOX_SCREENSHOT")
        if keep:
            pathlib.Path(keep).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(out, keep)
    finally:
        if tools is not None:
            tools.close()
        for proc in (browser, server):
            if proc is not None and proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=5)
        server_log.close()
