"""End to end in a real browser: JupyterLab, the TrainingPanel, Train, Stop, TensorBoard.

What a user does, done by headless Chromium (driven by Playwright, desktop scrollbars shown)
against a JupyterLab that the test starts on loopback (free port, its own token, a temporary
root folder and settings), at a laptop's 1280x800:

1. open a notebook written by the test (``TrainingPanel`` of a tiny class-folder tree,
   ResNet18, 2 CPU processes, 3 epochs; then ``show_tensorboard``) and run it with
   Run > Run All Cells;
2. the panel renders; its layout is checked: nothing wider than the panel or its output area,
   no clipped or sideways-scrolling box, no text under 11 px, the chart not shrunk below 75%;
3. click **Train**: the progress label reads "epoch 3/3 · step 2/3 · loss ..." (the picture the
   README shows is taken then, once the chart has the curves of the two epochs done) and then
   "epoch 3/3 ... ended after", the bar turns green, the status says Finished with the best
   accuracy, rank 0's log shows every epoch, and the chart's PNG (fetched from the page) changed
   and now has the green accuracy curve;
4. the TensorBoard iframe (``http://127.0.0.1:<port>/``, the page's own host) answers, its server lists the run's
   accuracy, and the frame itself shows the run's name and an "accuracy" card;
5. type 50 epochs, click **Train**, then **Stop** during epoch 1: the status says Stopped
   within seconds, and no worker recorded in either run's ``.nbddp/launch.json`` survives
   (/proc: gone, not even a zombie); the kernel has no zombie child.

Screenshots go to ``artifacts/browser/`` (git-ignored): the notebook before training, the whole
panel while training / finished / stopped, the 1280x800 view while training, the TensorBoard
frame, and ``last-page.png`` + ``console.log`` + ``jupyterlab.log`` for a failure. With
``NBDDP_SCREENSHOTS=docs/images`` (``bash dev.sh screenshots``) the ones the documentation shows
are copied there once the test has passed; an ordinary run leaves the documentation alone.
JupyterLab, its kernel (and so the workers and TensorBoard) and Chromium are killed in the
fixtures' teardown, also when the test fails or times out.

Skips, with the reason, when Playwright, JupyterLab or Chromium (``/usr/bin/chromium``, or
``NBDDP_CHROMIUM``) is missing: ``bash scripts/install_browser.sh`` installs Chromium with apt.
"""

import base64
import io
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from conftest import ROOT, children_of, free_port, make_tree, proc_state, survivors, wait_for

CHROMIUM = os.environ.get("NBDDP_CHROMIUM", "/usr/bin/chromium")
# Without the background-networking flags Chromium's own connections are refused here and
# slow everything down; --no-proxy-server: loopback only, whatever the environment says.
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--no-proxy-server"]
ARTIFACTS = ROOT / "artifacts" / "browser"
VIEWPORT = {"width": 1280, "height": 800}
NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))
TITLE = "nbddp · DistributedDataParallel training"
MS = 1000  # Playwright counts in milliseconds
#: The screenshots the documentation shows (docs/images/), refreshed on demand: NBDDP_SCREENSHOTS.
DOCS_SHOTS = ("panel-training.png", "tensorboard.png")

pytestmark = [pytest.mark.browser, pytest.mark.timeout(300)]


def _requirements():
    """The reason to skip, or None when everything the test needs is here."""
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "playwright is not installed (pip install -r requirements-dev.txt)"
    try:
        import jupyterlab  # noqa: F401
    except ImportError:
        return "jupyterlab is not installed (pip install -r requirements-dev.txt)"
    if not (os.path.isfile(CHROMIUM) and os.access(CHROMIUM, os.X_OK)):
        return f"no Chromium at {CHROMIUM} (bash scripts/install_browser.sh, or set NBDDP_CHROMIUM)"
    return None


# ------------------------------------------------------------------------ processes
def descendants(pid: int):
    out, todo = [], [pid]
    while todo:
        for child in children_of(todo.pop()):
            out.append(child)
            todo.append(child)
    return out


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def kill_all(pids):
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def http_get(url: str, timeout: float = 5.0):
    with NO_PROXY.open(url, timeout=timeout) as r:
        return r.status, r.read()


