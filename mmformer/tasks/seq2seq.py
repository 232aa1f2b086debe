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

from ..models.encoder_decoder import EncoderDecoder
from .prefix_lm import PrefixLMTask


class Seq2SeqTask(PrefixLMTask):
    """Args: as ``PrefixLMTask``, with the parts' names as an ``EncoderDecoder`` (``tokenizer`` whose
    tower encodes, ``text_tokenizer``, ``lm_head``) in place of a ``PrefixLM``."""

    def __init__(self, parts: EncoderDecoder, *args, **kwargs):
        super().__init__(parts, *args, **kwargs)
