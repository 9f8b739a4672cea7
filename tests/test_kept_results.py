"""A finished variant's result kept in the cache until logged (quantlab.kept_results), and the bounded
retry the sweep logs it with (tracking.with_retries). The whole path, with a real tracking server that
dies mid-sweep, is tests/test_resilience.py's test_results_outlive_a_tracking_server_that_dies_mid_sweep."""

from __future__ import annotations

import pytest

from quantlab import kept_results, tracking
from quantlab.kept_results import KeptResult
from quantlab.tracking import DatasetRecord


def _result(key: str = "k1", kld: float = 0.25) -> KeptResult:
    return KeptResult(
        variant="fp8",
        run_key=key,
        metrics={"quality/kld_mean": kld, "cost/weight_bytes": 1234.0},
        params={"variant.name": "fp8"},
        tags={"quantlab.checkpoint": "/cache/checkpoints/fp8-abc"},
        datasets=(DatasetRecord("mmlu_dev", "d1g", "local", "evals/mmlu_dev"),),
        files={"samples.json": '{"version": 2}', "logs/variant.log": b"\xffraw bytes\n"},
    )


def test_a_kept_result_reads_back_as_written(tmp_path):
    written = _result()
    kept_results.keep(tmp_path, written)
    read = kept_results.recall(tmp_path, "k1")
    assert read is not None and kept_results.has(tmp_path, "k1")
    assert read.files == {"samples.json": b'{"version": 2}', "logs/variant.log": b"\xffraw bytes\n"}
    assert (read.metrics, read.params, read.tags, read.datasets, read.finished_at) == (
        written.metrics,
        written.params,
        written.tags,
        written.datasets,
        written.finished_at,
    )


def test_keeping_again_replaces_and_discarding_removes(tmp_path):
    kept_results.keep(tmp_path, _result(kld=0.25))
    kept_results.keep(tmp_path, _result(kld=0.5))
    assert kept_results.recall(tmp_path, "k1").metrics["quality/kld_mean"] == 0.5
    assert kept_results.recall(tmp_path, "other") is None
    kept_results.discard(tmp_path, "k1")
    assert kept_results.recall(tmp_path, "k1") is None and not kept_results.has(tmp_path, "k1")
    assert not list((tmp_path / "results").iterdir())  # no scratch directory left either


def test_an_unreadable_kept_result_is_none_not_an_error(tmp_path):
    kept_results.keep(tmp_path, _result())
    (kept_results.kept_dir(tmp_path, "k1") / "files" / "samples.json").unlink()
    assert kept_results.recall(tmp_path, "k1") is None


def _failing(times: int, error: BaseException):
    calls = []

    def operation():
        calls.append(1)
        if len(calls) <= times:
            raise error
        return "logged"

    return operation, calls


def test_store_failures_are_retried_with_growing_waits_until_one_succeeds():
    operation, calls = _failing(2, OSError("connection refused"))
    waits = []
    assert tracking.with_retries(operation, 60, lambda error, wait: waits.append(wait)) == "logged"
    assert len(calls) == 3 and waits == [1.0, 2.0]


def test_the_last_store_error_is_raised_once_the_budget_is_spent():
    operation, calls = _failing(99, OSError("connection refused"))
    with pytest.raises(OSError, match="refused"):
        tracking.with_retries(operation, 2.5)
    assert len(calls) == 2  # tried at 0 s and after 1 s; the next wait (2 s) would pass the budget


def test_an_error_that_is_not_the_store_s_is_not_retried():
    operation, calls = _failing(1, KeyError("a bug"))
    with pytest.raises(KeyError):
        tracking.with_retries(operation, 60)
    assert len(calls) == 1
