"""What a reviewer sees on arrival (issue 32): a tiny sweep, `quantlab ui` on its store, and the addresses it prints
opened in a real headless Chromium, asserted without a click: MLflow's classic view, the sweep's runs grouped with
its variants and datasets in view, the chosen variant named at the top of the parent run's page, the decision at
the top of frontier.html (also at 1280 px). Then the release record (issue 49), after `quantlab pick --register`:
the variants as logged models in the experiment's Models tab, the release card on the registered version's page,
and a variant's changed answers opened from the parent run's description.

Screenshots at 1600x1000 go to artifacts/screenshots/ (gitignored, kept by CI; $QUANTLAB_SCREENSHOTS overrides).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import free_port
from test_embedded import CHROMIUM_ARGS, _wait_for
from test_sweep import quantlab
from tiny import save_tiny_llama

from quantlab import publish, tracking
from quantlab.report import decision_text
from recipes import REPO, tiny_recipe, write

pytestmark = pytest.mark.skipif(
    shutil.which("chromium") is None, reason="Debian's chromium is not installed (apt-get install chromium)"
)
# MXFP4 of a tiny Llama initialised at 10x the usual scale: it changes answers (FP8 of the tiny model changes none,
# and a changed-answers table without rows shows a reviewer nothing), and the policy's KL bound still passes it.
CHOSEN = "mxfp4"
VARIANTS = ("bf16", CHOSEN)
SHOTS = Path(os.environ.get("QUANTLAB_SCREENSHOTS", REPO / "artifacts" / "screenshots"))


@pytest.fixture(scope="module")
def reviewed(tmp_path_factory):
    """bf16 and mxfp4 of the tiny Llama, under a policy that chooses mxfp4 (a KL bound; the tiny model's few documents
    settle no drop limit), swept in this process's way (inprocess: no fork server for two variants), then
    `quantlab pick --register` and `quantlab ui` on its store: (store, parent run, the addresses `ui` printed by
    name, port)."""
    work = tmp_path_factory.mktemp("reviewed")
    model = save_tiny_llama(work / "model", initializer_range=0.2)
    variants = [{"name": name, "method": name} for name in VARIANTS]
    policy = {"default_policy": {"max_drop_any_task": None, "max_kld": 1.0}}
    path = write(work / "recipe.yaml", tiny_recipe(model, variants=variants, frontier=policy))
    uri = f"sqlite:///{work / 'mlruns' / 'mlflow.db'}"
    args = ["--tracking-uri", uri, "--cache-dir", str(work / "cache"), "--executor", "inprocess"]
    swept = quantlab("sweep", str(path), *args, cwd=work)
    assert swept.returncode == 0, swept.stdout[-3000:] + swept.stderr[-3000:]
    picked = quantlab("pick", "--register", *args[:2], cwd=work)  # mxfp4 registered, its card on the version
    assert picked.returncode == 0, picked.stdout[-3000:] + picked.stderr[-3000:]
    store = tracking.open_store(uri)
    parent = tracking.latest_sweep(store, "tiny")
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "quantlab", "ui", "--port", str(port), "--tracking-uri", uri],
        cwd=work,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        start_new_session=True,  # mlflow ui's workers with it: stopped as one group
        env={**os.environ, "COLUMNS": "300"},
    )
    try:
        printed = {}
        while len(printed) < 3 and (line := server.stdout.readline()):
            if found := re.match(r"(.+?): (http://\S+)$", line.strip()):
                printed[found[1]] = found[2]
        _wait_for(f"http://127.0.0.1:{port}/health", 120)
        yield store, parent, printed, port
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=30)


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=shutil.which("chromium"), args=CHROMIUM_ARGS)
        yield chromium
        chromium.close()


def _page(browser, width: int = 1600):
    """A first visit: a fresh profile, as a reviewer following a link (MLflow keeps its view choices per browser)."""
    return browser.new_context(viewport={"width": width, "height": 1000}).new_page()


def _shot(page, name: str) -> None:
    SHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SHOTS / name))


def _classic(page) -> None:
    """MLflow's classic (machine learning) view, not its GenAI one: its sidebar lists Runs and Models, not Observability."""
    assert "workflowType=machine_learning" in page.url
    page.get_by_role("link", name="Runs").first.wait_for(timeout=60_000)
    assert page.get_by_text("Observability").count() == 0