def http(method: str, url: str, timeout: float = 10.0):
    req = urllib.request.Request(url, method=method)
    with NO_PROXY.open(req, timeout=timeout) as r:
        return r.status, r.read()


# ------------------------------------------------------------------------ the notebook
def write_notebook(root: Path) -> Path:
    import nbformat

    make_tree(root / "data" / "tiny")  # 3 classes x 12 images of 16 px; the kernel starts in root
    panel_cell = """\
import nbddp
import nbddp.ui.panel as _panel
_panel.list_gpus = lambda: []  # the CPU panel on any machine
cfg = nbddp.TrainConfig(data_path="data/tiny", model="resnet18", image_size=32,
                        epochs=3, batch_size=4, lr=0.01, nprocs=2, name="browser")
panel = nbddp.TrainingPanel(cfg)
panel"""
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3 (ipykernel)", "language": "python"}
    nb.cells = [nbformat.v4.new_markdown_cell("# nbddp in a browser"),
                nbformat.v4.new_code_cell(panel_cell),
                nbformat.v4.new_code_cell('nbddp.show_tensorboard("runs", height=520)')]
    path = root / "browser_panel.ipynb"
    nbformat.write(nb, str(path))
    return path


# ------------------------------------------------------------------------ fixtures
@pytest.fixture
def lab(tmp_path):
    """JupyterLab on 127.0.0.1 (free port, token), root folder in tmp; everything killed after."""
    reason = _requirements()
    if reason:
        pytest.skip(reason)
    root = tmp_path / "lab"
    root.mkdir()
    notebook = write_notebook(root)
    conf = tmp_path / "jupyter"
    settings = conf / "lab-settings" / "@jupyterlab" / "apputils-extension"
    settings.mkdir(parents=True)
    # No news or update toast over the notebook.
    (settings / "notification.jupyterlab-settings").write_text(json.dumps({"fetchNews": "false",
                                                                           "checkForUpdates": False}))
    env = {k: v for k, v in os.environ.items() if k not in ("TENSORBOARD_PROXY_URL", "JUPYTER_PATH")}
    env.update(JUPYTER_CONFIG_DIR=str(conf / "config"), JUPYTER_RUNTIME_DIR=str(conf / "runtime"),
               JUPYTERLAB_SETTINGS_DIR=str(conf / "lab-settings"),
               JUPYTERLAB_WORKSPACES_DIR=str(conf / "workspaces"))
    port, token = free_port(), secrets.token_hex(16)
    shutil.rmtree(ARTIFACTS, ignore_errors=True)  # no screenshot of an earlier run left to mislead
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    log = open(ARTIFACTS / "jupyterlab.log", "wb")
    cmd = [sys.executable, "-m", "jupyterlab", "--no-browser", "--ServerApp.open_browser=False",
           "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={port}", "--ServerApp.port_retries=0",
           f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={root}",
           "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate", "--LabApp.news_url=None",
           "--LabApp.extension_manager=readonly", "--ServerApp.terminals_enabled=False"]
    if os.geteuid() == 0:
        cmd.append("--allow-root")  # containers and CI run as root
    proc = subprocess.Popen(cmd, cwd=root, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    base = f"http://127.0.0.1:{port}"  # for the test's own HTTP calls

    def up():
        if proc.poll() is not None:
            raise AssertionError(f"JupyterLab exited with code {proc.returncode}; see {ARTIFACTS / 'jupyterlab.log'}")
        try:
            return http_get(f"{base}/api/status?token={token}", timeout=2)[0] == 200
        except OSError:
            return False

    try:
        assert wait_for(up, timeout=90, interval=0.3), f"JupyterLab did not answer in 90 s: {ARTIFACTS}/jupyterlab.log"
        # The browser opens http://127.0.0.1:<port>, the address Jupyter also prints. A frame at
        # "localhost" would be third-party there (Chromium denies it localStorage and TensorBoard
        # shows "Data could not be loaded"): the frame must follow the page's own host name.
        yield dict(base=base, url=f"http://127.0.0.1:{port}", token=token, root=root, notebook=notebook, proc=proc)
    finally:
        family = descendants(proc.pid)  # kernels (own sessions), their workers, TensorBoard
        try:  # gently first: a kernel shut down by the server runs its atexit (TensorBoard, runs)
            for k in json.loads(http_get(f"{base}/api/kernels?token={token}")[1]):
                http("DELETE", f"{base}/api/kernels/{k['id']}?token={token}", timeout=10)
            proc.terminate()
            proc.wait(10)
        except Exception:  # noqa: BLE001 - refused, timed out, interrupted: the kill below does it
            pass
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            kill_all(p for p in family if proc_state(p) not in (None, "Z"))
            proc.wait(10)
            log.close()
        left = wait_for(lambda: not survivors(family), timeout=10) or survivors(family)
        assert left is True, f"processes left after JupyterLab's shutdown (pid: state): {left}"


@pytest.fixture
def page(lab, tmp_path):
    """A headless Chromium page at 1280x800 with a fresh profile; Chromium killed after."""
    from playwright.sync_api import sync_playwright

    profile = tmp_path / "chromium-profile"
    pw = sync_playwright().start()
    context, console = None, []
    try:
        context = pw.chromium.launch_persistent_context(
            str(profile), executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS, viewport=VIEWPORT,
            ignore_default_args=["--hide-scrollbars"],  # scrollbars as on a desktop: overflow shows
            timeout=90 * MS)
        context.set_default_timeout(60 * MS)
        pg = context.pages[0] if context.pages else context.new_page()
        pg.on("console", lambda m: console.append(f"{m.type}: {m.text}"))
        pg.on("pageerror", lambda e: console.append(f"pageerror: {e}"))
        yield pg
    finally:
        if context is not None:  # what the page showed last, and its console: for a failure
            try:
                context.pages[0].screenshot(path=str(ARTIFACTS / "last-page.png"), timeout=10 * MS)
            except Exception:  # noqa: BLE001
                pass
            (ARTIFACTS / "console.log").write_text("\n".join(console))
        stray = [p for p in descendants(os.getpid()) if str(profile) in cmdline(p)]
        try:
            if context is not None:
                context.close()
        except Exception:  # noqa: BLE001 - killed below
            pass
        try:
            pw.stop()
        except Exception:  # noqa: BLE001
            pass
        kill_all(p for p in stray if proc_state(p) not in (None, "Z"))


# ------------------------------------------------------------------------ page helpers
def text(locator) -> str:
    return re.sub(r"\s+", " ", locator.inner_text()).strip()


def shot(target, name: str) -> Path:
    path = ARTIFACTS / name
    target.screenshot(path=str(path), animations="disabled")
    assert path.stat().st_size > 5000, f"{path} is nearly empty"
    return path


def shot_whole(page, element, name: str) -> Path:
    """A screenshot of all of ``element``: the page grows taller for it (same 1280 px width),
    since JupyterLab scrolls the notebook inside a fixed-height window."""
    height = int(element.evaluate("el => el.getBoundingClientRect().height"))
    page.set_viewport_size({"width": VIEWPORT["width"], "height": max(VIEWPORT["height"], height + 300)})
    try:
        element.scroll_into_view_if_needed()
        page.wait_for_timeout(300)
        return shot(element, name)
    finally:
        page.set_viewport_size(VIEWPORT)


def frame_text(frame_el) -> str:
    """What an iframe shows as text (its document's body), or why it could not be read."""
    try:
        frame = frame_el.element_handle(timeout=5 * MS).content_frame()
        return frame.evaluate("() => document.body ? document.body.innerText : '(no body)'")[:3000]
    except Exception as e:  # noqa: BLE001 - a report of the page, never the failure itself
        return f"(unreadable: {e})"


def image_bytes(img) -> bytes:
    """The bytes behind an <img> (ipywidgets 8 serves Image values as blob: URLs)."""
    b64 = img.evaluate("""async (el) => {
        const buf = new Uint8Array(await (await fetch(el.src)).arrayBuffer());
        let s = ''; for (let i = 0; i < buf.length; i += 8192) s += String.fromCharCode(...buf.subarray(i, i + 8192));
        return btoa(s);
    }""")
    return base64.b64decode(b64)


def green_pixels(png: bytes) -> int:
    """Pixels of the accuracy curve (matplotlib's tab:green) in the right half of the chart."""
    from PIL import Image

    im = Image.open(io.BytesIO(png)).convert("RGB")
    w, h = im.size
    right = im.crop((w // 2, 0, w, h))
    pixels = right.get_flattened_data() if hasattr(right, "get_flattened_data") else right.getdata()
    return sum(1 for r, g, b in pixels if abs(r - 44) < 25 and abs(g - 160) < 25 and abs(b - 44) < 25)


def run_all_cells(page):
    """Run > Run All Cells, through the menu a user clicks; once more if no cell started.

    A click in the first moments after the kernel connects can be dropped by JupyterLab:
    nothing runs and every prompt stays ``[ ]``. A second click is safe then.
    """
    prompts = page.locator(".jp-Notebook .jp-CodeCell .jp-InputArea-prompt")
    for attempt in range(3):
        page.locator(".lm-MenuBar-itemLabel", has_text=re.compile(r"^Run$")).click()
        page.locator(".lm-Menu-itemLabel", has_text=re.compile(r"^Run All Cells$")).click()
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            if any(re.search(r"\[(\*|\d+)\]", t) for t in prompts.all_inner_texts()):
                return
            page.wait_for_timeout(250)
    raise AssertionError(f"Run All Cells started no cell: prompts {prompts.all_inner_texts()}")


LAYOUT_JS = """(root) => {
    const box = root.getBoundingClientRect(), rs = getComputedStyle(root);
    const r = {left: box.left + parseFloat(rs.borderLeftWidth) + parseFloat(rs.paddingLeft),
               right: box.right - parseFloat(rs.borderRightWidth) - parseFloat(rs.paddingRight)};
    const out = {root: [r.left, r.right], overflow: [], clipped: [], fonts: []};
    const area = root.closest('.jp-OutputArea-output').getBoundingClientRect();
    if (box.left < area.left - 1 || box.right > area.right + 1)
        out.overflow.push(`the panel [${box.left}, ${box.right}] in its output area [${area.left}, ${area.right}]`);
    const scroller = root.closest('.jp-WindowedPanel-outer');
    if (scroller && scroller.scrollWidth > scroller.clientWidth + 1)
        out.overflow.push(`the notebook scrolls sideways: ${scroller.scrollWidth} > ${scroller.clientWidth}`);
    const name = (el) => el.tagName.toLowerCase() + (el.className && typeof el.className === 'string'
        ? '.' + el.className.trim().split(/\\s+/).slice(0, 3).join('.') : '') +
        ' "' + (el.innerText || el.value || '').trim().slice(0, 40) + '"';
    for (const el of root.querySelectorAll('*')) {
        const b = el.getBoundingClientRect();
        const st = getComputedStyle(el);
        if (b.width === 0 || b.height === 0 || st.visibility === 'hidden' || st.display === 'none') continue;
        if (b.right > r.right + 1 || b.left < r.left - 1)
            out.overflow.push(name(el) + ` [${Math.round(b.left)}, ${Math.round(b.right)}]`);
        const tag = el.tagName;
        if (tag !== 'INPUT' && tag !== 'TEXTAREA' && tag !== 'SELECT' && st.overflowX !== 'visible'
            && el.scrollWidth > el.clientWidth + 1)
            out.clipped.push(name(el) + ` scroll ${el.scrollWidth} > ${el.clientWidth}`);
        if (el.childNodes.length && [...el.childNodes].some(n => n.nodeType === 3 && n.textContent.trim()))
            out.fonts.push([name(el), parseFloat(st.fontSize)]);
    }
    return out;
}"""


def check_layout(panel, where: str):
    """Nothing overflows the panel, no text is clipped, no text under 11 px."""
    found = panel.evaluate(LAYOUT_JS)
    assert not found["overflow"], f"{where}: wider than the panel {found['root']}: {found['overflow']}"
    assert not found["clipped"], f"{where}: clipped: {found['clipped']}"
    small = [f for f in found["fonts"] if f[1] < 11]
    assert not small, f"{where}: text under 11 px: {small}"
    # The chart's numbers are drawn at 9-11 pt for its 960 px: shown much smaller, they blur.
    natural, shown = panel.locator("img").evaluate("el => [el.naturalWidth, el.getBoundingClientRect().width]")
    assert 0.75 * natural <= shown <= natural + 1, f"{where}: chart of {natural} px shown {shown:.0f} px wide"
    return found


def publish_screenshots() -> None:
    """Copy the documentation's screenshots to ``$NBDDP_SCREENSHOTS`` (relative: to the repository)."""
    dest = os.environ.get("NBDDP_SCREENSHOTS")
    if not dest:
        return
    folder = Path(dest) if os.path.isabs(dest) else ROOT / dest
    folder.mkdir(parents=True, exist_ok=True)
    for name in DOCS_SHOTS:
        shutil.copyfile(ARTIFACTS / name, folder / name)
    print(f"browser test: {', '.join(DOCS_SHOTS)} copied to {folder}")


# ------------------------------------------------------------------------ the test
def test_panel_trains_stops_and_tensorboard_shows_the_run_in_jupyterlab(lab, page):
    from playwright.sync_api import expect

    t0 = time.monotonic()
    page.goto(f"{lab['url']}/lab/tree/{lab['notebook'].name}?token={lab['token']}", wait_until="domcontentloaded",
              timeout=120 * MS)
    notebook = page.locator(".jp-NotebookPanel")
    expect(notebook).to_be_visible(timeout=120 * MS)
    expect(page.locator(".jp-Notebook .jp-Cell").nth(2)).to_be_visible(timeout=60 * MS)
    # The kernel is up when the status bar says idle (the toolbar's circle can say so earlier).
    expect(page.locator(".jp-StatusBar-Widget", has_text=re.compile(r"\| Idle"))).to_have_count(
        1, timeout=120 * MS)
    run_all_cells(page)

    panel = page.locator(".widget-vbox", has=page.get_by_text(TITLE, exact=True)).first
    expect(panel).to_be_visible(timeout=120 * MS)
    train = panel.locator("button", has_text="Train")
    stop = panel.locator("button", has_text="Stop")
    label = panel.locator(".widget-hbox:has(> .widget-hprogress) > .widget-html")
    status = panel.locator(".widget-hbox:has(> .widget-button) + .widget-html")  # under Train and Stop
    chart = panel.locator("img")
    expect(train).to_be_enabled()
    expect(stop).to_be_disabled()
    expect(label).to_have_text("not started")
    expect(panel).to_contain_text("No GPU found")
    page.wait_for_timeout(500)
    shot(page, "notebook-before-training.png")
    check_layout(panel, "before training")
    empty_png = image_bytes(chart)

    # ---- Train: the bar, the label, the chart and the status follow the run
    train.click()
    expect(stop).to_be_enabled(timeout=30 * MS)
    expect(train).to_be_disabled()
    # Polled in the page every 50 ms: on a fast machine the whole run lasts a few seconds.
    # The README's picture: in the last epoch, after two done, so its chart shows their curves.
    page.wait_for_function(r"""el => /epoch 3\/3 · step \d+\/\d+ · loss \d+\.\d{4} · [\d,]+ img\/s/
                                    .test(el.innerText) && !el.innerText.includes('ended')""",
                           arg=label.element_handle(), polling=50, timeout=120 * MS)
    bar = panel.locator(".widget-hprogress .progress-bar")
    assert float(bar.evaluate("el => parseFloat(el.style.width) || 0")) > 0
    assert green_pixels(image_bytes(chart)) > 200, "epoch 3 began above a chart without the curves of epochs 1-2"
    shot_whole(page, panel, "panel-training.png")
    label.scroll_into_view_if_needed()
    shot(page, "notebook-training-1280x800.png")  # what a laptop shows
    check_layout(panel, "while training")
    expect(status).to_contain_text("Finished", timeout=150 * MS)
    status_text = text(status)
    assert "best val accuracy" in status_text and "3 epochs completed" in status_text, status_text
    # The label changes to "ended after" a moment after the status: waited for, not read once.
    expect(label).to_have_text(re.compile(r"epoch 3/3 · step \d+/\d+ · loss \d+\.\d{4} .* · ended after \d+:\d\d"),
                               timeout=30 * MS)
    expect(bar).to_have_class(re.compile("progress-bar-success"))
    trained_png = image_bytes(chart)
    assert trained_png[:8] == b"\x89PNG\r\n\x1a\n" and trained_png != empty_png
    assert green_pixels(empty_png) == 0 and green_pixels(trained_png) > 200, "no accuracy curve drawn"
    log = panel.locator(".widget-html").last  # rank 0's log
    expect(log).to_contain_text("epoch 3/3")
    expect(log).to_contain_text("data: 3 classes")
    shot_whole(page, panel, "panel-finished.png")
    check_layout(panel, "after training")

    # ---- TensorBoard: the iframe's server answers and shows the run
    runs = sorted((lab["root"] / "runs").glob("*-browser"))
    assert len(runs) == 1, runs
    run_name = f"{runs[0].name}/tensorboard"
    frame_el = page.locator("iframe")
    expect(frame_el).to_have_count(1)
    src = frame_el.get_attribute("src")
    assert re.fullmatch(r"http://127\.0\.0\.1:\d+/", src), src  # the page's own host name
    port = int(src.rsplit(":", 1)[1].strip("/"))

    def tb_has_accuracy():  # the server rescans the folder every 5 s
        tags = json.loads(http_get(f"http://127.0.0.1:{port}/data/plugin/scalars/tags")[1])
        return "accuracy" in tags.get(run_name, {})

    assert wait_for(tb_has_accuracy, timeout=45, interval=1), f"TensorBoard at {port} lists no accuracy for {run_name}"
    frame_el.evaluate("el => { el.src = el.src; }")  # it loaded before the run existed: reload
    frame_el.scroll_into_view_if_needed()
    frame = page.frame_locator("iframe")
    try:
        expect(frame.get_by_text(run_name).first).to_be_visible(timeout=60 * MS)
        expect(frame.get_by_text("accuracy", exact=True).first).to_be_visible(timeout=30 * MS)  # a scalar card
        expect(frame.get_by_text("Data could not be loaded")).to_have_count(0)
    except AssertionError as e:  # what the frame showed instead, for the report
        shot(frame_el, "tensorboard-failed.png")
        raise AssertionError(f"{e}\nthe TensorBoard frame reads: {frame_text(frame_el)!r}") from None
    shot(frame_el, "tensorboard.png")

    # ---- A second, long run, stopped mid-epoch from the Stop button
    # The field labelled exactly "Epochs" ("Warm-up epochs" in the Advanced section matches a substring)
    epochs_box = panel.locator(".widget-inline-hbox", has_text=re.compile(r"^\s*Epochs\s*$"))
    epochs = epochs_box.locator("input")
    epochs.fill("50")
    epochs.press("Tab")
    expect(epochs).to_have_value("50")
    train.click()
    expect(label).to_have_text(re.compile(r"epoch 1/50 · step \d+/\d+"), timeout=120 * MS)
    stop.click()
    clicked = time.monotonic()
    expect(status).to_contain_text("Stopped", timeout=60 * MS)
    stop_s = time.monotonic() - clicked
    assert stop_s < 30, f"Stop took {stop_s:.0f} s"
    expect(label).to_have_text(re.compile(r"epoch \d+/50 · .* · ended after"), timeout=30 * MS)
    expect(train).to_be_enabled(timeout=30 * MS)
    expect(stop).to_be_disabled()
    expect(bar).to_have_class(re.compile("progress-bar-warning"))
    shot_whole(page, panel, "panel-stopped.png")

    runs = sorted((lab["root"] / "runs").glob("*-browser"))
    assert len(runs) == 2, runs
    assert json.loads((runs[1] / "config.json").read_text())["epochs"] == 50  # typed in the browser
    kernel_pid = None
    for run in runs:
        rec = json.loads((run / ".nbddp" / "launch.json").read_text())
        assert len(rec["pids"]) == 2 and "ended" in rec, rec
        assert wait_for(lambda: not survivors(rec["pids"]), timeout=15), f"{run.name}: {survivors(rec['pids'])}"
        kernel_pid = rec["parent_pid"]
    assert proc_state(kernel_pid) not in (None, "Z"), "the kernel died"
    zombies = [p for p in children_of(kernel_pid) if proc_state(p) == "Z"]
    assert not zombies, f"zombie children of the kernel: {zombies}"
    print(f"browser test: {time.monotonic() - t0:.0f} s in the page, Stop took {stop_s:.1f} s")
    publish_screenshots()
