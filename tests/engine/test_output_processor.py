"""The output processor's end-of-request rules: a stop token is never shown, but a request
that stopped on a dropped token (a grammar dead end) shows all of its tokens."""

from __future__ import annotations

from pathlib import Path

from kvgate.engine import SamplingParams
from kvgate.engine.core.request import GRAMMAR_DEAD_END
from kvgate.engine.output_processor import OutputProcessor
from kvgate.engine.outputs import OutputKind, StepOutput
from kvgate.engine.tokenization.tokenizer import Tokenizer


def finish(
    tokenizer: Tokenizer, ids: list[int], stop_reason: str | None, skip_special: bool = True
) -> tuple[str, str | None]:
    params = SamplingParams(skip_special_tokens=skip_special)
    processor = OutputProcessor("r", [1], params, tokenizer, OutputKind.FINAL_ONLY)
    step = StepOutput(ids, None, True, "stop", 0, 0, stop_reason=stop_reason)
    out = processor.process(step)
    assert out is not None and out.finished
    return out.text, out.stop_reason


def test_a_stop_token_is_hidden_but_a_dead_end_keeps_its_last_token(tiny_model_dir: Path):
    tokenizer = Tokenizer.from_dir(tiny_model_dir)
    ids = tokenizer.encode("ok then", add_special_tokens=False)
    eos = tokenizer.eos_token_ids[0]
    assert finish(tokenizer, [*ids, eos], None) == ("ok then", None)
    # One merged delta holding the last text tokens and the finish (a reader behind).
    assert finish(tokenizer, ids, GRAMMAR_DEAD_END) == ("ok then", GRAMMAR_DEAD_END)


def test_special_tokens_stay_when_asked(tiny_model_dir: Path):
    """Tool-call markers are special tokens in some vocabularies: the parser must see them."""
    tokenizer = Tokenizer.from_dir(tiny_model_dir)
    ids = tokenizer.encode("<|im_start|>ok", add_special_tokens=False)
    eos = tokenizer.eos_token_ids[0]
    assert finish(tokenizer, [*ids, eos], None) == ("ok", None)
    assert finish(tokenizer, [*ids, eos], None, skip_special=False) == ("<|im_start|>ok", None)
