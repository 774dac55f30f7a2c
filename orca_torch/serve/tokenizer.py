"""Text in and out of the server: the presets' word-level tokenizer, or a checkpoint's own.

A preset (`tiny`, `mini`) has random weights and no tokenizer of its own, yet a standard benchmark
client loads a tokenizer to build prompts and re-tokenizes the streamed text to count output
tokens. So each preset ships a real Hugging Face-format tokenizer (`presets/<name>/`, built here by
`build_preset_tokenizer` with the `tokenizers` library and saved with transformers'
`save_pretrained`): a word-level vocabulary of exactly the preset's size, id 0 `<unk>` and every
other id a made-up lowercase word of consonant-vowel syllables ("ka", "bemo", ...), split on
whitespace. Every id's text is one whitespace-free word, and the server streams each token as a
space and its word, so any streamed text re-tokenizes to exactly the tokens generated. Words not in
the vocabulary (any real prompt) become `<unk>`; the preset has no end-of-sequence token.

Chat prompts of a preset use the plain template `PLAIN_CHAT_TEMPLATE` (also in the saved
tokenizer's config, so a client applies the same): one line `role: content` per message, then
`assistant:`; a content of several text parts is the parts with a newline between them. A
checkpoint uses its own tokenizer and chat template (transformers, the `hf` extra).

Threads: the server encodes in one parse thread, and decodes (`detokenizer`) in its event loop and,
for a request with stop strings, in the engine thread. A preset's detokenizer reads a list of words
alone, which any thread may share. A checkpoint's encoding through transformers may reconfigure the
Rust tokenizer (truncation, padding: a mutable borrow, which fails with "Already borrowed" while
another thread's call holds it), so `CheckpointTokenizer` decodes with a copy of its own, which
only ever decodes (shared borrows, safe together).
"""
from __future__ import annotations

import copy
import itertools
import json
from pathlib import Path
from typing import Sequence

import numpy as np

from orca_torch.lab.cli_args import command_parser, dir_out_arg
from orca_torch.specs import get_model_spec

PRESETS_DIR = Path(__file__).resolve().parent / "presets"
PRESETS = ("tiny", "mini")
UNK = "<unk>"
CONSONANTS, VOWELS = "bdfghjklmnprstvz", "aeiou"
PLAIN_CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: "
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}"
    "{% for p in m['content'] %}{% if not loop.first %}{{ '\\n' }}{% endif %}{{ p['text'] }}{% endfor %}"
    "{% endif %}{{ '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}")


def preset_words(vocab: int) -> list[str]:
    """The `vocab` words of a preset's vocabulary: `<unk>`, then syllable words, shortest first."""
    syllables = [c + v for c in CONSONANTS for v in VOWELS]
    words = itertools.chain.from_iterable(itertools.product(syllables, repeat=n) for n in itertools.count(1))
    return [UNK] + ["".join(parts) for parts in itertools.islice(words, vocab - 1)]


def build_preset_tokenizer(name: str, out_dir: str | Path) -> Path:
    """Build preset `name`'s tokenizer and save it (HF format) into `out_dir`; needs transformers."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    spec = get_model_spec(name)
    words = preset_words(spec.vocab)
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token=UNK, model_max_length=spec.max_context)
    fast.chat_template = PLAIN_CHAT_TEMPLATE
    out = Path(out_dir)
    fast.save_pretrained(str(out))
    config_path = out / "tokenizer_config.json"       # loadable by transformers 4.x too (benchmark clients)
    config = json.loads(config_path.read_text())
    config.update(tokenizer_class="PreTrainedTokenizerFast", chat_template=PLAIN_CHAT_TEMPLATE)
    config.pop("backend", None)
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return out


def content_text(content: str | Sequence[dict]) -> str:
    """A message's content as one text: a string as it is, a list of text parts joined with a
    newline between them (as `PLAIN_CHAT_TEMPLATE` joins them)."""
    return content if isinstance(content, str) else "\n".join(p["text"] for p in content)


def plain_chat_text(messages: Sequence[dict]) -> str:
    """`PLAIN_CHAT_TEMPLATE` rendered (messages already checked: a role, and content as text or text parts)."""
    return "".join(f"{m['role']}: {content_text(m['content'])}\n" for m in messages) + "assistant:"


class PresetTokenizer:
    """A preset's shipped word-level tokenizer, read with `tokenizers` alone."""

    def __init__(self, name: str) -> None:
        from tokenizers import Tokenizer

        self.path = PRESETS_DIR / name
        self.tok = Tokenizer.from_file(str(self.path / "tokenizer.json"))
        self.words = preset_words(get_model_spec(name).vocab)
        assert self.tok.get_vocab_size() == len(self.words)
        self.stop_token_ids: frozenset[int] = frozenset()     # (no end-of-sequence token)
        self.eos_token_id: int | None = None

    def encode(self, text: str) -> list[int]:
        """(`encode_batch` lets go of Python's lock while it works, `encode` does not: a long prompt
        would stall every stream.)"""
        return self.tok.encode_batch([text], add_special_tokens=False)[0].ids

    def min_tokens(self, text: str) -> int:
        """At most `len(encode(text))`, in milliseconds for megabytes: the words, split where the
        pre-tokenizer splits (Unicode's White_Space: ASCII's, and the 19 others, such as U+00A0 and
        U+3000), each one token of the word-level vocabulary (a literal `<unk>` inside a word splits
        it further, so this is a lower bound, not always the count)."""
        b = np.frombuffer(text.encode(), dtype=np.uint8)
        if not len(b):
            return 0
        space = (b == 32) | ((b >= 9) & (b <= 13))     # " \t\n\v\f\r"
        if not text.isascii():                          # every byte of a multi-byte space is a space
            two, three = np.zeros(len(b), bool), np.zeros(len(b), bool)
            two[:-1] = (b[:-1] == 0xC2) & ((b[1:] == 0x85) | (b[1:] == 0xA0))          # U+0085, U+00A0
            x, y, z = b[:-2], b[1:-1], b[2:]
            three[:-2] = (((x == 0xE2) & (y == 0x80) & (((z >= 0x80) & (z <= 0x8A)) | (z == 0xA8) | (z == 0xA9)
                                                          | (z == 0xAF)))                 # U+2000-200A, 2028, 2029, 202F
                          | ((x == 0xE1) & (y == 0x9A) & (z == 0x80))                     # U+1680
                          | ((x == 0xE2) & (y == 0x81) & (z == 0x9F))                     # U+205F
                          | ((x == 0xE3) & (y == 0x80) & (z == 0x80)))                    # U+3000
            space |= two | three
            space[1:] |= two[:-1] | three[:-1]
            space[2:] |= three[:-2]
        return int(np.count_nonzero(space[:-1] & ~space[1:])) + int(not space[0])

    def chat(self, messages: Sequence[dict]) -> list[int]:
        return self.encode(plain_chat_text(messages))

    def detokenizer(self, after: Sequence[int] = ()) -> "WordDetokenizer":
        """(Every word comes with its space, after a prompt or not.)"""
        return WordDetokenizer(self.words)


