"""Output masking: personal data in a model's BYTES outputs is masked before it leaves the gateway.

A model opts in through its own config (Triton ``parameters``), so the policy
travels with the model and reaches every gateway replica through the model
metadata the gateway already fetches; it works with and without tenancy:

==========================  ===========================================================
parameter                   meaning
==========================  ===========================================================
``mask_patterns``           comma-separated pattern names, applied in that order
                            (built-ins: ``email``, ``phone``, ``id_card``); unset: off
``mask_outputs``            comma-separated output names (default: every BYTES output)
``mask_style``              ``partial`` (default: keep a short prefix and suffix, ``*``
                            in between) or ``token`` (replace with a fixed token)
``mask_keep``               ``prefix,suffix`` characters kept by ``partial`` (default ``2,2``)
``mask_token``              the token of ``token`` style (default ``[<NAME>]``, e.g. ``[EMAIL]``)
``mask_pattern.<name>``     a custom pattern (a Python regex) named ``<name>``
==========================  ===========================================================

Patterns run on each element's UTF-8 bytes (bytes regexes: ``\\d``, ``\\w``
and case folding are ASCII), so an element without a match is passed on as
the same memoryview slice and a tensor without any match is not copied at
all. Digit patterns are bounded by look-arounds, so a phone number is not
found inside an 18-digit ID or a longer number.

Masking runs on every response, cache hits included: the result cache keeps
what the model produced, and what a client may see is decided here.

Bounded cost (docs/security.md, "Hostile input"): a model's output can be
whatever a client made it echo, so masking must cost time linear in it.

- The built-in patterns are linear: a match can start only where a run of its
  characters starts (a look-behind, then possessive repeats that never give
  back), and the digit patterns run only on the spans of digits and
  separators a fast scan finds, not at every position of the text.
- Custom patterns (``mask_pattern.<name>``, and the deny-list's in the tenants
  file) are compiled with RE2, whose matching time is linear in the text
  whatever the pattern: a pattern RE2 cannot run (look-arounds,
  back-references) is refused when it is loaded, naming it.
- A response's masked outputs are scanned up to ``max_scan_bytes`` (the
  gateway's ``mask_max_scan_bytes``); a response with more is refused (413,
  naming the setting) rather than passed on partly unscanned.
- Above ``OFF_LOOP_BYTES`` the masking runs in a worker thread, so the event
  loop keeps answering other requests; below, it runs inline, costing no hop.
"""

from __future__ import annotations

import re
import struct
from collections.abc import Callable
from dataclasses import dataclass

import re2

from aiworks.core.datatypes import Tensor, bytes_offsets, deserialize_bytes, serialize_items
from aiworks.core.errors import Internal, InvalidArgument, PayloadTooLarge
from aiworks.core.inference import InferResponse
from aiworks.core.looplag import offload
from aiworks.core.model_config import ModelSpec

DEFAULT_MAX_SCAN_BYTES = 1 << 20
OFF_LOOP_BYTES = 64 << 10

# Built-in patterns. Kept deliberately broad: a masked false positive costs
# less than a leaked number. Each is linear in the text (see above; the test
# suite times them on megabytes of hostile text).
BUILTIN_PATTERNS: dict[str, bytes] = {
    # A match starts only at the start of a run of local-part characters, which it takes whole; the
    # domain's labels are taken whole as well, so a failed attempt gives back at most one label.
    "email": rb"(?<![A-Za-z0-9._%+\-])[A-Za-z0-9._%+\-]++@(?:[A-Za-z0-9\-]++\.)+[A-Za-z]{2,}",
    "phone": (
        # Chinese mobile numbers, optionally with +86.
        rb"(?<![\d+])(?:\+?86[ \-]?)?1[3-9]\d(?:[ \-]?\d{4}){2}(?!\d)"
        # North American numbers: (555) 123-4567, 555-123-4567, +1 555 123 4567.
        rb"|(?<![\d+])(?:\+?1[ .\-]?)?(?:\([2-9]\d{2}\)|[2-9]\d{2})[ .\-]?\d{3}[ .\-]\d{4}(?!\d)"
        # Other international numbers in E.164 form, optionally grouped.
        rb"|\+[1-9](?:[ \-]?\d){7,14}(?!\d)"
    ),
    "id_card": (
        # Chinese resident identity card: 6-digit region, birth date, sequence, check digit.
        rb"(?<![0-9A-Za-z])[1-9]\d{5}(?:18|19|20)\d{2}(?:0[1-9]|1[0-2])(?:0[1-9]|[12]\d|3[01])\d{3}[\dXx](?![0-9A-Za-z])"
        # US Social Security number (area 000, 666 and 9xx are never issued).
        rb"|(?<!\d)(?!000|666|9\d\d)\d{3}-(?!00)\d{2}-(?!0000)\d{4}(?!\d)"
    ),
}

