"""A byte-level BPE tokenizer with Qwen's special tokens, trained with the `tokenizers` library.

Used by the tests and by the model vlmkit ships; official Qwen tokenizer files load unchanged with
AutoTokenizer and work with VLMKitProcessor as they are.
"""

from collections.abc import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

# Order fixes their ids 0..7 in a freshly trained tokenizer.
SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
]

MULTIMODAL_TOKENS = {
    "image_token": "<|image_pad|>",
    "video_token": "<|video_pad|>",
    "vision_start_token": "<|vision_start|>",
    "vision_end_token": "<|vision_end|>",
}


def build_tokenizer(texts: Iterable[str], vocab_size: int = 1024, padding_side: str = "left",
                    split_digits: bool = False) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE on `texts`; Qwen's special tokens are single tokens with ids 0-7.

    eos is <|im_end|> (the end of a chat turn) and pad is <|endoftext|>; padding is on the left,
    as batched generation needs. `split_digits=True` makes every digit its own token, as Qwen's
    tokenizers do ("[123, 456" -> "[", "1", "2", "3", ",", " ", "4", ...), so a number is always
    spelled with the same ten tokens instead of whichever digit pairs the merges happened to learn.
    """
    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size {vocab_size} is below the {256 + len(SPECIAL_TOKENS)} byte and special tokens")
    tokenizer = Tokenizer(models.BPE(unk_token=None))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.pre_tokenizer = (pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
                               if split_digits else byte_level)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(list(texts), trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        padding_side=padding_side,
        extra_special_tokens=dict(MULTIMODAL_TOKENS),
    )
