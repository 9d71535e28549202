"""`ember serve`'s start: the timeline it logs, and what start-up leaves out or defers.

- the server logs one start-up line: the front end's and the engine core process's moments, in
  time order, in seconds since the server's process started;
- `ember serve` starts its engine core's process before parsing its flags, and one nobody took
  (bad flags, `--help`) is killed when the front end exits;
- `ember serve` builds only its own command's parser (no `run-batch` / `bench` modules), and neither
  process imports llguidance before the first grammar, nor the engine core `tokenizers`;
- on an unquantized HF model, neither process imports the GGUF reader (the `gguf` package) or PyYAML,
  the core no pre-quantized checkpoint's reader, the front end no image processor (nor numpy);
- the engine core leaves a GGUF vocabulary's strings undecoded until read (`StringArray`), and the
  decoded strings are the file's;
- the native int4 relayout gives the bytes the unpack-and-repack reference gives;
- rotary tables cover max_model_len positions, not the model's own maximum;
- `ember.heap`: the collector off during start-up, back on (and start-up's objects frozen) after.
Timings are benchmarks/startup.py's business, not these tests'.
"""

from __future__ import annotations

import gc
import os
import re
import signal
import struct
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from conftest import default_gguf_path, free_port, inproc_core, wait_healthy

from ember import heap, timeline
from ember.cpu_native.ops import _relayout_int4
from ember.model.gguf_reader import GGUFFile, GGUFFormatError, StringArray
from ember.quant.formats import unpack_int4

FRONT_END_ORDER = ["front end imported", "core spawned", "web stack imported", "HTTP listening", "accepting requests"]
CORE_ORDER = ["core process started", "core imported", "model files read", "model loaded", "KV allocated", "core ready"]


