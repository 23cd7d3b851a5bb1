"""Prompt encoding with a transformers UMT5 encoder, and a tokenizer that needs no download.

`PromptEncoder` follows diffusers' Wan pipeline: tokenize to ``max_length`` with padding,
run the UMT5 encoder, keep the real tokens and zero the padding, so an embedding is
``[1, max_length, d_model]``. Embeddings are memoized per text. A prompt longer than
``max_length`` tokens is cut there, as diffusers does, and one warning line says how many
tokens were kept and dropped.

`build_byte_tokenizer` makes a byte-level tokenizer from code (the `tokenizers` library, no
vocabulary file to download): 256 byte symbols plus ``<pad>``, ``</s>``, ``<unk>``, with
``</s>`` appended like T5. The tiny presets save it with ``save_pretrained`` and load it
back with ``AutoTokenizer.from_pretrained``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from causalkv.errors import ConfigError, print_stderr
from causalkv.runtime.processes.launch import env_world

if TYPE_CHECKING:
    import torch

__all__ = ["PromptEncoder", "build_byte_tokenizer", "BYTE_TOKENIZER_VOCAB_SIZE", "warn_line"]


def warn_line(line: str) -> None:
    """One ``causalkv: warning:`` line on stderr (rank 0 of a torchrun job alone; every
    process when torchrun's environment cannot be read: a warning never raises)."""
    with contextlib.suppress(ConfigError):
        if env_world()[0] != 0:
            return
    print_stderr(f"causalkv: warning: {line}")


_SPECIALS = ("<pad>", "</s>", "<unk>")
#: vocabulary size of `build_byte_tokenizer` (3 specials + 256 bytes)
BYTE_TOKENIZER_VOCAB_SIZE = len(_SPECIALS) + 256


def build_byte_tokenizer(model_max_length: int = 512) -> Any:
    """A byte-level ``PreTrainedTokenizerFast`` built in code (no files, no network)."""
    # lazy: tokenizers/transformers load only when a preset's tokenizer is built
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    symbols = [*_SPECIALS, *sorted(pre_tokenizers.ByteLevel.alphabet())]
    vocab = {symbol: i for i, symbol in enumerate(symbols)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.TemplateProcessing(
        single="$A </s>", pair="$A </s> $B </s>", special_tokens=[("</s>", vocab["</s>"])]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        eos_token="</s>",
        unk_token="<unk>",
        model_max_length=model_max_length,
    )


class PromptEncoder:
    """Text -> prompt embeddings ``[1, max_length, d_model]`` (Wan pipeline semantics).

    Args:
        tokenizer: a transformers tokenizer (UMT5's, or `build_byte_tokenizer`'s).
        text_encoder: a transformers ``UMT5EncoderModel``.
        max_length: text tokens (Wan: 512); shorter prompts are zero-padded, longer ones cut
            (``warn`` gets one line saying how many tokens were kept).
        device, dtype: of the returned embeddings.
        warn: receives the truncation line (default `warn_line`: stderr).
    """

    def __init__(
        self,
        tokenizer: Any,
        text_encoder: torch.nn.Module,
        *,
        max_length: int,
        device: torch.device | str = "cpu",
        dtype: torch.dtype | None = None,
        warn: Callable[[str], None] = warn_line,
    ) -> None:
        import torch

        self.tokenizer = tokenizer
        self.text_encoder = text_encoder.eval()
        self.max_length = max_length
        self.device = torch.device(device)
        self.dtype = dtype if dtype is not None else torch.float32
        self.warn = warn
        #: texts whose truncation is not reported (the host's default prompt)
        self.quiet_texts: frozenset[str] = frozenset()
        self._memo: dict[str, torch.Tensor] = {}

    def __call__(self, text: str) -> torch.Tensor:
        import torch  # the encoder runs with a model loaded (this module stays light)

        hit = self._memo.get(text)
        if hit is not None:
            return hit
        stripped = text.strip()
        # tokens of the text with the end mark, before any truncation
        n = len(self.tokenizer(stripped, add_special_tokens=True, truncation=False,
                               verbose=False)["input_ids"])
        if n > self.max_length and text not in self.quiet_texts:
            shown = stripped if len(stripped) <= 40 else stripped[:37] + "..."
            self.warn(
                f"the prompt {shown!r} is {n:,} tokens and the text encoder reads {self.max_length:,} "
                f"(text_max_length): the first {self.max_length:,} are kept (the end mark included), "
                f"{n - self.max_length:,} dropped; shorten the prompt to keep all of it"
            )
        enc = self.tokenizer(
            [stripped],
            padding="max_length",
            max_length=self.max_length,
            truncation=True,
            add_special_tokens=True,
            return_attention_mask=True,
            return_tensors="pt",
        )
        ids, mask = enc["input_ids"], enc["attention_mask"]
        te_device = next(self.text_encoder.parameters()).device
        with torch.no_grad():
            hidden = self.text_encoder(ids.to(te_device), attention_mask=mask.to(te_device)).last_hidden_state
        n = int(mask.sum())  # once per prompt, not on the chunk loop's hot path
        out = torch.zeros_like(hidden)
        out[:, :n] = hidden[:, :n]
        out = out.to(device=self.device, dtype=self.dtype)
        self._memo[text] = out
        return out
