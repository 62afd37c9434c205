"""The incremental SSE parser: WHATWG field rules, any chunking, and the 1 MiB caps."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from continuum.wire.sse import MAX_SSE_BUFFER_SIZE, SseOverflowError, SseParser, SseRecord

STREAM = (
    b"\xef\xbb\xbf: a comment\r\n"
    b"retry: 2500\n"
    b"id: 1\n"
    b"event: cache_created\n"
    b'data: {"prefix_hash": "ab",\n'
    b'data:  "token_count": 16}\n'
    b"\n"
    b"id: 2\r"
    b'data:{"event": "cache_evicted", "prefix_hash": "cd"}\r'
    b"\r"
    b": keep-alive\r\n"
    b"event: cache_cleared\r\n"
    b"data\r\n"
    b"\r\n"
    b"id: 3\n"
    b"\n"
    b"data: caf\xc3\xa9\n"
    b"\n"
    b"data: never finished\n"
)
EXPECTED = [
    SseRecord("cache_created", '{"prefix_hash": "ab",\n "token_count": 16}', "1"),
    SseRecord(None, '{"event": "cache_evicted", "prefix_hash": "cd"}', "2"),
    SseRecord("cache_cleared", "", None),
    SseRecord(None, None, "3"),
    SseRecord(None, "café", None),
]


def parse(chunks: list[bytes], limit: int = MAX_SSE_BUFFER_SIZE) -> list[SseRecord]:
    parser = SseParser(limit)
    out: list[SseRecord] = []
    for chunk in chunks:
        out.extend(parser.feed(chunk))
    return out


def test_whole_stream() -> None:
    parser = SseParser()
    assert parser.feed(STREAM) == EXPECTED
    assert parser.retry_ms == 2500
    # The unfinished record at the end is held, not dispatched.
    assert parser.buffered_bytes == len("never finished") + 1


@pytest.mark.parametrize("ending", [b"\n", b"\r\n", b"\r"])
def test_line_endings(ending: bytes) -> None:
    text = ending.join([b"id: 7", b"event: cache_created", b"data: a", b"data: b", b"", b""])
    assert parse([text]) == [SseRecord("cache_created", "a\nb", "7")]


def test_every_single_split_point() -> None:
    for cut in range(len(STREAM) + 1):
        assert parse([STREAM[:cut], STREAM[cut:]]) == EXPECTED, cut


def test_byte_at_a_time() -> None:
    assert parse([STREAM[i:i + 1] for i in range(len(STREAM))]) == EXPECTED


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=len(STREAM)), max_size=20))
def test_any_chunking(cuts: list[int]) -> None:
    points = sorted(set(cuts))
    chunks = [STREAM[a:b] for a, b in zip([0, *points], [*points, len(STREAM)], strict=True)]
    assert parse(chunks) == EXPECTED


def test_crlf_split_between_chunks_is_one_line_end() -> None:
    # "\r" ends a chunk and "\n" starts the next: one terminator, not an empty line.
    assert parse([b"data: x\r", b"\ndata: y\r", b"\n\r", b"\n"]) == [SseRecord(None, "x\ny", None)]



def test_mixed_line_endings_still_end_records() -> None:
    # LF then CRLF, CR then CRLF, CRLF then LF: each pair is a line end and a blank line.
    assert parse([b"data: a\n\r\ndata: b\r\r\ndata: c\r\n\n"]) == [
        SseRecord(None, "a", None), SseRecord(None, "b", None), SseRecord(None, "c", None)
    ]


def test_invalid_utf8_is_replaced_not_fatal() -> None:
    parser = SseParser()
    assert parser.feed(b"id: \xff1\ndata: caf\xc3\n\n") == [
        SseRecord(None, "caf\ufffd", "\ufffd1")
    ]
    assert parser.feed(b"data: next\n\n") == [SseRecord(None, "next", None)]

def test_comments_and_unknown_fields_are_ignored() -> None:
    text = b": hello\n:\nfoo: bar\nretry: soon\ndata: d\n: mid\n\n"
    parser = SseParser()
    assert parser.feed(text) == [SseRecord(None, "d", None)]
    assert parser.retry_ms is None


def test_field_without_colon_and_space_rules() -> None:
    assert parse([b"data\ndata:  two spaces\ndata:x\n\n"]) == [
        SseRecord(None, "\n two spaces\nx", None)
    ]


def test_event_field_is_reported_and_empty_event_is_none() -> None:
    assert parse([b"event: cache_evicted\ndata: {}\n\nevent:\ndata: {}\n\n"]) == [
        SseRecord("cache_evicted", "{}", None),
        SseRecord(None, "{}", None),
    ]


def test_id_only_dispatched_with_its_record() -> None:
    parser = SseParser()
    # The id of an unfinished record is not reported until the blank line arrives.
    assert parser.feed(b"id: 9\ndata: x\n") == []
    assert parser.feed(b"\n") == [SseRecord(None, "x", "9")]
    # The next record has no id field of its own.
    assert parser.feed(b"data: y\n\n") == [SseRecord(None, "y", None)]
    # An id containing NUL is ignored; an empty id is reported as "" (reset).
    assert parser.feed(b"id: a\x00b\ndata: z\n\nid\n\n") == [
        SseRecord(None, "z", None), SseRecord(None, None, "")
    ]


def test_blank_lines_alone_dispatch_nothing() -> None:
    assert parse([b"\n\n\r\n\r\r"]) == []


@pytest.mark.parametrize("stream", [b"\xef\xbb\xbfdata: a\n\n", b"data: a\n\n"])
def test_bom_split_anywhere(stream: bytes) -> None:
    for cut in range(len(stream) + 1):
        for cut2 in range(cut, len(stream) + 1):
            chunks = [stream[:cut], stream[cut:cut2], stream[cut2:]]
            assert parse(chunks) == [SseRecord(None, "a", None)], (cut, cut2)


def test_only_a_leading_bom_is_stripped() -> None:
    assert parse([b"data: a\n\n\xef\xbb\xbfdata: b\n\n"]) == [
        SseRecord(None, "a", None)  # the second record's field name is "\ufeffdata": ignored
    ]


def test_line_over_cap_without_newline_overflows() -> None:
    parser = SseParser()
    parser.feed(b"data: ")
    chunk = b"a" * 65536
    with pytest.raises(SseOverflowError) as info:
        for _ in range(MAX_SSE_BUFFER_SIZE // len(chunk) + 2):
            parser.feed(chunk)
    assert info.value.what == "line"
    assert parser.line_high_water <= MAX_SSE_BUFFER_SIZE
    assert parser.buffered_bytes == 0
    with pytest.raises(SseOverflowError):
        parser.feed(b"\n\n")  # an overflowed parser stays failed


def test_line_exactly_at_cap_is_fine() -> None:
    line = b"data:" + b"a" * (MAX_SSE_BUFFER_SIZE - 5)
    parser = SseParser()
    assert parser.feed(line) == []
    assert parser.line_high_water == MAX_SSE_BUFFER_SIZE
    assert parser.feed(b"\n\n") == [SseRecord(None, "a" * (MAX_SSE_BUFFER_SIZE - 5), None)]


def test_complete_line_over_cap_in_one_chunk_overflows() -> None:
    with pytest.raises(SseOverflowError) as info:
        SseParser().feed(b"data: " + b"a" * MAX_SSE_BUFFER_SIZE + b"\n\n")
    assert info.value.what == "line"


def test_data_accumulated_over_cap_across_lines_overflows() -> None:
    parser = SseParser()
    line = b"data: " + b"b" * 1023 + b"\n"  # 1024 bytes of data each, with the join
    with pytest.raises(SseOverflowError) as info:
        for _ in range(MAX_SSE_BUFFER_SIZE // 1024 + 1):
            parser.feed(line)
    assert info.value.what == "record data"
    assert parser.data_high_water <= MAX_SSE_BUFFER_SIZE
    assert parser.line_high_water == 0  # every line came whole


def test_data_up_to_cap_across_lines_dispatches() -> None:
    parser = SseParser()
    line = b"data: " + b"b" * 1023 + b"\n"
    count = MAX_SSE_BUFFER_SIZE // 1024
    for _ in range(count):
        assert parser.feed(line) == []
    (record,) = parser.feed(b"\n")
    assert record.data is not None
    assert len(record.data) == MAX_SSE_BUFFER_SIZE - 1
    assert parser.data_high_water == MAX_SSE_BUFFER_SIZE


def test_small_limit() -> None:
    assert parse([b"data: 12345\n\n"], limit=16) == [SseRecord(None, "12345", None)]
    with pytest.raises(SseOverflowError):
        parse([b"data: 123456789\ndata: 123456789\n\n"], limit=16)