class WordDetokenizer:
    """Each token's text on its own: a space and its word."""

    def __init__(self, words: list[str]) -> None:
        self.words = words

    def add(self, ids: Sequence[int], final: bool = False) -> str:
        return "".join(" " + self.words[i] for i in ids)

    def special_text(self, t: int) -> str | None:
        """None: a preset's words are all shown as its text shows them."""
        return None

    def next_text(self, t: int) -> str:
        """The text token `t` would add next (a likely token's, with its log probability)."""
        return " " + self.words[t]


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")


def check_tokenizer_files(path: str | Path) -> None:
    """Raise ValueError unless the checkpoint directory `path` has tokenizer files."""
    if not any((Path(path) / f).is_file() for f in TOKENIZER_FILES):
        raise ValueError(f"no tokenizer in {str(path)!r} (looked for {', '.join(TOKENIZER_FILES)}): give a "
                         "checkpoint directory with its tokenizer files")


def checkpoint_eos_ids(path: str | Path) -> frozenset[int]:
    """The end-of-sequence ids a checkpoint's own files name: `eos_token_id` (an id or a list of
    ids) of its `generation_config.json` and its `config.json`, each where present. Generation stops
    at any of them, as transformers' `generate` and vLLM stop: an instruct model's end of turn (Llama
    3's `<|eot_id|>`, say) is often listed there and not the tokenizer's own eos token."""
    out: set[int] = set()
    for name in ("generation_config.json", "config.json"):
        f = Path(path) / name
        if not f.is_file():
            continue
        try:
            config = json.loads(f.read_text(encoding="utf-8"))
        except ValueError as e:                         # (JSONDecodeError, UnicodeDecodeError)
            raise ValueError(f"{f} is not valid JSON: {e}") from None
        if not isinstance(config, dict):
            raise ValueError(f"{f} must hold a JSON object, got {type(config).__name__}")
        ids = config.get("eos_token_id")
        ids = [] if ids is None else ids if isinstance(ids, list) else [ids]
        if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
            raise ValueError(f"{f}: eos_token_id must be a token id (an integer >= 0), a list of them or null, "
                             f"got {config['eos_token_id']!r}")
        out.update(ids)
    return frozenset(out)