def _run_python(code: str) -> str:
    """The standard output of `code` run in a fresh interpreter, which must exit 0."""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_serve_logs_one_start_up_timeline(llama_dir):
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "ember.server.launch", str(llama_dir), "--port", str(port)]
        + ["--kv-cache-memory", "0.02", "--max-model-len", "256"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        wait_healthy(proc, f"http://127.0.0.1:{port}")
    finally:
        proc.send_signal(signal.SIGTERM)
        log, _ = proc.communicate(timeout=60)
    [line] = [line for line in log.splitlines() if "start-up, seconds since the process started:" in line]
    marks = [(m[1], float(m[2])) for m in re.finditer(r"([a-zA-Z][a-zA-Z /-]*?) (\d+\.\d\d)s", line.split(": ", 1)[1])]
    names = [name for name, _ in marks]
    times = [t for _, t in marks]
    assert times == sorted(times) and times[0] >= 0 and times[-1] < 120, line
    for order in (FRONT_END_ORDER, CORE_ORDER):  # each process's own moments, in the order they happen
        assert [n for n in names if n in order] == order, line
    # the core is ready before the front end hears it, and the front end serves only after that
    assert names.index("core ready") < names.index("core ready received") < names.index("accepting requests"), line


def test_timeline_marks_are_taken_once_in_time_order():
    timeline.take()
    timeline.mark("b", 2.0)
    timeline.mark("a", 1.0)
    marks = timeline.take()
    assert marks == [("b", 2.0), ("a", 1.0)] and timeline.take() == []
    assert timeline.summary(marks, 0.5) == "a 0.50s, b 1.50s"


def test_process_start_is_the_start_of_this_interpreter():
    """A fresh interpreter started before its first import and well under the run's minute."""
    code = (
        "import time\n"
        "before = time.monotonic()\n"
        "from ember import timeline\n"
        "start = timeline.process_start()\n"
        "print(before - start, time.monotonic() >= start)\n"
    )
    outer = time.monotonic()
    out = _run_python(code)
    age, ordered = out.split()
    assert ordered == "True" and -0.02 <= float(age) < time.monotonic() - outer + 0.02


def test_serve_builds_only_its_own_parser_and_no_process_imports_llguidance_at_start():
    code = (
        "import sys\n"
        "from ember.cli import build_parser\n"
        "build_parser('serve').parse_args(['serve', '--port', '1'])\n"
        "import ember.server.launch, ember.server.serve, ember.core.engine_core, ember.core.loop\n"
        "print(sorted(m for m in ('ember.batch.cli', 'ember.bench.serve', 'llguidance') if m in sys.modules))\n"
        "from ember.sampling.structured import StructuredOutputsParams, check_grammar\n"
        "check_grammar(StructuredOutputsParams(json={'type': 'object'}))\n"
        "print('llguidance' in sys.modules)\n"
        "full = build_parser()._subparsers._group_actions[0].choices\n"
        "print(sorted(full))\n"
    )
    out = _run_python(code)
    assert out.splitlines() == ["[]", "True", "['bench', 'chat', 'generate', 'run-batch', 'serve']"]


def test_serve_starts_its_core_before_its_flags_and_a_core_nobody_took_dies_with_the_front_end():
    code = (
        "import sys\n"
        "from ember.frontend import core_spawn\n"
        "from ember.cli import _serves_from_a_core_process as early\n"
        "print(early(['serve']), early(['serve', '--port=1']), early(['serve', '--no-engine-process']),\n"
        "      early(['serve', '-h']), early(['generate', 'x']))\n"
        "core_spawn.start_early()\n"
        "early_proc, later = core_spawn.spawn(), core_spawn.spawn()\n"
        "print(early_proc.args[1:], later is not early_proc)\n"
        "for proc in (early_proc, later):\n"
        "    proc.kill(), proc.wait()\n"
        "core_spawn.start_early()\n"
        "print(core_spawn._early.pid)\n"
    )
    out = _run_python(code)
    flags, taken, unclaimed = out.splitlines()[:3]
    assert flags == "True True False False False"
    assert taken == "['-m', 'ember.core.process'] True"
    with pytest.raises(ProcessLookupError):  # killed and reaped at exit, not left importing torch
        os.kill(int(unclaimed), 0)


def test_the_engine_core_imports_tokenizers_only_to_build_its_grammar_tokenizer():
    code = (
        "import sys\n"
        "import ember.core.process, ember.core.engine_core, ember.core.loop\n"
        "from ember.model.gguf_tokenizer import GGUFVocab, open_gguf\n"
        "print('tokenizers' in sys.modules)\n"
        f"vocab = GGUFVocab.read(open_gguf({default_gguf_path()!r}, lazy_strings=True))\n"
        "print(vocab.build().get_vocab_size() == len(vocab.tokens), 'tokenizers' in sys.modules)\n"
    )
    out = _run_python(code)
    assert out.splitlines() == ["False", "True True"]


def test_an_hf_model_starts_without_the_gguf_reader_yaml_checkpoint_readers_or_image_processors(llama_dir):
    """What each process imports to start on an unquantized HF model, its files read: each module named here
    is deferred to the model or flag that needs it (see ember.model.files and ember.quant.checkpoints)."""
    load = f"LoadConfig({str(llama_dir)!r}, None, 'auto', None)"

    def imported(*modules: str) -> str:
        return f"print(sorted(m for m in {modules} if m in sys.modules))\n"

    core = (
        "import sys\n"
        "import ember.core.process, ember.core.engine_core, ember.core.loop\n"
        "from ember.config import LoadConfig\n"
        "from ember.model.loader import load_model_files\n"
        f"load_model_files({load}).model_info()\n"
        + imported("gguf", "yaml", "ember.model.gguf", "ember.quant.checkpoints.gptq")
    )
    front_end = (
        "import sys\n"
        "import ember.server.launch, ember.server.serve\n"
        "from ember.config import LoadConfig\n"
        "from ember.model.files import load_model_info\n"
        f"load_model_info({load})\n" + imported("gguf", "yaml", "numpy", "ember.multimodal.preprocess")
    )
    assert _run_python(core).splitlines() == ["[]"]
    assert _run_python(front_end).splitlines() == ["[]"]


def test_lazy_strings_are_the_files_strings_decoded_on_first_read():
    path = default_gguf_path()
    eager, lazy = GGUFFile(path), GGUFFile(path, lazy_strings=True)
    tokens = lazy.fields["tokenizer.ggml.tokens"]
    assert isinstance(tokens, StringArray) and len(tokens) == len(eager.fields["tokenizer.ggml.tokens"])
    assert tokens._strings is None, "len() decodes nothing"
    for key, value in eager.fields.items():
        got = lazy.fields[key]
        assert (list(got) if isinstance(got, StringArray) else got) == value, key
    assert (
        tokens[5] == eager.fields["tokenizer.ggml.tokens"][5]
        and tokens[-2:] == eager.fields["tokenizer.ggml.tokens"][-2:]
    )


def test_a_lazy_string_that_is_not_utf8_fails_when_read():
    raw = struct.pack("<Q", 2) + b"ok" + struct.pack("<Q", 1) + b"\xff"
    strings = StringArray(raw, 2)
    assert len(strings) == 2
    with pytest.raises(GGUFFormatError, match="UTF-8"):
        list(strings)


@pytest.mark.parametrize("shape", [(3, 32), (64, 576), (17, 4096)])
def test_native_int4_relayout_matches_unpack_and_repack(shape):
    n, k = shape
    packed = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=torch.Generator().manual_seed(n))
    codes = unpack_int4(packed, k).numpy().reshape(n, k // 32, 2, 16)  # runs of 32: inputs j and j + 16 share byte j
    expected = (codes[:, :, 0] | (codes[:, :, 1] << 4)).reshape(n, k // 2)
    np.testing.assert_array_equal(_relayout_int4(packed, k).numpy(), expected)


def test_rotary_tables_cover_max_model_len(llama_dir):
    from ember import LLM

    llm = LLM(str(llama_dir), max_model_len=96, kv_cache_memory=0.02, engine_process=False)
    runner = inproc_core(llm).runner
    assert runner.model_config.max_position_embeddings != 96
    rotary = runner.model.attention_layers()[0].rotary
    assert rotary.cos.shape[0] == rotary.sin_signed.shape[0] == 96
    llm.llm_engine.shutdown()


def test_heap_pauses_the_collector_and_settles_with_start_up_frozen():
    assert gc.isenabled()
    try:
        heap.pause_collection()
        assert not gc.isenabled()
        heap.settle()
        assert gc.isenabled() and gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
        gc.enable()
