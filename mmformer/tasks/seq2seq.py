"""Sequence-to-sequence with an encoder–decoder (``mmformer.models.encoder_decoder``): speech
recognition, captioning or translation where the source is encoded once by its own tower and a
cross-attention decoder generates the text.

Batches, loss and metrics are those of the prefix-LM task (``mmformer.tasks.prefix_lm``): ``caption
(B, L)`` (``bos … eos``) with ``caption_valid``, next-token cross-entropy on the target tokens (teacher
forcing), and in validation ``loss``, ``ppl`` and the held-out text decoded with the KV cache and
scored (``wer``, ``cer``, ``exact_match``). Only the model differs: the decoder reads the source
through cross-attention instead of as a prefix of one sequence.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor

from ..models.encoder_decoder import EncoderDecoder
from ..models.model import MultimodalModel
from .prefix_lm import PrefixLMTask


class Seq2SeqTask(PrefixLMTask):
    """Args: as ``PrefixLMTask``, with the parts' names as an ``EncoderDecoder`` (``tokenizer`` whose
    tower encodes, ``text_tokenizer``, ``lm_head``) in place of a ``PrefixLM``; and ``suppress`` /
    ``suppress_begin``: ids never decoded / not decoded first (Whisper's rules; default none).

    The decoder starts from the text tokenizer's ``start_ids`` — ``bos``, or a pretrained model's prompt
    (Whisper: ``<|startoftranscript|> <|notimestamps|>``) — in training (the captions begin with them;
    only the tokens after the prompt are targets) and in decoding."""

    def __init__(
        self,
        parts: EncoderDecoder,
        *args,
        suppress: Sequence[int] = (),
        suppress_begin: Sequence[int] = (),
        **kwargs,
    ):
        super().__init__(parts, *args, **kwargs)
        self.suppress, self.suppress_begin = list(suppress), list(suppress_begin)
        start = getattr(self.text, "start_ids", None) or ([self.text.bos_id] if self.text is not None else [])
        self.start_ids = list(start)
        self.prompt_len = len(self.start_ids)

    def transcribe(
        self, model: MultimodalModel, inputs: Tensor, prefix_valid: Tensor | None = None
    ) -> list[str]:
        ids = self.parts.generate(
            model,
            inputs,
            self.start_ids,
            self.text.eos_id,
            self.max_new_tokens,
            self.beam_size,
            self.length_penalty,
            prefix_valid,
            self.suppress,
            self.suppress_begin,
            fixed_steps=self.lockstep,
        )
        return [self.text.decode(x, skip_special=True) for x in ids]
