"""The browser dashboard in a real headless Chromium (Debian's chromium + chromium-driver, driven
by Selenium) against the real stack: the service, PostgreSQL, Redis, the scheduler and a real
daemon training the tiny Llama on CPU.

- sign in with an API key, create a task from the page (upload, model, search space, early exit
  settings), watch its loss curves gain points while it trains (no reload: one live stream),
  see the early exit marked on the curves and in the leaderboard, sort the leaderboard, download
  the best adapter and load it with PEFT, cancel another task from its page;
- the cluster view with the operator token: the node, its GPU and the plan's timeline;
- a task continued from an uploaded adapter, with a W&B integration, whose jobs reported steps:
  its usage beside its estimate, each job's validation token accuracy, its result CSV downloaded
  from the page, the adapter named, the integration's sync, and the tenant's usage report;
- another tenant's key sees none of it, through the API and on the page.

Screenshots of the views (dashboard-{tasks,task,cluster,usage}.png) go to a temp folder, or to
docs/ with LORAPLEX_UPDATE_SCREENSHOTS=1 (tests.helpers.screenshots).
"""

from __future__ import annotations

import io
import json
import re
import shutil
import tarfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from service.result_files import RESULT_COLUMNS
from tests.e2e.conftest import WORKER_TOKEN, Stack, upload_jsonl, wait_for
from tests.e2e.test_chaos import rows
from tests.e2e.test_train_e2e import models_yaml  # noqa: F401 - the tiny Llama as "tiny"
from tests.helpers.screenshots import screenshot

CHROMIUM, CHROMEDRIVER = shutil.which("chromium"), shutil.which("chromedriver")
if not (CHROMIUM and CHROMEDRIVER):
    pytest.skip("chromium and chromium-driver are not installed", allow_module_level=True)
pytest.importorskip("selenium")

from selenium import webdriver  # noqa: E402
from selenium.common.exceptions import StaleElementReferenceException  # noqa: E402
from selenium.webdriver.chrome.options import Options  # noqa: E402
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import Select  # noqa: E402

ENDED = ("succeeded", "failed", "cancelled")


@pytest.fixture(autouse=True)
def wandb_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """W&B runs of a test's tracking integrations go under its tmp_path (set before the stack's
    service starts: an autouse fixture comes first), not the repository's var/."""
    monkeypatch.setenv("LORAPLEX_WANDB_DIR", str(tmp_path / "wandb"))
    return tmp_path / "wandb"


@pytest.fixture(scope="module")
def downloads(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("downloads")


@pytest.fixture(scope="module")
def chromium(downloads: Path) -> Iterator[webdriver.Chrome]:
    opts = Options()
    opts.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--disable-background-networking", "--disable-component-update",
                "--disable-sync", "--no-first-run", "--window-size=1280,1000"):
        opts.add_argument(arg)
    opts.add_experimental_option("prefs", {"download.default_directory": str(downloads),
                                           "download.prompt_for_download": False})
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)
    driver.implicitly_wait(0)
    try:
        yield driver
    finally:
        driver.quit()


@pytest.fixture
def browser(stack: Stack, chromium: webdriver.Chrome) -> Iterator[webdriver.Chrome]:
    """The browser for one test on its stack; leaves the page before the stack stops (an open
    live stream would hold the API's graceful shutdown)."""
    yield chromium
    chromium.get("about:blank")


def q(driver: webdriver.Chrome, css: str):  # noqa: ANN201 - a WebElement
    return driver.find_element(By.CSS_SELECTOR, css)


def qs(driver: webdriver.Chrome, css: str) -> list:
    return driver.find_elements(By.CSS_SELECTOR, css)


def wait_css(driver: webdriver.Chrome, css: str, timeout: float = 20, what: str = ""):  # noqa: ANN201
    return wait_for(lambda: (found := qs(driver, css)) and found[0], timeout, what or css)


def click(driver: webdriver.Chrome, css: str) -> None:
    """A real click; again when the page redrew the element in between (live updates)."""
    for _ in range(5):
        try:
            q(driver, css).click()
            return
        except StaleElementReferenceException:
            time.sleep(0.1)
    q(driver, css).click()


def attrs(driver: webdriver.Chrome, css: str, *names: str) -> list[tuple]:
    """The named attributes (or "text") of every element matching css, read in one step."""
    return [tuple(row) for row in driver.execute_script(
        "return [...document.querySelectorAll(arguments[0])].map(e => arguments[1].map("
        "n => n === 'text' ? e.innerText : e.getAttribute(n)))", css, list(names))]


def text(driver: webdriver.Chrome, css: str) -> str:
    """The element's visible text, read in one step (the page redraws parts as updates come)."""
    return driver.execute_script(
        "const e = document.querySelector(arguments[0]); return e ? e.innerText.trim() : ''", css)


def sign_in(driver: webdriver.Chrome, stack: Stack, key: str, operator: str = "") -> None:
    driver.get(f"{stack.url}/")
    driver.execute_script("sessionStorage.clear()")
    driver.get(f"{stack.url}/ui/#/signin")
    wait_css(driver, "#api-key").send_keys(key)
    if operator:
        q(driver, "#op-token").send_keys(operator)
    click(driver, "#btn-sign-in")


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def task_state(http: httpx.Client, task_id: str) -> str:
    return http.get(f"/v1/tasks/{task_id}").json()["state"]




