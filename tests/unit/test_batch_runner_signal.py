"""The batch runner reads the runtime's online_load signal from an answer and keeps it out of the job's output."""

import orjson

from aiworks.batch.answers import take_online_load


def answer(parameters=None) -> bytes:
    doc = {"model_name": "digits", "model_version": "1", "outputs": [{"name": "label", "datatype": "INT64",
                                                                       "shape": [1], "data": [3]}]}  # fmt: skip
    if parameters is not None:
        doc["parameters"] = parameters
    return orjson.dumps(doc)


def test_the_signal_is_read_and_removed():
    online, body = take_online_load(answer({"online_load": True}))
    assert online is True and body == answer()  # no empty "parameters" left behind
    online, body = take_online_load(answer({"online_load": False, "priority_clamped": "batch"}))
    assert online is False and orjson.loads(body)["parameters"] == {"priority_clamped": "batch"}


def test_answers_without_it_pass_untouched():
    for body in (answer(), answer({"priority_clamped": "batch"}), b'not json but mentions "online_load"'):
        assert take_online_load(body) == (None, body)


def test_a_non_boolean_value_is_no_signal_but_is_still_removed():
    online, body = take_online_load(answer({"online_load": "yes"}))
    assert online is None and body == answer()


def test_the_usual_answer_is_read_as_bytes_and_agrees_with_parsing_it():
    for value in (True, False):
        raw = answer({"online_load": value})
        assert raw.endswith(b',"parameters":{"online_load":' + orjson.dumps(value) + b"}}")  # the tail taken off
        assert take_online_load(raw) == (value, answer())
    # the signal nested in an output's parameters, last in the answer: not the top level's, so not taken
    nested = orjson.dumps({"model_name": "m", "outputs": [{"name": "x", "parameters": {"online_load": True}}]})
    assert take_online_load(nested) == (None, nested)
