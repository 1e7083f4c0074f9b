"""Cache warm-up from outside the cluster: `pdserve warmup` and the launcher's
`warmup_prompts`, both through the router's `POST /v1/cache/warmup` (DELETE unpins).

A prompt is text or a chat message list. Prompt files hold one prompt per line, or, for a
`.jsonl` file, one JSON value per line: a string, a message list, or {"prompt": ...} /
{"messages": [...]}. With `chat`, text prompts become system messages under the model's chat
template (a deployment's system prompt is what most requests share).
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from pdserve import envs

Prompt = str | list[dict[str, Any]]


class WarmupError(Exception):
    """One line for the user: bad input, an unreachable router, or an HTTP error answer."""


def read_prompts(path: str | Path) -> list[Prompt]:
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise WarmupError(f"cannot read prompts from {path}: {exc}") from None
    if path.suffix != ".jsonl":
        return [line for line in lines if line.strip()]
    prompts = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except json.JSONDecodeError as exc:
            raise WarmupError(f"{path}:{number}: not JSON: {exc}") from None
        if isinstance(value, dict):
            value = value.get("prompt", value.get("messages"))
        prompts.append(check_prompt(value, f"{path}:{number}"))
    return prompts


def check_prompt(value: Any, where: str) -> Prompt:
    """A non-empty string, or a non-empty list of {"role", "content"} objects."""
    if isinstance(value, str) and value:
        return value
    if isinstance(value, (list, tuple)) and value and all(_is_message(m) for m in value):
        return [dict(m) for m in value]
    raise WarmupError(
        f"{where}: a prompt must be a non-empty string or a list of "
        f'{{"role", "content"}} messages, got {value!r:.80}'
    )


def _is_message(value: Any) -> bool:
    return isinstance(value, dict) and isinstance(value.get("role"), str) and "content" in value


def warmup_body(
    prompts: list[Prompt], chat: bool = False, pin: bool = True, shared: bool = False
) -> dict[str, Any]:
    """The request body; the router answers texts first, then message lists, in this order
    (see `ordered`). `shared`: in the shared cache scope, hit by every tenant."""
    if chat:
        prompts = [[{"role": "system", "content": p}] if isinstance(p, str) else p for p in prompts]
    body: dict[str, Any] = {"pin": pin, "shared": shared}
    texts = [p for p in prompts if isinstance(p, str)]
    chats = [list(p) for p in prompts if not isinstance(p, str)]
    if texts:
        body["prompts"] = texts
    if chats:
        body["messages"] = chats
    return body


def ordered(body: dict[str, Any]) -> list[Prompt]:
    """The prompts of a body in the order of the router's `index`."""
    return [*body.get("prompts", []), *body.get("messages", [])]


def send_warmup(
    url: str,
    body: dict[str, Any],
    admin_key: str | None,
    unpin: bool = False,
    timeout_s: float = 600.0,
) -> dict[str, Any]:
    """POST (or, to unpin, DELETE) the body; the router's answer, or WarmupError."""
    base = url.rstrip("/").removesuffix("/v1")
    headers = {"Content-Type": "application/json"}
    if admin_key:
        headers["Authorization"] = f"Bearer {admin_key}"
    req = urllib.request.Request(
        f"{base}/v1/cache/warmup",
        data=json.dumps(body).encode(),
        headers=headers,
        method="DELETE" if unpin else "POST",
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        raise WarmupError(f"{base}: HTTP {exc.code}: {_error_message(exc)}") from None
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        raise WarmupError(f"cannot reach the router at {base}: {reason}") from None


def _error_message(exc: urllib.error.HTTPError) -> str:
    try:
        return json.loads(exc.read())["error"]["message"]
    except (ValueError, KeyError, TypeError, OSError):
        return exc.reason


def report_lines(answer: dict[str, Any], prompts: list[Prompt]) -> tuple[list[str], int]:
    """One line per worker and prompt, and how many of them are errors."""
    lines, num_errors = [], 0
    for worker_id, results in sorted(answer.get("workers", {}).items()):
        for r in results:
            label = _label(prompts[r["index"]]) if r["index"] < len(prompts) else ""
            if "error" in r:
                num_errors += 1
                lines.append(f"{worker_id} [{r['index']}] error: {r['error']}  {label}")
            else:
                lines.append(
                    f"{worker_id} [{r['index']}] {r['num_cached_tokens']}/"
                    f"{r['num_prompt_tokens']} tokens cached, {r['num_pinned_tokens']} "
                    f"{'pinned' if answer.get('pin') else 'unpinned'}  {label}"
                )
    return lines, num_errors


def _label(prompt: Prompt) -> str:
    text = prompt if isinstance(prompt, str) else " | ".join(str(m["content"]) for m in prompt)
    return json.dumps(text[:40] + ("..." if len(text) > 40 else ""))


# ---- `pdserve warmup` -------------------------------------------------------------------


def add_warmup_parser(sub) -> None:
    p = sub.add_parser(
        "warmup", help="prefill and pin prompts (e.g. system prompts) on a running cluster"
    )
    p.add_argument("--url", required=True, help="the router, e.g. http://127.0.0.1:8000")
    p.add_argument("--admin-key", default=envs.admin_key(), help=f"or ${envs.ADMIN_KEY}")
    p.add_argument("--prompt", action="append", default=[], help="repeatable")
    p.add_argument("--file", default=None, help="one prompt per line, or .jsonl")
    p.add_argument("--chat", action="store_true", help="text prompts as system messages")
    p.add_argument("--unpin", action="store_true", help="release the pins instead")
    p.add_argument(
        "--shared", action="store_true", help="in the shared cache scope: every tenant hits them"
    )
    p.add_argument("--timeout", type=float, default=600.0, help="seconds")
    p.set_defaults(func=cmd_warmup)


def cmd_warmup(args: argparse.Namespace) -> int:
    """Exit 0 when every worker warmed every prompt, 1 when some answered an error, 2 on bad
    input or an unreachable router (one line on stderr)."""
    try:
        prompts = [check_prompt(p, "--prompt") for p in args.prompt]
        if args.file:
            prompts += read_prompts(args.file)
        if not prompts:
            raise WarmupError("give --prompt (repeatable) and/or --file")
        body = warmup_body(prompts, args.chat, pin=not args.unpin, shared=args.shared)
        answer = send_warmup(args.url, body, args.admin_key, args.unpin, args.timeout)
    except WarmupError as exc:
        print(f"pdserve: error: {exc}", file=sys.stderr)
        return 2
    lines, num_errors = report_lines(answer, ordered(body))
    print("\n".join(lines))
    return 1 if num_errors else 0