def test_ui_prints_addresses_that_open_the_classic_view(reviewed):
    _, parent, printed, port = reviewed
    base = f"http://127.0.0.1:{port}/#/experiments/{parent.experiment_id}"
    assert printed == {
        "tiny: runs": f"{base}/runs?workflowType=machine_learning&viewStateShareKey={tracking.VIEW_KEY}",
        "tiny: newest sweep": f"{base}/runs/{parent.run_id}?workflowType=machine_learning",
        "tiny: frontier": f"{base}/runs/{parent.run_id}/artifacts/frontier.html?workflowType=machine_learning",
    }


def test_runs_table_shows_the_sweep_its_variants_their_verdicts_and_datasets(reviewed, browser):
    store, parent, printed, _ = reviewed
    page = _page(browser)
    page.goto(printed["tiny: runs"])
    _classic(page)
    group = page.get_by_text(f"Group: {parent.tags[tracking.SWEEP]}")
    group.first.wait_for(timeout=60_000)
    for name in (*VARIANTS, parent.name):  # the group is open: every run of the sweep is a row, no click
        assert page.get_by_role("link", name=name, exact=True).first.is_visible(), name
    # The decision's columns, then the policy's metric (the rest of the reviewer's columns follow, out of sight).
    for seen in ("quantlab.chosen", "quantlab.verdict", "chosen", CHOSEN, "quality/kld_mean"):
        assert page.get_by_text(seen, exact=True).first.is_visible(), seen
    for dataset in ("mmlu_dev", "pydoc_cloze"):  # the Dataset column, on the variants and on the sweep's row
        assert page.get_by_text(re.compile(rf"^{dataset} \(")).count() >= 2, dataset
    _shot(page, "runs-table.png")


def test_parent_run_page_names_what_ships_above_the_fold(reviewed, browser):
    store, parent, printed, _ = reviewed
    view = publish.read_sweep(store, parent.run_id)
    text = decision_text(publish.recipe_decision(view), view.variants)
    assert text.ship.startswith(f"Ship {CHOSEN}:")
    page = _page(browser)
    page.goto(printed["tiny: newest sweep"])
    _classic(page)
    ship = page.get_by_text(text.ship, exact=True)
    ship.wait_for(timeout=60_000)
    box = ship.bounding_box()
    assert box is not None and box["y"] + box["height"] < 1000 / 2  # in the description's first lines
    assert page.get_by_text(text.why[:60]).first.is_visible()
    assert page.get_by_text(re.compile(r"^Metrics \([1-9]")).first.is_visible()  # the chosen one's figures
    assert page.get_by_text(re.compile(r"^mmlu_dev \(")).first.is_visible()  # its box lists the first dataset
    _shot(page, "parent-run.png")


def test_a_variant_run_opens_in_the_classic_view_from_the_address_the_sweep_prints(reviewed, browser):
    store, parent, _, port = reviewed
    (chosen,) = [run for run in tracking.child_runs(store, parent.run_id) if run.variant == CHOSEN]
    page = _page(browser)
    page.goto(tracking.run_address(f"http://127.0.0.1:{port}", parent.experiment_id, chosen.run_id))
    _classic(page)
    page.get_by_text(re.compile(r"^Metrics \([1-9]")).first.wait_for(timeout=60_000)
    assert page.get_by_text(re.compile(r"^mmlu_dev \(")).first.is_visible()
    _shot(page, "child-run.png")


def _frontier_frame(page):
    """MLflow's artifact viewer shows frontier.html in a frame of its own."""
    for _ in range(120):
        for frame in page.frames:
            if frame.query_selector("#ship") is not None:
                return frame
        page.wait_for_timeout(500)
    raise AssertionError("frontier.html's decision never appeared")


def test_frontier_html_opens_with_the_decision_then_the_table_then_the_plots(reviewed, browser):
    store, parent, printed, port = reviewed
    page = _page(browser)
    page.goto(printed["tiny: frontier"])
    _classic(page)
    frame = _frontier_frame(page)
    ship = frame.locator("#ship")
    assert ship.inner_text().startswith(f"Ship {CHOSEN}:")
    order = frame.evaluate("[...document.querySelectorAll('#ship, table, svg')].map(node => node.tagName)")
    assert order[:3] == ["P", "TABLE", "svg"]
    _shot(page, "frontier-html.png")
    # The page alone at 1280 px: nothing wider than the window but the table, which scrolls in its own box.
    alone = _page(browser, width=1280)
    alone.set_content(store.read_artifact(parent.run_id, "frontier.html").decode())  # MLflow serves it as a download
    assert alone.evaluate("document.documentElement.scrollWidth") <= 1280
    assert alone.locator("#ship").bounding_box()["y"] < 200
    _shot(alone, "frontier-html-1280.png")