def downloaded_results(browser, http, downloads: Path, task_id: str, result_file: str) -> bytes:  # noqa: ANN001
    """Click the task's Results (CSV) button; the downloaded file, checked to be the API's
    result file with the documented header."""
    click(browser, "#btn-results")
    csv_path = wait_for(lambda: list(downloads.glob(f"{task_id}_step_metrics.csv")), 30,
                        f"the CSV download ({text(browser, '#task-msg')})")[0]
    wait_for(lambda: not list(downloads.glob("*.crdownload")), 10, "the download to finish")
    body = csv_path.read_bytes()
    assert body.split(b"\n", 1)[0].decode() == ",".join(RESULT_COLUMNS)
    assert body == http.get(f"/v1/files/{result_file}/content").content
    return body

def usage_report_row(browser, http, task_id: str, usage: dict) -> dict:  # noqa: ANN001
    """Open the usage report from the navigation and check the task's row against the API's
    report of the same period (its tokens also the task's own usage); the API's report."""
    click(browser, "#nav-usage")
    wait_css(browser, f'#usage-body tr[data-task="{task_id}"]', what="the task in the report")
    [(start, end)] = attrs(browser, "#usage-period", "data-start", "data-end")
    report = http.get("/v1/usage", params={"start": start, "end": end}).json()
    [line] = [t for t in report["tasks"] if t["task_id"] == task_id]
    assert line["trained_tokens"] == usage["trained_tokens"], (line, usage)
    shown = dict(attrs(browser, f'#usage-body tr[data-task="{task_id}"] [data-usage]',
                       "data-usage", "data-value"))
    assert same_numbers(shown, {k: line[k] for k in ("trained_tokens", "gpu_seconds", "cost")}), (
        shown, line)
    return report

def test_another_tenants_key_sees_nothing(stack: Stack, browser: webdriver.Chrome) -> None:
    """Tenant A has a task; B's key gets 404 for it through every route, its list is empty, and
    the page signed in as B shows no task and refuses the task's page and live stream."""
    other = stack.tenant("other-tenant")
    with stack.http() as http:
        train = upload_jsonl(http, "train.jsonl", rows(16, 1))
        r = http.post("/v1/tasks", json={"base_model": "tiny", "training_file": train,
                                          "search_space": {"learning_rate": [1e-3]}})
        assert r.status_code == 201, r.text
        task_id = r.json()["id"]
        job_id = http.get(f"/v1/tasks/{task_id}/jobs").json()["data"][0]["id"]
        assert http.get(f"/ui/v1/tasks/{task_id}/live", params={"duration_s": 0.1}).status_code == 200
    with stack.client(other) as b:
        assert b.get("/v1/tasks").json()["data"] == []
        for path in (f"/v1/tasks/{task_id}", f"/v1/tasks/{task_id}/jobs",
                     f"/v1/tasks/{task_id}/events", f"/v1/tasks/{task_id}/metrics",
                     f"/ui/v1/tasks/{task_id}/live", f"/v1/tasks/{task_id}/adapter",
                     f"/v1/jobs/{job_id}", f"/v1/jobs/{job_id}/adapter"):
            r = b.get(path)
            assert r.status_code == 404, (path, r.status_code, r.text)
            assert set(r.json()) == {"error"} and "base_model" not in r.text
        assert b.post(f"/v1/tasks/{task_id}/cancel").status_code == 404
    assert httpx.get(f"{stack.url}/ui/v1/tasks/{task_id}/live").status_code == 401  # no key
    assert task_state(stack.http(), task_id) != "cancelled"

    sign_in(browser, stack, other)
    wait_css(browser, "#tasks-body tr", what="the task list")
    wait_for(lambda: "No tasks yet" in text(browser, "#tasks-body"), 10, "an empty list")
    assert not qs(browser, f'#tasks-body tr[data-task="{task_id}"]')
    browser.get(f"{stack.url}/ui/#/task/{task_id}")
    wait_for(lambda: "not yours" in text(browser, "#task-msg"), 10, "the refusal on the page")
    assert qs(browser, "#leaderboard-body tr") == []
    assert browser.execute_script("return window.__lpxTask.jobs.length") == 0
    # and the owner does see it
    sign_in(browser, stack, stack.api_key)
    wait_css(browser, f'#tasks-body tr[data-task="{task_id}"]', what="the owner's task")


# The page's fetch, answering this task action's first call(s) with the given error instead of
# the API (the rest go through): how a transient 503 looks to the page without breaking the API.
FAIL_ACTION = """
const [suffix, times, status, body, retryAfter] = arguments;
window.__actionCalls = 0;
if (!window.__realFetch) window.__realFetch = window.fetch;
window.fetch = (path, opts) => {
  if (String(path).endsWith(suffix) && opts && opts.method === "POST") {
    window.__actionCalls++;
    if (window.__actionCalls <= times)
      return Promise.resolve(new Response(JSON.stringify(body), {status,
        headers: {"Content-Type": "application/json", "Retry-After": retryAfter}}));
  }
  return window.__realFetch(path, opts);
};
"""