# The characters each digit pattern's matches are made of, starting with one a match can start with:
# those patterns run only on these spans (a match never crosses a span's edge), found at scan speed.
# Spans shorter than the shortest match (10 characters for a phone number, 11 for an SSN) are skipped.
_CANDIDATES: dict[str, bytes] = {
    "phone": rb"[\d+(][\d +\-.()]{9,}",
    "id_card": rb"\d[\dXx\-]{10,}",
}

# Found at scan speed: each starts with a character class or a literal.
_THREE_DIGITS = re.compile(rb"\d\d\d")
_PLUS_DIGITS = re.compile(rb"\+\d[ \-]?\d")
_MAX_DIGIT_MATCH = 32  # the longest match of a digit pattern (an E.164 number, grouped) is 30 bytes
_WINDOW = 16 << 10

PARAM_PATTERNS = "mask_patterns"
PARAM_OUTPUTS = "mask_outputs"
PARAM_STYLE = "mask_style"
PARAM_KEEP = "mask_keep"
PARAM_TOKEN = "mask_token"
PARAM_CUSTOM_PREFIX = "mask_pattern."
STYLES = ("partial", "token")


class TextPattern:
    """A named pattern over UTF-8 bytes whose matching costs time linear in the text.

    ``candidates`` (built-in digit patterns) narrows the work to the spans
    that can hold a match; the pattern still sees one character on each
    side of a span, so its look-arounds decide as they would on the whole text.
    """

    __slots__ = ("name", "pattern", "candidates", "_bytes_only")

    def __init__(self, name: str, pattern, candidates: re.Pattern[bytes] | None = None, *, bytes_only: bool = False):
        self.name = name
        self.pattern = pattern
        self.candidates = candidates
        self._bytes_only = bytes_only  # RE2's Python wrapper takes bytes, not memoryviews

    def _text(self, data):
        return bytes(data) if self._bytes_only and not isinstance(data, bytes) else data

    def _matches(self, data):
        if self.candidates is None:
            yield from self.pattern.finditer(self._text(data))
            return
        for span in self.candidates.finditer(data):
            pos, stop = span.start(), span.end()
            # A long span goes in windows, so no one regex call holds the GIL for long; each window reads
            # _MAX_DIGIT_MATCH + 1 characters past its end, so a match starting in it is found whole.
            while pos < stop:
                window_end = min(pos + _WINDOW, stop)
                resume = window_end
                reach = min(window_end + _MAX_DIGIT_MATCH, stop) + 1
                if _THREE_DIGITS.search(data, pos, reach) is None and _PLUS_DIGITS.search(data, pos, reach) is None:
                    pos = resume  # every digit pattern's match holds three digits in a row, or "+" and two
                    continue
                for match in self.pattern.finditer(data, pos, reach):
                    if match.start() >= window_end:
                        break
                    resume = max(resume, match.end())
                    yield match
                pos = resume

    def search(self, data):
        """The first match in ``data``, or None."""
        return next(self._matches(data), None)

    def sub(self, replace: Callable[[re.Match], bytes], data):
        """``data`` with every match replaced by ``replace(match)``; ``data`` itself when nothing matched."""
        parts: list = []
        last = 0
        text = self._text(data)
        for match in self._matches(text):
            parts.append(text[last : match.start()])
            parts.append(replace(match))
            last = match.end()
        if not parts:
            return data
        parts.append(text[last:])
        return b"".join(parts)


