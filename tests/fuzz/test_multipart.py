"""The Batch API's streaming multipart parser (services/gateway/multipart.py) under generated bodies.

In process, no suite: any bytes, cut into chunks anywhere, end in events or
in InvalidArgument (a 400 that names the problem), never another error; and
a well-formed form parses to the same parts and bytes however it is cut.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from aiworks.core.errors import InvalidArgument
from aiworks.gateway.multipart import PART_END, FormStream, Part

BOUNDARY = b"fz-1"
ATOMS = [b"--fz-1", b"\r\n", b"\r\n\r\n", b"--", b"\r\n--fz", b"x", b"\xff\x00",
         b'Content-Disposition: form-data; name="file"; filename="a.jsonl"',
         b"Content-Disposition: form-data; name*=utf-8''%FF%FE", b"Content-Disposition: attachment",
         b"filename*=bad''%zz", b"Content-Type: text/plain; charset=\xff"]  # fmt: skip


def parse_cut(body: bytes, cuts: list[int], boundary: bytes = BOUNDARY) -> list:
    """The events of ``body`` fed in pieces cut at ``cuts`` (taken modulo its length), adjacent bytes joined."""
    form = FormStream(boundary)
    events, at = [], 0
    for cut in sorted(set(c % (len(body) + 1) for c in cuts)) + [len(body)]:
        events += form.feed(body[at:cut])
        at = cut
    form.finish()
    joined: list = []
    for event in events:
        if isinstance(event, bytes) and joined and isinstance(joined[-1], bytes):
            joined[-1] += event
        else:
            joined.append(event)
    return joined


@settings(max_examples=400, deadline=None)
@given(st.lists(st.sampled_from(ATOMS) | st.binary(max_size=12), max_size=30), st.lists(st.integers(0, 10**6)))
def test_any_body_ends_in_events_or_a_named_refusal(atoms, cuts):
    try:
        parse_cut(b"".join(atoms), cuts)
    except InvalidArgument as exc:
        assert exc.status.http == 400 and exc.message


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=300).filter(lambda b: b"\r\n--fz-1" not in b), st.text(max_size=20),
       st.lists(st.integers(0, 10**6), max_size=12))  # fmt: skip
def test_a_well_formed_form_parses_the_same_however_it_is_cut(data, purpose, cuts):
    body = (b'--fz-1\r\nContent-Disposition: form-data; name="purpose"\r\n\r\n' + purpose.encode() + b"\r\n"
            b'--fz-1\r\nContent-Disposition: form-data; name="file"; filename="in.jsonl"\r\n\r\n' + data
            + b"\r\n--fz-1--\r\n")  # fmt: skip
    events = parse_cut(body, cuts)
    expected = [Part("purpose", None), *([purpose.encode()] if purpose else []), PART_END,
                Part("file", "in.jsonl"), *([data] if data else []), PART_END]  # fmt: skip
    assert events == expected