def test_an_action_that_raced_a_change_is_sent_again(stack: Stack,
                                                     browser: webdriver.Chrome) -> None:
    """A 503 concurrent_change (rolled back: nothing changed) is sent again by the page, which
    then shows the action done; any other 503 is shown at once, with the API's message."""
    with stack.http() as http:
        train = upload_jsonl(http, "train.jsonl", rows(16, 1))
        task_id = http.post("/v1/tasks", json={"base_model": "tiny", "training_file": train,
                                                "search_space": {"learning_rate": [1e-3]}}
                            ).json()["id"]
    sign_in(browser, stack, stack.api_key)
    wait_css(browser, f'#tasks-body tr[data-task="{task_id}"]', what="the task list")
    browser.get(f"{stack.url}/ui/#/task/{task_id}")
    wait_for(lambda: text(browser, "#task-state") == "queued", 20, "the task's page")
    down = {"error": {"type": "server_error", "code": "unavailable",
                      "message": "the database is unavailable; retry"}}
    browser.execute_script(FAIL_ACTION, "/pause", 1, 503, down, "5")
    click(browser, "#btn-pause")
    wait_for(lambda: text(browser, "#task-msg"), 10, "pause's answer")
    assert text(browser, "#task-msg") == "Pause failed: the database is unavailable; retry"
    assert browser.execute_script("return window.__actionCalls") == 1  # not retried
    assert task_state(stack.http(), task_id) == "queued"

    raced = {"error": {"type": "server_error", "code": "concurrent_change",
                       "message": "the request raced a concurrent change and changed nothing"}}
    browser.execute_script(FAIL_ACTION, "/cancel", 2, 503, raced, "1")
    click(browser, "#btn-cancel")
    wait_for(lambda: text(browser, "#task-msg") == "Cancel: cancelled", 20,
             f"the cancel, sent again ({text(browser, '#task-msg')!r})")
    assert browser.execute_script("return window.__actionCalls") == 3  # two raced, one went
    # (a live update read just before the cancel may show the old state for up to a tick)
    wait_for(lambda: text(browser, "#task-state") == "cancelled", 10, "cancelled on the page")
    assert task_state(stack.http(), task_id) == "cancelled"


def create_task_from_page(driver: webdriver.Chrome, tmp_path: Path) -> str:
    """Fill the new-task form (upload both files, model, search space, early exit), look at the
    dry-run estimate when the API has one, create; the task's id from the page it opens."""
    # 960 rows x 2 epochs at batch 4: 480 steps (under the page's 500 points a curve), long
    # enough (about 20 s on an idle 2-core CPU, minutes under load) to watch it train and list
    # it as running
    train = write_jsonl(tmp_path / "train.jsonl", rows(960, 1))
    val = write_jsonl(tmp_path / "val.jsonl", rows(8, 2))
    wait_for(lambda: qs(driver, "#f-model option"), 20, "the model list")
    q(driver, "#f-train").send_keys(str(train))
    q(driver, "#f-val").send_keys(str(val))
    Select(q(driver, "#f-model")).select_by_value("tiny")
    for css, value in (("#f-lr", "1e-2, 3e-1"), ("#f-rank", "4"), ("#f-bs", "4"),
                       ("#f-epochs", "2")):
        q(driver, css).clear()
        q(driver, css).send_keys(value)
    # The ranking after a quarter of the steps keeps one of the two jobs: the other exits.
    q(driver, "#f-extra").send_keys(json.dumps({
        "max_seq_len": 48, "eval": {"eval_every_steps": 5, "eval_max_samples": 8},
        "early_exit": {"warmup_fraction": 0.25, "keep_fraction": 0.5}}))
    if q(driver, "#btn-estimate").is_enabled():  # POST /v1/tasks?dry_run=true is there
        click(driver, "#btn-estimate")
        est = wait_for(lambda: (e := q(driver, "#estimate")).is_displayed() and e, 30,
                       f"the estimate ({text(driver, '#create-msg')})")
        assert "Jobs" in est.text and "\n2\n" in f"{est.text}\n", est.text
        assert re.search(r"Start\n.*\((now|in \d+ (s|min))\)", est.text), est.text
    click(driver, "#btn-create")
    wait_for(lambda: "#/task/" in driver.current_url, 60,
             f"the new task's page ({text(driver, '#create-msg')})")
    return driver.current_url.rsplit("#/task/", 1)[1]


def same_numbers(shown: dict[str, str], api: dict[str, Any]) -> bool:
    """The page's data-value of each key (empty: null) is the API's number."""
    return set(shown) == set(api) and all(
        (v is None and shown[k] == "") or (v is not None and shown[k] != "" and float(shown[k]) == v)
        for k, v in api.items())


def chart_points(driver: webdriver.Chrome) -> int:
    return int(driver.execute_script(
        "const s = document.getElementById('loss-chart'); return s ? +(s.dataset.points||0) : 0"))