_RE2_OPTIONS = re2.Options()
_RE2_OPTIONS.log_errors = False  # the error reaches the operator in our own message


def compile_pattern(name: str, source: str | bytes, where: str) -> TextPattern:
    """A custom pattern, compiled with RE2 (linear time), or InvalidArgument naming it and what is wrong."""
    raw = source.encode("utf-8") if isinstance(source, str) else source
    try:
        pattern = re2.compile(raw, _RE2_OPTIONS)
    except re2.error as exc:
        reason = exc.args[0].decode("utf-8", "replace") if exc.args and isinstance(exc.args[0], bytes) else exc
        raise InvalidArgument(
            f"{where}: pattern '{name}' is not a valid regular expression for RE2, the linear-time engine "
            f"custom patterns run on (no look-arounds or back-references): {reason}"
        ) from None
    if pattern.search(b"") is not None:
        raise InvalidArgument(f"{where}: pattern '{name}' matches the empty string, so it would match everything")
    return TextPattern(name, pattern, bytes_only=True)


def _builtin(name: str, source: bytes) -> TextPattern:
    candidates = _CANDIDATES.get(name)
    return TextPattern(name, re.compile(source), re.compile(candidates) if candidates else None)


_BUILTINS = {name: _builtin(name, src) for name, src in BUILTIN_PATTERNS.items()}


def builtin_pattern(name: str) -> TextPattern | None:
    return _BUILTINS.get(name)


def _names(value: str) -> list[str]:
    return [n.strip() for n in value.split(",") if n.strip()]


@dataclass(frozen=True, slots=True)
class MaskRule:
    name: str
    pattern: TextPattern
    replacement: bytes  # the token, for ``token`` style


