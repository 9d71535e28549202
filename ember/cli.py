"""`ember generate`, `ember chat`, `ember serve` and `ember run-batch`: the engine from a terminal.

Building the parser imports nothing heavy (no torch, no web stack): `ember --help` answers at once,
and each command imports what it runs. A command's own parser is built alone when the command line
names it: `ember serve` reaches the engine core's spawn without importing `run-batch`'s and `bench`'s
modules (asyncio, the HTTP client, prometheus' parser): 0.079 s of CPU from `import ember.cli` to the
launcher imported, against 0.126 s with every parser (medians of 7, 2-core EPYC, 2026-12-05). Before
any of that, `ember serve` starts its engine core's process (ember.frontend.core_spawn), so this
module imports nothing of the engine at its top.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from ember.frontend import core_spawn
from ember.torchrun import launched_by_torchrun

if TYPE_CHECKING:
    from ember.frontend.engine import LLMEngine, PromptType
    from ember.sampling.params import SamplingParams


def _add_sampling_args(p: argparse.ArgumentParser, default_max_tokens: int) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=default_max_tokens)
    g.add_argument("--temperature", type=float, default=None, help="0 = greedy (default: the model's)")
    g.add_argument("--top-p", type=float, default=None)
    g.add_argument("--top-k", type=int, default=None)
    g.add_argument("--min-p", type=float, default=None)
    g.add_argument("--repetition-penalty", type=float, default=None)


def _sampling_params(engine: LLMEngine, ns: argparse.Namespace) -> SamplingParams:
    from ember.sampling.params import SamplingParams

    defaults = engine.default_sampling_params()
    overrides = {
        k: getattr(ns, k)
        for k in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
        if getattr(ns, k) is not None
    }
    fields = {k: getattr(defaults, k) for k in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")}
    # --seed seeds the engine and each request, so a command line reproduces its output.
    return SamplingParams(**{**fields, **overrides}, max_tokens=ns.max_tokens, seed=ns.seed)


def stream(engine: LLMEngine, prompt: PromptType, params: SamplingParams) -> Iterator[str]:
    """Text deltas of one request as the engine produces them."""
    rid = engine.add_request(None, prompt, params)
    try:
        while True:
            for out in engine.step():
                if out.request_id == rid:
                    yield out.outputs[0].delta_text
                    if out.finished:
                        return
    finally:
        engine.abort_request(rid)


def _print_stream(chunks: Iterator[str]) -> str:
    text = []
    for chunk in chunks:
        sys.stdout.write(chunk)
        sys.stdout.flush()
        text.append(chunk)
    sys.stdout.write("\n")
    return "".join(text)


def cmd_generate(ns: argparse.Namespace) -> int:
    from ember.config import EngineArgs
    from ember.frontend.engine import LLMEngine

    engine = LLMEngine(EngineArgs.from_cli_args(ns))
    _print_stream(stream(engine, ns.prompt, _sampling_params(engine, ns)))
    return 0


def cmd_chat(ns: argparse.Namespace) -> int:
    from ember.config import EngineArgs
    from ember.frontend.engine import LLMEngine
    from ember.llm import chat_prompt

    engine = LLMEngine(EngineArgs.from_cli_args(ns))
    if engine.tokenizer is None:
        raise SystemExit("error: chat needs a tokenizer")
    params = _sampling_params(engine, ns)
    history: list[dict[str, Any]] = [{"role": "system", "content": ns.system}] if ns.system else []
    # --image: read here (the command line's own file), attached to the first user message
    images = [engine.processor.media.load(path) for path in ns.image or ()]

    def answer(user_text: str) -> None:
        content: Any = user_text
        if images and not any(m["role"] == "user" for m in history):
            content = [*({"type": "image_pil", "image_pil": im} for im in images), {"type": "text", "text": user_text}]
        history.append({"role": "user", "content": content})
        reply = _print_stream(stream(engine, chat_prompt(engine.processor, history), params))
        history.append({"role": "assistant", "content": reply})

    if ns.message is not None:
        answer(ns.message)
        return 0
    print("Ember chat. Type 'exit' or press Ctrl-D to quit.", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)
            return 0
        if line.strip() in ("exit", "quit"):
            return 0
        if line.strip():
            try:
                answer(line)
            except ValueError as e:  # e.g. the conversation outgrew the context window
                history.pop()
                print(f"error: {e}", file=sys.stderr)


_COMMANDS = ("generate", "chat", "serve", "run-batch", "bench")


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """Every command's parser; only `command`'s when it names one (the rest would only cost imports)."""
    from ember.config import EngineArgs

    parser = argparse.ArgumentParser(prog="ember", description="Ember LLM inference engine")
    sub = parser.add_subparsers(dest="command", required=True)
    wanted = set(_COMMANDS) if command not in _COMMANDS else {command}
    if "generate" in wanted:
        gen = sub.add_parser("generate", help="complete one prompt and print the text")
        gen.add_argument("prompt")
        EngineArgs.add_cli_args(gen)
        _add_sampling_args(gen, 256)
        gen.set_defaults(func=cmd_generate)

    if "chat" in wanted:
        chat = sub.add_parser("chat", help="interactive chat with the model's chat template")
        chat.add_argument("--message", default=None, help="answer this one message and exit")
        chat.add_argument("--system", default=None, help="system prompt")
        chat.add_argument(
            "--image",
            action="append",
            metavar="PATH",
            help="attach this image to the first user message (a vision model; may be given again)",
        )
        EngineArgs.add_cli_args(chat)
        _add_sampling_args(chat, 512)
        chat.set_defaults(func=cmd_chat)

    if "serve" in wanted:
        from ember.server.args import add_serve_parser
        from ember.server.launch import cmd_serve

        add_serve_parser(sub).set_defaults(func=cmd_serve)
    if "run-batch" in wanted:
        from ember.batch.cli import add_run_batch_parser

        add_run_batch_parser(sub)
    if "bench" in wanted:
        from ember.bench.serve import add_bench_parser

        add_bench_parser(sub)
    return parser


def _serves_from_a_core_process(argv: list[str]) -> bool:
    """Whether the command line is `ember serve` with an engine core process of its own (the default)."""
    flags = {arg.split("=", 1)[0] for arg in argv[1:]}
    return argv[:1] == ["serve"] and not flags & {"-h", "--help", "--no-engine-process"} and not launched_by_torchrun()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if _serves_from_a_core_process(argv):
        core_spawn.start_early()
    ns = build_parser(argv[0] if argv else None).parse_args(argv)
    try:
        return ns.func(ns)
    except ValueError as e:  # bad flags, bad model files: one clear line, no traceback
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
