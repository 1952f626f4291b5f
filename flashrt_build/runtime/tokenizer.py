"""The tokenizer a build copied beside its package, for text in and text
out (`generate` with text, `python -m flashrt_build.generate`): every file
of the directory one its build wrote, as it wrote it (a tokenizer reads more
than any fixed list of names), then transformers' `AutoTokenizer` where it is
installed (no code of a directory's own ever run: a tokenizer_config.json
whose `auto_map` names some is refused, exit 2) or the `tokenizers` library
for a `tokenizer.json`; and the model's end-of-sequence tokens, which must be
token ids."""

from __future__ import annotations

import json
import operator
from pathlib import Path
from typing import Any

from ..artifact import foreign_entries
from ..errors import ArtifactError, ConfigError
from .hashing import altered_digest, check_served_files
from .manifest import manifest_methods

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


def check_serving_dir(output_dir: Path, manifest: dict[str, Any]) -> None:
    """Every served file as its build wrote it (digests), and no entry the
    manifest does not list (`additional_chat_templates/*.jinja` would replace
    the chat template), before a tokenizer reads a byte."""
    check_served_files(output_dir, manifest)
    served = {record["file"] for record in manifest.get("files") or []}

    def altered(path: Path, record: Any) -> bool:  # the package and its weights: `load` checks their digests
        return path.name in served and altered_digest(path, record) is not None

    foreign = foreign_entries(output_dir, altered)
    if foreign:
        raise ArtifactError(
            f"{output_dir} holds entries its build did not write (its manifest does not list them), which a "
            f"tokenizer may read: {', '.join(foreign)}; refusing to serve from it"
        )


def served_tokenizer(output_dir: Path, chat: bool = False, prompt: str = "prompt") -> Any:
    """The tokenizer the build copied: transformers' when installed (chat
    templates, every tokenizer kind), else a tokenizer.json through the
    `tokenizers` library; `prompt` names the argument a refusal names."""
    if not any((output_dir / name).is_file() for name in TOKENIZER_FILES):
        raise _refused(prompt, output_dir, "holds no tokenizer (tokenizer.json): give token ids instead (--prompt-ids)")
    own_code = tokenizer_code(output_dir / "tokenizer_config.json")
    if own_code is not None:  # a build from before the build refused it
        raise _refused(prompt, output_dir, f"its tokenizer_config.json's auto_map names tokenizer code of its own "
                       f"({own_code}), which is never run: give token ids instead (--prompt-ids)")  # fmt: skip
    try:
        from transformers import AutoTokenizer
    except ImportError:
        return _plain_tokenizer(output_dir, chat, prompt)
    # a tokenizer_config.json's auto_map names code of its own: never asked about, never run
    return AutoTokenizer.from_pretrained(output_dir, local_files_only=True, trust_remote_code=False)


def tokenizer_code(path: Path) -> str | None:
    """What a tokenizer_config.json's `auto_map` names (code of the
    directory's own, which transformers would have to run), else None."""
    try:
        data = json.loads(path.read_bytes()) if path.is_file() else None
    except (OSError, ValueError):
        return None  # not JSON: the tokenizer's own reading says so
    return auto_map_of(data)


def auto_map_of(config: Any) -> str | None:
    """A parsed tokenizer_config.json's `auto_map`, as JSON text, or None
    where it names none (or the file holds no object)."""
    found = config.get("auto_map") if isinstance(config, dict) else None
    return json.dumps(found) if found else None


def _plain_tokenizer(output_dir: Path, chat: bool, prompt: str) -> Any:
    """A tokenizer.json through the `tokenizers` library, where transformers is not installed."""
    if chat:
        raise ConfigError("--chat", True, "applying a chat template needs transformers: pip install transformers",
                          kind="argument")  # fmt: skip
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise _refused(
            prompt,
            output_dir,
            "encoding text needs a tokenizer library: pip install tokenizers (or transformers, for every "
            "tokenizer kind and --chat); token ids (--prompt-ids) are served without one",
        ) from None
    path = output_dir / "tokenizer.json"
    if not path.is_file():
        raise _refused(prompt, output_dir, "its tokenizer needs transformers: pip install transformers")
    return Tokenizer.from_file(str(path))


def _refused(prompt: str, output_dir: Path, expected: str) -> ConfigError:
    """The package at `output_dir` cannot encode `prompt`'s text here."""
    return ConfigError("OUTPUT_DIR", str(output_dir), f"{prompt}'s text: {expected}", kind="argument")


def eos_tokens(output_dir: Path, tokenizer: Any) -> set[int] | None:
    """The model's end-of-sequence tokens: its generation config's, else its tokenizer's."""
    path = output_dir / "generation_config.json"
    if path.is_file():
        try:
            found = json.loads(path.read_bytes()).get("eos_token_id")
        except (ValueError, AttributeError) as exc:  # a build from before the build checked it
            raise ArtifactError(f"{path} is not a JSON object ({exc}); rebuild the package") from None
        if found is not None:
            return set(eos_token_ids(found, f"{path}: its eos_token_id", ArtifactError, "; rebuild the package"))
    found = getattr(tokenizer, "eos_token_id", None)
    return {int(found)} if found is not None else None


def eos_token_ids(found: Any, where: str, error: Any = ValueError, then: str = "") -> list[int]:
    """generation_config.json's `eos_token_id` (`found`, not None): a token
    id or a list of them; anything else raises `error`, naming `where`."""
    try:
        if isinstance(found, (int, list)):
            return token_ids(found)
    except TypeError:
        pass
    raise error(f"{where} = {found!r}: expected a token id or a list of token ids (integers from 0 to 2**63 - 1){then}")


def token_ids(given: Any) -> list[int]:
    """A token id or a collection of them, as a list; a TypeError for
    anything else (a string, a float, a bool, a list holding one)."""
    items = [given] if isinstance(given, int) else given
    if isinstance(items, (str, bytes)) or any(isinstance(i, (bool, str, bytes)) for i in items):
        raise TypeError(f"not token ids: {given!r}")
    ids = [operator.index(i) for i in items]
    if any(not 0 <= i < 2**63 for i in ids):  # a token id is an int64 index, never negative
        raise TypeError(f"not token ids: {given!r}")
    return ids


# Text shorter than this is tokenized in no time and little memory, whatever it holds.
SHORT_TEXT = 1 << 20


def too_long(text: str, tokenizer: Any, manifest: dict[str, Any]) -> str | None:
    """Why `text` is longer than any prompt of the package's cache could be,
    whatever its tokens (each covers at most its vocabulary's longest
    token); None where it may fit. Asked before the tokenizer holds the text:
    tokenizers aborts the whole process when its memory runs out."""
    position = next((i for i in manifest_methods(manifest).get("decode", {}).get("inputs", [])
                     if i.get("name") == "position"), None)  # fmt: skip
    if position is None or position.get("high") is None or len(text) <= SHORT_TEXT:
        return None
    longest = max((len(token.encode("utf-8", "replace")) for token in tokenizer.get_vocab()), default=1)
    bound = int(position["high"]) * longest * 4  # 4: normalizers may drop characters before tokens are cut
    if len(text) <= bound:  # characters: each is at least one byte
        return None
    return (f"is longer than any prompt of the package's {position['high']} positions could be ({bound} characters "
            f"at most: its longest token has {longest} bytes)")  # fmt: skip
