"""The dashboard's Webhooks page in a real headless Chromium against the real service: add an
endpoint (the secret is shown once), send it a test event and see the delivery in its log, then
disable it. The receiver is a real HTTP server; the event verifies with the secret the page
showed (standardwebhooks). The screenshot (dashboard-webhooks.png) goes to a temp folder, or to
docs/ with LORAPLEX_UPDATE_SCREENSHOTS=1 (tests.helpers.screenshots)."""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator

import pytest
from standardwebhooks.webhooks import Webhook

from tests.e2e.conftest import Stack, wait_for
from tests.helpers.screenshots import screenshot
from tests.helpers.webhook_receiver import Receiver

CHROMIUM, CHROMEDRIVER = shutil.which("chromium"), shutil.which("chromedriver")
if not (CHROMIUM and CHROMEDRIVER):
    pytest.skip("chromium and chromium-driver are not installed", allow_module_level=True)
pytest.importorskip("selenium")

from selenium import webdriver  # noqa: E402
from selenium.common.exceptions import StaleElementReferenceException  # noqa: E402
from selenium.webdriver.chrome.options import Options  # noqa: E402
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402


@pytest.fixture(autouse=True)
def webhook_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LORAPLEX_WEBHOOK_ALLOW_PRIVATE", "true")  # the receiver is local
    monkeypatch.setenv("LORAPLEX_WEBHOOK_POLL_S", "0.2")


@pytest.fixture
def browser(stack: Stack) -> Iterator[webdriver.Chrome]:
    opts = Options()
    opts.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--disable-background-networking", "--no-first-run", "--window-size=1280,1000"):
        opts.add_argument(arg)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)
    try:
        yield driver
    finally:
        driver.quit()


def text(driver: webdriver.Chrome, css: str) -> str:
    return driver.execute_script(
        "const e = document.querySelector(arguments[0]); return e ? e.innerText.trim() : ''", css)


def click(driver: webdriver.Chrome, css: str) -> None:
    """A real click; again when the page redrew the element in between (it refreshes)."""
    for _ in range(20):
        try:
            driver.find_element(By.CSS_SELECTOR, css).click()
            return
        except StaleElementReferenceException:
            time.sleep(0.1)
    driver.find_element(By.CSS_SELECTOR, css).click()


def test_webhooks_page(stack: Stack, browser: webdriver.Chrome) -> None:
    receiver = Receiver()
    try:
        browser.get(f"{stack.url}/ui/#/signin")
        wait_for(lambda: browser.find_elements(By.CSS_SELECTOR, "#api-key"), 20, "sign-in form")
        browser.find_element(By.CSS_SELECTOR, "#api-key").send_keys(stack.api_key)
        click(browser, "#btn-sign-in")
        wait_for(lambda: browser.find_elements(By.CSS_SELECTOR, "#tasks-table"), 20, "tasks")
        click(browser, "#nav-webhooks")
        wait_for(lambda: "No endpoints yet" in text(browser, "#webhooks-list"), 20, "empty list")
        time.sleep(0.5)  # the tasks page's refresh, in flight when we left, must not flash here
        assert not browser.find_element(By.CSS_SELECTOR, "#flash").is_displayed(), \
            text(browser, "#flash")

        browser.find_element(By.CSS_SELECTOR, "#wh-url").send_keys(receiver.url)
        browser.find_element(By.CSS_SELECTOR, "#wh-desc").send_keys("from the page")
        click(browser, 'input[data-type="task.paused"]')
        click(browser, "#btn-webhook")
        secret = wait_for(lambda: text(browser, "#wh-secret-value"), 20, "the secret shown")
        assert secret.startswith("whsec_")
        card = wait_for(lambda: text(browser, "[data-webhook]"), 20, "the endpoint listed")
        assert receiver.url in card and "enabled" in card and "task.paused" in card
        assert "fine_tuning.job.succeeded" in card and secret not in card

        click(browser, "[data-webhook] .wh-test")
        [ping] = wait_for(lambda: receiver.of_type("webhook.test"), 20, "the test event")
        assert Webhook(secret).verify(ping.body, ping.headers)["type"] == "webhook.test"
        click(browser, "[data-webhook] .wh-deliveries")
        wait_for(lambda: "delivered" in text(browser, "[data-webhook] .deliveries"), 20,
                 "the delivery in the log")
        row = text(browser, "[data-webhook] .deliveries tbody tr")
        assert "webhook.test" in row and "200" in row
        screenshot(browser, "dashboard-webhooks.png")

        click(browser, "[data-webhook] .wh-redeliver")
        wait_for(lambda: len(receiver.ids()) == 2, 20, "the redelivery")
        assert receiver.ids()[0] == receiver.ids()[1]

        click(browser, "[data-webhook] .wh-toggle")
        wait_for(lambda: "disabled" in text(browser, "[data-webhook]"), 20, "disabled")
        with stack.http() as http:
            [hook] = http.get("/v1/webhooks").json()["data"]
            assert hook["enabled"] is False and hook["description"] == "from the page"
    finally:
        receiver.release()
        receiver.stop()
