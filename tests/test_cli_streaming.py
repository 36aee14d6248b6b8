"""``deepinfer generate`` as a newcomer meets it: streamed output, Ctrl-C (a real SIGINT to a subprocess), ``-v``,
prompts that are not UTF-8, refused prompts shown short, and ``deepinfer --help`` without torch."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from v4_factory import tiny_checkpoint

from deepinfer_core.cli.generate import RULE
from deepinfer_core.cli.main import main

pytest.importorskip("transformers")

FLAGS = ["--max-tokens", "5", "--temperature", "0.8", "--seed", "3"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tiny_stream")
    tiny_checkpoint(folder)
    return folder


def _environ() -> dict[str, str]:
    environ = {k: v for k, v in os.environ.items() if k not in ("DEEPINFER_ACCELERATOR", "DEEPINFER_PLUGINS")}
    environ["OMP_NUM_THREADS"] = "1"
    return environ


def _start(*args: str) -> subprocess.Popen:
    """The CLI in a child process that gets SIGINT as a terminal's foreground process would: handled by default, not
    blocked. Where these tests run with SIGINT ignored (a shell's background job) or blocked (some CI runners), the
    child would inherit that: Python would install no handler, or the signal would stay pending, and Ctrl-C would do
    nothing. A handler of this process is reset to the default in the child; an ignored or blocked signal is not."""
    handler = signal.signal(signal.SIGINT, signal.default_int_handler)
    mask = signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    try:
        return subprocess.Popen([sys.executable, "-m", "deepinfer_core.cli", *args], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, env=_environ())
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        signal.signal(signal.SIGINT, handler)


def _wait_until_sigint_is_handled(process: subprocess.Popen) -> None:
    """Until Python has installed its SIGINT handler (before that, SIGINT kills the process outright)."""
    status = Path(f"/proc/{process.pid}/status")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        caught = next(line for line in status.read_text().splitlines() if line.startswith("SigCgt:"))
        if int(caught.split()[1], 16) & (1 << (signal.SIGINT - 1)):
            return
        time.sleep(0.005)
    pytest.fail("the process never installed a SIGINT handler")


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads the signal mask from /proc")
def test_ctrl_c_while_importing_exits_130_with_one_line():
    process = _start("generate", "--max-tokens", "1", "w1")
    _wait_until_sigint_is_handled(process)
    time.sleep(0.2)  # inside the imports (torch alone takes seconds)
    process.send_signal(signal.SIGINT)
    _, err = process.communicate(timeout=120)
    assert process.returncode == 130
    assert err.decode() == "deepinfer: interrupted\n"


def test_ctrl_c_while_streaming_keeps_the_text_so_far_and_exits_130(checkpoint):
    process = _start("generate", "--model", str(checkpoint), "--stream", "--max-tokens", "4000", "--temperature", "1",
                     "--seed", "3", "--max-model-len", "4096", "w1")
    os.set_blocking(process.stdout.fileno(), False)
    shown, deadline = b"", time.monotonic() + 120
    while shown.count(b" w") < 5 and time.monotonic() < deadline:  # a few tokens of the completion are on screen
        shown += process.stdout.read() or b""
        time.sleep(0.02)
    process.send_signal(signal.SIGINT)
    out, err = process.communicate(timeout=120)
    stdout = (shown + (out or b"")).decode()
    assert process.returncode == 130
    assert err.decode() == "deepinfer: interrupted\n"
    assert stdout.startswith(f"{RULE}\nprompt:\nw1\n--- completion:\n")
    partial = stdout.split("--- completion:\n", 1)[1]
    assert partial.endswith("\n") and "--- finish" not in partial and len(partial.split()) >= 5


def test_streamed_output_is_the_layout_with_each_completion_closed_by_its_finish(checkpoint, capsys):
    prompts = ["w1 w2", "w3"]
    assert main(["generate", "--model", str(checkpoint), "--json", *FLAGS, "--n", "2", *prompts]) == 0
    final = json.loads(capsys.readouterr().out)
    assert main(["generate", "--model", str(checkpoint), "--stream", *FLAGS, "--n", "2", *prompts]) == 0
    expected = ""
    for i, output in enumerate(final):
        expected += f"{RULE}\nprompt {i + 1} of 2:\n{prompts[i]}\n"
        for j, completion in enumerate(output["outputs"]):
            expected += (f"--- completion {j + 1} of 2:\n{completion['text']}\n--- finish: "
                         f"{completion['finish_reason']}, {len(completion['token_ids'])} tokens\n")
    assert capsys.readouterr().out == expected + f"{RULE}\n"


def test_json_stays_whole_even_when_stream_is_asked(checkpoint, capsys):
    assert main(["generate", "--model", str(checkpoint), "--json", "--stream", *FLAGS, "w1"]) == 0
    assert json.loads(capsys.readouterr().out)[0]["outputs"][0]["finish_reason"] in ("stop", "length")


def test_a_prompt_that_is_not_utf8_is_refused_before_loading(capsys):
    prompt = b"w1 \xff\xfe w2".decode("utf-8", "surrogateescape")  # as Python passes such argv bytes
    assert main(["generate", "--model", "/no/such/model", "ok", prompt]) == 2
    assert capsys.readouterr().err == ("deepinfer generate: error: prompt 2 is not valid UTF-8 (bytes ff fe at "
                                       "character 3); pass UTF-8 text (e.g. convert it with iconv -t UTF-8)\n")


def test_a_refused_long_prompt_is_shown_by_its_start_and_length(checkpoint, capsys):
    long_prompt = " ".join(["w1"] * 400)
    assert main(["generate", "--model", str(checkpoint), "--no-stream", "--max-model-len", "64", *FLAGS,
                 long_prompt, "w2"]) == 2
    captured = capsys.readouterr()
    assert f"{long_prompt[:200]}... (1199 characters)\n--- refused: the prompt has 400 tokens" in captured.out
    assert long_prompt not in captured.out + captured.err
    assert "deepinfer generate: error: prompt 1: the prompt has 400 tokens" in captured.err


def test_verbose_shows_what_the_engine_does(checkpoint):
    args = ["generate", "--model", str(checkpoint), "--no-stream", *FLAGS, "w1"]
    quiet = subprocess.run([sys.executable, "-m", "deepinfer_core.cli", *args], capture_output=True, text=True,
                           env=_environ(), timeout=300, check=True)
    assert quiet.stderr == ""
    verbose = subprocess.run([sys.executable, "-m", "deepinfer_core.cli", *args, "-v"], capture_output=True,
                             text=True, env=_environ(), timeout=300, check=True)
    assert f"deepinfer: model {checkpoint}: torch.float32, max_model_len 4096" in verbose.stderr
    assert "tokens for 1 prompt(s) in" in verbose.stderr and "DEBUG" not in verbose.stderr


def test_help_parses_without_importing_torch():
    code = ("import sys\nfrom deepinfer_core.cli.main import main\n"
            "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
            "print('torch imported' if 'torch' in sys.modules else 'no torch', file=sys.stderr)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_environ(),
                            timeout=120, check=True)
    assert result.stdout.startswith("usage: deepinfer ") and result.stderr == "no torch\n"