class Masker:
    """The masking policy of one model version, compiled once."""

    def __init__(
        self,
        rules: list[MaskRule],
        *,
        outputs: frozenset[str] | None = None,
        style: str = "partial",
        keep_prefix: int = 2,
        keep_suffix: int = 2,
    ):
        self.rules = rules
        self.outputs = outputs
        self.style = style
        self.keep_prefix = keep_prefix
        self.keep_suffix = keep_suffix

    @classmethod
    def from_spec(cls, spec: ModelSpec) -> Masker | None:
        """The model's masker, or None when its config enables no masking."""
        params = spec.parameters
        selected = _names(params.get(PARAM_PATTERNS, ""))
        if not selected:
            return None
        where = f"model '{spec.name}' config parameter '{PARAM_PATTERNS}'"
        style = params.get(PARAM_STYLE, "partial").strip() or "partial"
        if style not in STYLES:
            raise InvalidArgument(f"model '{spec.name}' config parameter '{PARAM_STYLE}' is '{style}'; use {STYLES}")
        keep = params.get(PARAM_KEEP, "2,2")
        try:
            prefix, suffix = (int(x) for x in keep.split(","))
            if prefix < 0 or suffix < 0:
                raise ValueError
        except ValueError:
            raise InvalidArgument(
                f"model '{spec.name}' config parameter '{PARAM_KEEP}' is '{keep}'; use 'prefix,suffix', e.g. '2,2'"
            ) from None
        rules = []
        for name in selected:
            custom = params.get(PARAM_CUSTOM_PREFIX + name)
            if custom is not None:
                pattern = compile_pattern(
                    name, custom, f"model '{spec.name}' config parameter '{PARAM_CUSTOM_PREFIX}{name}'"
                )
            else:
                pattern = builtin_pattern(name)
                if pattern is None:
                    raise InvalidArgument(
                        f"{where} names pattern '{name}', which is neither built in ({sorted(BUILTIN_PATTERNS)}) "
                        f"nor defined by a '{PARAM_CUSTOM_PREFIX}{name}' parameter"
                    )
            token = params.get(PARAM_TOKEN, f"[{name.upper()}]")
            rules.append(MaskRule(name, pattern, token.encode("utf-8")))
        outputs = _names(params.get(PARAM_OUTPUTS, ""))
        declared = {t.name: t.datatype for t in spec.outputs}
        for out in outputs:
            if declared and declared.get(out) != "BYTES":
                raise InvalidArgument(
                    f"model '{spec.name}' config parameter '{PARAM_OUTPUTS}' names '{out}', which is not a BYTES output"
                )
        return cls(rules, outputs=frozenset(outputs) or None, style=style, keep_prefix=prefix, keep_suffix=suffix)

    # ---- masking ---------------------------------------------------------------------------------------

    def _partial(self, match: re.Match[bytes]) -> bytes:
        text = match.group().decode("utf-8", "replace")
        if len(text) <= self.keep_prefix + self.keep_suffix:
            return b"*" * len(text)
        end = len(text) - self.keep_suffix
        return (text[: self.keep_prefix] + "*" * (end - self.keep_prefix) + text[end:]).encode("utf-8")

    def mask_element(self, data: bytes | memoryview) -> bytes | memoryview:
        """One element, masked; the same object when nothing matched."""
        out: bytes | memoryview = data
        for rule in self.rules:
            if self.style == "token":
                token = rule.replacement  # a function, so the token is never read as a template
                out = rule.pattern.sub(lambda _m, token=token: token, out)
            else:
                out = rule.pattern.sub(self._partial, out)
        return out

    def mask_tensor(self, tensor: Tensor) -> Tensor:
        """The tensor with its elements masked; the same object when nothing matched."""
        view = memoryview(tensor.raw)
        offsets = bytes_offsets(view, name=tensor.name)
        parts: list[bytes | memoryview] = []
        changed = False
        for start, end in zip(offsets, offsets[1:]):
            element = view[start + 4 : end]
            masked = self.mask_element(element)
            if masked is not element:
                changed = True
            parts.append(struct.pack("<I", len(masked)))
            parts.append(masked)
        if not changed:
            return tensor
        return Tensor(tensor.name, tensor.datatype, tensor.shape, b"".join(parts), dict(tensor.parameters))

    def applies_to(self, tensor: Tensor) -> bool:
        return tensor.datatype == "BYTES" and (self.outputs is None or tensor.name in self.outputs)

    def scan_bytes(self, response: InferResponse) -> int:
        """How many bytes of ``response`` masking would scan."""
        return sum(len(t.raw) for t in response.outputs if self.applies_to(t))

    def mask_response(self, response: InferResponse) -> InferResponse:
        """Mask the response's BYTES outputs in place, and return it."""
        for i, tensor in enumerate(response.outputs):
            if self.applies_to(tensor):
                response.outputs[i] = self.mask_tensor(tensor)
        return response


HOLD_MAX_BYTES = 4096  # a line longer than this is let go, all but its last HOLD_KEEP_BYTES
HOLD_KEEP_BYTES = 256  # longer than any built-in pattern's match (an e-mail address is at most 254)