@pytest.mark.with_scheduler
def test_dashboard_end_to_end(stack: Stack, browser: webdriver.Chrome, downloads: Path,
                              tmp_path: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    stack.daemon("node")
    stack.node_id("node")  # registered: the estimate can say where and when
    sign_in(browser, stack, stack.api_key, operator=WORKER_TOKEN)
    task_id = create_task_from_page(browser, tmp_path)
    http = stack.http()
    task = http.get(f"/v1/tasks/{task_id}").json()
    assert task["num_jobs"] == 2 and task["early_exit"]["keep_fraction"] == 0.5
    assert task["validation_file"] is not None
    # A second task, paused, resumed and cancelled from its page later. It waits for the one
    # slot or (co-location) joins the first task's executor, so it is long enough (20 epochs)
    # never to end before the test cancels it.
    waiting = http.post("/v1/tasks", json={
        "base_model": "tiny", "training_file": task["training_file"], "epochs": 20,
        "search_space": {"learning_rate": [1e-3]}, "max_seq_len": 48}).json()["id"]

    # Curves gain points while it trains, on one page load fed by the live stream.
    browser.execute_script("window.__sameLoad = 'yes'")
    wait_for(lambda: text(browser, "#task-state") == "running", 120,
             f"the task to run\n{stack.daemon_log('node')[-3000:]}")
    seen = [chart_points(browser)]

    def grew() -> bool:
        seen.append(chart_points(browser))
        return len({n for n in seen if n > 0}) >= 3

    wait_for(grew, 120, f"the curves to grow ({seen[-5:]})\n{stack.daemon_log('node')[-2000:]}",
             interval=0.3)
    assert seen == sorted(seen), seen  # points only ever added
    assert task_state(http, task_id) in ("running", "succeeded")
    assert browser.execute_script("return window.__sameLoad") == "yes"  # no reload

    # The tasks list mid-run: one running, one waiting, with their planned start and finish.
    browser.get(f"{stack.url}/ui/#/tasks")
    wait_css(browser, f'#tasks-body tr[data-task="{waiting}"]', what="the list")
    listed = dict(attrs(browser, "#tasks-body tr[data-task]", "data-task", "text"))
    assert "running" in listed[task_id] and "planned" in listed[waiting], listed
    q(browser, "#f-train").send_keys(str(tmp_path / "train.jsonl"))  # and what a third would cost
    click(browser, "#btn-estimate")
    wait_for(lambda: q(browser, "#estimate").is_displayed() or text(browser, "#create-msg"), 30,
             "the estimate")
    browser.set_window_size(1280, 1150)  # the whole form, the estimate included
    time.sleep(0.3)
    screenshot(browser, "dashboard-tasks.png")
    browser.set_window_size(1280, 1000)

    # The cluster: the node, its GPU, the running task and the one waiting on the timeline.
    browser.get(f"{stack.url}/ui/#/cluster")
    wait_css(browser, "#nodes-body tr[data-node]", what="the node row")
    assert "node" in text(browser, "#nodes-body") and "up" in text(browser, "#nodes-body")
    wait_for(lambda: qs(browser, f'#timeline .bar[data-task="{task_id}"]'), 20,
             "the running task on the timeline")
    if task_state(http, waiting) == "queued":
        wait_for(lambda: qs(browser, f'#timeline .bar.planned[data-task="{waiting}"]')
                 or task_state(http, waiting) != "queued", 20, "the waiting task's bar")
    screenshot(browser, "dashboard-cluster.png")

    # Pause, resume and cancel the second task from its page.
    def waiting_context() -> str:  # what a failure here needs to be understood
        evs = http.get(f"/v1/tasks/{waiting}/events", params={"limit": 100}).json()["data"]
        return (f"page: {text(browser, '#task-state')!r} {text(browser, '#task-msg')!r}; "
                f"API: {task_state(http, waiting)!r}; events: "
                f"{[(e['type'], e['message']) for e in evs]}\n{stack.service_log()[-3000:]}")

    def wait_page(predicate: Callable[[], Any], timeout: float, what: str) -> Any:
        try:
            return wait_for(predicate, timeout, what)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{waiting_context()}") from None

    browser.get(f"{stack.url}/ui/#/task/{waiting}")
    wait_page(lambda: text(browser, "#task-state"), 20, "the waiting task's page")
    click(browser, "#btn-pause")
    msg = wait_page(lambda: text(browser, "#task-msg"), 20, "pause's answer")
    assert msg in ("Pause: paused", "Pause: pausing"), waiting_context()  # queued / running
    wait_page(lambda: text(browser, "#task-state") == "paused", 30, "paused")
    click(browser, "#btn-resume")
    wait_page(lambda: text(browser, "#task-state") not in ("paused", ""), 20, "resumed")
    click(browser, "#btn-cancel")
    wait_page(lambda: text(browser, "#task-state") == "cancelled", 30, "the cancel on the page")
    assert task_state(http, waiting) == "cancelled"

    # Back to the training task: it ends; one job exited early and is marked on the curves.
    browser.get(f"{stack.url}/ui/#/task/{task_id}")
    wait_for(lambda: text(browser, "#task-state") in ENDED, 300,
             f"the task to end\n{stack.daemon_log('node')[-3000:]}")
    assert text(browser, "#task-state") == "succeeded", stack.daemon_log("node")[-3000:]
    jobs = http.get(f"/v1/tasks/{task_id}/jobs").json()["data"]
    exited = [j for j in jobs if j["state"] == "exited"]
    assert exited, jobs
    marks = wait_for(lambda: attrs(browser, ".exit-marker", "data-job", "data-reason"), 20,
                     "an early-exit marker")
    assert set(marks) == {(j["id"], j["exit_reason"]) for j in exited}
    wait_for(lambda: len(qs(browser, "#leaderboard-body tr")) == 2, 20, "the leaderboard")
    board = dict(attrs(browser, "#leaderboard-body tr", "data-job", "text"))
    for j in exited:
        assert j["exit_reason"] in board[j["id"]]
    # the event log is the task's events, each once, in order (across the stream's reconnects)
    logged = [int(i) for (i,) in attrs(browser, "#events li", "data-id")]
    api_events = http.get(f"/v1/tasks/{task_id}/events", params={"limit": 1000}).json()["data"]
    assert logged == [e["id"] for e in api_events]
    assert "job_exited" in text(browser, "#events")
    # every point of the curves is on the chart (each curve is under the page's max_points, 500)
    curves = http.get(f"/v1/tasks/{task_id}/metrics").json()["jobs"]
    total = sum(len(c["train"]) + len(c["val"]) for c in curves)
    wait_for(lambda: chart_points(browser) == total, 10, f"{total} points on the chart")
    for c in curves:
        [(n,)] = attrs(browser, f'#loss-chart path[data-job="{c["job_id"]}"][data-split="train"]',
                       "data-points")
        assert int(n) == len(c["train"])
    # server-side downsampling keeps the first and the last step (where the exit happened)
    small = http.get(f"/v1/tasks/{task_id}/metrics", params={"max_points": 4}).json()["jobs"]
    for c, s in zip(curves, small, strict=True):
        assert len(s["train"]) <= 4 and s["train"][0] == c["train"][0]
        assert s["train"][-1] == c["train"][-1]

    # Sort the leaderboard by best validation loss, both ways.
    click(browser, '#leaderboard th[data-sort="best_val_loss"]')
    order = [r for (r,) in attrs(browser, "#leaderboard-body tr", "data-job")]
    by_loss = sorted(jobs, key=lambda j: (j["best_val_loss"] is None, j["best_val_loss"] or 0))
    want = [j["id"] for j in by_loss]
    if attrs(browser, '#leaderboard th[data-sort="best_val_loss"]', "aria-sort") == [
            ("descending",)]:
        want = [j["id"] for j in reversed(by_loss) if j["best_val_loss"] is not None] + [
            j["id"] for j in by_loss if j["best_val_loss"] is None]
    assert order == want, (order, want)
    click(browser, '#leaderboard th[data-sort="index"]')
    assert [r for (r,) in attrs(browser, "#leaderboard-body tr", "data-job")] == [
        j["id"] for j in sorted(jobs, key=lambda j: j["index"])]

    # What the run used, as the executor reported it: the API's numbers on the page, and each
    # job's validation token accuracy at its best step as its checkpoint says.
    usage = http.get(f"/v1/tasks/{task_id}").json()["usage"]
    assert usage["trained_tokens"] > 0 and usage["gpu_seconds"] > 0, usage
    wait_for(lambda: same_numbers(dict(attrs(browser, "#task-usage [data-usage]", "data-usage",
                                             "data-value")), usage), 20,
             f"the usage on the page ({text(browser, '#task-usage')!r} vs {usage})")
    checkpoints = http.get(f"/v1/fine_tuning/jobs/{task_id}/checkpoints").json()["data"]
    accuracy = {j["id"]: None for j in jobs} | {
        c["job_id"]: c["metrics"]["valid_mean_token_accuracy"] for c in checkpoints}
    assert any(a is not None for a in accuracy.values()), checkpoints  # SFT reports it
    wait_for(lambda: {j: (float(v) if v else None) for j, v in attrs(
        browser, "#leaderboard-body td.val-acc", "data-job", "data-value")} == accuracy, 20,
        f"the token accuracies ({text(browser, '#leaderboard-body')!r} vs {accuracy})")
    browser.set_window_size(1280, 1500)  # the curves, the leaderboard and the events
    time.sleep(0.3)
    screenshot(browser, "dashboard-task.png")
    browser.set_window_size(1280, 1000)

    # Download the best adapter from the page and load it with PEFT.
    best = http.get(f"/v1/tasks/{task_id}").json()["best_job_id"]
    assert best
    click(browser, "#btn-best")
    archive = wait_for(lambda: [p for p in downloads.glob("*.tar.gz")], 30,
                       f"the download ({text(browser, '#task-msg')})")[0]
    wait_for(lambda: not list(downloads.glob("*.crdownload")), 10, "the download to finish")
    assert best in archive.name
    out = tmp_path / "best-adapter"
    with tarfile.open(archive, mode="r:gz") as tar:
        tar.extractall(out, filter="data")
    with io.BytesIO(http.get(f"/v1/jobs/{best}/adapter").content) as f, \
            tarfile.open(fileobj=f, mode="r:gz") as tar:
        same = {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}
    assert same == {p.name: p.read_bytes() for p in out.iterdir()}
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "tiny-llama")
    tuned = PeftModel.from_pretrained(base, out)
    assert any("lora_" in n for n, _ in tuned.named_parameters())

    # Its result file: the step metrics CSV of the run, downloaded from the page.
    result_file = http.get(f"/v1/tasks/{task_id}").json()["result_files"][0]  # the CSV (samples after)
    downloaded_results(browser, http, downloads, task_id, result_file)

    # The merged model, beside it: the first click asks for it, one once it is built downloads.
    click(browser, "#btn-merged")
    wait_for(lambda: "Merged model: " in text(browser, "#task-msg"), 10, "the merge request")
    merged = wait_for(lambda: (m := http.get(f"/v1/tasks/{task_id}/merged").json())["state"]
                      in ("succeeded", "failed") and m, 120, "the merge")
    assert merged["state"] == "succeeded", merged
    click(browser, "#btn-merged")
    tar = wait_for(lambda: [p for p in downloads.glob("merged-*.tar")], 30,
                   f"the merged download ({text(browser, '#task-msg')})")[0]
    wait_for(lambda: not list(downloads.glob("*.crdownload")), 10, "the download to finish")
    with tarfile.open(tar) as archive:
        assert "config.json" in archive.getnames()
    assert tar.read_bytes() == http.get(f"/v1/tasks/{task_id}/merged/content").content

    # The tasks list: both tasks with their final states.
    browser.get(f"{stack.url}/ui/#/tasks")
    wait_css(browser, f'#tasks-body tr[data-task="{task_id}"]', what="the list")
    listed = dict(attrs(browser, "#tasks-body tr[data-task]", "data-task", "text"))
    assert "succeeded" in listed[task_id] and "cancelled" in listed[waiting], listed

    # The usage report of the last 30 days has the run, with the API's numbers.
    usage_report_row(browser, http, task_id, usage)
    http.close()
    errors = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"
              and "Failed to load resource" not in e["message"]]  # the API's 4xx answers
    assert not errors, errors  # no script error, no CSP violation


