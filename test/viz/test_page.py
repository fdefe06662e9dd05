"""The VIZ page in headless Chromium (Debian's chromium and chromium-driver, driven through selenium): it loads without
console errors and shows the known program's kernels, a rewrite step's graphs, a kernel's source and the timeline.
A screenshot of each view is saved under the test's temporary folder and checked not to be blank."""
import shutil
import struct
import threading
import time
import zlib
import pytest
from fusegrad.viz import record
from fusegrad.viz.server import Viewer, load_trace, make_server
from fusegrad.device import GlobalCounters
from test.viz.programs import jit_mismatch, nan_program, symbolic_rewrite, tensor_program

webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (the test extra has it)")
CHROMIUM, DRIVER = shutil.which("chromium"), shutil.which("chromedriver")
pytestmark = pytest.mark.skipif(CHROMIUM is None or DRIVER is None,
                                reason="no chromium and chromedriver (apt-get install chromium chromium-driver)")

@pytest.fixture(scope="module")
def page(tmp_path_factory):
    record.recorder.reset()
    record.enable(viz=True, profile=True)
    try:
        expr, result = symbolic_rewrite()
        k0 = GlobalCounters.kernel_count
        tensor_program(n=5)
        findings = [jit_mismatch(), nan_program()]
        ran = GlobalCounters.kernel_count - k0
        path = record.save(str(tmp_path_factory.mktemp("viz") / "trace.json"))
    finally:
        record.enable(viz=False, profile=False)
    trace = record.trace()
    record.recorder.reset()
    server = make_server(Viewer(load_trace(path)), 0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    driver = _chromium()
    try: yield driver, f"http://127.0.0.1:{server.server_address[1]}/", trace, (expr, result, ran, findings)
    finally:
        driver.quit()
        server.shutdown()
        server.server_close()

def _chromium():
    from selenium.webdriver.chrome.service import Service
    opts = webdriver.ChromeOptions()
    for a in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1400,1000"):
        opts.add_argument(a)
    opts.binary_location = CHROMIUM
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(options=opts, service=Service(DRIVER))

def _wait_view(driver, view, tries=100):
    for _ in range(tries):
        if driver.execute_script("return document.body.dataset.ready") == view: return
        time.sleep(0.05)
    raise AssertionError(f"the page never showed {view}")

def _screenshot(driver, tmp_path, name):
    path = tmp_path / f"{name}.png"
    driver.save_screenshot(str(path))
    # a blank page is one row of pixels repeated: count the distinct rows of the decoded image
    data, pos, idat, width = path.read_bytes(), 8, b"", 0
    while pos < len(data):
        n, kind = struct.unpack(">I4s", data[pos:pos + 8])
        if kind == b"IHDR": width, _, depth, color = struct.unpack(">IIBB", data[pos + 8:pos + 18])
        if kind == b"IDAT": idat += data[pos + 8:pos + 8 + n]
        pos += n + 12
    raw = zlib.decompress(idat)
    stride = 1 + width * {2: 3, 6: 4}[color] * depth // 8
    rows = {raw[i + 1:i + stride] for i in range(0, len(raw), stride)}
    assert len(rows) > 20, f"{name}: the screenshot is blank"

def _no_errors(driver):
    from selenium.webdriver.common.by import By
    assert driver.find_element(By.ID, "errors").text == ""
    assert [e for e in driver.get_log("browser") if e["level"] == "SEVERE"] == []

def test_views(page, tmp_path):
    from selenium.webdriver.common.by import By
    driver, url, trace, (expr, result, ran, _) = page
    driver.get(url + "#kernels")
    _wait_view(driver, "#kernels")
    assert int(driver.find_element(By.ID, "kernel-list").get_attribute("data-count")) == len(trace["kernels"])
    assert sum(len(k["runs"]) for k in trace["kernels"]) == ran
    _screenshot(driver, tmp_path, "kernels")
    # a kernel's source
    driver.find_elements(By.CSS_SELECTOR, "tr.kernel-row")[0].click()
    _wait_view(driver, "#kernel/0")
    assert driver.find_element(By.ID, "kernel-src").text.strip() == trace["kernels"][0]["src"].strip()
    assert driver.find_elements(By.CSS_SELECTOR, "#kernel-src .tok-kw")
    _screenshot(driver, tmp_path, "kernel")
    # a rewrite step: the graph before and after, with as many nodes as the rewriter's input and result had
    driver.find_element(By.CSS_SELECTOR, "nav a[data-tab=rewrites]").click()
    _wait_view(driver, "#rewrites")
    # kernelization's passes are stages like the rewriter's
    assert driver.find_elements(By.CSS_SELECTOR, "details[data-matcher=kernelize] tr.rewrite-row")
    i = next(i for i, r in enumerate(trace["rewrites"]) if r["name"] == "known")
    driver.find_element(By.CSS_SELECTOR, f"tr.rewrite-row[data-index='{i}']").click()
    _wait_view(driver, f"#rewrite/{i}/0")
    count = lambda side: int(driver.find_element(By.CSS_SELECTOR, f"#graph-{side} .node-count").text)  # noqa: E731
    assert count("before") == len(expr.toposort())
    assert len(driver.find_elements(By.CSS_SELECTOR, "#graph-before rect.node")) == len(expr.toposort())
    assert driver.find_elements(By.CSS_SELECTOR, "#graph-before rect.node.changed")
    last = len(trace["rewrites"][i]["steps"]) - 1
    driver.find_element(By.CSS_SELECTOR, f"li.step[data-step='{last}']").click()
    _wait_view(driver, f"#rewrite/{i}/{last}")
    assert count("after") == len(result.toposort())
    assert len(driver.find_elements(By.CSS_SELECTOR, "#graph-after rect.node")) == len(result.toposort())
    assert "fusegrad/uop/symbolic.py:" in driver.find_element(By.ID, "rule").text
    _screenshot(driver, tmp_path, "rewrite")
    # the timeline: one bar per kernel run
    driver.find_element(By.CSS_SELECTOR, "nav a[data-tab=timeline]").click()
    _wait_view(driver, "#timeline")
    assert len(driver.find_elements(By.CSS_SELECTOR, "#timeline-svg rect.bar[data-cat=kernel]")) == ran
    _screenshot(driver, tmp_path, "timeline")
    driver.find_element(By.CSS_SELECTOR, "nav a[data-tab=schedules]").click()
    _wait_view(driver, "#schedules")
    driver.find_elements(By.CSS_SELECTOR, "tr.schedule-row")[0].click()
    _wait_view(driver, "#schedule/0")
    assert driver.find_elements(By.CSS_SELECTOR, "tr.item-row")
    _screenshot(driver, tmp_path, "schedule")
    _no_errors(driver)

def test_explanations_findings_and_zoom(page, tmp_path):
    from selenium.webdriver.common.by import By
    driver, url, trace, (_, _, ran, findings) = page
    # the schedule view: the estimate and, per kernel, why the graph was cut there
    sched = trace["schedules"][0]
    driver.get(url + "#schedule/0")
    _wait_view(driver, "#schedule/0")
    cell = lambda key: driver.find_element(By.CSS_SELECTOR, f"#schedule-estimate td[data-key='{key}']").text  # noqa: E731
    assert int(cell("kernels")) == sched["estimate"]["kernels"] == len(sched["items"])
    assert int(cell("FLOPs")) == sched["estimate"]["flops"] and int(cell("bytes moved")) == sched["estimate"]["bytes"]
    assert cell("peak memory").startswith(f"{sched['estimate']['peak_memory']} bytes")
    whys = driver.find_elements(By.CSS_SELECTOR, "#item-list td.item-why")
    assert len(whys) == len(sched["items"])
    for td, k in zip(whys, sched["explain"]["kernels"]):
        assert [r.text for r in td.find_elements(By.CSS_SELECTOR, ".reason")] == [o[1] for o in k["outputs"]]
    assert any(td.text for td in whys)
    _screenshot(driver, tmp_path, "schedule-explained")
    # the findings: the JIT_VERIFY mismatch and the DEBUG_NANS error, with their messages
    driver.find_element(By.CSS_SELECTOR, "nav a[data-tab=findings]").click()
    _wait_view(driver, "#findings")
    rows = driver.find_elements(By.CSS_SELECTOR, "#findings-list tr.finding-row")
    assert [(r.get_attribute("data-kind"), r.find_element(By.CSS_SELECTOR, "pre").text) for r in rows] == \
        [("JIT_VERIFY", findings[0]), ("DEBUG_NANS", findings[1])]
    _screenshot(driver, tmp_path, "findings")
    # the timeline: both findings marked; zooming in halves the window and draws no more bars
    driver.find_element(By.CSS_SELECTOR, "nav a[data-tab=timeline]").click()
    _wait_view(driver, "#timeline")
    assert len(driver.find_elements(By.CSS_SELECTOR, "#timeline-svg path.marker")) == 2
    assert len(driver.find_elements(By.CSS_SELECTOR, "#timeline-svg rect.bar[data-cat=kernel]")) == ran
    span = lambda: float(driver.find_element(By.ID, "timeline-svg").get_attribute("data-t1")) - \
        float(driver.find_element(By.ID, "timeline-svg").get_attribute("data-t0"))  # noqa: E731
    full, bars = span(), len(driver.find_elements(By.CSS_SELECTOR, "#timeline-svg rect.bar"))
    for _ in range(3): driver.find_element(By.ID, "zoom-in").click()
    assert span() == pytest.approx(full / 8)
    assert len(driver.find_elements(By.CSS_SELECTOR, "#timeline-svg rect.bar")) <= bars
    _screenshot(driver, tmp_path, "timeline-zoomed")
    driver.find_element(By.ID, "zoom-fit").click()
    assert span() == pytest.approx(full)
    _no_errors(driver)

@pytest.mark.slow
def test_a_resnet50_sized_trace_loads_within_3_seconds(tmp_path):
    """A synthetic trace the size of a ResNet-50 training step's (programs.synthetic_trace): the page shows its
    kernels within 3 s of being opened; the other views' times are printed (pytest -s)."""
    import json
    from test.viz.programs import synthetic_trace
    path = tmp_path / "big.json"
    path.write_text(json.dumps(synthetic_trace(), separators=(",", ":")))
    st = time.perf_counter()
    server = make_server(Viewer(load_trace(str(path))), 0)
    print(f"\ntrace of {path.stat().st_size / 1e6:.1f} MB read by the server in {time.perf_counter() - st:.2f} s")
    threading.Thread(target=server.serve_forever, daemon=True).start()
    driver = _chromium()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/"
        driver.get(url + "#findings")  # (a light view first: Chromium itself has started)
        _wait_view(driver, "#findings", 600)
        times = {}
        for view in ("#kernels", "#timeline", "#schedule/0", "#rewrites", "#rewrite/0/0"):
            st = time.perf_counter()
            driver.get(url + view) if view == "#kernels" else driver.execute_script(f"location.hash = '{view}'")
            _wait_view(driver, view, 1200)
            times[view] = time.perf_counter() - st
        print("  ".join(f"{v}: {t:.2f} s" for v, t in times.items()))
        assert times["#kernels"] < 3.0
        _no_errors(driver)
    finally:
        driver.quit()
        server.shutdown()
        server.server_close()
