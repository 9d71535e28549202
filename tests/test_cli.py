"""The `ember` command line, run as a user would run it."""

from __future__ import annotations

import subprocess
import sys


def ember(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ember.cli", *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=300,
        env={"EMBER_LOGGING_LEVEL": "WARNING", "PATH": "/usr/bin:/bin"},
    )


def test_chat_message_answers_about_paris():
    r = ember(
        "chat",
        "--message",
        "What is the capital of France?",
        "--temperature",
        "0",
        "--kv-cache-memory",
        "0.1",
        "--max-model-len",
        "2048",
    )
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout


def test_interactive_chat_keeps_history(default_llm):
    from ember import SamplingParams

    turns = ["My name is Alice.", "What is my name?"]
    r = ember(
        "chat",
        "--temperature",
        "0",
        "--max-tokens",
        "24",
        "--kv-cache-memory",
        "0.1",
        "--max-model-len",
        "2048",
        stdin="".join(t + "\n" for t in turns),
    )
    assert r.returncode == 0, r.stderr
    # The second answer must be the one the model gives with the whole conversation as context.
    params = SamplingParams(temperature=0, max_tokens=24, seed=0)
    history: list[dict] = []
    expected = ""
    for turn in turns:
        history.append({"role": "user", "content": turn})
        reply = default_llm.chat(history, params, use_tqdm=False)[0].outputs[0].text
        history.append({"role": "assistant", "content": reply})
        expected += f"> {reply}\n"
    assert r.stdout == expected + "> "


def test_generate_prints_completion(llama_dir):
    r = ember(
        "generate",
        "The quick brown fox",
        "--model",
        str(llama_dir),
        "--max-tokens",
        "5",
        "--temperature",
        "0",
        "--kv-cache-memory",
        "0.02",
    )
    assert r.returncode == 0, r.stderr
    again = ember(
        "generate",
        "The quick brown fox",
        "--model",
        str(llama_dir),
        "--max-tokens",
        "5",
        "--temperature",
        "0",
        "--kv-cache-memory",
        "0.02",
    )
    assert r.stdout == again.stdout and r.stdout.strip()


def test_bad_input_is_one_clear_line(tmp_path):
    r = ember("generate", "hi", "--model", str(tmp_path / "missing"))
    assert r.returncode == 2
    assert r.stderr.strip().startswith("error:") and "missing" in r.stderr and "Traceback" not in r.stderr
    r = ember("generate", "hi", "--temperature", "-1", "--kv-cache-memory", "0.1", "--max-model-len", "2048")
    assert r.returncode == 2 and "temperature" in r.stderr and "Traceback" not in r.stderr


def test_building_the_command_line_imports_neither_torch_nor_the_web_stack():
    """`ember --help` (and parsing any command's flags) answers at once: heavy imports wait for a command to run."""
    code = (
        "import sys; from ember.cli import build_parser; build_parser().parse_args(['serve', '--port', '1']); "
        "heavy = [m for m in ('torch', 'fastapi', 'uvicorn', 'numpy') if m in sys.modules]; print(heavy)"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"