def test_sixty_jobs_of_thousands_of_points_stay_usable(stack: Stack, browser: webdriver.Chrome,
                                                       tmp_path: Path) -> None:
    """A 60-job task with 3,000 train and 300 validation points per job (198,000 points; a spike
    at one step, some jobs exited): the page gets each curve downsampled by the server, keeps
    the spike and the exits, draws within seconds, and fits a narrow window."""
    from sqlalchemy import create_engine
    from sqlalchemy import text as sql

    with stack.http() as http:
        train = upload_jsonl(http, "train.jsonl", rows(16, 1))
        r = http.post("/v1/tasks", json={
            "base_model": "tiny", "training_file": train,
            "search_space": {"learning_rate": [1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3],
                             "lora_rank": [2, 4, 8, 16, 32, 64, 96, 128, 192, 256]}})
        assert r.status_code == 201, r.text
        task_id = r.json()["id"]
        engine = create_engine(stack.db_url.replace("postgresql://", "postgresql+psycopg://"))
        with engine.begin() as conn:
            conn.execute(sql(
                "UPDATE jobs SET state = 'exited', exit_reason = 'diverging', last_step = 1500 "
                "WHERE task_id = :t AND index % 7 = 3"), {"t": task_id})
            conn.execute(sql(
                "INSERT INTO metric_points (task_id, job_id, step, split, loss, created_at) "
                "SELECT j.task_id, j.id, s.s, 'train', 2 + 3.0 / s.s + j.index * 0.01 + random() * 0.05, now() "
                "FROM jobs j CROSS JOIN generate_series(1, 3000) AS s(s) WHERE j.task_id = :t "
                "AND (j.state <> 'exited' OR s.s <= 1500)"), {"t": task_id})
            conn.execute(sql(
                "INSERT INTO metric_points (task_id, job_id, step, split, loss, created_at) "
                "SELECT j.task_id, j.id, s.s * 10, 'val', 2.1 + 3.0 / s.s + j.index * 0.01, now() "
                "FROM jobs j CROSS JOIN generate_series(1, 300) AS s(s) WHERE j.task_id = :t"),
                {"t": task_id})
            conn.execute(sql("UPDATE metric_points SET loss = 40 WHERE task_id = :t AND "
                             "step = 1234 AND split = 'train' AND job_id = (SELECT id FROM jobs "
                             "WHERE task_id = :t AND index = 0)"), {"t": task_id})
        engine.dispose()
        jobs = http.get(f"/v1/tasks/{task_id}/jobs").json()["data"]
        t0 = time.perf_counter()
        full = http.get(f"/v1/tasks/{task_id}/metrics")
        t_full = time.perf_counter() - t0
        t0 = time.perf_counter()
        small = http.get(f"/v1/tasks/{task_id}/metrics", params={"max_points": 500})
        t_small = time.perf_counter() - t0
    curves = small.json()["jobs"]
    assert len(curves) == 60 and all(len(c["train"]) <= 500 for c in curves)
    spiked = next(c for c in curves if c["index"] == 0)
    assert [1234, 40.0] in [[p["step"], p["loss"]] for p in spiked["train"]]
    total = sum(len(c["train"]) + len(c["val"]) for c in curves)
    print(f"\n60 jobs: full curves {len(full.content) / 1e6:.1f} MB in {t_full:.2f} s, "
          f"max_points=500 {len(small.content) / 1e6:.2f} MB in {t_small:.2f} s, {total} points")

    sign_in(browser, stack, stack.api_key, operator=WORKER_TOKEN)
    wait_css(browser, "#tasks-body tr[data-task]", what="the list")
    t0 = time.perf_counter()
    browser.get(f"{stack.url}/ui/#/task/{task_id}")
    wait_for(lambda: chart_points(browser) == total, 30, f"{total} points on the chart")
    drawn = time.perf_counter() - t0
    print(f"60 jobs: page drawn in {drawn:.2f} s")  # 1.4 s here; bounded by the wait above
    exited = {j["id"] for j in jobs if j["state"] == "exited"}
    assert {m for (m,) in attrs(browser, ".exit-marker", "data-job")} == exited
    assert len(qs(browser, "#leaderboard-body tr")) == 60
    assert browser.execute_script(
        "return window.__lpxTask.curves[arguments[0]].train.some(p => p[0] === 1234 && p[1] === 40)",
        spiked["job_id"])
    clipped = "return document.getElementById('loss-chart').dataset.clipped"
    assert browser.execute_script(clipped) == "true"  # the spike does not flatten the rest
    click(browser, "#log-y")
    wait_for(lambda: browser.execute_script(clipped) == "false", 10, "log scale: all shown")
    assert chart_points(browser) == total
    t0 = time.perf_counter()  # a redraw (toggle a series) stays interactive
    click(browser, "#show-val")
    wait_for(lambda: chart_points(browser) < total, 10, "the redraw")
    print(f"60 jobs: redraw in {time.perf_counter() - t0:.2f} s")

    browser.set_window_size(400, 900)  # a narrow window: nothing wider than the page
    try:
        for page in (f"#/task/{task_id}", "#/tasks", "#/cluster", "#/usage"):
            browser.get(f"{stack.url}/ui/{page}")
            wait_css(browser, "#leaderboard-body tr, #tasks-body tr[data-task], #timeline, "
                     "#usage-body tr", what=page)
            time.sleep(0.3)
            over = browser.execute_script(
                "return document.documentElement.scrollWidth - window.innerWidth")
            browser.save_screenshot(str(tmp_path / f"narrow-{page.split('/')[1]}.png"))
            assert over <= 0, (page, over)
    finally:
        browser.set_window_size(1280, 1000)