class CheckpointTokenizer:
    """A local checkpoint's own tokenizer and chat template (transformers, loaded offline)."""

    def __init__(self, path: str | Path) -> None:
        try:
            from transformers import AutoTokenizer
        except ImportError:
            raise ValueError("a checkpoint's tokenizer needs transformers: pip install 'orca-torch[hf]'") from None
        self.path = Path(path)
        check_tokenizer_files(self.path)
        try:
            self.tok = AutoTokenizer.from_pretrained(str(self.path), local_files_only=True)
        except Exception as e:      # (a malformed file fails it in any way: a KeyError, an AttributeError, a
            # config.json field of the wrong type raises huggingface_hub's StrictDataclassError)
            raise ValueError(f"cannot load the tokenizer in {str(self.path)!r}: {type(e).__name__}: "
                             f"{' '.join(str(e).split())}") from None
        self.eos_token_id: int | None = self.tok.eos_token_id     # (`stop_token_ids` adds the config's)
        self.stop_token_ids = checkpoint_eos_ids(self.path) | ({self.eos_token_id} - {None})
        self.decoding = copy.deepcopy(self.tok)         # (decodes only: see the module's docstring)

    def encode(self, text: str) -> list[int]:
        return list(self.tok(text)["input_ids"])

    def min_tokens(self, text: str) -> int:
        """No bound known without tokenizing (a byte-level BPE token may span many characters)."""
        return 0

    def chat(self, messages: Sequence[dict]) -> list[int]:
        if not self.tok.chat_template:
            return self.encode(plain_chat_text(messages))
        from jinja2 import TemplateError

        try:
            out = self.tok.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True)
        except (TemplateError, ValueError, TypeError, KeyError) as e:    # e.g. roles that must alternate
            raise ValueError(f"the chat template refused the messages: {e}") from None
        return list(out["input_ids"] if hasattr(out, "keys") else out)     # (transformers 5: a BatchEncoding)

    def detokenizer(self, after: Sequence[int] = ()) -> "IncrementalDetokenizer":
        """(On `decoding`, the copy no encoding touches: any thread may use it beside the parse thread.)"""
        return IncrementalDetokenizer(self.decoding, after)


class IncrementalDetokenizer:
    """A BPE stream's text, a token at a time: decode a short window (the tokens since the last
    text sent, after a few already sent, so a word's leading space survives) and send what it adds
    beyond the window's old part; hold back while the window ends in a split character. Each token
    is decoded a bounded number of times, not once per later token.

    `after`: the tokens the stream continues (a completion's prompt), of which the last few open the
    first window, so the first word keeps the space that a tokenizer such as SentencePiece drops
    from the start of a text. Special tokens are skipped, as `skip_special_tokens=True` skips them,
    but for `after`'s unknown token: it stands for a word of the prompt, so a word-level tokenizer
    puts a space between it and the first new word (skipped, a prompt of unknown words decodes to
    nothing and the first word loses its space)."""

    CONTEXT = 5
    """Tokens of `after` that open the first window (vLLM's detokenizer opens its own with as many)."""

    def __init__(self, tok, after: Sequence[int] = ()) -> None:
        self.tok, self.ids = tok, list(after[len(after) - self.CONTEXT:] if len(after) > self.CONTEXT else after)
        self.prefix, self.read = 0, len(self.ids)       # window: ids[prefix:]; text sent up to ids[:read]
        self.n_after = len(self.ids)
        self.special = set(tok.all_special_ids) | {i for i, t in tok.added_tokens_decoder.items() if t.special}
        self.unk = tok.unk_token_id

    def _decode(self, start: int, stop: int) -> str:
        """The text of `ids[start:stop]`, its special tokens skipped but for `after`'s unknown ones."""
        kept = [t for k, t in enumerate(self.ids[start:stop], start)
                if t not in self.special or (k < self.n_after and t == self.unk)]
        return self.tok.decode(kept, skip_special_tokens=False)

    def add(self, ids: Sequence[int], final: bool = False) -> str:
        """The text `ids` add; `final`: the stream ends here, so nothing is held back."""
        self.ids.extend(ids)
        old, text = self._window()
        if (text.endswith("\ufffd") and not final) or len(text) <= len(old):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return text[len(old):]

    def _window(self) -> tuple[str, str]:
        """The window's text sent so far, and its whole text."""
        return self._decode(self.prefix, self.read), self._decode(self.prefix, len(self.ids))

    def special_text(self, t: int) -> str | None:
        """A special token's text in log probabilities: the token decoded alone, special tokens
        kept ("</s>"), as vLLM shows it, though the answer's text skips it; None for another token."""
        return self.tok.decode([t], skip_special_tokens=False) if t in self.special else None

    def next_text(self, t: int) -> str:
        """The text token `t` would add next, after the stream so far (a likely token's, with its
        log probability): decoded in context, as `add` decodes it, so a word's leading space that
        a token decoded alone loses (SentencePiece's, byte-level BPE's) is kept; a piece of a
        character shows as U+FFFD; a special token, which the text skips, as `special_text`."""
        special = self.special_text(t)
        if special is not None:
            return special
        self.ids.append(t)
        try:
            old, text = self._window()
        finally:
            self.ids.pop()
        return text[len(old):] if len(text) > len(old) else ""


def main(argv: list[str] | None = None) -> None:
    p = command_parser(prog="python -m orca_torch.serve.tokenizer",
                       description="Rebuild the presets' shipped tokenizers (needs transformers).")
    p.add_argument("--out", type=dir_out_arg, default=PRESETS_DIR,
                   help="the folder to write tiny/ and mini/ into (default: the package's own presets, rewritten)")
    a = p.parse_args(argv)
    for name in PRESETS:
        print(build_preset_tokenizer(name, a.out / name))


if __name__ == "__main__":
    from orca_torch.lab.report import quiet_exit

    with quiet_exit():
        main()
