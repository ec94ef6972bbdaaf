"""`tierlm generate` and `tierlm chat`."""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path

from tierlm.cli.common import generation_config, load_model, status, use_packages


def cmd_generate(args) -> int:
    prompt = args.prompt if args.prompt is not None else sys.stdin.read()
    if not prompt.strip():
        raise ValueError("empty prompt: give one as an argument or on stdin")
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as e:  # undecodable bytes, read by Python as lone surrogates
        raise ValueError(f"the prompt is not valid UTF-8 (at character {e.start})") from None
    config = generation_config(args)
    model = load_model(args)
    use_packages(model, config)
    if args.chat or args.system:
        messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
            {"role": "user", "content": prompt}
        ]
        text = model.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        # the template writes its own special tokens (Gemma's <bos>): as the server does, add none
        prompt = model.tokenizer.encode(text, add_special_tokens=False)
    else:
        from tierlm.generation.prompts import encode_prompts

        prompt = encode_prompts(model.tokenizer, prompt)[0]
    check_room(model, len(prompt), config.max_new_tokens)
    gen = model.start([prompt], config)
    if args.explain:
        from tierlm import cpu

        status(f"tierlm: cpu: {cpu.detect().describe()}")
        status(f"tierlm: {gen.decision.explain()}")  # a package step said which one as it loaded
    for _row, delta, _finished, _reason in gen.stream():  # a beam search's best beam comes at its end
        if not args.json:
            sys.stdout.write(delta)
            sys.stdout.flush()
    result = gen.result()
    if args.json:
        print(json.dumps(result_json(result)))
    else:
        sys.stdout.write("\n")
        s = result.stats
        status(
            f"tierlm: {s.new_tokens} tokens, prefill {s.prefill_seconds:.2f} s, {s.decode_tokens_per_s:.1f} tok/s"
        )
    return 0


def check_room(model, prompt_tokens: int, max_new_tokens: int) -> None:
    """The prompt and --max-new-tokens must fit the model's context, as the server's max_tokens must."""
    context = model.config.max_position_embeddings
    if prompt_tokens > context:
        raise ValueError(f"prompt of {prompt_tokens} tokens exceeds the model's context of {context}")
    if prompt_tokens + max_new_tokens > context:
        raise ValueError(
            f"--max-new-tokens {max_new_tokens} and the prompt's {prompt_tokens} tokens exceed the model's "
            f"context of {context}: use --max-new-tokens <= {context - prompt_tokens}"
        )


def result_json(result) -> dict:
    s = result.stats
    return {
        "text": result.texts[0],
        "token_ids": result.token_ids[0],
        "finish_reason": result.finish_reasons[0],
        "stats": {
            "prompt_tokens": s.prompt_tokens,
            "new_tokens": s.new_tokens,
            "prefill_seconds": s.prefill_seconds,
            "decode_tokens_per_s": s.decode_tokens_per_s,
            "cache": s.cache,
            "compiled": s.compile.compile,
            "compile_reasons": list(s.compile.reasons),
        },
    }


def cmd_chat(args) -> int:
    tools = _read_tools(args.tools) if args.tools else None  # before the load: a bad file costs no wait
    config = generation_config(args)
    model = load_model(args)
    use_packages(model, config)
    history = [{"role": "system", "content": args.system}] if args.system else []
    if sys.stdin.isatty():  # input() then edits lines and reads past a terminal's 4095-byte line limit
        with contextlib.suppress(ImportError):  # (it cut a longer message there without a word)
            import readline  # noqa: F401
    while True:
        try:
            line = input("> ")
        except EOFError:
            print()
            return 0
        if line.strip() in ("/exit", "/quit"):
            return 0
        if not line.strip():
            continue
        history.append({"role": "user", "content": line})
        if tools is not None:
            if not _tool_turns(model, config, history, tools, args.tool_choice):
                return 0
            continue
        text = model.tokenizer.apply_chat_template(history, add_generation_prompt=True)
        try:
            prompt = model.tokenizer.encode(text, add_special_tokens=False)  # the template wrote them
            check_room(model, len(prompt), config.max_new_tokens)
        except ValueError as e:  # this turn only: the conversation so far stays, and the session goes on
            history.pop()
            status(f"tierlm: error: {e}; this message was not sent")
            continue
        reply = []
        for _row, delta, _f, _r in model.start([prompt], config).stream():
            reply.append(delta)
            sys.stdout.write(delta)
            sys.stdout.flush()
        print()
        history.append({"role": "assistant", "content": "".join(reply)})


def _read_tools(path: str) -> list:
    try:
        tools = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ValueError(f"--tools {path}: {e}") from None
    tools = tools.get("tools") if isinstance(tools, dict) else tools
    if not isinstance(tools, list) or not tools:
        raise ValueError(f"--tools {path}: expected a list of function tools (or {{'tools': [...]}})")
    return tools


def _tool_turns(model, config, history: list[dict], tools: list, choice: str) -> bool:
    """One user turn with tools: answers until one is text, each call printed and its result read from the
    next input line (False: input ended)."""
    from tierlm.generation.tools import tool_use

    tok = model.tokenizer
    choice = (
        choice
        if choice in ("auto", "required", "none")
        else {"type": "function", "function": {"name": choice}}
    )
    while True:
        use = tool_use(tools, choice, None, tok.chat_template)
        messages = use.template_messages(history) if use else history
        extra = {"tools": [t.as_dict() for t in use.tools]} if use and use.renders_tools else {}
        prompt = tok.encode(tok.apply_chat_template(messages, **extra), add_special_tokens=False)
        check_room(model, len(prompt), config.max_new_tokens)
        turn = config.replace(response_format=use.response_format()) if use else config
        text = model.generate([prompt], turn).texts[0]
        content, calls = use.parse(text) if use else (text, [])
        if not calls:
            print(text)
            history.append({"role": "assistant", "content": text})
            return True
        history.append(
            {"role": "assistant", "content": content or "", "tool_calls": [c.as_dict() for c in calls]}
        )
        for call in calls:
            print(f"call {call.name}({call.arguments})")
            try:
                result = input(f"{call.name} result> ")
            except EOFError:
                print()
                return False
            history.append({"role": "tool", "tool_call_id": call.id, "content": result})
        choice = "auto"  # with the results in hand the model may answer (a forced choice would call again)
