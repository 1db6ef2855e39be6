"""pipeserve/startup.py: the one line of a start-up failure for the exceptions torch and the engine
raise, and the start-up phases' log lines, ticking clock and progress bar (in a terminal only)."""

from __future__ import annotations

import io
import logging
import sys
import time

import pytest

from pipeserve.startup import EXIT_STARTUP, StartupError, explain, fail, phase, progress

pytestmark = pytest.mark.timeout(60)


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize(("exc", "device", "flag"), [
    (ValueError("the KV pool needs at least one page; raise kv_cache_gb"), "cpu", "--kv-cache-gb"),
    (RuntimeError("CUDA out of memory. Tried to allocate 20.00 GiB"), "cuda", "--kv-cache-gb"),
    (AssertionError("Torch not compiled with CUDA enabled"), "cuda", "--device cuda"),
    (RuntimeError("Expected one of cpu, cuda, ... device type at start of device string: tpu"), "tpu",
     "--device tpu"),
    (StartupError("--port 1 is taken: choose another --port"), "auto", "--port"),
])
def test_the_exceptions_of_a_bad_flag_name_it(exc: BaseException, device: str, flag: str) -> None:
    line = explain(exc, device)
    assert flag in line and "\n" not in line


def test_anything_else_says_what_it_was_and_how_to_see_more() -> None:
    line = explain(KeyError("model.layers.0.mlp"), "cpu")
    assert line == ("the engine failed to start: KeyError: 'model.layers.0.mlp' (run with --debug for the "
                    "traceback)")


def test_fail_prints_one_line_and_the_traceback_only_with_debug(capsys: pytest.CaptureFixture[str]) -> None:
    try:
        raise StartupError("--x is wrong: give --x 1")
    except StartupError as exc:
        assert fail("pipeserve up", exc) == EXIT_STARTUP
        assert capsys.readouterr().err == "pipeserve up: error: --x is wrong: give --x 1\n"
        assert fail("pipeserve up", exc, debug=True) == EXIT_STARTUP
    err = capsys.readouterr().err
    assert err.startswith("Traceback") and err.endswith("pipeserve up: error: --x is wrong: give --x 1\n")


def test_a_phase_says_what_it_does_and_how_long_it_took(caplog: pytest.LogCaptureFixture,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "stderr", io.StringIO())  # not a terminal: no clock
    with caplog.at_level(logging.INFO, logger="pipeserve.startup"), phase("loading the weights", slow=True):
        time.sleep(0.05)
    assert caplog.messages[0] == "loading the weights ..."
    assert caplog.messages[1].startswith("loading the weights: done in 0.")
    assert sys.stderr.getvalue() == ""


def test_a_slow_phase_shows_a_clock_in_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    with phase("building the native kernels", slow=True):
        time.sleep(0.7)  # at least one tick of the clock
    assert "building the native kernels: 00:00" in terminal.getvalue()
    quiet = Terminal()
    monkeypatch.setattr(sys, "stderr", quiet)
    with phase("allocating the KV cache"):  # not slow: the log lines only
        pass
    assert quiet.getvalue() == ""


def test_progress_is_a_bar_in_a_terminal_only(monkeypatch: pytest.MonkeyPatch) -> None:
    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    assert list(progress([1, 2, 3], "compiling decode steps")) == [1, 2, 3]
    assert "compiling decode steps:   0%|" in terminal.getvalue() and "| 0/3 [" in terminal.getvalue()
    plain = io.StringIO()
    monkeypatch.setattr(sys, "stderr", plain)
    assert list(progress([1, 2], "compiling decode steps")) == [1, 2] and plain.getvalue() == ""
