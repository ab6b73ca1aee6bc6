"""Prompts built from real code on the machine: the Python standard library sources.

Both drafter training data and `cluster bench` workloads come from here, so the split between
them is decided in one place: a file belongs to the `eval` split when the first byte of the
SHA-1 of its path (relative to the stdlib root) is below 52 (about 20%), else to `train`.
Drafters are trained on `train` files only; benchmarks and drafter evaluation use `eval` files,
so measured acceptance is on code the drafter never saw.

Two prompt kinds:
- `code-long`: a source file cut at N tokens, asked to continue (long-context completion);
- `chat-short`: an instruction about one real function (explain / document / review).

Everything is deterministic for a given seed, tokenizer and Python installation.
"""

from __future__ import annotations

import ast
import hashlib
import json
import random
import sysconfig
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal, Protocol

Split = Literal["train", "eval"]
SPLITS: tuple[Split, ...] = ("train", "eval")

_EVAL_HASH_BYTE_BELOW = 52  # of 256: about 20% of files are held out
_EXCLUDED_TOP_DIRS = {"test", "tests", "idlelib", "site-packages", "lib2to3", "__pycache__"}

CODE_LONG_INSTRUCTION = "Continue this Python file from where it stops. Reply with code only."
CHAT_SHORT_INSTRUCTIONS = (
    "Explain what this Python function does, step by step.",
    "Write a docstring for this Python function.",
    "Review this Python function and point out possible bugs.",
    "Suggest clearer names for the variables in this function and rewrite it.",
    "Write a short unit test for this Python function.",
)


class Tokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...
    def decode(self, ids: list[int]) -> str: ...


@dataclass(frozen=True)
class Prompt:
    """One request of a workload, in the JSONL form `vllm.benchmarks.serve` replays."""

    prompt: str
    """The user message."""
    output_tokens: int
    """Tokens to generate."""
    kind: str
    """`code-long` or `chat-short`."""
    source: str
    """Path of the stdlib file it was built from, relative to the stdlib root."""
    context_tokens: int
    """Tokens of source code in the prompt (the context-length bucket key)."""


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def split_of(relative_path: str) -> Split:
    digest = hashlib.sha1(relative_path.encode()).digest()
    return "eval" if digest[0] < _EVAL_HASH_BYTE_BELOW else "train"


def source_files(split: Split, root: Path | None = None) -> list[Path]:
    """Python files of the stdlib in `split`, sorted (tests, idlelib and lib2to3 excluded)."""
    root = root or stdlib_root()
    files = []
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root)
        if relative.parts[0] in _EXCLUDED_TOP_DIRS or "__pycache__" in relative.parts:
            continue
        if split_of(relative.as_posix()) == split:
            files.append(path)
    return files


def _read(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return None


def code_long(
    tokenizer: Tokenizer,
    context_tokens: Iterable[int],
    per_bucket: int,
    output_tokens: int,
    split: Split,
    seed: int,
) -> list[Prompt]:
    """`per_bucket` prompts for each context length: a file long enough, cut at that many
    tokens from a random line start, asked to continue."""
    root = stdlib_root()
    rng = random.Random(seed)
    files = source_files(split, root)
    prompts = []
    for bucket in context_tokens:
        candidates = files[:]
        rng.shuffle(candidates)
        made = 0
        for path in candidates:
            if made == per_bucket:
                break
            text = _read(path)
            if text is None:
                continue
            ids = _from_random_line(tokenizer, text, bucket + output_tokens, rng)
            if ids is None:
                continue
            code = tokenizer.decode(ids[:bucket])
            prompts.append(
                Prompt(
                    prompt=f"{CODE_LONG_INSTRUCTION}\n\n```python\n{code}",
                    output_tokens=output_tokens,
                    kind="code-long",
                    source=path.relative_to(root).as_posix(),
                    context_tokens=bucket,
                )
            )
            made += 1
        if made < per_bucket:
            raise ValueError(
                f"only {made} {split} files have {bucket + output_tokens} tokens "
                f"({per_bucket} asked for)"
            )
    return prompts


def _from_random_line(
    tokenizer: Tokenizer, text: str, needed: int, rng: random.Random
) -> list[int] | None:
    """Token ids of `text` from a random line start on, with at least `needed` tokens left."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) < needed:
        return None
    line_starts = [0] + [i + 1 for i, c in enumerate(text) if c == "\n"]
    # The cut must leave `needed` tokens: try starts in the first part of the file.
    usable = line_starts[: max(1, int(len(line_starts) * (1 - needed / len(ids))))]
    for _ in range(4):
        suffix = tokenizer.encode(text[rng.choice(usable) :], add_special_tokens=False)
        if len(suffix) >= needed:
            return suffix
    return ids


def _functions(text: str) -> Iterator[str]:
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return
    lines = text.splitlines()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.end_lineno:
            length = node.end_lineno - node.lineno + 1
            if 5 <= length <= 60:
                yield "\n".join(lines[node.lineno - 1 : node.end_lineno])


def chat_short(
    tokenizer: Tokenizer, count: int, output_tokens: int, split: Split, seed: int
) -> list[Prompt]:
    """`count` instructions, each about one real function (5 to 60 lines) of a `split` file."""
    root = stdlib_root()
    rng = random.Random(seed)
    files = source_files(split, root)
    rng.shuffle(files)
    prompts = []
    for path in files:
        text = _read(path)
        if text is None:
            continue
        functions = list(_functions(text))
        if not functions:
            continue
        function = rng.choice(functions).strip("\n")
        # Dedent methods so the snippet stands alone.
        indent = len(function) - len(function.lstrip(" "))
        function = "\n".join(line[indent:] for line in function.splitlines())
        instruction = rng.choice(CHAT_SHORT_INSTRUCTIONS)
        prompts.append(
            Prompt(
                prompt=f"{instruction}\n\n```python\n{function}\n```",
                output_tokens=output_tokens,
                kind="chat-short",
                source=path.relative_to(root).as_posix(),
                context_tokens=len(tokenizer.encode(function, add_special_tokens=False)),
            )
        )
        if len(prompts) == count:
            return prompts
    raise ValueError(f"only {len(prompts)} {split} files have a suitable function ({count} asked)")


def write_jsonl(prompts: Iterable[Prompt], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for prompt in prompts:
            f.write(json.dumps(asdict(prompt)) + "\n")
    return path


def read_jsonl(path: Path) -> list[Prompt]:
    with path.open() as f:
        return [Prompt(**json.loads(line)) for line in f if line.strip()]
