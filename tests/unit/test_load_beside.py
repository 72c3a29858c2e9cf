"""The executor's load reads and tokenises its tasks' data while the backbone loads
(`trainer.task_parts.beside`): both at once, each read's error kept for its task's own guard, and
a first task whose data does not parse fails with that error after the model loaded."""

from __future__ import annotations

import threading
import time
from dataclasses import replace

import pytest

from tests.helpers.engine_ref import synthetic_rows, tiny_model_dir, write_jsonl
from tests.helpers.executor_cfg import executor_config
from trainer.executor import Executor
from trainer.jobs import TrainJob
from trainer.task_parts import beside


def test_the_reads_run_while_the_work_does_and_their_errors_are_kept_in_order() -> None:
    work_thread, read_threads, order = [], [], []
    started = threading.Event()

    def work() -> str:
        work_thread.append(threading.get_ident())
        # the first read starts while the work still runs (it would time out here if run after)
        assert started.wait(5.0)
        return "model"

    def read(i: int, fail: bool) -> None:
        read_threads.append(threading.get_ident())
        started.set()
        order.append(i)
        if fail:
            raise ValueError(f"task {i}'s data")

    t0 = time.perf_counter()
    result, errors = beside(work, [lambda: read(0, False), lambda: read(1, True), lambda: read(2, False)])
    assert time.perf_counter() - t0 < 5.0
    assert result == "model" and order == [0, 1, 2]
    assert errors[0] is None and errors[2] is None and str(errors[1]) == "task 1's data"
    # the work in the caller's thread (a lockstep load's collectives), the reads in one other
    assert work_thread == [threading.get_ident()] and len(set(read_threads)) == 1
    assert read_threads[0] != work_thread[0]


def test_an_error_of_the_work_is_raised_after_every_read_ended() -> None:
    done = []

    def work() -> None:
        raise RuntimeError("the backbone did not load")

    def slow_read() -> None:
        time.sleep(0.2)
        done.append(True)

    with pytest.raises(RuntimeError, match="did not load"):
        beside(work, [slow_read])
    assert done == [True]  # not left running behind the error


def test_a_first_task_whose_data_does_not_parse_fails_with_its_error_after_the_load(tmp_path) -> None:  # noqa: ANN001
    model = tiny_model_dir("llama", tmp_path)
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"text_of_another_api": "x"}] * 3)
    cfg = executor_config(model_dir=str(model), train_file=str(bad), output_dir=str(tmp_path / "out"),
                          jobs=[TrainJob("j", lora_rank=2, learning_rate=1e-3, batch_size=1, max_steps=2)],
                          max_seq_len=48)
    ex = Executor(cfg)
    with pytest.raises(Exception, match="unknown record format"):
        ex.run()
    assert ex.load_parts["model"] >= 0 and ex.results()[ex.first.task_id]["outcome"] == "failed"
    # the same task on good data trains: the data read beside the load is the one the task uses
    good = write_jsonl(tmp_path / "good.jsonl", synthetic_rows(12, seed=3, fmt="completion"))
    ok = Executor(replace(cfg, train_file=str(good), output_dir=str(tmp_path / "ok")))
    status = ok.run()
    assert status["j"]["state"] == "completed" and len(ok.first.train) > 0