def _without_assistant(page) -> None:
    """MLflow's assistant panel closed (each fresh profile opens it), for the table's width."""
    page.get_by_role("button", name="Close", exact=True).first.click()


def test_the_models_tab_lists_each_variant_as_a_logged_model_compared_by_data_set(reviewed, browser):
    from playwright.sync_api import expect

    store, parent, _, port = reviewed
    models = {model["name"]: model for model in store.logged_models(parent.experiment_id)}
    assert set(models) == set(VARIANTS)
    page = _page(browser)
    page.goto(f"http://127.0.0.1:{port}/#/experiments/{parent.experiment_id}/models?{tracking.CLASSIC_VIEW}")
    _classic(page)
    runs = {run.variant: run for run in tracking.child_runs(store, parent.run_id)}
    for name in VARIANTS:  # a row each: the model's page, then the run that logged it, both named as the variant
        for href in (f'$="/models/{models[name]["model_id"]}"', f'*="/runs/{runs[name].run_id}"'):
            expect(page.locator(f"a[href{href}]").first).to_have_text(name, timeout=60_000)  # a run's id, then its name
    _without_assistant(page)
    # Past the run's columns to the registered version (the chosen one's alone) and the first data set's metrics.
    page.locator(".ag-body-horizontal-scroll-viewport").evaluate("box => { box.scrollLeft = 400; }")
    # The grid draws the columns scrolled into view a moment later, so these wait for them.
    expect(page.get_by_text(re.compile(r"^mmlu_dev \(#")).first).to_be_visible(timeout=60_000)
    expect(page.get_by_text("v1", exact=True)).to_have_count(1)
    _shot(page, "models-tab.png")
    # Compared: each metric a chart of the variants side by side, grouped by the data set it was scored on.
    page.locator("label:has(input[value=CHART])").click()
    page.get_by_text("eval/mmlu_dev/acc").first.wait_for(timeout=60_000)
    for name in VARIANTS:  # in the list beside the charts and in each chart's legend
        assert page.get_by_text(name, exact=True).count() >= 2, name
    _shot(page, "models-compared.png")


def test_the_registered_version_shows_the_release_card(reviewed, browser):
    store, parent, _, port = reviewed
    (version,) = store.model_versions("tiny")
    page = _page(browser)
    page.goto(f"http://127.0.0.1:{port}/#/models/tiny/versions/{version}?{tracking.CLASSIC_VIEW}")
    heading = page.get_by_text(f"tiny v{version} (@production): {CHOSEN}", exact=True)
    heading.wait_for(timeout=60_000)
    assert heading.bounding_box()["y"] < 1000 / 2  # the card opens the page
    for seen in ("Error rate of the choice.", "checkpoint hash (content key)", "Verdicts", "Data sets", "Reproduce"):
        assert page.get_by_text(seen, exact=True).count() == 1, seen
    _without_assistant(page)
    _shot(page, "version-card.png")


def test_a_variants_changed_answers_open_from_the_parent_run(reviewed, browser):
    store, parent, printed, _ = reviewed
    chosen = next(run for run in tracking.child_runs(store, parent.run_id) if run.variant == CHOSEN)
    tables = json.loads(chosen.tags[tracking.LOGGED_ARTIFACTS])
    rows = {table["path"]: json.loads(store.read_artifact(chosen.run_id, table["path"]))["data"] for table in tables}
    path = next(path for path, changed in rows.items() if changed)  # a table with rows: answers that changed
    task = path.removeprefix("changed_answers/").removesuffix(".json")
    page = _page(browser)
    page.goto(printed["tiny: newest sweep"])
    _classic(page)
    section = page.get_by_text("Changed answers (against bf16)").first
    section.wait_for(timeout=60_000)
    section.scroll_into_view_if_needed()  # the description's end, in its own scrolling box
    _without_assistant(page)
    _shot(page, "parent-run-changed-answers.png")
    with page.context.expect_page() as opened:  # the description's links open a tab of their own
        page.get_by_role("link", name=task, exact=True).first.click()
    flips = opened.value
    flips.get_by_text("doc_id", exact=True).first.wait_for(timeout=60_000)  # the table, in the artifact viewer
    for column in ("gold", "bf16 answer", f"{CHOSEN} answer", "direction"):
        assert flips.get_by_text(column, exact=True).first.is_visible(), column
    assert flips.get_by_text(f"Previewing the first {len(rows[path])} rows").is_visible()
    _shot(flips, "flips-table.png")