class StreamHold:
    """A masked model's stream of text pieces (a generation's tokens), released a line at a time.

    Masking a piece at a time would miss a match the model made across
    pieces (``a@`` then ``b.io``). So the text of each one-element BYTES
    output that masking applies to is held back until a line ends (none of
    the built-in patterns spans lines), and each response goes out when the
    next one comes, carrying the lines completed so far; the last one carries
    the rest. A line of more than :data:`HOLD_MAX_BYTES` is let go but for its
    last :data:`HOLD_KEEP_BYTES`. Responses keep their parameters (token
    counts, finish reasons) and their number; only where their text lies moves.
    """

    def __init__(self, masker: Masker):
        self.masker = masker
        self.held: dict[str, bytes] = {}
        self.waiting: InferResponse | None = None

    def push(self, response: InferResponse) -> InferResponse | None:
        """Take ``response``; the one before it, with the lines completed so far (None for the first)."""
        out, self.waiting = self.waiting, response
        return self._release(out, last=False) if out is not None else None

    def end(self) -> InferResponse | None:
        """The stream ended: the response still waiting, with all the text held."""
        out, self.waiting = self.waiting, None
        return self._release(out, last=True) if out is not None else None

    def _release(self, response: InferResponse, last: bool) -> InferResponse:
        for i, tensor in enumerate(response.outputs):
            if not self.masker.applies_to(tensor) or len(tensor.shape) != 1 or tensor.shape[0] != 1:
                continue
            text = self.held.pop(tensor.name, b"") + bytes(deserialize_bytes(tensor.raw, 1, name=tensor.name)[0])
            cut = len(text) if last else text.rfind(b"\n") + 1
            if len(text) - cut > HOLD_MAX_BYTES:
                cut = len(text) - HOLD_KEEP_BYTES
                while cut > 0 and 0x80 <= text[cut] < 0xC0:  # not inside a character
                    cut -= 1
            if cut < len(text):
                self.held[tensor.name] = text[cut:]
            response.outputs[i] = Tensor(tensor.name, "BYTES", (1,), serialize_items([text[:cut]]),
                                         dict(tensor.parameters))  # fmt: skip
        if last:  # text held for an output this response lacks: a stream that switched outputs; it goes too
            for name, text in self.held.items():
                response.outputs.append(Tensor(name, "BYTES", (1,), serialize_items([text])))
            self.held.clear()
        return response


class MaskingPolicies:
    """Maskers by model version, compiled once per distinct config and reused.

    A model's parameters can change when it is reloaded, so the cache key is
    the masking parameters themselves, not just the name and version.
    """

    def __init__(self, max_entries: int = 1024, *, max_scan_bytes: int | None = DEFAULT_MAX_SCAN_BYTES):
        self.max_entries = max_entries
        self.max_scan_bytes = max_scan_bytes
        self._maskers: dict[tuple, Masker | None] = {}

    def for_spec(self, spec: ModelSpec) -> Masker | None:
        relevant = tuple(sorted((k, v) for k, v in spec.parameters.items() if k.startswith("mask_")))
        if not relevant:
            return None
        key = (spec.name, spec.version, relevant)
        try:
            return self._maskers[key]
        except KeyError:
            pass
        try:
            masker = Masker.from_spec(spec)
        except InvalidArgument as exc:  # the model's config is wrong, not the client's request
            raise Internal(f"output masking is misconfigured: {exc.message}") from None
        if len(self._maskers) >= self.max_entries:
            self._maskers.pop(next(iter(self._maskers)))
        self._maskers[key] = masker
        return masker

    def hold_for(self, spec: ModelSpec) -> StreamHold | None:
        """A :class:`StreamHold` for a stream of ``spec``'s responses when it masks them, else None."""
        masker = self.for_spec(spec)
        return StreamHold(masker) if masker is not None else None

    def mask(self, spec: ModelSpec, response: InferResponse) -> InferResponse:
        """The response with the model's masking applied (unchanged when it has none), here on the caller's thread."""
        masker = self.for_spec(spec)
        if masker is None:
            return response
        self._check_size(spec, masker.scan_bytes(response))
        return masker.mask_response(response)

    async def mask_async(self, spec: ModelSpec, response: InferResponse) -> InferResponse:
        """:meth:`mask`, in a worker thread when there is more than ``OFF_LOOP_BYTES`` to scan."""
        masker = self.for_spec(spec)
        if masker is None:
            return response
        size = masker.scan_bytes(response)
        self._check_size(spec, size)
        return await offload(masker.mask_response, response, large=size > OFF_LOOP_BYTES)

    def _check_size(self, spec: ModelSpec, size: int) -> None:
        if self.max_scan_bytes is not None and size > self.max_scan_bytes:
            raise PayloadTooLarge(
                f"model '{spec.name}' answered with {size} bytes of text to mask, more than the "
                f"{self.max_scan_bytes} bytes masking scans (setting mask_max_scan_bytes); the answer is withheld"
            )