# What an executor reports for each job, stored as the internal API stores it: train steps with
# their exact tokens and GPU-seconds, validation steps with the mean token accuracy, the adapter.
REPORTS = """
INSERT INTO metric_points (task_id, job_id, step, split, loss, tokens, gpu_seconds, created_at)
SELECT j.task_id, j.id, s, 'train', 3.0 - s * 0.1 - j.index * 0.05, 100 + 7 * j.index + s,
       0.5 + 0.01 * s, now() FROM jobs j CROSS JOIN generate_series(1, 10) AS s WHERE j.task_id = :t;
INSERT INTO metric_points (task_id, job_id, step, split, loss, data, created_at)
SELECT j.task_id, j.id, s, 'val', 2.5 - s * 0.01 - j.index * 0.2,
       jsonb_build_object('token_accuracy', 0.4 + j.index * 0.1 + s / 1000.0), now()
FROM jobs j CROSS JOIN (VALUES (5), (10)) AS v(s) WHERE j.task_id = :t;
UPDATE jobs SET state = 'running', last_step = 10, best_step = CASE WHEN index = 0 THEN 10 ELSE 5 END,
       best_val_loss = 2.5 - (CASE WHEN index = 0 THEN 10 ELSE 5 END) * 0.01 - index * 0.2
WHERE task_id = :t;
INSERT INTO artifacts (id, task_id, job_id, kind, key, files, step, created_at)
SELECT 'art_' || md5(j.id), j.task_id, j.id, 'adapter', 'adapters/' || j.id, '[]', j.best_step, now()
FROM jobs j WHERE j.task_id = :t;
"""


