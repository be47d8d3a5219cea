"""Request values past what the wire carries are mapped or refused at the gateway, never a 500."""

from shared.api.serving import COMPLETIONS_URL, parse_request, prepare, validation_message
from shared.contract.wire import sampling_to_pb
from shared.models.text import load_text_model


def test_a_top_k_past_the_vocabulary_is_off_and_fits_the_wire():
    text = load_text_model("tiny-llama")
    for top_k, expected in ((110432545974350440824832, 0), (text.spec.vocab_size, 0), (-1, 0), (40, 40)):
        prepared = prepare(text, parse_request(COMPLETIONS_URL, {"prompt": [5, 6], "top_k": top_k}))
        assert prepared.sampling.top_k == expected
        assert sampling_to_pb(prepared.sampling).top_k == expected


def test_many_wrong_items_are_refused_quickly_and_briefly():
    import time

    from pydantic import ValidationError

    from shared.api.schemas import CompletionRequest

    start = time.monotonic()
    try:
        CompletionRequest.model_validate({"prompt": [[5]] * 50_000})
    except ValidationError as error:
        message = validation_message(error)
    assert time.monotonic() - start < 5  # was 28 s at 10,000 (errors read in quadratic time)
    assert message.count(";") == 4 and message.endswith("more")
