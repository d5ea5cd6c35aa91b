"""The HTTP frontend and the router never import torch, and the frontend's tokenizer, loaded with
torch kept out, is the one the engine side would load."""

from __future__ import annotations

import json
import subprocess
import sys

from tiny_models import build_tokenizer


def _run(code: str) -> str:
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout


def test_frontend_tokenizes_without_torch_as_with_it(tmp_path):
    from strata.tokenizer import apply_chat_template, load_tokenizer

    build_tokenizer(tmp_path)
    text = "Hello world! Paged attention keeps <|im_end|> the KV cache."
    messages = [{"role": "user", "content": "hi there"}]
    out = _run(
        "import json, sys\n"
        "from strata.server.launch import keep_torch_out\n"
        "keep_torch_out()\n"
        "import strata.server.app, strata.server.engine_client\n"
        "from strata.tokenizer import load_tokenizer, apply_chat_template\n"
        f"tok = load_tokenizer({str(tmp_path)!r})\n"
        f"ids = tok({text!r})['input_ids']\n"
        f"chat = apply_chat_template(tok, {messages!r})\n"
        "assert sys.modules.get('torch') is None, 'torch was imported'\n"
        "print(json.dumps([type(tok).__name__, ids, chat, tok.decode(ids, skip_special_tokens=True)]))\n"
    )
    theirs = load_tokenizer(tmp_path)
    ids = theirs(text)["input_ids"]
    expected = [
        type(theirs).__name__,
        ids,
        apply_chat_template(theirs, messages),
        theirs.decode(ids, skip_special_tokens=True),
    ]
    assert json.loads(out) == expected


def test_router_does_not_import_torch():
    _run(
        "import sys\nimport strata.router.app, strata.router.cli, strata.router.launcher\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )


def test_building_the_cli_parser_does_not_import_torch():
    """`strata serve` and `strata router` run in the process that built the whole CLI's parser (every
    subcommand's flags), so no parser builder may import torch; the subcommand imports what it runs."""
    _run(
        "import sys\nfrom strata.cli import build_parser\n"
        "parser = build_parser()\n"
        "parser.parse_args(['bench', 'moe', '--family', 'mixtral'])\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