def test_usage_results_tracking_and_adapter_on_the_page(stack: Stack, browser: webdriver.Chrome,
                                                        downloads: Path, tmp_path: Path) -> None:
    """A task continued from an uploaded adapter, with a W&B integration, whose two jobs reported
    ten steps each and which is then cancelled: its page shows the API's usage beside the
    estimate, each job's validation token accuracy at its best step, the adapter it started from
    and the integration's sync; the page downloads its result CSV; the usage report of a period,
    reached from the navigation, has its row and totals."""
    from sqlalchemy import create_engine
    from sqlalchemy import text as sql

    from tests.e2e.test_init_adapter_e2e import make_adapter

    archive = make_adapter(tmp_path / "tiny-llama", tmp_path / "adapter")
    http = stack.http()
    train = upload_jsonl(http, "train.jsonl", rows(16, 1))
    r = http.post("/v1/files", data={"purpose": "adapter"},
                  files={"file": ("my-adapter.tar.gz", io.BytesIO(archive))})
    assert r.status_code == 201, r.text
    adapter_file = r.json()["id"]
    r = http.post("/v1/tasks", json={
        "base_model": "tiny", "training_file": train, "init_adapter_file": adapter_file,
        "search_space": {"learning_rate": [1e-3, 2e-3]}, "max_seq_len": 48,
        "integrations": [{"type": "wandb", "wandb": {"project": "dashboard-e2e"}}]})
    assert r.status_code == 201, r.text
    task_id = r.json()["id"]
    engine = create_engine(stack.db_url.replace("postgresql://", "postgresql+psycopg://"))
    with engine.begin() as conn:
        for statement in filter(str.strip, REPORTS.split(";")):
            conn.execute(sql(statement), {"t": task_id})
    engine.dispose()
    assert http.post(f"/v1/tasks/{task_id}/cancel").json()["state"] == "cancelled"
    task = http.get(f"/v1/tasks/{task_id}").json()
    jobs = {j["id"]: j for j in http.get(f"/v1/tasks/{task_id}/jobs").json()["data"]}

    sign_in(browser, stack, stack.api_key)
    wait_css(browser, f'#tasks-body tr[data-task="{task_id}"]', what="the task list")
    browser.get(f"{stack.url}/ui/#/task/{task_id}")
    wait_for(lambda: text(browser, "#task-state") == "cancelled", 20, "the task's page")

    # Usage: the API's numbers (the steps' exact tokens and GPU-seconds, the cost at the
    # operator's price) beside the dry run's estimate.
    usage = task["usage"]
    assert usage["trained_tokens"] == sum(100 + 7 * j["index"] + s for j in jobs.values()
                                          for s in range(1, 11))
    assert usage["cost"] is not None and usage["expected_tokens"] > 0, usage
    wait_for(lambda: same_numbers(dict(attrs(browser, "#task-usage [data-usage]", "data-usage",
                                             "data-value")), usage), 20,
             f"the usage on the page ({text(browser, '#task-usage')!r} vs {usage})")
    assert text(browser, '#task-usage td[data-usage="trained_tokens"]') == (
        f"{usage['trained_tokens']:,}")

    # Each job's validation token accuracy at its best step, as its checkpoint says.
    checkpoints = http.get(f"/v1/fine_tuning/jobs/{task_id}/checkpoints").json()["data"]
    accuracy = {c["job_id"]: c["metrics"]["valid_mean_token_accuracy"] for c in checkpoints}
    assert accuracy == {j: pytest.approx(0.4 + job["index"] * 0.1 + job["best_step"] / 1000)
                        for j, job in jobs.items()}
    wait_for(lambda: {j: (float(v) if v else None) for j, v in attrs(
        browser, "#leaderboard-body td.val-acc", "data-job", "data-value")} == accuracy, 20,
        f"the token accuracies ({text(browser, '#leaderboard-body')!r} vs {accuracy})")
    for job_id, a in accuracy.items():
        assert text(browser, f'#leaderboard-body td.val-acc[data-job="{job_id}"]') == f"{a:.4f}"

    # Continued from the uploaded adapter: its id and name.
    wait_for(lambda: "my-adapter.tar.gz" in text(browser, "#init-adapter"), 20,
             f"the adapter named ({text(browser, '#init-adapter')!r})")
    assert adapter_file in text(browser, "#init-adapter") and task["init_adapter_file"] == (
        adapter_file)

    # The W&B integration's sync, as the API shows it (done, or failed once: retried later).
    def synced() -> dict | None:
        i = http.get(f"/v1/tasks/{task_id}").json()["integrations"][0]
        return i if i["status"] in ("synced", "failed") or i["last_error"] else None

    sync = wait_for(synced, 120, "the W&B sync")
    row = '#integrations tr[data-type="wandb"]'
    wait_for(lambda: text(browser, f"{row} .sync-status") == sync["status"], 20,
             f"the sync's status on the page ({text(browser, '#integrations')!r} vs {sync})")
    assert "project dashboard-e2e" in text(browser, row)
    assert text(browser, f"{row} .last-error") == (sync["last_error"] or "")
    screenshot(browser, "dashboard-task-usage.png")

    # The result file: the step metrics CSV, downloaded from the page with the key.
    result_file = task["result_files"][0]  # the CSV (the samples file after it)
    wait_for(lambda: attrs(browser, "#btn-results", "data-file") == [(result_file,)], 20,
             "the result file's button")
    body = downloaded_results(browser, http, downloads, task_id, result_file)
    assert body.count(b"\n") == 1 + 2 * 10  # a row per job and step

    # The usage report of the last 30 days, from the navigation: the task's row and the totals
    # are the API's.
    report = usage_report_row(browser, http, task_id, usage)
    totals = dict(attrs(browser, "#usage-summary [data-total]", "data-total", "data-value"))
    assert same_numbers(totals, {k: report[k] for k in ("trained_tokens", "gpu_seconds", "cost")}
                        | {"tasks": len(report["tasks"])}), (totals, report)
    screenshot(browser, "dashboard-usage.png")
    # another period: nothing trained then
    browser.execute_script("document.getElementById('u-start').value = '2001-01-01T00:00';"
                           "document.getElementById('u-end').value = '2001-01-02T00:00';")
    click(browser, "#btn-usage")
    wait_for(lambda: "No training in this period" in text(browser, "#usage-body"), 10,
             f"an empty period ({text(browser, '#usage-msg')!r})")
    assert text(browser, '#usage-summary [data-total="trained_tokens"]') == "0"
    http.close()
    errors = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"
              and "Failed to load resource" not in e["message"]]
    assert not errors, errors  # no script error, no CSP violation
