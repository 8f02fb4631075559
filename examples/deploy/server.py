"""A tensor-parallel model behind HTTP, started as a plain `python server.py` (no distributed launcher).

    python examples/deploy/server.py --model tiny --tensor-parallel-size 2 --port 8000
    curl -s localhost:8000/generate -d '{"input_ids": [[5, 6, 7]], "max_new_tokens": 8}'

`--model` is a merged Hugging Face folder, an atorch checkpoint directory, or `tiny` (the
test suite's tiny Llama, built from a config: no download). POST /generate takes JSON:
`input_ids` (list of token-id lists, all the same length) or `text` (a string or a list of
strings, tokenized with the bundled tokenizer when `--model tiny`, or the folder's
tokenizer), not both, plus generate options among `ALLOWED_OPTIONS` (finite numbers; `eos_token_id`
a token id or a list of them; `stop_strings` is refused: the workers have no tokenizer); it answers
`{"output_ids": [[...]], "text": [...]}`. GET /health answers `{"ok": true}` while the
workers are alive.

Limits, answered with a 400 before the workers see the request (the workers run one request at
a time, so one long generation makes every other client wait): `max_new_tokens` at most
`--max-new-tokens-limit` (default 256), and the prompt plus the new tokens within the model's
`max_position_embeddings` when it has one; the sequences generated at once (rows x `num_beams`) at
most `--max-sequences-limit` (default 16), since the workers' memory grows with them. A request
without `max_new_tokens` gets the model's generation-config value, else transformers' default of 20,
cut to fit both limits.

A `--model` that cannot be served (a corrupted atorch checkpoint included) stops the server before any
worker starts: one `server.py: error:` line, exit code 2; workers failing to build the model: one such
line, exit code 1.

Standard library `http.server` (ThreadingHTTPServer), not FastAPI + uvicorn: nothing to
install, and one endpoint needs no framework. Requests are handled in threads; the deployed
model serializes them (see `atorch.deploy`). SIGTERM / SIGINT stop the server and close the
workers.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Dict, List, Optional

import torch

import atorch
from atorch.deploy import WorkerError

ALLOWED_OPTIONS = {"max_new_tokens": int, "min_new_tokens": int, "num_beams": int, "do_sample": bool,
                   "temperature": float, "top_k": int, "top_p": float, "no_repeat_ngram_size": int,
                   "repetition_penalty": float, "fused_no_repeat_ngram_blocking": bool, "eos_token_id": list}
# generate() options a deployed model cannot take (they need the tokenizer object in the workers), with what to use.
UNSUPPORTED_OPTIONS = {"stop_strings": "it needs a tokenizer in the workers, which a deployed model does not have; "
                                       "send eos_token_id (a token id or a list of them) instead"}
MAX_BODY_BYTES = 1 << 20
DEFAULT_MAX_NEW_TOKENS_LIMIT = 256
DEFAULT_MAX_SEQUENCES_LIMIT = 16
DEFAULT_NEW_TOKENS = 20     # what transformers generates when neither the request nor the model sets a length


def tokenizer_folder(model: str) -> Optional[str]:
    """The folder holding `--model`'s tokenizer: the folder itself (a merged Hugging Face model) or the
    `tokenizer/` an atorch checkpoint records (`save_checkpoint(..., tokenizer=...)`); None when neither has one."""
    from atorch.checkpoint.tokenizer_files import RECORDED_DIR, tokenizer_files_in

    for folder in (model, os.path.join(model, RECORDED_DIR)):
        if os.path.isdir(folder) and tokenizer_files_in(folder):
            return folder
    return None


def load_tokenizer(model: str) -> Optional[Any]:
    """`--model`'s tokenizer, or None (said on stderr: text requests are then refused) when it has none.

    A tokenizer that is there but cannot be loaded stops the server with the folder named:
    serving without it would hide the problem behind "send input_ids".
    """
    if model == "tiny":
        from atorch.testing.assets import load_tokenizer as load_bundled

        return load_bundled()
    from atorch.checkpoint.tokenizer_files import RECORDED_DIR

    folder = tokenizer_folder(model)
    if folder is None:
        print(f"server: no tokenizer in {model} nor in {os.path.join(model, RECORDED_DIR)}: text requests will be "
              "refused; send input_ids", file=sys.stderr, flush=True)
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(folder)
    except Exception as e:  # noqa: BLE001 - any loader failure: one line naming the folder
        raise SystemExit(f"server: error: the tokenizer in {folder} cannot be loaded: {type(e).__name__}: {e}") from e


def one_line(message: str) -> str:
    """A multi-line error (a checkpoint's list of problems) as one line for `server.py: error: ...`."""
    return " ".join(part.strip() for part in message.splitlines() if part.strip())


def _divisors(value: int) -> List[int]:
    return [d for d in range(1, value + 1) if value % d == 0]


def check_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> Any:
    """Refuse a `--model` that is not there and a tensor-parallel size the model's heads or widths do not split over,
    as usage errors (exit 2) before any worker starts; return the model's config (None if unknown)."""
    if args.tensor_parallel_size < 1:
        parser.error(f"--tensor-parallel-size={args.tensor_parallel_size} must be >= 1")
    for flag in ("max_new_tokens_limit", "max_sequences_limit"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')}={getattr(args, flag)} must be >= 1")
    if args.model == "tiny":
        from atorch.testing import tiny_llama_config

        config: Any = tiny_llama_config()
    elif not os.path.isdir(args.model):
        parser.error(f"--model {args.model!r} is neither 'tiny' nor a directory (a Hugging Face model folder or an "
                     "atorch checkpoint)")
    elif os.path.isfile(os.path.join(args.model, "config.json")):
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(args.model)
    else:
        return None   # atorch.deploy reads what it can and says what is missing
    from atorch.tensor_parallel.plan import config_sizes

    for key, value in config_sizes(config).items():   # what tensor parallelism itself checks, before any worker
        if value % args.tensor_parallel_size:
            parser.error(f"--tensor-parallel-size={args.tensor_parallel_size} does not divide the model's {key}="
                         f"{value}; use one of {_divisors(value)}")
    return config


class GenerateHandler(BaseHTTPRequestHandler):
    model: Any = None
    tokenizer: Any = None
    pad_token_id: int = 0
    max_new_tokens_limit: int = DEFAULT_MAX_NEW_TOKENS_LIMIT
    max_sequences_limit: int = DEFAULT_MAX_SEQUENCES_LIMIT
    # Seconds a connection may stay silent (a client that announces more body than it sends) before
    # its handler thread gives up; generation itself is not bounded by it.
    timeout = 60

    def log_message(self, fmt: str, *args: Any) -> None:  # quieter than the default stderr line per request
        pass

    def _reply(self, status: int, body: Dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        if self.path == "/health":
            alive = self.model.is_alive()
            self._reply(200 if alive else 503, {"ok": alive})
        else:
            self._reply(404, {"error": f"no route GET {self.path}; use POST /generate or GET /health"})

    def do_POST(self) -> None:  # noqa: N802
        if self.path != "/generate":
            self._reply(404, {"error": f"no route POST {self.path}; use POST /generate"})
            return
        try:
            length = int(self.headers.get("Content-Length", 0))
            if not 0 <= length <= MAX_BODY_BYTES:    # rfile.read(-1) would wait for the client to hang up
                raise ValueError(f"Content-Length {length} must be between 0 and {MAX_BODY_BYTES} bytes")
            request = json.loads(self.rfile.read(length) or b"{}")
            input_ids, options = self._parse(request)
        except (ValueError, TypeError) as e:
            self._reply(400, {"error": str(e)})
            return
        try:
            with torch.no_grad():
                output = self.model.generate(input_ids, attention_mask=torch.ones_like(input_ids),
                                             pad_token_id=self.pad_token_id, **options)
        except WorkerError as e:  # a dead worker: the server stays up and says so
            self._reply(503, {"error": f"{type(e).__name__}: {e}"})
            return
        except Exception as e:  # noqa: BLE001 - the workers are fine: what the request asked cannot run
            # The workers' traceback stays in the server's log, not in the answer to a client.
            print(f"request failed: {type(e).__name__}: {e}", file=sys.stderr)
            self._reply(400, {"error": f"{type(e).__name__}: {str(e).split(' (raised by deployed rank')[0]}"})
            return
        body: Dict[str, Any] = {"output_ids": output.tolist()}
        if self.tokenizer is not None:
            body["text"] = self.tokenizer.batch_decode(output, skip_special_tokens=True)
        self._reply(200, body)

    def _parse(self, request: Any) -> tuple:
        if not isinstance(request, dict):
            raise ValueError("the body must be a JSON object")
        for key, why in UNSUPPORTED_OPTIONS.items():
            if key in request:
                raise ValueError(f"{key} is not supported: {why}")
        unknown = [k for k in request if k not in ALLOWED_OPTIONS and k not in ("input_ids", "text")]
        if unknown:
            raise ValueError(f"unknown field(s) {unknown}; allowed: input_ids or text, and {sorted(ALLOWED_OPTIONS)}")
        options = {}
        for key, kind in ALLOWED_OPTIONS.items():
            if key in request:
                value = request[key]
                if key == "eos_token_id":
                    options[key] = eos_token_ids(value)
                    continue
                if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
                    if not (kind is float and isinstance(value, int) and not isinstance(value, bool)):
                        raise ValueError(f"{key} must be a {kind.__name__}, got {value!r}")
                options[key] = value
        check_option_ranges(options)
        config, generation = self.model.config, getattr(self.model, "generation_config", None)
        vocab_size = getattr(config, "vocab_size", None)
        ids = prompt_ids(request, vocab_size, self.tokenizer)
        if vocab_size is not None and not all(0 <= t < vocab_size for t in options.get("eos_token_id", [])):
            raise ValueError(f"eos_token_id must be token ids in [0, {vocab_size}), got {options['eos_token_id']}")
        check_sequences(ids.shape[0], options.get("num_beams", 1), self.max_sequences_limit)
        model_default = getattr(generation, "max_new_tokens", None)
        positions = getattr(config, "max_position_embeddings", None)
        options["max_new_tokens"] = settle_new_tokens(
            ids.shape[1], options.get("max_new_tokens"), self.max_new_tokens_limit, positions, model_default)
        least = options.get("min_new_tokens", 0)
        if least > options["max_new_tokens"]:
            if "max_new_tokens" in request:
                raise ValueError(f"min_new_tokens={least} exceeds max_new_tokens={options['max_new_tokens']}")
            # The client never sent the max_new_tokens it is compared with: say where it comes from.
            default = model_default or DEFAULT_NEW_TOKENS
            origin = (f"the model's generation_config.max_new_tokens={default}" if model_default
                      else f"transformers' default of {default}")
            settled = options["max_new_tokens"]
            if settled < default:   # what cut it: the server's limit, the positions the prompt leaves, or both
                cuts = [f"--max-new-tokens-limit={settled}"] if self.max_new_tokens_limit == settled else []
                if positions is not None and positions - ids.shape[1] == settled:
                    cuts.append(f"the {settled} positions the model has left after the prompt")
                origin += f", cut to {settled} by {' and '.join(cuts)}"
            raise ValueError(f"min_new_tokens={least} exceeds max_new_tokens={options['max_new_tokens']}, the "
                             f"server's default for a request without max_new_tokens ({origin}); send "
                             f"max_new_tokens >= {least} in the request (this server allows at most "
                             f"{self.max_new_tokens_limit}: --max-new-tokens-limit)")
        return ids, options


def check_sequences(rows: int, num_beams: int, limit: int) -> None:
    """ValueError (a 400) when a request would generate more than `limit` sequences at once (rows x beams):
    the workers hold a KV cache per sequence, so an unbounded request could exhaust their memory."""
    if rows * num_beams > limit:
        raise ValueError(f"{rows} prompt row(s) x num_beams={num_beams} = {rows * num_beams} sequences exceed this "
                         f"server's limit of {limit} (--max-sequences-limit); send fewer rows or beams")


def prompt_ids(request: Dict[str, Any], vocab_size: Optional[int], tokenizer: Any) -> torch.Tensor:
    """The request's prompt as a [rows, tokens] tensor: its `input_ids` (each in [0, vocab_size)), or its `text`
    tokenized with `tokenizer` (None: text is refused). Not both: one of them would be silently ignored."""
    if "input_ids" in request and "text" in request:
        raise ValueError("send either input_ids or text, not both")
    if "input_ids" in request:
        ids = request["input_ids"]
        # bool is an int subclass: true/false are not token ids.
        if not (isinstance(ids, list) and ids and all(isinstance(r, list) and r for r in ids)
                and len({len(r) for r in ids}) == 1 and all(type(t) is int for r in ids for t in r)):
            raise ValueError("input_ids must be a non-empty list of equally long, non-empty lists of ints "
                             "(not booleans)")
        if vocab_size is not None and not all(0 <= t < vocab_size for r in ids for t in r):
            raise ValueError(f"input_ids must be token ids in [0, {vocab_size})")
        return torch.tensor(ids, dtype=torch.long)
    if "text" in request:
        if tokenizer is None:
            raise ValueError("this server has no tokenizer: send input_ids")
        texts: List[str] = [request["text"]] if isinstance(request["text"], str) else request["text"]
        if not isinstance(texts, list) or not texts or not all(isinstance(x, str) and x for x in texts):
            raise ValueError("text must be a non-empty string or a non-empty list of them")
        encoded = [tokenizer(t)["input_ids"] for t in texts]
        if len({len(e) for e in encoded}) != 1:
            raise ValueError("texts of different token lengths: send one text per request, or input_ids")
        return torch.tensor(encoded, dtype=torch.long)
    raise ValueError("send input_ids (a list of token-id lists) or text")


def settle_new_tokens(prompt_len: int, requested: Optional[int], limit: int, max_positions: Optional[int],
                      model_default: Optional[int]) -> int:
    """The `max_new_tokens` to generate with; ValueError (a 400) for a request past the server's limits.

    `requested`: the request's value (None: `model_default`, else `DEFAULT_NEW_TOKENS`, cut to fit). `limit`:
    `--max-new-tokens-limit`. `max_positions`: the model's max_position_embeddings (None: no such bound); a
    longer sequence would index past the position table or silently degrade, depending on the model.
    """
    if max_positions is not None and prompt_len >= max_positions:
        raise ValueError(f"the prompt has {prompt_len} tokens; this model reads at most max_position_embeddings="
                         f"{max_positions} tokens, new ones included: shorten the prompt")
    if requested is None:
        room = limit if max_positions is None else min(limit, max_positions - prompt_len)
        return min(model_default or DEFAULT_NEW_TOKENS, room)
    if requested > limit:
        raise ValueError(f"max_new_tokens={requested} exceeds this server's limit of {limit} "
                         "(--max-new-tokens-limit); ask for fewer tokens")
    if max_positions is not None and prompt_len + requested > max_positions:
        raise ValueError(f"the prompt's {prompt_len} tokens + max_new_tokens={requested} exceed this model's "
                         f"max_position_embeddings={max_positions}; ask for at most {max_positions - prompt_len} "
                         "new tokens or shorten the prompt")
    return requested


def eos_token_ids(value: Any) -> List[int]:
    """A request's `eos_token_id` (a token id or a non-empty list of them) as a list; ValueError (a 400) otherwise."""
    ids = [value] if type(value) is int else value
    if not (isinstance(ids, list) and ids and all(type(t) is int for t in ids)):
        raise ValueError(f"eos_token_id must be a token id or a non-empty list of token ids (ints), got {value!r}")
    return ids


def check_option_ranges(options: Dict[str, Any]) -> None:
    """Values generate() would fail on deep in the workers (num_beams=0 divides by zero), refused as a 400.

    json.loads reads the non-standard literals NaN and Infinity: a float option must be finite."""
    for key, value in options.items():
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"{key} must be a finite number, got {value}")
    if options.get("max_new_tokens", 1) < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {options['max_new_tokens']}")
    for key, least in (("num_beams", 1), ("min_new_tokens", 0), ("top_k", 0), ("no_repeat_ngram_size", 0)):
        if options.get(key, least) < least:
            raise ValueError(f"{key} must be >= {least}, got {options[key]}")
    for key in ("temperature", "repetition_penalty"):
        if options.get(key, 1.0) <= 0:
            raise ValueError(f"{key} must be > 0, got {options[key]}")
    top_p = options.get("top_p", 1.0)
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a Hugging Face folder, an atorch checkpoint, or 'tiny'")
    parser.add_argument("--tensor-parallel-size", type=int, default=2)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000, help="0: any free port (printed)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--max-new-tokens-limit", type=int, default=DEFAULT_MAX_NEW_TOKENS_LIMIT,
                        help="the most new tokens one request may ask for (a larger max_new_tokens is a 400): the "
                             "workers serve one request at a time, so a long one makes every other client wait")
    parser.add_argument("--max-sequences-limit", type=int, default=DEFAULT_MAX_SEQUENCES_LIMIT,
                        help="the most sequences one request may generate at once, prompt rows x num_beams (more "
                             "is a 400): each holds a KV cache in the workers' memory")
    args = parser.parse_args(argv)
    check_arguments(parser, args)
    tokenizer = load_tokenizer(args.model)   # before the workers: a broken tokenizer stops the server now

    source: Any = args.model
    if args.model == "tiny":
        from atorch.testing import tiny_llama

        source = tiny_llama(seed=0).eval()
    try:
        model = atorch.deploy(source, tensor_parallel_size=args.tensor_parallel_size, device=args.device)
    except ValueError as e:   # what deploy refuses before starting a worker (a corrupted checkpoint too): exit 2
        parser.error(one_line(str(e)))
    except WorkerError as e:  # a worker failed (or died) while building the model: one line, without its traceback
        reason = str(e).split("\nTraceback (most recent call last):")[0]
        print(f"{parser.prog}: error: the workers could not start: {one_line(reason)}", file=sys.stderr, flush=True)
        sys.exit(1)
    GenerateHandler.model = model
    GenerateHandler.tokenizer = tokenizer
    GenerateHandler.max_new_tokens_limit = args.max_new_tokens_limit
    GenerateHandler.max_sequences_limit = args.max_sequences_limit
    GenerateHandler.pad_token_id = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    server = ThreadingHTTPServer((args.host, args.port), GenerateHandler)
    server.daemon_threads = True

    def stop(signum: int, frame: Any) -> None:
        threading.Thread(target=server.shutdown, daemon=True).start()  # shutdown() blocks: not in the handler

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    print(json.dumps({"listening": f"http://{args.host}:{server.server_address[1]}", "port": server.server_address[1],
                      "worker_pids": model.worker_pids}), flush=True)
    try:
        server.serve_forever()
    finally:
        server.server_close()
        model.close()
    print("stopped", flush=True)
    sys.exit(0)


if __name__ == "__main__":
    main()
